"""A network namespace whose loopback is limited to a given rate (tc tbf), for bandwidth-limited benchmarks.

Needs root (``ip netns``, ``tc``). Only loopback traffic inside the namespace is shaped; the namespace is deleted on
exit, also after an exception or SIGTERM, and namespaces left by a crashed run (their process gone) are removed first.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

PREFIX = "gradcomp-bench-"


def _remove_stale() -> None:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    for name in re.findall(rf"^({PREFIX}(\d+))", listing, flags=re.M):
        full, pid = name
        if not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", full], check=False)


@contextmanager
def shaped_namespace(rate: str, burst: str = "256kb", latency: str = "50ms") -> Iterator[str]:
    """Yield the name of a fresh namespace whose loopback is shaped to ``rate`` (e.g. ``"100mbit"``)."""
    _remove_stale()
    name = f"{PREFIX}{os.getpid()}"
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                name,
                "tc",
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "latency",
                latency,
            ],
            check=True,
        )
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
        signal.signal(signal.SIGTERM, previous)


def rate_bytes_per_second(rate: str) -> float:
    """``"100mbit"`` -> 12.5e6 (tc's units: kbit/mbit/gbit are powers of 1000 bits per second)."""
    match = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", rate.strip().lower())
    if not match:
        raise ValueError(f"Expected a rate like '100mbit' or '1gbit', got {rate!r}.")
    value, unit = float(match.group(1)), match.group(2)
    return value * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[unit] / 8
