"""Checks, before torch.distributed starts, of what would otherwise fail later on one rank only:
wandb (an API key for online mode), environment overrides, and that every output path is
writable. Each failure is a ConfigError (one line, exit 2) instead of one rank's traceback
while the others wait in a collective."""
import netrc
import os
import tempfile
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from data.cache import lock_timeout_s
from launch.checkpoints.slow_save import slow_save_s
from launch.config.recipe import Recipe
from launch.errors import ConfigError
from launch.instruments.metrics import PEAK_TFLOPS_ENV, peak_flops
from launch.resilience.failure import fault_injection

def wandb_api_key_present() -> bool:
    """What wandb.init(mode="online") looks for: WANDB_API_KEY, else a netrc entry for the
    API host (WANDB_BASE_URL, default https://api.wandb.ai) in $NETRC or ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def check_wandb(mode: str) -> None:
    """An online run needs an API key (the mode itself: WandbSection.validate)."""
    if mode == "online" and not wandb_api_key_present():
        raise ConfigError("--wandb online (wandb.mode) needs an API key: set WANDB_API_KEY or run `wandb login`; "
                          "or use --wandb offline and `wandb sync` later")


def check_writable_dir(directory: Path, what: str) -> None:
    """Create `directory` if needed and write and remove a probe file in it (permission bits say
    nothing for root, and a read-only mount or a full quota only shows on a write)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory) as probe:
            probe.write(b"probe")
            probe.flush()
    except OSError as e:
        raise ConfigError(f"{what}: cannot create or write in the directory {str(directory)!r} "
                          f"({e.strerror or type(e).__name__}); choose another path") from None


def check_writable_file(path: Path, what: str) -> None:
    """The file's directory is writable and the file itself, if present, can be opened for
    writing (opened for append: its content is left as it is until training starts)."""
    check_writable_dir(path.parent, what)
    if path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a directory; give a file name")
    if path.exists():
        try:
            open(path, "a").close()
        except OSError as e:
            raise ConfigError(f"{what} {str(path)!r} is not writable ({e.strerror}); choose another path") from None


def check_before_start(recipe: Recipe, metrics_out: Optional[Path], save: Optional[Path],
                       timeline: Optional[Path], comm_counts: Optional[Path]) -> None:
    check_wandb(recipe.wandb.mode)
    peak_flops(None, os.environ.get(PEAK_TFLOPS_ENV))  # raises on a malformed GPT3D_PEAK_TFLOPS
    fault_injection()  # raises on a malformed GPT3D_FAULT_INJECT (a test hook)
    slow_save_s()  # raises on a malformed GPT3D_SLOW_SAVE (a test hook)
    lock_timeout_s()  # raises on a malformed GPT3D_CACHE_LOCK_TIMEOUT_S
    if metrics_out is not None:
        check_writable_file(metrics_out, "--metrics-out")
    if timeline is not None:
        check_writable_file(timeline, "--timeline")
    if save is not None:
        check_writable_dir(save, "--save")
    if comm_counts is not None:
        check_writable_dir(comm_counts, "--comm-counts")
