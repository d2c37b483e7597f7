"""What transformers tensors one of our dense parameters is made of (`Source`), and the two ways
between them: the stored tensors of a full dense tensor (`stored_tensors`, export) and the full
tensor from the stored ones (`dense_tensor`, import). A leaf module: the families' name maps
(model/hf/llama.py, model/hf/moe.py) build Sources, model/hf/shards.py plans each rank's reads."""
from dataclasses import dataclass
from typing import Callable, Iterator, Tuple


@dataclass(frozen=True)
class Source:
    """The transformers tensors one dense parameter is made of, in order along its dim 0; with
    `experts`, along dim 1 of each expert: expert e's tensors are names[e*P:(e+1)*P] (P parts)."""
    names: Tuple[str, ...]
    conv1d: bool = False  # GPT-2's Conv1D weight: stored (in, out), ours (out, in)
    rows: Tuple[int, ...] = ()  # several parts (Llama's fused qkv_proj, gate_up_proj; an expert's gate, up): their rows
    experts: int = 0  # a (E, rows, columns) expert weight stored as one tensor per expert and part (E of them)

    @property
    def parts(self) -> int:
        return len(self.names) // self.experts if self.experts else len(self.names)


def stored_tensors(source: Source, full) -> Iterator[Tuple[str, object]]:
    """(transformers name, tensor) of each stored tensor that one dense parameter's full tensor
    (real vocabulary) is made of: its parts by rows, one per expert, GPT-2's linears as Conv1D."""
    per_expert = full.unbind(0) if source.experts else (full,)
    names = iter(source.names)
    for tensor in per_expert:
        for part in (tensor.split(source.rows) if source.rows else (tensor,)):
            yield next(names), part.t().contiguous() if source.conv1d else part.contiguous()


def dense_tensor(source: Source, stored: Callable[[str], object]):
    """Inverse of `stored_tensors`: the full dense tensor from `stored(name)` of each of its names."""
    import torch
    tensors = [stored(name).t() if source.conv1d else stored(name) for name in source.names]
    if not source.experts:
        return torch.cat(tensors) if len(tensors) > 1 else tensors[0].clone()
    P = source.parts
    return torch.stack([torch.cat(tensors[e * P:(e + 1) * P]) for e in range(source.experts)])
