"""Quiet hub and datasets access: the hub client logs a warning per retry, and datasets a progress
bar and a log line about a bad file, which would bury or come before our one-line error."""
import contextlib
import logging

from huggingface_hub.utils import logging as hub_logging


@contextlib.contextmanager
def hub_errors_only():
    before = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()
    try:
        yield
    finally:
        hub_logging.set_verbosity(before)


@contextlib.contextmanager
def datasets_silent():
    """No progress bar or log line from datasets: while it converts local files, its json builder
    logs "Failed to load JSON from file ..." at ERROR before raising (datasets/packaged_modules/json),
    and "Generating train split" bars stand before whatever error follows; ours names the line."""
    import datasets
    bars, level = not datasets.utils.are_progress_bars_disabled(), datasets.utils.logging.get_verbosity()
    datasets.utils.disable_progress_bars()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(level)
        if bars:
            datasets.utils.enable_progress_bars()


PROGRESS_ROWS = 100_000
"""datasets' progress bars (filter, tokenize) show for datasets of at least this many documents,
where the work takes long enough to want them; below, they would only stand before an error line."""


def datasets_progress(rows: int):
    """datasets' bars on for a long pass over `rows` documents, off (datasets_silent) for a short one."""
    return contextlib.nullcontext() if rows >= PROGRESS_ROWS else datasets_silent()
