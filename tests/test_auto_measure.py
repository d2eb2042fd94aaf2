"""What AutoCompression measures, in one process: the hook's recorder, step records and their summary, codec costs."""

import pytest
import torch

from lightning_gradcomp.auto.measure import StepRecord, codec_cost, last_layout, summarise
from lightning_gradcomp.auto.timeline import Link
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.compressors.base import layers_from_shapes
from lightning_gradcomp.ddp.hook import CompressionState
from lightning_gradcomp.engine.telemetry import BucketRecord
from lightning_gradcomp.testing import SimulatedHook

LAYERS = layers_from_shapes([(40, 50), (30,)])


def test_the_hook_records_every_bucket_only_between_start_and_stop():
    states = [CompressionState(TopK(ratio=0.1), min_compress_numel=64) for _ in range(2)]
    hook = SimulatedHook(states, LAYERS)
    grads = [torch.randn(sum(layer.numel for layer in LAYERS)) for _ in range(2)]
    hook.step(grads)
    assert states[0].stop_recording() is None  # nothing records unless asked
    for state in states:
        state.start_recording()
    hook.step(grads)
    records = [state.stop_recording() for state in states]
    for recorded in records:
        assert recorded is not None
        assert len(recorded) == 1
        (bucket,) = recorded
        assert bucket.layers == tuple(layer.name for layer in LAYERS)
        assert bucket.numel == 40 * 50 + 30
        assert bucket.finished is not None
        assert bucket.finished >= bucket.entered
    assert states[0].recorder is None  # stopped: the next steps record nothing
    assert states[0].bucket_layouts() == {tuple(layer.name for layer in LAYERS)}


def _record(start, entered, finished, layers=(("a",), ("b",)), numel=(10, 20)):
    """A step with backward at 1.0 s and the optimizer at 2.0 s of ``start``, ending at 2.5 s."""
    recorded = [
        BucketRecord(start + 1.0 + e, names, n, None if f is None else start + 1.0 + f)
        for e, f, names, n in zip(entered, finished, layers, numel)
    ]
    return StepRecord.from_times(start, start + 1.0, start + 2.0, start + 2.5, recorded)


def test_a_step_record_counts_bucket_times_from_the_backward_and_an_unfinished_bucket_finishes_at_the_end():
    record = _record(100.0, entered=(0.25, 0.5), finished=(0.75, None))
    assert (record.forward, record.backward, record.optimizer, record.step) == (1.0, 1.0, 0.5, 2.5)
    assert [b.entered for b in record.buckets] == [0.25, 0.5]
    assert [b.finished for b in record.buckets] == [0.75, 1.5]  # the end of the step, from the backward's start


def test_summarise_takes_medians_over_the_steps_of_the_last_layout():
    records = [
        _record(0.0, entered=(0.1, 0.2), finished=(0.3, 0.9), layers=(("old",), ("b",))),  # before a rebuild
        _record(10.0, entered=(0.25, 0.5), finished=(0.5, 0.75)),
        _record(20.0, entered=(0.125, 0.625), finished=(0.5, 0.875)),
        _record(30.0, entered=(0.375, 0.25), finished=(0.5, 0.5)),
    ]
    kept = last_layout(records)
    assert kept == records[1:]
    buckets, timing, step = summarise(kept)
    assert [b.ready for b in buckets] == [0.25, 0.5]  # per-bucket medians of the entry times
    assert [b.layers for b in buckets] == [("a",), ("b",)]
    assert [b.numel for b in buckets] == [10, 20]
    assert timing.backward_end == 0.5
    assert (timing.forward, timing.optimizer, step) == (1.0, 0.5, 2.5)
    # what the backward call takes after its last reduction: 1 - max(finished, entered) per step, the median
    assert timing.tail == pytest.approx(0.25)


def test_a_codec_cost_is_timed_through_the_hook_and_counts_the_bytes_the_payload_has():
    state = CompressionState(TopK(ratio=0.1), min_compress_numel=64)
    flat = torch.randn(sum(layer.numel for layer in LAYERS))
    cost = codec_cost(TopK(ratio=0.1), state, LAYERS, flat, world_size=2)
    reference = [CompressionState(TopK(ratio=0.1), min_compress_numel=64) for _ in range(2)]
    SimulatedHook(reference, LAYERS).step([flat, flat])
    stats = reference[0].telemetry.pop_step()
    # at 2 ranks an all-gather's all-reduce-equivalent bytes are what each rank hands it: the hook's own count
    assert cost.nbytes == stats.bytes_sent
    # TopK's 200 of the 2000 weights (an index and a value each, 8 bytes) and the dense 30-element bias (float32)
    assert cost.nbytes - stats.bytes_guard == 200 * 8 + 30 * 4
    assert cost.rounds == TopK(ratio=0.1).rounds + 1
    assert cost.encode > 0
    assert cost.decode >= 0
    assert Link(1e-3, 1e6).time(cost.nbytes) < Link(1e-3, 1e6).time(flat.numel() * 4)
