"""Table tests for the emergency-deadline estimator (pure, no I/O)."""

from __future__ import annotations

import pytest

from spotguard.sidecar.deadline import (
    ThroughputTracker,
    Transfer,
    assess,
    expected_seconds,
    notice_deadline,
    progress_deadline,
    rate_bytes_per_second,
)

MB = 1_000_000


@pytest.mark.parametrize(
    ("samples", "want"),
    [
        ([], None),
        ([Transfer(0, 0.0)], None),
        ([Transfer(100 * MB, 0.0)], None),
        ([Transfer(100 * MB, 1.0)], 100 * MB),
        # Weighted by size: (100 + 10) MB over (1 + 1) s, not the mean of 100 and 10 MB/s.
        ([Transfer(100 * MB, 1.0), Transfer(10 * MB, 1.0)], 55 * MB),
        # Nonsense samples (negative) are ignored, not averaged in.
        ([Transfer(100 * MB, 2.0), Transfer(-5, 1.0), Transfer(5, -1.0)], 50 * MB),
    ],
)
def test_rate(samples: list[Transfer], want: float | None) -> None:
    assert rate_bytes_per_second(samples) == want


@pytest.mark.parametrize(
    ("nbytes", "saves", "uploads", "overhead", "want"),
    [
        # Nothing uploaded yet: cannot say.
        (100 * MB, [Transfer(100 * MB, 1.0)], [], 2.0, None),
        # Upload only: save counts as free.
        (100 * MB, [], [Transfer(100 * MB, 4.0)], 2.0, 6.0),
        # Save 100 MB/s + upload 50 MB/s of 200 MB + 1 s overhead.
        (200 * MB, [Transfer(100 * MB, 1.0)], [Transfer(100 * MB, 2.0)], 1.0, 2.0 + 4.0 + 1.0),
        (0, [Transfer(100 * MB, 1.0)], [Transfer(100 * MB, 2.0)], 0.5, 0.5),
    ],
)
def test_expected_seconds(
    nbytes: int,
    saves: list[Transfer],
    uploads: list[Transfer],
    overhead: float,
    want: float | None,
) -> None:
    assert expected_seconds(nbytes, saves, uploads, overhead) == want


@pytest.mark.parametrize(
    ("upload_seconds", "grace", "margin", "want_expected", "want_budget", "want_risk"),
    [
        (None, 30.0, 5.0, None, 25.0, False),  # unmeasured: not at risk
        (10.0, 30.0, 5.0, 12.0, 25.0, False),
        (23.0, 30.0, 5.0, 25.0, 25.0, False),  # exactly fits
        (23.5, 30.0, 5.0, 25.5, 25.0, True),
        (1.0, 2.0, 5.0, 3.0, 0.0, True),  # margin larger than grace: budget clamps to 0
    ],
)
def test_assess(
    upload_seconds: float | None,
    grace: float,
    margin: float,
    want_expected: float | None,
    want_budget: float,
    want_risk: bool,
) -> None:
    uploads = [] if upload_seconds is None else [Transfer(10 * MB, upload_seconds)]
    got = assess(10 * MB, [], uploads, grace, margin, overhead_seconds=2.0)
    assert got.expected_seconds == want_expected
    assert got.budget_seconds == want_budget
    assert got.at_risk is want_risk
    assert ("AT RISK" in got.describe()) is want_risk


def test_tracker_window_follows_recent_samples() -> None:
    tracker = ThroughputTracker(grace_seconds=10.0, safety_margin_seconds=0.0, window=2, overhead_seconds=0.0)
    assert tracker.assessment().expected_seconds is None
    tracker.record_upload(10 * MB, 100.0)  # one very slow upload ...
    assert tracker.assessment().at_risk
    tracker.record_upload(10 * MB, 1.0)
    tracker.record_upload(10 * MB, 1.0)  # ... falls out of the 2-sample window
    got = tracker.assessment()
    assert got.expected_seconds == pytest.approx(1.0)
    assert not got.at_risk
    tracker.record_save(10 * MB, 1.0)
    assert tracker.assessment().expected_seconds == pytest.approx(2.0)


NOW = 1_000_000.0


@pytest.mark.parametrize(
    ("announced", "grace", "margin", "want"),
    [
        (None, 30.0, 5.0, NOW + 25.0),  # no time announced: like SIGTERM
        (NOW + 120.0, 30.0, 5.0, NOW + 115.0),  # AWS's two minutes, less the margin
        (NOW + 5.5, 30.0, 5.0, NOW + 0.5),  # tight, but still ahead
        # Nothing left after the margin, or already past (read late, clock
        # skew, Azure's empty NotBefore): best effort, never an expired deadline.
        (NOW + 5.0, 30.0, 5.0, NOW + 25.0),
        (NOW - 60.0, 30.0, 5.0, NOW + 25.0),
        (None, 2.0, 5.0, NOW),  # margin larger than grace: clamps to now
    ],
)
def test_notice_deadline(announced: float | None, grace: float, margin: float, want: float) -> None:
    assert notice_deadline(announced, NOW, grace, margin) == want


def test_tracker_counts_only_new_bytes_of_an_incremental_upload() -> None:
    """A 4 GiB checkpoint written in 4 s whose incremental upload sent 10 MB in
    1 s: the emergency path writes 4 GiB again but sends about 10 MB, so it
    fits a 30 s grace period. Counting the whole checkpoint as sent (at the
    measured 10 MB/s) would call it at risk."""
    tracker = ThroughputTracker(grace_seconds=30.0, safety_margin_seconds=5.0, overhead_seconds=2.0)
    tracker.record_save(4 << 30, 4.0)
    tracker.record_upload(10_000_000, 1.0)
    got = tracker.assessment()
    assert got.expected_seconds == pytest.approx(4.0 + 1.0 + 2.0)
    assert not got.at_risk
    # A plain upload of the same checkpoint at that rate would not fit.
    tracker.record_upload(4 << 30, (4 << 30) / 10_000_000)
    assert tracker.assessment().at_risk


@pytest.mark.parametrize(
    ("before", "seen", "now", "want"),
    [
        # A first look says nothing about what is still coming: the deadline stands.
        (None, (1, 10, 0.0), 50.0, 100.0),
        # Nothing changed: the deadline stands (no progress for the whole span gives up).
        ((1, 10, 0.0), (1, 10, 0.0), 99.0, 100.0),
        # New bytes, a new part, a live upload's heartbeat: the span counts again from now.
        ((1, 10, 0.0), (1, 20, 0.0), 90.0, 150.0),
        ((1, 10, 0.0), (2, 10, 0.0), 90.0, 150.0),
        ((1, 10, 0.0), (1, 10, 7.0), 120.0, 180.0),
        # Never earlier than it was.
        ((1, 10, 0.0), (1, 20, 0.0), 10.0, 100.0),
        # A look that failed (None) is no progress.
        ((1, 10, 0.0), None, 90.0, 100.0),
    ],
)
def test_progress_deadline(before: object, seen: object, now: float, want: float) -> None:
    assert progress_deadline(100.0, 60.0, before, seen, now) == want
