"""A free TCP port on localhost, for the ``MASTER_PORT`` of spawned gloo processes (benchmarks and tests).

The port is drawn *below* the range the kernel hands out for outgoing connections
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default). A port the kernel picked itself (``bind`` to
port 0) lies inside that range, so between the moment it is chosen and the moment the rendezvous store binds it, and
again between two fits of one launch that each bind it anew, any connection on the machine (gloo's own pairs, the
store's clients, another job) can be given it as its local port, and the bind then fails with "address already in
use". The busier the machine, the longer that window. A port below the range is never handed out that way: only an
explicit ``bind`` can take it.
"""

from __future__ import annotations

import random
import socket

_DEFAULT_EPHEMERAL_START = 32768
#: how far below the ephemeral range the draw goes (thousands of ports: two draws rarely meet)
_SPAN = 12000


def _ephemeral_start() -> int:
    """The first port of the kernel's range for outgoing connections (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_START


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listens on now, outside the kernel's range for outgoing connections where it can be."""
    start = _ephemeral_start()
    low = max(1024, start - _SPAN)
    draw = random.SystemRandom()  # independent of the seeded global generator every test and fit sets
    if start - low >= 100:
        for _ in range(100):
            port = draw.randrange(low, start)
            if _bindable(port):
                return port
    with socket.socket() as s:  # no room below the range (an unusual kernel setting): the kernel's own choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
