"""The goodput simulation behind the benchmark report's scenarios (pure: no I/O)."""

from __future__ import annotations

import math
import random

from bench import goodput

COSTS = goodput.Costs(stall_spotguard=0.1, stall_periodic=60.0, emergency=20.0, restart=40.0)


def test_an_emergency_checkpoint_within_the_notice_loses_no_work() -> None:
    trace = goodput.Trace(mtbf_hours=1.0, notice_seconds=30.0, job_hours=24.0)
    rng = random.Random(1)
    wall = goodput.simulate(COSTS, trace, "spotguard", rng)
    # Only restarts and snapshot stalls: about 24 preemptions of 40 s, and stalls of 0.1 s.
    lost = wall - 24 * 3600
    assert 0 < lost < 0.03 * 24 * 3600, lost


def test_an_emergency_checkpoint_that_misses_the_notice_falls_back_to_a_shipped_one() -> None:
    trace = goodput.Trace(mtbf_hours=1.0, notice_seconds=10.0, job_hours=24.0)
    fits = goodput.simulate(COSTS, goodput.Trace(1.0, 30.0, 24.0), "spotguard", random.Random(2))
    misses = goodput.simulate(COSTS, trace, "spotguard", random.Random(2))
    assert misses > fits


def test_a_checkpoint_counts_only_once_shipped_and_the_interval_is_at_least_the_shipping() -> None:
    slow = goodput.Costs(stall_spotguard=0.1, stall_periodic=60.0, emergency=600.0, restart=40.0, ship=600.0)
    trace = goodput.Trace(mtbf_hours=1.0, notice_seconds=30.0, job_hours=24.0)
    quick = goodput.Costs(stall_spotguard=0.1, stall_periodic=60.0, emergency=600.0, restart=40.0, ship=0.0)
    walls = [goodput.simulate(c, trace, "spotguard", random.Random(3)) for c in (quick, slow)]
    assert walls[1] > walls[0]  # shipping takes 10 min: more is lost at each preemption
    res = {r.name.split(" ")[0]: r for r in goodput.compare(slow, trace, trials=20, seed=3)}
    assert res["spotguard"].interval == "10.0 min"


def test_the_emergency_spread_matches_its_quartile() -> None:
    sigma = goodput.sigma_from_quartile(10.0, 12.0)
    assert math.isclose(10.0 * math.exp(0.6745 * sigma), 12.0, rel_tol=1e-9)
    costs = goodput.Costs(0.1, 60.0, emergency=10.0, restart=40.0, emergency_sigma=sigma)
    assert abs(goodput.in_time_share(costs, 10.0) - 0.5) < 0.02  # the median fits half the time
    assert abs(goodput.in_time_share(costs, 12.0) - 0.75) < 0.02
    assert goodput.in_time_share(goodput.Costs(0.1, 60.0, 10.0, 40.0), 9.9) == 0.0
    assert goodput.sigma_from_quartile(10.0, 9.0) == 0.0


def test_a_scenario_reports_its_in_time_share_and_both_goodputs() -> None:
    sc = goodput.Scenario("x", goodput.Costs(0.1, 60.0, emergency=20.0, restart=40.0, ship=20.0), 30.0)
    r = goodput.run_scenario(sc, trials=20)
    assert r.in_time == 1.0 and 0 < r.periodic.goodput < r.spotguard.goodput < 1


def test_the_throughput_a_notice_needs() -> None:
    # 26 GiB in a 30 s notice of which 2 s are fixed costs: 26 / 28 GiB/s.
    assert goodput.needed_throughput(26.0, 30.0, 2.0) == 26.0 / 28.0
    assert goodput.needed_throughput(0.1, 120.0, 0.5) == 0.1 / 119.5
    # Fixed costs that take the whole notice: no throughput is enough.
    assert goodput.needed_throughput(1.0, 30.0, 30.0) is None
