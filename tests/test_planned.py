"""``Planned``: per-bucket dispatch to named candidates, and error feedback across plan switches."""

import pickle

import pytest
import torch

from lightning_gradcomp.compressors import BF16, Identity, Planned, PowerSGD, ScaleCom, SignSGD, TopK
from lightning_gradcomp.compressors.base import layers_from_shapes
from lightning_gradcomp.ddp.hook import CompressionState
from lightning_gradcomp.testing import SimulatedHook

LAYERS = layers_from_shapes([(16, 8), (32,), (8, 8)], names=["a.weight", "a.bias", "b.weight"])


def _planned():
    return Planned({"dense": Identity(), "topk": TopK(ratio=0.25), "psgd": PowerSGD(rank=1), "bf16": BF16()})


def test_a_bucket_goes_to_the_candidate_of_its_largest_assigned_layer():
    planned = _planned()
    assert planned.bucket_compressor(LAYERS) is planned.candidates["dense"]  # the default: the first candidate
    planned.set_assignment({"b.weight": "psgd"})
    assert planned.candidate_name(LAYERS) == "psgd"
    planned.set_assignment({"b.weight": "psgd", "a.weight": "topk"})
    assert planned.candidate_name(LAYERS) == "topk"  # a.weight (128) is larger than b.weight (64)
    assert planned.rounds == 2  # PowerSGD's, so that its process groups exist


def test_the_plan_key_changes_with_the_assignment_only():
    planned = _planned()
    key = planned.plan_key()
    planned.set_assignment({})
    assert planned.plan_key() == key
    planned.set_assignment({"a.weight": "topk"})
    assert planned.plan_key() != key


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"candidates": {}}, "candidates"),
        ({"candidates": {"x": "topk"}}, "candidates"),
        ({"candidates": {"dense": Identity()}, "assignment": {"a.weight": "nope"}}, "assignment"),
        ({"candidates": {"dense": Identity()}, "default": "nope"}, "default"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Planned(**kwargs)


def test_every_candidate_checks_the_error_feedback_setting():
    """The hook resolves error feedback per bucket, for the bucket's candidate: with it forced on, a candidate that
    cannot carry a memory (the majority vote) refuses when the state is made; by default each keeps its own."""
    planned = Planned({"dense": Identity(), "sign": SignSGD()})
    with pytest.raises(ValueError, match="error feedback"):
        CompressionState(planned, error_feedback=True)
    state = CompressionState(planned)
    assert not state.uses_error_feedback(planned.candidates["sign"])
    with pytest.raises(ValueError, match="`beta`"):
        CompressionState(Planned({"dense": Identity(), "scalecom": ScaleCom(beta=0.5)}), error_feedback=False)


def test_state_and_pickle_keep_the_assignment():
    planned = _planned()
    planned.set_assignment({"a.weight": "psgd"})
    other = _planned()
    other.load_state_dict(planned.state_dict())
    assert other.assignment == {"a.weight": "psgd"}
    assert pickle.loads(pickle.dumps(planned)).assignment == {"a.weight": "psgd"}


def test_error_feedback_telescopes_across_plan_switches():
    """Sum of applied averages + mean final residual == sum of mean gradients, exactly, while the plan switches
    between error-feedback candidates (TopK, PowerSGD) and ones without (Identity pays what is owed)."""
    states = [CompressionState(_planned(), min_compress_numel=0) for _ in range(2)]
    hook = SimulatedHook(states, LAYERS)
    numel = sum(layer.numel for layer in LAYERS)
    g = torch.Generator().manual_seed(0)
    schedule = ["dense", "topk", "topk", "psgd", "topk", "dense", "psgd", "psgd", "topk"]
    applied = torch.zeros(numel, dtype=torch.float64)
    computed = torch.zeros(numel, dtype=torch.float64)
    for name in schedule:
        for state in states:
            state.compressor.set_assignment({layer.name: name for layer in LAYERS})
        grads = [torch.randn(numel, generator=g, dtype=torch.float64) for _ in states]
        outs = hook.step(grads)
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        applied += outs[0]
        computed += (grads[0] + grads[1]) / 2
    owed = torch.zeros(numel, dtype=torch.float64)
    for state in states:
        residuals = state.residuals.state_dict()
        for layer in LAYERS:
            if layer.name in residuals:
                layer.flat(owed).add_(residuals[layer.name].reshape(-1).double() / len(states))
    assert owed.abs().sum() > 0, "the last step (TopK) owes something: the check below is not vacuous"
    torch.testing.assert_close(applied + owed, computed, rtol=0, atol=1e-12)


def test_switching_to_dense_pays_every_residual():
    states = [CompressionState(_planned(), min_compress_numel=0) for _ in range(2)]
    hook = SimulatedHook(states, LAYERS)
    numel = sum(layer.numel for layer in LAYERS)
    for state in states:
        state.compressor.set_assignment({layer.name: "topk" for layer in LAYERS})
    hook.step([torch.randn(numel, dtype=torch.float64) for _ in states])
    assert any(t.abs().sum() > 0 for t in states[0].residuals.state_dict().values())
    for state in states:
        state.compressor.set_assignment({})
    hook.step([torch.zeros(numel, dtype=torch.float64) for _ in states])
    assert all(t.abs().sum() == 0 for t in states[0].residuals.state_dict().values())


def test_a_limit_caps_the_bucket_at_its_strictest_layer():
    planned = _planned()  # from the least lossy: dense, topk, psgd, bf16
    planned.set_assignment({"a.weight": "psgd", "b.weight": "psgd"})
    assert planned.limit == "bf16"  # the last candidate: no limit
    assert planned.allowed(["a.weight"]) == ["dense", "topk", "psgd", "bf16"]
    key = planned.plan_key()
    planned.set_levels({"b.weight": "topk"})
    assert planned.plan_key() != key, "a limit changes which candidate reduces a bucket: the hook must re-plan"
    assert planned.candidate_name(LAYERS) == "topk"  # b.weight's limit holds for the whole bucket
    assert planned.candidate_name(LAYERS[:1]) == "psgd"  # a.weight alone is not limited
    planned.set_levels({"b.weight": "dense"})
    assert planned.bucket_compressor(LAYERS) is planned.candidates["dense"]
    planned.set_assignment({})
    assert planned.candidate_name(LAYERS[:1]) == "dense"
    assert planned.may_compress(LAYERS[0], 0)  # a.weight may still use any candidate
    assert not planned.may_compress(LAYERS[2], 0)  # b.weight may only be dense
    with pytest.raises(ValueError, match="`limit` to name one of"):
        planned.set_levels({"a.weight": "fp8"})


def test_state_keeps_the_limits():
    planned = _planned()
    planned.set_levels({"a.weight": "topk"})
    restored = _planned()
    restored.load_state_dict(planned.state_dict())
    assert restored.layer_levels == {"a.weight": "topk"}
    restored.load_state_dict(_planned().state_dict())
    assert restored.layer_levels == {}
