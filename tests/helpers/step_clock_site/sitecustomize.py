"""Loaded at start-up by the ranks of a training run whose throughput a test checks against its own
measurement (tests/runtime/test_metrics.py, tests/analysis/test_gpu_mfu.py: PYTHONPATH=tests/helpers/step_clock_site and
GPT3D_STEP_CLOCK_DIR set). Every DeepSpeed `PipelineEngine.train_batch` is timed with this clock,
not the training loop's, and the tokens of the label batches it draws are counted: one JSON line
{"seconds", "tokens"} per call in $GPT3D_STEP_CLOCK_DIR/rank<RANK>.jsonl. Never on the path of a real run.
"""
import os
import sys

if os.environ.get("GPT3D_STEP_CLOCK_DIR") and ("RANK" in os.environ or sys.argv[0].endswith("train.py")):
    import functools
    import json
    import time
    from pathlib import Path

    from deepspeed.runtime.pipe.engine import PipelineEngine

    train_batch = PipelineEngine.train_batch

    @functools.wraps(train_batch)
    def timed_train_batch(self, data_iter=None):
        tokens = 0

        def counted(batches):
            nonlocal tokens
            for inputs, labels in batches:
                tokens += labels.numel()
                yield inputs, labels
        start = time.perf_counter()
        loss = train_batch(self, data_iter=None if data_iter is None else counted(data_iter))
        seconds = time.perf_counter() - start
        path = Path(os.environ["GPT3D_STEP_CLOCK_DIR"]) / f"rank{os.environ['RANK']}.jsonl"
        with open(path, "a") as out:
            out.write(json.dumps({"seconds": seconds, "tokens": tokens}) + "\n")
        return loss

    PipelineEngine.train_batch = timed_train_batch
