"""Pure decisions of the sidecar, ``spotguard run`` and the demo (table tests, no I/O)."""

from __future__ import annotations

import random

import pytest

from spotguard.demo.runner import Segment, lost_steps, preemption_points
from spotguard.run.supervisor import backoff_delay
from spotguard.sidecar.shipper import plan_local_prune, plan_shipping, step_of


def ck(*steps: int) -> list[str]:
    return [f"ckpt-{s:012d}" for s in steps]


@pytest.mark.parametrize(
    ("committed", "shipped", "newest_only", "want"),
    [
        (ck(), set(), False, ck()),
        (ck(10, 20, 30), set(), False, ck(10, 20, 30)),
        (ck(30, 10, 20), set(), False, ck(10, 20, 30)),  # by step, not listing order
        (ck(10, 20, 30), set(ck(10)), False, ck(20, 30)),
        (ck(10, 20, 30), set(), True, ck(30)),  # against a deadline: the newest only
        (ck(10, 20, 30), set(ck(30)), True, ck()),
        # Older than something already shipped: never uploaded (would only look older).
        (ck(10, 20), set(ck(30)), False, ck()),
        (ck(5, 40), set(ck(30)), False, ck(40)),
    ],
)
def test_plan_shipping(committed: list[str], shipped: set[str], newest_only: bool, want: list[str]) -> None:
    assert plan_shipping(committed, shipped, newest_only) == want


@pytest.mark.parametrize(
    ("committed", "shipped", "keep", "want"),
    [
        (ck(10, 20, 30), set(), 1, ck()),  # nothing in storage yet: keep everything
        (ck(10, 20, 30), set(ck(30)), 1, ck(10, 20)),
        (ck(10, 20, 30), set(ck(30)), 2, ck(10)),
        (ck(10, 20, 30), set(ck(20)), 1, ck(10)),  # 30 is not shipped yet: kept
        (ck(10, 20, 30), set(ck(10)), 1, ck()),
        (ck(10, 20, 30), set(ck(30)), 0, ck(10, 20)),  # keep at least one
    ],
)
def test_plan_local_prune(committed: list[str], shipped: set[str], keep: int, want: list[str]) -> None:
    assert plan_local_prune(committed, shipped, keep) == want


def test_step_of() -> None:
    assert step_of("ckpt-000000000042") == 42


@pytest.mark.parametrize(
    ("restart", "initial", "maximum", "want"),
    [
        (0, 1.0, 60.0, 0.0),
        (1, 1.0, 60.0, 1.0),
        (2, 1.0, 60.0, 2.0),
        (4, 1.0, 60.0, 8.0),
        (10, 1.0, 60.0, 60.0),
        (3, 0.5, 1.0, 1.0),
    ],
)
def test_backoff_delay(restart: int, initial: float, maximum: float, want: float) -> None:
    assert backoff_delay(restart, initial, maximum) == want


@pytest.mark.parametrize("seed", range(20))
def test_preemption_points_are_distinct_increasing_and_inside_the_run(seed: int) -> None:
    points = preemption_points(300, 3, random.Random(seed))
    assert len(points) == 3 == len(set(points))
    assert points == sorted(points)
    assert all(30 <= p < 270 for p in points)


def test_preemption_points_never_more_than_fit() -> None:
    assert len(preemption_points(10, 50, random.Random(0))) <= 8


@pytest.mark.parametrize(
    ("segments", "want"),
    [
        ([Segment(resumed_from=None, last_step=35), Segment(resumed_from=35, last_step=99)], [0]),
        ([Segment(resumed_from=None, last_step=35), Segment(resumed_from=30, last_step=99)], [5]),
        # Nothing verified before the first preemption: everything trained is lost.
        ([Segment(resumed_from=None, last_step=3), Segment(resumed_from=None, last_step=99)], [4]),
        (
            [Segment(last_step=10), Segment(resumed_from=10, last_step=20), Segment(resumed_from=19, last_step=30)],
            [0, 1],
        ),
    ],
)
def test_lost_steps(segments: list[Segment], want: list[int]) -> None:
    assert lost_steps(segments) == want


@pytest.mark.parametrize(
    ("args", "want"),
    [
        ((True, "sigterm", 42, 42), {"preempted": True, "reason": "sigterm", "step": 42, "trainerStep": 42}),
        ((False, "finished", 299, None), {"preempted": False, "reason": "finished", "step": 299}),
        ((True, "notice:aws", None, 7), {"preempted": True, "reason": "notice:aws", "trainerStep": 7}),
    ],
)
def test_termination_report(args: tuple[bool, str, int | None, int | None], want: dict[str, object]) -> None:
    from spotguard.sidecar.mainloop import termination_report

    assert termination_report(*args).to_json() == want


@pytest.mark.parametrize(("failures", "want"), [(1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (50, 30.0)])
def test_retry_delay(failures: int, want: float) -> None:
    from spotguard.contract.retry import retry_delay

    assert retry_delay(failures) == want


@pytest.mark.parametrize(
    ("reason", "want"),
    [
        (None, "interval"),
        ("interval", "interval"),
        ("sigterm", "sigterm"),
        ("notice:aws", "notice"),
        ("notice:k8s", "notice"),
        ("proactive", "proactive"),
        ("something new", "other"),
    ],
)
def test_save_reason_label(reason: str | None, want: str) -> None:
    from spotguard.sidecar.shipper import save_reason_label

    assert save_reason_label(reason) == want


@pytest.mark.parametrize(
    ("times", "want"),
    [
        ([], None),
        ([5.0], None),
        ([5.0, 5.0], None),
        ([0.0, 60.0], 60.0),
        ([0.0, 60.0, 120.0, 300.0], 60.0),
        ([300.0, 0.0, 100.0], 150.0),
        ([0.0, 10.0, 30.0, 60.0, 100.0], 25.0),
    ],
)
def test_observed_interval(times: list[float], want: float | None) -> None:
    from spotguard.sidecar.shipper import observed_interval

    assert observed_interval(times) == want
