"""The timeline model and the greedy planner, against timelines computed by hand (one process, no torch)."""

import pytest

from lightning_gradcomp.auto.timeline import (
    DENSE,
    Bucket,
    Cost,
    Link,
    Timing,
    allreduce_equivalent,
    exposed_tail,
    fit_link,
    plan_greedy,
    predict,
)
from lightning_gradcomp.engine.wire import all_gather, all_reduce

LINK = Link(alpha=0.001, beta=1e6)  # 1 ms per collective, 1 MB/s
TIMING = Timing(forward=0.010, backward_end=0.100, optimizer=0.005)


def _buckets(compressed=True):
    """Three buckets ready at 20, 50 and 90 ms; "c" sends a tenth of the bytes for 2 ms encode and 1 ms decode."""
    out = []
    for ready, nbytes, name in ((0.02, 10_000, "a"), (0.05, 50_000, "b"), (0.09, 100_000, "c")):
        costs = {DENSE: Cost(0.0, 0.0, nbytes)}
        if compressed:
            costs["c"] = Cost(0.002, 0.001, nbytes / 10)
        out.append(Bucket(ready=ready, numel=nbytes // 4, layers=(f"{name}.weight",), costs=costs))
    return out


def test_fit_link_recovers_alpha_and_beta():
    samples = [(n, 1e-3 + n / 1e8) for n in (1e4, 1e5, 1e6, 4e6)]
    link = fit_link(samples)
    assert link.alpha == pytest.approx(1e-3, rel=1e-6)
    assert link.beta == pytest.approx(1e8, rel=1e-6)


def test_fit_link_never_returns_a_negative_latency():
    link = fit_link([(1e4, 1e-5), (1e6, 2e-2)])
    assert link.alpha == 0.0
    assert link.beta > 0


def test_fit_link_needs_two_sizes():
    with pytest.raises(ValueError, match="samples"):
        fit_link([(1e4, 1.0), (1e4, 2.0)])


def test_dense_timeline_by_hand():
    # b0: 20 + (1 + 10) = 31 ms; b1: 50 + 51 = 101 ms; b2: starts at max(90, 101) = 101, + 101 = 202 ms
    p = predict(_buckets(), [DENSE] * 3, LINK, TIMING)
    assert p.finish == pytest.approx((0.031, 0.101, 0.202))
    assert p.step == pytest.approx(0.010 + 0.202 + 0.005)
    assert p.exposed == pytest.approx(0.102)
    # b0 ends before b1 is ready (an idle gap); b1 and b2 run back to back: the exposed tail starts at b1
    assert exposed_tail(p, _buckets(), LINK) == 1


def test_compressed_tail_by_hand_encode_blocks_the_backward():
    # b2 compressed: ready 90 + 2 = 92, waits for b1 until 101, + 1 + 10 + 1 (decode) = 113; backward ends 102
    p = predict(_buckets(), [DENSE, DENSE, "c"], LINK, TIMING)
    assert p.finish[-1] == pytest.approx(0.113)
    assert p.backward_end == pytest.approx(0.102)
    assert p.step == pytest.approx(0.128)
    # on a device where encoding does not block the backward pass, the backward still ends at 100 ms
    assert predict(_buckets(), [DENSE, DENSE, "c"], LINK, TIMING, encode_blocks_backward=False).backward_end == 0.1


def test_greedy_compresses_the_exposed_tail_largest_first():
    plan = plan_greedy(_buckets(), [DENSE, "c"], LINK, TIMING, margin=0.03)
    # b2 first (217 -> 128 ms), then b1 (128 -> 121 ms: b1 0.052 + 0.006 + 0.001 = 0.059, b2 0.094 + 0.012 = 0.106);
    # b0 sits before an idle gap and stays dense; uniform "c" (123 ms) does not beat it
    assert plan.assignment == (DENSE, "c", "c")
    assert plan.predicted == pytest.approx(0.121)
    assert plan.dense_predicted == pytest.approx(0.217)
    assert len(plan.reasons) == 2


def test_fast_link_stays_dense():
    plan = plan_greedy(_buckets(), [DENSE, "c"], Link(alpha=1e-5, beta=1e10), TIMING)
    assert plan.assignment == (DENSE,) * 3
    assert "dense" in plan.reasons[0]


def test_a_gain_below_the_margin_is_not_taken():
    # compressing only saves ~9 % here (slow encode): a 10 % margin keeps dense
    buckets = [Bucket(0.09, 25_000, ("w",), {DENSE: Cost(0, 0, 30_000), "c": Cost(0.01, 0.0, 3_000)})]
    assert plan_greedy(buckets, [DENSE, "c"], LINK, TIMING, margin=0.0).assignment == ("c",)
    assert plan_greedy(buckets, [DENSE, "c"], LINK, TIMING, margin=0.2).assignment == (DENSE,)


def test_least_lossy_candidate_that_hides_communication_wins():
    # "gentle" and "hard" both hide the communication behind the backward pass: the gentle one is chosen
    costs = {DENSE: Cost(0, 0, 100_000), "gentle": Cost(0, 0, 5_000), "hard": Cost(0, 0, 500)}
    buckets = [Bucket(0.05, 25_000, ("w",), costs)]
    plan = plan_greedy(buckets, [DENSE, "gentle", "hard"], LINK, TIMING)
    assert plan.assignment == ("gentle",)


def test_margin_is_checked():
    with pytest.raises(ValueError, match="margin"):
        plan_greedy(_buckets(), [DENSE], LINK, TIMING, margin=1.0)


def test_traffic_is_priced_as_the_all_reduce_that_moves_as_much():
    assert allreduce_equivalent(all_gather(100, 2), 2) == 100
    assert allreduce_equivalent(all_gather(100, 8), 8) == 400  # 7 payloads each way against 2 * 7 / 8 buffers
    assert allreduce_equivalent(all_reduce(800, 8), 8) == 800


def test_the_tail_after_the_last_reduction_is_added_to_every_candidate():
    timing = Timing(forward=0.010, backward_end=0.100, optimizer=0.005, tail=0.002)
    assert predict(_buckets(), [DENSE] * 3, LINK, timing).step == pytest.approx(0.219)


def test_the_advise_report_and_plot(tmp_path):
    from lightning_gradcomp.auto.report import advice, plot_speedup

    text = advice(_buckets(), [DENSE, "c"], LINK, TIMING, measured_step=0.2)
    assert "| dense | 0.0 | 0.0 | 0.160 | 1.0x |" in text
    assert "| c | 6.0 | 3.0 | 0.016 | 10.0x |" in text
    assert "recommendation at measured: c on 2 bucket(s), the rest dense; predicted 1.79x plain DDP" in text
    assert "recommendation at 100 Gbit/s: plain DDP" in text
    pytest.importorskip("matplotlib")
    plot_speedup(str(tmp_path / "s.png"), _buckets(), [DENSE, "c"], LINK, TIMING)
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_on_a_contended_cpu_decoding_takes_from_the_backward():
    # b0 compressed ends at 20 + 2 + (1 + 1) + 1 = 25 ms; its 2 ms encode delays the later buckets and, contended,
    # its 1 ms decode does too: b1 is ready at 53 ms and ends at 53 + 51 = 104, b2 starts at max(93, 104) and ends
    # at 205 ms
    assignment = ["c", DENSE, DENSE]
    assert predict(_buckets(), assignment, LINK, TIMING).step == pytest.approx(0.219)
    contended = predict(_buckets(), assignment, LINK, TIMING, contended=True)
    assert contended.finish == pytest.approx((0.025, 0.104, 0.205))
    assert contended.step == pytest.approx(0.220)
    assert contended.backward_end == pytest.approx(0.103)
    # the dense assignment is what was measured: contention changes nothing there
    assert predict(_buckets(), [DENSE] * 3, LINK, TIMING, contended=True).step == pytest.approx(0.217)


def test_fit_link_with_a_measured_latency_fits_the_slope_only():
    # a token bucket lets the first bytes through at once: the intercept of the large sizes is negative
    samples = [(1e6, 0.080), (4e6, 0.320)]
    assert fit_link(samples).alpha == 0.0
    link = fit_link(samples, alpha=0.005)
    assert link.alpha == 0.005
    assert link.beta == pytest.approx(1 / ((1e6 * 0.075 + 4e6 * 0.315) / (1e6**2 + 4e6**2)))


def test_the_advise_report_has_diloco_rows_computed_by_hand():
    from lightning_gradcomp.auto.report import advice

    text = advice(_buckets(), [DENSE, "c"], LINK, TIMING, measured_step=0.2)
    # 40,000 parameters; fp32: 160 kB per sync at the measured 1 MB/s: 1 ms + 160 ms, over H = 20 steps: 8.05 ms
    # 8-bit: 40 kB, (1 + 40) / 100 = 0.41 ms; at 100 Mbit/s (12.5 MB/s): (1 + 12.8) / 20 = 0.69 ms
    assert "| H=20 fp32 | 8.05 | 0.69 | 0.11 | 0.06 | 0.05 |" in text
    assert "| H=100 8-bit | 0.41 | 0.04 | 0.01 | 0.01 | 0.01 |" in text
    assert "the step with no communication takes 115.0 ms" in text  # 10 + 100 + 5
    # measured: the best per-step plan (c on two buckets) takes 121 ms, 6 ms over; H = 20 adds 8.05, H = 100 1.61
    assert "pays where no per-step plan hides the wire: at measured (best per-step plan +6.0 ms, DiLoCo H=100" in text
    assert "100 Mbit/s (" not in text, "at 100 Mbit/s plain DDP already hides the wire"
    fast = advice(_buckets(), [DENSE, "c"], Link(alpha=0.001, beta=1e12), TIMING)
    assert "Periodic synchronization would not pay here" in fast


def test_diloco_utilisation_is_the_overlap_bound_of_each_schedule():
    """H t over H t + the exposed exchange + the codec: blocking pays it all, streaming what a fragment's exchange
    takes beyond its overlap, the one-step delay what it takes beyond a whole period."""
    from lightning_gradcomp.auto.periodic import predict_periodic

    link = Link(alpha=0.01, beta=1e6)  # 1 MB/s
    cost = Cost(encode=0.2, decode=0.1, nbytes=5e6, rounds=1)  # an exchange of 5.01 s plus 0.3 s of codec
    step, cu = predict_periodic(0.1, link, cost, 100, 1, 0)
    assert cu == pytest.approx(10 / (10 + 5.01 + 0.3))
    assert step == pytest.approx((10 + 5.01 + 0.3) / 100)
    # 5 fragments of 1 MB (1.01 s each), overlapped by 4 steps (0.4 s): 0.61 s exposed each
    assert predict_periodic(0.1, link, cost, 100, 5, 4)[1] == pytest.approx(10 / (10 + 5 * 0.61 + 0.3))
    # a whole period (20 steps, 2 s) hides each fragment: only the codec is left
    assert predict_periodic(0.1, link, cost, 100, 5, 20)[1] == pytest.approx(10 / 10.3)


def test_diloco_recommendation_is_the_least_lossy_setting_that_reaches_the_target():
    from lightning_gradcomp.auto.periodic import constructor, periodic_plans, recommend

    fp32, eight = Cost(0.0, 0.0, 4e6, 1), Cost(0.1, 0.0, 1e6, 2)
    plans = periodic_plans(0.1, Link(0.0, 1e6), {"fp32": fp32, "8-bit": eight})
    assert {(p.sync_every, p.schedule) for p in plans} >= {(10, "blocking"), (500, "one-step delay")}
    plan, reaches = recommend(plans)
    assert reaches
    # H = 10 reaches 95 % with neither payload; H = 30 does with 8 bits overlapped (the shortest round first)
    assert (plan.sync_every, plan.payload) == (30, "8-bit")
    assert constructor(plan) == "DiLoCo(sync_every=30, compressor=MinMax(bits=8), fragments=5, overlap_steps=3)"
    assert all(p.utilisation < 0.95 for p in plans if p.sync_every == 10)
    slow, reaches = recommend(periodic_plans(0.1, Link(0.0, 1e3), {"fp32": fp32}))
    assert not reaches
    assert slow.sync_every == 500, "none reaches it: the fastest"
    assert slow.schedule != "blocking"
