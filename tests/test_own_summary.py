"""DiLoCo's summary divides this process's own time and bytes by its own optimizer steps, not the healed global step."""

from types import SimpleNamespace

from lightning_gradcomp.diloco.membership import Membership
from lightning_gradcomp.diloco.own_summary import own_summary


def test_a_healed_group_reports_its_own_steps_bytes_and_time_per_step():
    # a group restarted at global step 0, healed to 280, trained to 600: 320 optimizer steps of its own
    outer = SimpleNamespace(
        bytes_sent=3_200_000, bytes_received=3_200_000, syncs=30, skipped=0, membership=Membership()
    )
    line = own_summary(600, (320, 0, 0), (100.0, 0), outer, 86_300, 2, now=100.0 + 320 * 0.05)  # type: ignore[arg-type]
    assert line.startswith(
        "gradcomp summary (DiLoCo): 320 optimizer steps (global step 600: healed or resumed), 30 syncs"
    )
    assert "(0.0200 MB moved per step, plain DDP's ring 0.1726: 8.6x less)" in line  # 6.4 MB / 320, not / 600
    assert line.endswith("; 50.0 ms per optimizer step.")


def test_a_resumed_run_counts_the_bytes_since_it_started():
    # resumed at global step 100 with 1 MB already counted in its checkpoint; 50 more steps moved 0.5 MB each way
    outer = SimpleNamespace(
        bytes_sent=1_500_000, bytes_received=1_500_000, syncs=15, skipped=1, membership=Membership()
    )
    line = own_summary(150, (50, 1_000_000, 1_000_000), (10.0, 100), outer, 86_300, 2, now=20.0)  # type: ignore[arg-type]
    assert line.startswith("gradcomp summary (DiLoCo): 50 optimizer steps, 15 syncs (1 skipped);")
    assert "0.500 MB sent, 0.500 MB received (0.0200 MB moved per step" in line
    assert line.endswith("; 200.0 ms per optimizer step.")
