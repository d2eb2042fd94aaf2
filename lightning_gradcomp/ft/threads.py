"""Replica groups that share a machine each take their share of its cores.

Each group of a fault-tolerant run is its own job, so Lightning's launcher gives every process ``cores / (the job's
processes)`` compute threads (``_set_num_threads_if_needed``), unaware of the other groups on the machine: two
one-process groups on two cores run two threads each, and oversubscribed cores made each step about 13 times slower
than one thread per process (torchrun sets one per process for the same reason). :func:`share_cores` divides the
cores by the job's processes times the groups expected on this machine: every group when the lighthouse is on
loopback, else this one. A thread count the user chose (``OMP_NUM_THREADS`` or ``torch.set_num_threads``) is kept.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Callable
from urllib.parse import urlparse

import torch

from lightning_gradcomp.ft.config import TorchFT

__all__ = ["available_cores", "groups_on_this_host", "share_cores"]

OMP_ENV = "OMP_NUM_THREADS"
# what the user had chosen before Lightning's launcher sets its own: read when the package is imported, which a
# script or the CLI does before building the Trainer
_ENV_AT_IMPORT = os.environ.get(OMP_ENV)
_THREADS_AT_IMPORT = torch.get_num_threads()


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def groups_on_this_host(config: TorchFT) -> int:
    """The groups expected on this machine: all of them with a lighthouse on loopback, else this one alone."""
    host = urlparse(config.lighthouse).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = False
    return config.groups if loopback else 1


def share_cores(
    config: TorchFT | None, local_processes: int, info: Callable[[str], None] = logging.getLogger(__name__).info
) -> int:
    """Set this process's compute threads to its share of the cores, unless the user chose a number; return it.

    Args:
        config: the run's fault tolerance (``None``: a plain job, left to Lightning).
        local_processes: this job's processes on this machine.
        info: where the line saying what was chosen goes.

    Returns:
        The number of compute threads this process runs with.
    """
    lightnings = str(max(1, available_cores() // max(1, local_processes)))  # what Lightning's launcher sets
    chosen_by_user = _ENV_AT_IMPORT is not None or os.environ.get(OMP_ENV, lightnings) != lightnings
    chosen_by_user = chosen_by_user or torch.get_num_threads() not in (_THREADS_AT_IMPORT, int(lightnings))
    if config is None or chosen_by_user:
        return torch.get_num_threads()
    groups = groups_on_this_host(config)
    processes = local_processes * groups
    threads = max(1, available_cores() // processes)
    torch.set_num_threads(threads)
    os.environ[OMP_ENV] = str(threads)  # what data-loader workers and child processes inherit
    where = f"{groups} groups with the lighthouse on loopback" if groups > 1 else "this group alone"
    info(
        f"TorchFT: {threads} compute thread{'s' if threads > 1 else ''} per process: {available_cores()} cores for"
        f" {processes} processes on this machine ({local_processes} per group, {where}); set {OMP_ENV} to choose."
    )
    return threads
