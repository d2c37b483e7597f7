"""A free TCP port for the DeepSpeed launcher's --master_port: the benches start several launches in
a row (and beside other jobs), so each asks the system for an unused port instead of 29500."""
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
