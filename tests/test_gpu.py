"""The GPU path: every compressor on CUDA tensors, the hook through DDP with NCCL and with gloo, no host syncs.

Skipped without a GPU (CI has none); run on a GPU machine with ``pytest tests/test_gpu.py``. Without one, the last
test runs what these tests do on the CPU instead, so that they cannot break unseen between runs on a GPU. The
host-sync checks use ``torch.cuda.set_sync_debug_mode("error")``: any operation on the codec path that makes the CPU
wait for the GPU (``.item()``, ``nonzero``, a device-to-host copy) raises, so the hook never stalls the backward
pass it overlaps.
"""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from lightning_gradcomp.compressors.base import layers_from_shapes
from lightning_gradcomp.testing import EXAMPLES, simulate_reduce
from tests.distributed import child_env, run_distributed

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU machine)")

SHAPES = [(64, 32, 3, 3), (128, 256), (256, 128), (10, 128)]
# Methods whose result does not depend on random draws made on the device: CUDA must give the CPU's result (to
# rounding: kernels sum in another order)
DETERMINISTIC = (
    "identity",
    "fp16",
    "bf16",
    "topk",
    "topk-10%",
    "randomk",
    "powersgd",
    "scalecom",
    "signsgd",
    "efsignsgd",
    "onebit",
    "dgc-no-momentum",
)
# What cannot avoid a host read on the codec path, and why (docs/benchmarks.md#gpu)
SYNCS: dict[str, str] = {}


