"""State that makes every step non-finite is reset after ``reset_state_after`` such steps: training never stalls.

The spikes are those ``benchmarks/spikes.py`` lists as leaving state that no later step can use: fp16 gradients of
order ``1e4`` (sums and decoded values above fp16's range), one rank's fp32 gradient of order ``1e18`` for QSGD's
small buckets, and of order ``1e35`` for LGC's all-reduce variant. Without the reset every step after the spike is
non-finite forever; with it, training goes on after ``reset_state_after`` of them, as a fresh start would.
"""

import copy

import pytest
import torch

from lightning_gradcomp import CompressionState
from lightning_gradcomp.compressors.base import layers_from_shapes
from lightning_gradcomp.engine.staging import NonfiniteRun
from lightning_gradcomp.testing import EXAMPLES, SimulatedHook

# the shapes of tests/test_contract.py: a conv weight, two same-shape matrices apart, a tall and a wide matrix
LAYERS = layers_from_shapes([(16, 4, 3, 3), (48, 64), (96, 24), (48, 64), (24, 96)])
NUMEL = sum(layer.numel for layer in LAYERS)
STALLS = [  # (example, spike magnitude, gradient dtype)
    ("qsgd", 1e7, torch.float16),
    ("powersgd", 1e7, torch.float16),
    ("dgc", 1e7, torch.float16),
    ("randomk-unbiased", 1e7, torch.float16),
    ("qsgd-2bit-small-buckets", 1e21, torch.float32),
    ("lgc-allreduce-stage3", 1e38, torch.float32),
]
STEPS = 10
SPIKE = 1


def _states(name, reset_state_after, ranks=2):
    compressor = EXAMPLES[name]()
    try:
        compressor.check_error_feedback(True)
        feedback = True
    except ValueError:
        feedback = False
    return [
        CompressionState(
            copy.deepcopy(compressor),
            min_compress_numel=0,
            error_feedback=feedback,
            reset_state_after=reset_state_after,
        )
        for _ in range(ranks)
    ]


def _gradients(magnitude, dtype, steps=STEPS, ranks=2):
    """Gradients of order 1e-3; at step SPIKE, the last rank's whole gradient times ``magnitude``."""
    generator = torch.Generator().manual_seed(0)
    steps_grads = []
    for step in range(steps):
        grads = [(torch.randn(NUMEL, generator=generator, dtype=torch.float64) * 1e-3) for _ in range(ranks)]
        if step == SPIKE:
            grads[-1] = grads[-1] * magnitude
        steps_grads.append([g.to(dtype) for g in grads])
    return steps_grads


def _finite(outs):
    return all(bool(torch.isfinite(out).all()) for out in outs)


def _bits(tensor):
    """The tensor's bits as integers: equal bits compare equal, NaNs included."""
    return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


@pytest.mark.parametrize(("name", "magnitude", "dtype"), STALLS, ids=[f"{s[0]}-{s[2]}" for s in STALLS])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_state_that_stalls_training_is_reset_and_training_goes_on(name, magnitude, dtype, ranks, caplog):
    grads = _gradients(magnitude, dtype, ranks=ranks)
    # without the reset, the spike's state makes every later step non-finite: the stall this guards against
    hook = SimulatedHook(_states(name, None, ranks), LAYERS)
    stalled = [_finite(hook.step(g)) for g in grads]
    since = stalled.index(False, SPIKE)
    assert not any(stalled[since:]), stalled
    assert since <= STEPS - 5, stalled
    assert hook.states[0].telemetry.total_state_resets == 0

    states = _states(name, 3, ranks)
    hook = SimulatedHook(states, LAYERS)
    finite, resets, every = [], [], []
    for step, g in enumerate(grads):
        outs = hook.step(g)
        assert all(torch.equal(_bits(out), _bits(outs[0])) for out in outs), step  # every rank resets at one step
        finite.append(_finite(outs))
        resets.append(states[0].telemetry.total_state_resets)
        every.append(outs)
    assert all(state.telemetry.total_state_resets == 1 for state in states)
    warned = [r.getMessage() for r in caplog.records if "consecutive steps were not finite" in r.getMessage()]
    assert len(warned) == ranks
    assert warned[0].startswith("gradcomp: 3 consecutive steps were not finite on every rank")
    first = resets.index(1)  # the step that started afresh
    # it came after exactly three non-finite steps, and every step from it on is finite
    assert finite[first - 3 : first] == [False] * 3, finite
    assert all(finite[first:]), finite
    assert states[0].step == STEPS

    if name.startswith("lgc"):
        return  # LGC keeps its trained autoencoder (only the residuals start afresh): no fresh start to compare with
    # the step after the reset is bitwise a fresh start at that step
    fresh = _states(name, 3, ranks)
    for state in fresh:
        state.step = first
    for out, expected in zip(SimulatedHook(fresh, LAYERS).step(grads[first]), every[first]):
        assert torch.equal(out, expected)


