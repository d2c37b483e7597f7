"""Bits per byte of the validation text: the validation loss with the tokenizer taken out.

A loss in nats per token depends on how many tokens the tokenizer cuts the text into; the same
loss per UTF-8 byte of that text does not, so runs with different tokenizers (or vocabulary
sizes) compare. AI2's "Signal and Noise" (Heineman et al. 2025) finds it less noisy than accuracy at
small scale; The Pile and the GPT-NeoX papers report it. With the validation loss L the mean over
every target token of the first n validation global batches (no token is left out: the windows
are packed, whole),

    bits per byte = L x tokens / (ln 2 x bytes)

where bytes counts the UTF-8 bytes those target tokens decode to, each window's targets decoded
together, special tokens (the end of a document) as no text. The loss of predicting a document's
end stays in L, as the model pays it. (A character cut by a window's edge decodes to a
replacement character: at most a few bytes per window of thousands.) The count reads the
validation windows once per run.
"""
import itertools
import math
from typing import Callable, Dict, Optional, Tuple

from data.pipeline import RunData, SourceData

_TOKENS_PER_BYTE: Dict[Tuple[int, int], float] = {}  # (id of a source, global batches) -> its ratio


def tokens_per_byte(source: SourceData, n_global_batches: int) -> float:
    """Target tokens over the UTF-8 bytes they decode to, in `source`'s first validation global
    batches (the ones its validation loss averages)."""
    key = (id(source), n_global_batches)
    if key not in _TOKENS_PER_BYTE:
        micro = n_global_batches * source.global_batch_size // source.micro_batch_size
        tokens = text_bytes = 0
        for _, targets in itertools.islice(source.val_batches(0, 1, n_global_batches), micro):
            for row in targets.tolist():  # (b, seq_len) -> each window's targets
                tokens += len(row)
                text_bytes += len(source.tokenizer.decode(row, skip_special_tokens=True).encode("utf-8"))
        _TOKENS_PER_BYTE[key] = tokens / text_bytes
    return _TOKENS_PER_BYTE[key]


def bits_per_byte(loss_nats_per_token: float, source: SourceData, n_global_batches: int) -> float:
    return loss_nats_per_token * tokens_per_byte(source, n_global_batches) / math.log(2)


def validation_loss_and_bpb(data: RunData, loss_of: Callable[[SourceData], float],
                            global_batches_of: Callable[[SourceData], int], with_bpb: bool
                            ) -> Tuple[float, Optional[Dict[str, float]], Optional[float]]:
    """(validation loss, label -> each source's loss or None for one source, bits per byte or None
    without `with_bpb`): `loss_of` scores one source once, over `global_batches_of(source)`
    validation global batches; a mixture's bits per byte is weighted as its loss."""
    losses = {}  # id of a source -> its validation loss

    def scored(part: SourceData) -> float:
        losses[id(part)] = loss_of(part)
        return losses[id(part)]
    loss, by_source = data.validation_losses(scored)
    if not with_bpb:
        return loss, by_source, None
    bpb, _ = data.validation_losses(lambda part: bits_per_byte(losses[id(part)], part, global_batches_of(part)))
    return loss, by_source, bpb