def _grads(layers, n, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    numel = sum(layer.numel for layer in layers)
    return [torch.randn(numel, generator=g).to(device) for _ in range(n)]


def _reduce_steps(name, device, steps=3, sync_check=False):
    layers = layers_from_shapes(SHAPES)
    compressors = [EXAMPLES[name]() for _ in range(2)]
    numel = sum(layer.numel for layer in layers)
    ef = compressors[0].default_error_feedback
    residuals = [torch.zeros(numel, device=device) for _ in range(2)] if ef else None
    outs = []
    for step in range(steps):
        grads = _grads(layers, 2, device, seed=step)
        # the first steps allocate and warm caches; the steady state must not sync
        check = sync_check and step == steps - 1
        if check:
            torch.cuda.set_sync_debug_mode("error")
        try:
            outs.append(simulate_reduce(compressors, grads, layers, step=step, residuals=residuals))
        finally:
            if check:
                torch.cuda.set_sync_debug_mode("default")
    return outs


@needs_gpu
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_compressor_reduces_on_cuda_identically_on_every_rank_without_host_syncs(name):
    if name in SYNCS:
        with pytest.raises(RuntimeError, match="synchroniz"):
            _reduce_steps(name, "cuda", sync_check=True)
        return
    for outs in _reduce_steps(name, "cuda", sync_check=True):
        assert outs[0].device.type == "cuda"
        assert torch.equal(outs[0], outs[1])
        assert torch.isfinite(outs[0]).all()


@needs_gpu
@pytest.mark.parametrize("name", DETERMINISTIC)
def test_cuda_gives_the_cpu_result(name):
    for cpu, cuda in zip(_reduce_steps(name, "cpu"), _reduce_steps(name, "cuda")):
        tol = {"rtol": 1e-2, "atol": 1e-2} if name == "bf16" else {"rtol": 1e-4, "atol": 1e-5}
        torch.testing.assert_close(cuda[0].cpu(), cpu[0], **tol)


@needs_gpu
def test_the_contract_suite_passes_on_cuda_tensors():
    """tests/test_contract.py, every compressor, with every tensor on the GPU (GRADCOMP_TEST_DEVICE=cuda)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = child_env(GRADCOMP_TEST_DEVICE="cuda")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_contract.py"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------------------
# The hook through DDP
# ---------------------------------------------------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(512, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def _train(rank, world_size, name, steps, sync_check, device="cuda"):
    """``steps`` SGD steps of DDP on cuda:0 (``name``: a compressor of EXAMPLES, or None for plain DDP).

    ``device="cpu"``: the same on the CPU, for the check that this file still runs where it is skipped.
    """
    from lightning_gradcomp import CompressionState, compression_hook

    on_gpu = device == "cuda"
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    device_ids = [0] if on_gpu else None
    model = torch.nn.parallel.DistributedDataParallel(_model().to(device), device_ids=device_ids, bucket_cap_mb=0.05)
    if name == "torch-fp16":  # torch's own hook, for comparison
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        model.register_comm_hook(None, fp16_compress_hook)
    elif name is not None:
        state = CompressionState(EXAMPLES[name](), min_compress_numel=256)
        state.attach(model)
        model.register_comm_hook(state, compression_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    synced = []
    for step in range(steps):
        x = torch.randn(16, 3, 16, 16, generator=g).to(device)
        y = torch.randint(0, 10, (16,), generator=g).to(device)
        loss = nn.functional.cross_entropy(model(x), y)
        check = sync_check and step >= 2  # after DDP's bucket rebuild and the first allocations
        if check:
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
        except RuntimeError as err:
            synced.append(str(err).splitlines()[0])
            raise
        finally:
            if check:
                torch.cuda.set_sync_debug_mode("default")
        optimizer.step()
        optimizer.zero_grad()
    if on_gpu:
        torch.cuda.synchronize()
    return {"params": [p.detach().cpu() for p in model.parameters()], "synced": synced}


@needs_gpu
def test_ddp_over_nccl_at_world_size_one_with_identity_is_bitwise_plain_ddp():
    plain = run_distributed(_train, None, 4, False, world_size=1, backend="nccl")[0]
    ours = run_distributed(_train, "identity", 4, True, world_size=1, backend="nccl")[0]
    for a, b in zip(plain["params"], ours["params"]):
        assert torch.equal(a, b)


NO_SYNC_METHODS = [
    "topk",
    "powersgd",
    "qsgd",
    "qsgd-16bit-draws",
    "terngrad",
    "terngrad-16bit-draws",
    "efsignsgd",
    "onebit",
    "scalecom",
    "fp16",
]


@needs_gpu
@pytest.mark.parametrize("name", NO_SYNC_METHODS)
def test_ddp_over_nccl_runs_every_method_without_host_syncs_in_backward(name):
    result = run_distributed(_train, name, 5, True, world_size=1, backend="nccl")[0]
    assert not result["synced"]
    assert all(torch.isfinite(p).all() for p in result["params"])


@needs_gpu
@pytest.mark.parametrize("name", ["topk", "powersgd", "qsgd"])
def test_two_processes_share_the_gpu_over_gloo_and_stay_identical(name):
    """Two ranks on one GPU (NCCL refuses two ranks per device; gloo stages CUDA tensors through the host)."""
    ranks = run_distributed(_train, name, 4, False, world_size=2, backend="gloo")
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)


def _fit_with_lightning(rank, world_size, accelerator="gpu", strategy=None):
    import lightning as L

    from lightning_gradcomp import CompressedDDP
    from lightning_gradcomp.compressors import PowerSGD

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 16, 16, generator=g), torch.randint(0, 10, (64,), generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    strategy = CompressedDDP(compressor=PowerSGD(rank=2)) if strategy is None else strategy
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    return [p.detach().cpu() for p in module.parameters()]


@needs_gpu
def test_lightning_trainer_fits_with_compressed_ddp_on_the_gpu(in_process_ddp):
    params = _fit_with_lightning(0, 1)
    assert all(torch.isfinite(p).all() for p in params)
    assert not torch.equal(params[0], _model()[0].weight.detach())


def _fit_diloco(accelerator, offload):
    """DiLoCo with an 8-bit outer exchange, 2 rounds of 2 steps: the parameters after ``fit`` and the outer state."""
    from lightning_gradcomp import DiLoCo
    from lightning_gradcomp.compressors import MinMax

    strategy = DiLoCo(sync_every=2, offload=offload, compressor=MinMax(bits=8))
    return _fit_with_lightning(0, 1, accelerator=accelerator, strategy=strategy), strategy.outer_state


@needs_gpu
def test_diloco_over_nccl_keeps_theta_global_on_the_gpu_or_offloads_it(in_process_ddp):
    """DiLoCo on the GPU (NCCL, one process): theta_global and the outer momentum on the GPU, or in CPU memory with
    ``offload=True``; the same model either way, to rounding (the outer step runs on the other device)."""
    kept, kept_state = _fit_diloco("gpu", offload=False)
    offloaded, offloaded_state = _fit_diloco("gpu", offload=True)
    assert kept_state.params[0].is_cuda
    assert not offloaded_state.params[0].is_cuda
    assert kept_state.syncs == offloaded_state.syncs == 2
    for a, b in zip(kept, offloaded):
        torch.testing.assert_close(a, b)
    assert not torch.equal(kept[0], _model()[0].weight.detach())  # it trained


@needs_gpu
def test_the_run_of_non_finite_steps_is_counted_on_cuda_without_a_host_sync():
    """CUDA verdicts are copied to the host behind events and counted ``CUDA_LAG`` steps late, with no sync."""
    from lightning_gradcomp.engine.staging import CUDA_LAG, NonfiniteRun

    run = NonfiniteRun()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 6):
            run.add(step, torch.zeros((), dtype=torch.bool, device="cuda"))
            assert run.length_before(step, CUDA_LAG) == max(0, step - CUDA_LAG)
        run.add(6, torch.ones((), dtype=torch.bool, device="cuda"))
        assert run.length_before(8, CUDA_LAG) == 0
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------------------------------------------------------------
# Without a GPU
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests above run")
def test_this_file_still_runs_where_its_gpu_tests_are_skipped(in_process_ddp):
    """CI has no GPU, so the tests above are skipped there and could break unseen (a renamed configuration, a changed
    signature) until the next run on a GPU. Their parts run here on the CPU: every configuration they name exists and
    reduces (finite, the same on both ranks), the DDP helper trains (Identity bitwise plain DDP, as on NCCL), and the
    Lightning fits (CompressedDDP and DiLoCo) train."""
    for name in sorted({*DETERMINISTIC, *SYNCS, *NO_SYNC_METHODS}):
        for outs in _reduce_steps(name, "cpu"):
            assert torch.equal(outs[0], outs[1]), name
            assert torch.isfinite(outs[0]).all(), name
    plain = run_distributed(_train, None, 3, False, "cpu", world_size=1)[0]
    ours = run_distributed(_train, "identity", 3, False, "cpu", world_size=1)[0]
    for a, b in zip(plain["params"], ours["params"]):
        assert torch.equal(a, b)
    assert not torch.equal(plain["params"][0], _model()[0].weight.detach())  # it trained
    params = _fit_with_lightning(0, 1, accelerator="cpu")  # in this process, as the GPU test runs it
    assert all(torch.isfinite(p).all() for p in params)
    assert not torch.equal(params[0], _model()[0].weight.detach())
    params, outer = _fit_diloco("cpu", offload=True)
    assert outer.syncs == 2
    assert not outer.params[0].is_cuda
    assert not torch.equal(params[0], _model()[0].weight.detach())
