"""What one rank puts on and takes off the wire in each collective: the package's one byte model.

The telemetry (:class:`~lightning_gradcomp.engine.comm.Comm`), DiLoCo's outer exchange and monitor, and every
compressor's declared byte model (:meth:`Compressor.wire_bytes <lightning_gradcomp.compressors.Compressor.wire_bytes>`)
count with these functions, so the logged numbers and the predicted ones cannot drift apart. A collective's algorithm
decides what a rank moves, not the size of the buffer it is handed; the standard ones (Thakur, Rabenseifner & Gropp,
2005, "Optimization of collective communication operations in MPICH"; Patarasuk & Yuan, 2009, the bandwidth-optimal
ring all-reduce) give, for ``n`` ranks and a buffer of ``b`` bytes per rank:

=================  ====================================  ====================================
collective         sent by each rank                     received by each rank
=================  ====================================  ====================================
all-reduce (ring)  ``2 (n - 1) / n * b``                 ``2 (n - 1) / n * b``
all-gather (ring)  ``(n - 1) * b`` (its block, forwarded) ``(n - 1) * b``
all-to-all         what it sends to the other ranks      what the other ranks send it
broadcast          binomial tree from the source: each   every rank but the source: ``b``
                   rank sends ``b`` to each child
=================  ====================================  ====================================

An all-gather of variable sizes is an all-gather of buffers padded to the largest (the padding moves), and a sparse
all-reduce is what gloo runs, an all-gather of every rank's rows. The broadcast is assumed to be a binomial tree, as
gloo's and MPI's for the small buffers compressors broadcast: ``n - 1`` copies in all, so ``(n - 1) / n * b`` sent
and received per rank on average, while the source sends ``ceil(log2 n)`` copies. With two ranks every formula is
the buffer itself, once each way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Wire",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "broadcast_mean",
    "compression_ratio",
    "sparse_all_reduce",
]


@dataclass(frozen=True)
class Wire:
    """Bytes one rank puts on the wire (``sent``) and takes off it (``received``).

    Integers where a rank's own collective is counted, fractions where a figure is a mean over ranks
    (:func:`broadcast_mean`) or a model's.
    """

    sent: float = 0
    received: float = 0

    @property
    def moved(self) -> float:
        """``sent + received``: what the rank's links carry."""
        return self.sent + self.received

    def __add__(self, other: Wire) -> Wire:
        return Wire(self.sent + other.sent, self.received + other.received)

    def scaled(self, factor: float) -> Wire:
        """Both counts times ``factor`` (a figure per step from a total, say)."""
        return Wire(self.sent * factor, self.received * factor)


def all_reduce(nbytes: int, world_size: int) -> Wire:
    """A ring all-reduce of ``nbytes``: reduce-scatter then all-gather, ``2 (n - 1) / n`` of it each way."""
    moved = 2 * (world_size - 1) * nbytes // world_size if world_size > 1 else 0
    return Wire(moved, moved)


def all_gather(nbytes: int, world_size: int) -> Wire:
    """A ring all-gather of ``nbytes`` per rank: each rank forwards ``n - 1`` blocks and receives as many."""
    moved = (world_size - 1) * nbytes
    return Wire(moved, moved)


def sparse_all_reduce(nbytes: int, world_size: int) -> Wire:
    """Gloo's sparse all-reduce of ``nbytes`` of rows: an all-gather of every rank's rows.

    Counted as if every rank held as many rows (the other ranks' counts are not known here).
    """
    return all_gather(nbytes, world_size)


def all_to_all(send_bytes: Sequence[int], recv_bytes: Sequence[int], rank: int) -> Wire:
    """An all-to-all where ``rank`` sends ``send_bytes[d]`` to rank ``d`` and receives ``recv_bytes[s]`` from ``s``.

    What a rank keeps for itself never reaches the wire.
    """
    return Wire(sum(send_bytes) - send_bytes[rank], sum(recv_bytes) - recv_bytes[rank])


def broadcast(nbytes: int, world_size: int, rank: int, src: int) -> Wire:
    """A binomial-tree broadcast of ``nbytes`` from ``src``, as ``rank`` sees it.

    Counted from the source, rank ``r`` (relative) receives once from ``r`` minus its lowest set bit and sends to
    ``r + m`` for every power of two ``m`` below that bit (below ``n`` for the source) while ``r + m < n``.
    """
    relative = (rank - src) % world_size
    lowest = relative & -relative if relative else 1 << max(world_size - 1, 0).bit_length()
    children = sum(1 for shift in range(lowest.bit_length() - 1) if relative + (1 << shift) < world_size)
    return Wire(children * nbytes, nbytes if relative else 0)


def broadcast_mean(nbytes: int, world_size: int) -> Wire:
    """A broadcast of ``nbytes`` averaged over the ranks: ``n - 1`` copies move, whatever the tree."""
    moved = (world_size - 1) * nbytes / world_size if world_size > 1 else 0
    return Wire(moved, moved)


def compression_ratio(dense: Wire, moved: Wire) -> float:
    """How many times fewer bytes ``moved`` carries than ``dense`` (plain DDP's ring); 1.0 when neither moved any."""
    if moved.moved == 0:
        return 1.0 if dense.moved == 0 else float("inf")
    return dense.moved / moved.moved
