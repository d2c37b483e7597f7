"""Per-step metrics on the logging rank: a JSON-lines file, the console and wandb."""
import json
import time
from pathlib import Path
from typing import Any, Dict, Optional


def is_logging_rank(global_rank: int) -> bool:
    """The one predicate that decides who prints, writes metrics and talks to wandb.

    Global rank 0 is on the first stage; DeepSpeed broadcasts each step's loss from the last
    stage to the whole pipeline, and the gradient norm is reduced over every rank."""
    return global_rank == 0


class MetricsLogger:
    def __init__(self, metrics_out: Optional[Path], wandb_mode: str, wandb_project: str,
                 wandb_name: Optional[str], run_config: Dict[str, Any]):
        self.file = None
        if metrics_out is not None:
            metrics_out.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(metrics_out, "w")
        self.wandb_run = None
        if wandb_mode != "disabled":
            import wandb
            self.wandb_run = wandb.init(project=wandb_project, name=wandb_name, mode=wandb_mode,
                                        config=run_config)
        self.start = time.perf_counter()

    def log(self, record: Dict[str, Any]) -> None:
        record = dict(record, elapsed_s=round(time.perf_counter() - self.start, 4))
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        line = (f"step {record['step']:>5} | loss {record['loss']:.4f} | grad_norm {record['grad_norm']:.4f} | "
                f"lr {record['lr']:.3e} | {record['tokens_per_s']:.0f} tok/s")
        if "val_loss" in record:
            line += f" | val_loss {record['val_loss']:.4f} (ppl {record['val_ppl']:.1f})"
        print(line, flush=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
