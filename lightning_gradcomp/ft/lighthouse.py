"""torchft's lighthouse, started and stopped from Python: the one process a fault-tolerant run needs besides its jobs.

The lighthouse (pytorch/torchft ``src/lighthouse.rs``) forms the quorums: every replica group's manager heartbeats
to it and asks it, at each sync, which groups take part. Its rules, with their defaults: a quorum forms at once
when every member of the last one is back; otherwise with at least ``min_replicas`` groups and more than half of
those heartbeating, after waiting up to ``join_timeout_ms`` (60 s) for healthy stragglers; a group that has not
heartbeated for ``heartbeat_timeout_ms`` (5 s) is dead, which is how long the others' next sync waits for a group
that died. It has no authentication: whoever reaches its port can join a quorum, so it binds to loopback unless
told otherwise.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from lightning_gradcomp.ft.config import import_torchft

__all__ = ["Lighthouse", "serve"]


class Lighthouse:
    """torchft's ``LighthouseServer`` in this process, as a context manager.

    Args:
        min_replicas: the fewest replica groups a new quorum needs.
        port: the port to listen on (0: any free one).
        host: the address to bind (``127.0.0.1``: this machine only; ``0.0.0.0``: every interface).
        join_timeout_ms: how long a valid quorum waits for healthy groups that have not asked yet (the default of
            ``torchft_lighthouse``; torchft's Python ``LighthouseServer`` defaults to 100 ms, which lets a quorum
            form without a group that is merely a moment late).
        heartbeat_timeout_ms: how long a silent group counts as alive (how long the others' next sync waits for a
            group that died).
        quorum_tick_ms: how often the quorum is recomputed (besides at every request).

    Attributes:
        address: ``http://HOST:PORT``, what ``TorchFT(lighthouse=...)`` and ``TORCHFT_LIGHTHOUSE`` take.
    """

    def __init__(
        self,
        min_replicas: int = 1,
        port: int = 0,
        host: str = "127.0.0.1",
        join_timeout_ms: int = 60_000,
        heartbeat_timeout_ms: int = 5_000,
        quorum_tick_ms: int = 100,
    ) -> None:
        import_torchft()
        from torchft._torchft import LighthouseServer

        self._server: Any = LighthouseServer(
            bind=f"{host}:{port}",
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        bound_port = int(str(self._server.address()).rsplit(":", 1)[1].rstrip("/"))
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host
        self.address = f"http://{shown}:{bound_port}"

    def stop(self) -> None:
        """Stop listening (the groups' next quorum fails once their timeout passes)."""
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


def serve(lighthouse: Lighthouse, announce: Callable[[str], Any] = print) -> None:
    """Run ``lighthouse`` until SIGINT or SIGTERM, then stop it (what ``lightning-gradcomp lighthouse`` does)."""
    stopped = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopped.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        announce(f"lighthouse listening on {lighthouse.address}; TORCHFT_LIGHTHOUSE={lighthouse.address}")
        while not stopped.wait(0.5):
            pass
    finally:
        lighthouse.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        announce("lighthouse stopped")
