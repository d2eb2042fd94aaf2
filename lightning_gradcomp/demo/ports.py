"""A free TCP port on localhost, for the ``MASTER_PORT`` of the benchmarks' spawned gloo processes."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the operating system's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