@pytest.mark.parametrize(("name", "magnitude", "dtype"), STALLS[:2] + STALLS[4:5], ids=["qsgd", "powersgd", "qsgd-32"])
@pytest.mark.parametrize("stop", [2, 3, 4])
def test_a_resume_inside_a_run_of_non_finite_steps_resets_at_the_same_step(name, magnitude, dtype, stop):
    """Checkpointed after ``stop`` steps (inside the run, or just before the reset) and resumed: the same bits."""
    grads = _gradients(magnitude, dtype)
    hook = SimulatedHook(_states(name, 3), LAYERS)
    through = [hook.step(g) for g in grads]

    hook = SimulatedHook(_states(name, 3), LAYERS)
    for g in grads[:stop]:
        hook.step(g)
    saved = [state.state_dict() for state in hook.states]
    resumed = _states(name, 3)
    for state, state_dict in zip(resumed, saved):
        state.load_state_dict(copy.deepcopy(state_dict))
    hook = SimulatedHook(resumed, LAYERS)
    for step in range(stop, STEPS):
        outs = hook.step(grads[step])
        for rank in range(2):
            assert torch.equal(_bits(outs[rank]), _bits(through[step][rank])), (step, rank)
    assert resumed[0].telemetry.total_state_resets == 1


def test_a_model_that_stays_non_finite_resets_every_few_steps_and_warns_less_and_less(caplog):
    """NaN on one rank at every step: a reset every three steps, warned at the 1st, 2nd, 4th and 8th."""
    grads = _gradients(1.0, torch.float32, steps=25)
    for step_grads in grads:
        step_grads[-1][0] = float("nan")
    states = _states("topk", 3)
    hook = SimulatedHook(states, LAYERS)
    for g in grads:
        assert not _finite(hook.step(g))
    assert [state.telemetry.total_state_resets for state in states] == [8, 8]  # before steps 4, 7, ..., 25
    warned = [r for r in caplog.records if "consecutive steps were not finite" in r.getMessage()]
    numbers = [int(r.getMessage().split("(reset ")[1].split(";")[0]) for r in warned]
    assert numbers == [1, 1, 2, 2, 4, 4, 8, 8]  # each on both ranks


def test_the_run_counts_consecutive_non_finite_verdicts():
    run = NonfiniteRun()
    verdicts = [True, False, False, None, True, False, False, False]  # None: a step that was not checked
    expected = [0, 1, 2, 2, 0, 1, 2, 3]
    for step, (ok, length) in enumerate(zip(verdicts, expected), start=1):
        run.add(step, None if ok is None else torch.tensor(ok))
        assert run.length_before(step) == length, step
    # a lag counts only the verdicts through ``step - lag``
    lagged = NonfiniteRun()
    for step, ok in enumerate([False, False, False], start=1):
        lagged.add(step, torch.tensor(ok))
    assert lagged.length_before(3, lag=2) == 1
    state = lagged.state_dict()
    assert state == {"length": 1, "pending": [(2, False), (3, False)]}
    restored = NonfiniteRun()
    restored.load_state_dict(state)
    assert restored.length_before(3) == lagged.length_before(3) == 3
    restored.add(4, torch.tensor(False))
    restored.clear()  # after a reset: the verdicts still pending were made with the state that was dropped
    assert restored.length_before(10) == 0
