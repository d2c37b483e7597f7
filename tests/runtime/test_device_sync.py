"""The GPU-only work of a training step, seen on CPU: the device sync before
the step clock stops (launch/trainer/loop.py: timed_train_batch) and the pinned, non-blocking
copies of the micro-batches (data/pipeline.py: on_device). On DeepSpeed's CPU accelerator both
are no-ops, so deleting either would leave every other test green.

Our code reaches the device through DeepSpeed's accelerator (get_accelerator), so one real
training step runs here under a subclass of the CPU accelerator that records what a GPU would be
asked to do: synchronize() calls, and pin_memory() calls, whose result records the copy made of
it (`.to(device, non_blocking=...)`, read with torch's own argument parser). Everything else is
the CPU accelerator's: the step computes what it computes on CPU."""
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from helpers.distributed import run_distributed, sgd_engine, uses_deepspeed
from helpers.launcher import TINY

MICRO_BATCHES = 2


def recording_accelerator(events: list, copies: list):
    """A DeepSpeed CPU accelerator that appends "synchronize" to `events` at every sync, and
    whose pin_memory returns a tensor that records each copy made of it in `copies` as
    (result, device, non_blocking)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    class PinnedHostTensor(torch.Tensor):
        """What a GPU's pin_memory returns: here the same values, marked, its copies recorded."""
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.to:
                device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
                result = args[0].as_subclass(torch.Tensor).to(*args[1:], **kwargs)
                copies.append((result, device, non_blocking))
                return result
            return super().__torch_function__(func, types, args, kwargs)

    class RecordingAccelerator(CPU_Accelerator):
        def synchronize(self, device_index=None):
            events.append("synchronize")
            return super().synchronize(device_index)

        def pin_memory(self, tensor, *args, **kwargs):
            return super().pin_memory(tensor, *args, **kwargs).as_subclass(PinnedHostTensor)

    return RecordingAccelerator()


@uses_deepspeed
def _one_step_on_a_recording_accelerator():
    import time
    import types

    from deepspeed.accelerator import get_accelerator, set_accelerator

    from data.pipeline import on_device
    from launch.config.recipe import load_recipe
    from launch.trainer import loop
    from model.parallel.state import init_parallel_state

    events, copies = [], []
    set_accelerator(recording_accelerator(events, copies))
    # The loop's clock, read as usual, each read recorded in order with the syncs.
    loop.time = types.SimpleNamespace(perf_counter=lambda: events.append("clock") or time.perf_counter())
    register_optimizer_step_post_hook(lambda *_: events.append("optimizer step"))

    config = load_recipe(TINY, []).gpt_config(4096)
    engine = sgd_engine(config, init_parallel_state(1, 1), micro_batch_size=2, micro_batches=MICRO_BATCHES)
    tokens = torch.randint(0, 4096, (MICRO_BATCHES, 2, config.seq_len + 1), generator=torch.Generator().manual_seed(5))
    host = [(t[:, :-1], t[:, 1:]) for t in tokens]
    device = torch.device(get_accelerator().current_device_name())
    drawn = []  # what the engine drew, in order

    def drawing(feed):
        for x, y in feed:
            drawn.append((x, y))
            yield x, y

    loss, seconds = loop.timed_train_batch(engine, lambda: drawing(on_device(iter(host), device)))

    # The clock stops after the device is done: the step's last compute (the optimizer step,
    # asynchronous on a GPU), then the sync, then the clock.
    assert events[0] == "clock" and "optimizer step" in events, events
    last_step = len(events) - 1 - events[::-1].index("optimizer step")
    assert events[last_step:] == ["optimizer step", "synchronize", "clock"], events
    assert seconds > 0 and torch.isfinite(loss)
    # Every micro-batch tensor the engine drew is a non-blocking copy, to the accelerator's
    # device, of a pinned host tensor holding the source's values.
    assert len(drawn) == MICRO_BATCHES, len(drawn)
    for (x, y), (hx, hy) in zip(drawn, host):
        for tensor, source in ((x, hx), (y, hy)):
            (copy,) = [c for c in copies if c[0] is tensor] or [None]
            assert copy is not None, "a micro-batch reached the engine without a copy from pinned memory"
            assert copy[1] == device and copy[2] is True, f"copied to {copy[1]} with non_blocking={copy[2]}"
            assert torch.equal(tensor, source)


def test_step_clock_waits_for_the_device_and_batches_arrive_pinned_and_non_blocking():
    run_distributed(_one_step_on_a_recording_accelerator, 1)
