"""Quiet hub access: the hub client logs a warning per retry, which would bury our one-line
error for an unreachable dataset or tokenizer."""
import contextlib

from huggingface_hub.utils import logging as hub_logging


@contextlib.contextmanager
def hub_errors_only():
    before = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()
    try:
        yield
    finally:
        hub_logging.set_verbosity(before)
