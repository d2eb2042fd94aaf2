"""The floor plan, measured on the running code: how deep the way to the wire is, and what the top of a folder holds.

Both strategies reach ``torch.distributed`` through the same frames below their own: the engine's split of a flat
tensor (``engine/split.py``), the compressor's sealed ``reduce``, the driver, ``Comm`` and ``TorchCollectives``. The
depth is read from the stack when the first collective is issued, in one process (a process group of one rank).
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

from lightning_gradcomp import CompressedDDP, DiLoCo
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.engine.collectives import TorchCollectives
from lightning_gradcomp.testing import exported_compressor_classes
from tests.models import TinyNet

ROOT = Path(__file__).resolve().parent.parent / "lightning_gradcomp"


def _frames_below(entry: str, monkeypatch) -> list[list[str]]:
    """Record, at every all-gather, the frames from the innermost call of ``entry`` down to ``TorchCollectives``."""
    seen: list[list[str]] = []
    original = TorchCollectives.all_gather

    def recorded(self, tensor, round):
        names = [frame.name for frame in traceback.extract_stack()]
        if entry in names:
            start = len(names) - 1 - names[::-1].index(entry)
            seen.append([*names[start:-1], "TorchCollectives.all_gather"])
        return original(self, tensor, round)

    monkeypatch.setattr(TorchCollectives, "all_gather", recorded)
    return seen


def _fit(tmp_path, strategy) -> None:
    options = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=2,
        default_root_dir=str(tmp_path),
        enable_model_summary=False,
        **options,
    )
    trainer.fit(TinyNet())


def test_the_hook_reaches_the_wire_in_eight_frames(tmp_path, monkeypatch, in_process_ddp):
    seen = _frames_below("compression_hook", monkeypatch)
    _fit(tmp_path, CompressedDDP(TopK(ratio=0.1), min_compress_numel=0))
    assert seen, "TopK gathers its pairs"
    assert seen[0][:3] == ["compression_hook", "reduce", "reduce_split"], seen[0]
    assert len(seen[0]) <= 8, seen[0]


def test_diloco_reaches_the_wire_in_nine_frames(tmp_path, monkeypatch, in_process_ddp):
    seen = _frames_below("optimizer_step", monkeypatch)
    _fit(tmp_path, DiLoCo(sync_every=1, compressor=TopK(ratio=0.1)))
    assert seen, "the outer exchange gathers TopK's pairs"
    # Round.send: the one place an exchange starts (the membership says who takes part there), called by the front door
    assert seen[0][:3] == ["optimizer_step", "send", "start"], seen[0]
    assert "reduce_split" in seen[0], "the outer exchange uses the engine's one split"
    assert len(seen[0]) <= 9, " > ".join(seen[0])


def test_the_frame_count_sees_a_deeper_path(monkeypatch):
    """The check itself: a call two frames deeper is counted two frames deeper."""
    seen: list[list[str]] = []

    def leaf():
        names = [frame.name for frame in traceback.extract_stack()]
        seen.append(names[names.index("entry") :])

    def middle():
        leaf()

    def entry(deeper: bool):
        return middle() if deeper else leaf()

    entry(False)
    entry(True)
    assert [len(s) for s in seen] == [2, 3]


def test_the_top_of_compressors_is_the_list_of_methods():
    """Every module (or package) at the top of ``compressors/`` but the base class defines an exported compressor;
    kernels and exchange patterns live one level down (``ops/``, ``transports/``)."""
    defined = {cls.__module__.split(".")[2] for cls in exported_compressor_classes()}
    top = {p.stem for p in (ROOT / "compressors").glob("*.py")} - {"__init__", "base"}
    packages = {p.parent.name for p in (ROOT / "compressors").glob("*/__init__.py")} - {"ops", "transports"}
    assert top | packages <= defined, sorted((top | packages) - defined)
    assert {"ops", "transports"} <= {p.parent.name for p in (ROOT / "compressors").glob("*/__init__.py")}


@pytest.mark.parametrize("folder", ["engine", "compressors/ops", "compressors/transports"])
def test_machinery_folders_define_no_compressor(folder):
    package = "lightning_gradcomp." + folder.replace("/", ".")
    assert not [cls for cls in exported_compressor_classes() if cls.__module__.startswith(package)]


def test_the_top_level_holds_at_most_five_modules():
    assert len(list(ROOT.glob("*.py"))) <= 5, sorted(p.name for p in ROOT.glob("*.py"))
