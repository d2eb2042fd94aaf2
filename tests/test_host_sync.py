"""No compressor reads the device from the host on the hook path: detected on the CPU, for every example.

On a GPU a host read (``.item()``, ``.tolist()``, ``bool(tensor)``) or an operator whose output size depends on the
data (``nonzero``, ``unique``, a boolean-mask index) waits for the device, so the hook stalls the backward pass.
Here every configuration of ``EXAMPLES`` runs a step of ``simulate_reduce`` under a ``TorchDispatchMode`` that records
such operators, and with ``Tensor.tolist`` recorded; ``flat_nonzero``'s NumPy shortcut is replaced by
``torch.nonzero`` so that its data-dependent size is seen. Reads in branches that run on the CPU only (the NumPy
comparisons' scalar bound, the commit of a CPU flag, the sparsifiers' owner map and the index plans of DGC's and the
top-k selections, built on the CPU once per layout: DGC's warm-up changes the layout at every stage) are not counted:
on a GPU those branches are not taken.

The compressors that still read are listed with the reason; the test fails when one of them stops reading too (the
list must shrink), and when any other starts.
"""

from __future__ import annotations

import collections
import traceback
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gradcomp.compressors import adacomp, dgc, masked, sparsify, zen
from lightning_gradcomp.compressors.ops import layer_topk, packing
from lightning_gradcomp.compressors.transports import hashed_sum as transport
from lightning_gradcomp.engine.context import layers_from_shapes
from lightning_gradcomp.testing import EXAMPLES, simulate_reduce

aten = torch.ops.aten
_READS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
}
# (file, function) of the branches that run only on the CPU, where reading a scalar is no synchronisation
_CPU_ONLY = {
    ("requests.py", "commit"),
    ("packing.py", "above"),
    ("packing.py", "magnitude_above"),
    ("quantize.py", "_clamp_"),
    ("layer_topk.py", "_sampled"),
    ("sparse_shards.py", "device_owners"),
    ("dgc_select.py", "_plan"),
    ("layer_topk.py", "_plan"),
}

# what still reads on the hook path, and where
KNOWN = {
    **dict.fromkeys(["zen", "zen-always", "zen-bitmap", "topk-zen", "topk-auto", "dgc-zen"], "sparse sizes"),
    **dict.fromkeys(
        [name for name in EXAMPLES if name.startswith("lgc") and name.endswith(("stages", "stage2"))],
        "LGC's sparse stages: nonzero",
    ),
    "lgc-ps-stage3": "LGC's sparse stages: nonzero",
}
# a few examples run by default (the sign family, the casts, MinMax); every example is marked slow
QUICK = ["signsgd", "signum", "efsignsgd", "onebit", "fp16", "minmax8", "powersgd", "randomk-unbiased"]


class HostReads(TorchDispatchMode):
    """Counts the operators that read the device from the host, by where they were called."""

    def __init__(self) -> None:
        super().__init__()
        self.found: collections.Counter[str] = collections.Counter()

    def record(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "lightning_gradcomp" in f.filename]
        if any((f.filename.rsplit("/", 1)[-1], f.name) in _CPU_ONLY for f in frames):
            return
        where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[-2:][::-1])
        self.found[f"{what} at {where}"] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        unsized = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        if func in _READS or unsized:
            self.record(str(func))
        elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.record("boolean index")
        return func(*args, **kwargs)


def _torch_nonzero(values: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(values).squeeze(1)


@pytest.fixture
def device_paths(monkeypatch: pytest.MonkeyPatch) -> HostReads:
    """A recording mode, with ``flat_nonzero`` and ``tolist`` seen as the device runs them."""
    reads = HostReads()
    for module in (packing, adacomp, dgc, layer_topk, masked, sparsify, transport, zen):
        monkeypatch.setattr(module, "flat_nonzero", _torch_nonzero, raising=False)
    # DGC selects layer by layer on the CPU only (reading a count there waits for nothing): watch the bucket's path
    monkeypatch.setattr(dgc, "LOOP_ON_CPU", False)
    tolist = torch.Tensor.tolist

    def recorded(self: torch.Tensor) -> Any:
        reads.record("tolist")
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", recorded)
    return reads


LAYERS = layers_from_shapes([(64, 3, 3, 3), (64,), (32, 16, 3, 3), (10, 512), (10,)])


@pytest.mark.parametrize(
    "name", [name if name in QUICK else pytest.param(name, marks=pytest.mark.slow) for name in sorted(EXAMPLES)]
)
def test_no_host_reads_on_the_hook_path(name: str, device_paths: HostReads) -> None:
    numel = LAYERS[-1].offset + LAYERS[-1].numel
    torch.manual_seed(0)
    compressors = [EXAMPLES[name]() for _ in range(2)]
    residuals = [torch.zeros(numel) for _ in range(2)] if compressors[0].default_error_feedback else None
    for step in range(3):  # the third step is watched: warm-ups, layouts built and stages begun before are not
        grads = [torch.randn(numel) * 1e-3 for _ in range(2)]
        if step < 2:
            simulate_reduce(compressors, grads, LAYERS, step=step, residuals=residuals)
            continue
        with device_paths:
            simulate_reduce(compressors, grads, LAYERS, step=step, residuals=residuals)
    if name in KNOWN:
        assert device_paths.found, f"{name} no longer reads the device ({KNOWN[name]}): remove it from KNOWN"
    else:
        assert not device_paths.found, f"{name} reads the device on the hook path: {dict(device_paths.found)}"


def test_the_mode_sees_a_read() -> None:
    """The control: an ``.item()`` and a ``nonzero`` under the mode are recorded."""
    reads = HostReads()
    with reads:
        torch.ones(3).sum().item()
        torch.nonzero(torch.ones(3))
    assert len(reads.found) == 2
