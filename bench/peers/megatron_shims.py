"""What megatron-core 0.19.2 needs to train on CPU processes over gloo (bench/peers/megatron_peer.py).

megatron-core is written for CUDA; these patches replace exactly the CUDA-only calls the GPT
model, its local layer spec and the pipeline schedules reach, in the peer's own processes (ours
never import this). `install()` applies them all, before the model is built. Each says what it
works around; nothing here changes the arithmetic of a step. The fusions are switched off in the
peer's TransformerConfig (`UNFUSED` below), not patched."""
import contextlib
import functools
import types

import torch

# TransformerConfig fields: each fusion is a CUDA kernel (Apex, Transformer Engine or a JIT
# extension) that this CPU install lacks; with the flag off megatron-core runs its torch version.
UNFUSED = dict(masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
               gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)


class _NoRngTracker:
    """megatron.core.tensor_parallel.random's CUDA RNG tracker forks torch.cuda's generator around
    every dropout; at dropout 0 (the bench's) no random number is drawn, so a no-op fork is the same."""

    def fork(self, name=None):
        return contextlib.nullcontext()

    def is_initialized(self):
        return True

    def add(self, name, seed):
        pass

    def get_states(self):
        return {}

    def set_states(self, states):
        pass

    def reset(self):
        pass


class _CpuDeviceTorch(types.ModuleType):
    """`torch` as seen by the pipeline schedules: they allocate their token counter with a
    hard-coded `device="cuda"` (schedules.py, `total_num_tokens`); this one puts it on the CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs):
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)


@functools.lru_cache(maxsize=8)
def _causal_mask(sq: int) -> torch.Tensor:
    """transformer/utils.py's get_default_causal_mask builds the mask with device="cuda"."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


@contextlib.contextmanager
def _cuda_copies_stay_on_cpu():
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **kw: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _tied_head_setup_on_cpu(setup):
    """language_module.py's setup_embeddings_and_output_layer moves the tied embedding to the GPU
    (`weight.data.cuda()`) before all-reducing it between the first and last stage (pp > 1)."""
    @functools.wraps(setup)
    def on_cpu(self, *args, **kwargs):
        with _cuda_copies_stay_on_cpu():
            return setup(self, *args, **kwargs)
    return on_cpu


def install() -> None:
    from megatron.core import tensor_parallel
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import layers, random
    from megatron.core.transformer import dot_product_attention
    from megatron.core.models.common.embeddings import language_model_embedding

    # p2p_communication.py, the tensor-parallel layers and attention allocate on
    # torch.cuda.current_device() and call torch.cuda.synchronize() after each exchange; on CPU
    # the current device is the CPU, and gloo's send/recv have completed when they return.
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    schedules.torch = _CpuDeviceTorch()
    fused_softmax.get_default_causal_mask = _causal_mask
    LanguageModule.setup_embeddings_and_output_layer = _tied_head_setup_on_cpu(
        LanguageModule.setup_embeddings_and_output_layer)

    tracker = _NoRngTracker()
    get_tracker = lambda *a, **kw: tracker  # noqa: E731
    for module in (tensor_parallel, random, layers, dot_product_attention, language_model_embedding):
        if hasattr(module, "get_cuda_rng_tracker"):
            module.get_cuda_rng_tracker = get_tracker
