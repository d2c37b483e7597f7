"""What a rank prints: our lines and real problems, not library noise that is known to be harmless.

Each silenced message is named exactly, with where it comes from and why it is harmless;
`--verbose` on train.py shows everything again. Nothing else is filtered: an unknown warning,
or a known one whose text changes with a library upgrade, still reaches the console.
"""
import contextlib
import io
import logging
import re
import warnings
from typing import Iterator

# (category, start of the message, origin and why it is harmless)
KNOWN_NOISE = [
    (UserWarning, "c10d::broadcast_: an autograd kernel was not registered",
     "DeepSpeed's PipelineModule._synchronize_tied_weights broadcasts the tied embedding weight "
     "outside no_grad, once per rank at start-up and after each step. The weight stays a leaf and "
     "its gradient is right: tests/model/test_pipeline.py compares the tied embedding's gradient, summed "
     "over the first and last stage, with the single-process model's."),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated",
     "DeepSpeed 0.19.8 (deepspeed/comm/torch.py) calls torch's all_gather_into_tensor, which torch "
     "2.13 renames to all_gather_single; only the name is deprecated."),
]


# (start of a DeepSpeed log line, origin and why it is harmless)
KNOWN_LOG_NOISE = [
    ("[pinned-memory checkpoint]",
     "DeepSpeed's pinned-memory tracker (deepspeed/utils/pin_memory_tracker.py) adds up every tensor "
     "pinned through the accelerator and never subtracts a freed one, and logs the total at 32, 64, "
     "128 GB and so on. data/pipeline.py pins each micro-batch for its non-blocking copy to the GPU "
     "and frees it once copied, so on a long run that total reads like a leak of memory never held."),
]


class _KnownLogNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(record.getMessage().startswith(start) for start, _why in KNOWN_LOG_NOISE)


def silence_known_noise() -> None:
    """Ignore exactly the KNOWN_NOISE warnings and KNOWN_LOG_NOISE log lines, in this process."""
    from deepspeed.utils import logger
    for category, message, _why in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    if not any(isinstance(f, _KnownLogNoise) for f in logger.filters):
        logger.addFilter(_KnownLogNoise())


@contextlib.contextmanager
def quiet_stdout(quiet: bool) -> Iterator[None]:
    """Swallow what the enclosed code prints (DeepSpeed's PipelineModule prints its seed settings,
    its topology and a per-stage layer list on rank 0, all of which our role map shows)."""
    if not quiet:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield
