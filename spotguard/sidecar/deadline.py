"""Deadline awareness: will an emergency save plus upload fit the grace period?

Pure logic, no I/O. The sidecar feeds it the measured duration and size of
recent saves and uploads; it answers how long an emergency checkpoint is
expected to take and whether that still fits the time between a preemption
signal and the kill.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Seconds an emergency checkpoint needs on top of moving bytes: the trainer
# reaching its next step boundary, the manifest, the pointer and verification
# round trips. Deliberately conservative; it only tips borderline cases.
DEFAULT_OVERHEAD_SECONDS = 2.0

# How many recent samples of each kind are averaged. Few enough to follow a
# change in checkpoint size or network speed, enough to smooth out one slow
# transfer.
DEFAULT_WINDOW = 5


@dataclass(frozen=True)
class Transfer:
    """One measured save or upload: how many bytes it moved and how long it took."""

    nbytes: int
    seconds: float


@dataclass(frozen=True)
class DeadlineAssessment:
    """The answer to "would an emergency checkpoint make it in time?".

    ``expected_seconds`` is ``None`` while there is nothing measured yet; then
    nothing is considered at risk.
    """

    expected_seconds: float | None
    budget_seconds: float
    at_risk: bool

    def describe(self) -> str:
        """One line for the log."""
        if self.expected_seconds is None:
            return f"no save/upload measured yet; budget {self.budget_seconds:.1f}s"
        verdict = "AT RISK" if self.at_risk else "fits"
        return (
            f"expected emergency checkpoint {self.expected_seconds:.1f}s, budget {self.budget_seconds:.1f}s: {verdict}"
        )


def rate_bytes_per_second(samples: list[Transfer]) -> float | None:
    """Aggregate throughput of ``samples`` (total bytes / total seconds).

    Weighting by size keeps a tiny checkpoint with a large fixed cost from
    dominating. ``None`` when there is nothing to go on.
    """
    total_bytes = sum(s.nbytes for s in samples if s.seconds >= 0 and s.nbytes >= 0)
    total_seconds = sum(s.seconds for s in samples if s.seconds >= 0 and s.nbytes >= 0)
    if total_bytes <= 0 or total_seconds <= 0:
        return None
    return total_bytes / total_seconds


def expected_seconds(
    checkpoint_bytes: int,
    saves: list[Transfer],
    uploads: list[Transfer],
    overhead_seconds: float = DEFAULT_OVERHEAD_SECONDS,
    upload_bytes: int | None = None,
) -> float | None:
    """Expected duration of an emergency save of ``checkpoint_bytes`` plus the
    upload of ``upload_bytes`` (default: the same bytes; fewer for a
    checkpoint stored incrementally, where only new chunks travel).

    A missing save measurement counts as free (the trainer may not report
    it); a missing upload measurement means we cannot say anything yet.
    """
    upload_rate = rate_bytes_per_second(uploads)
    if upload_rate is None:
        return None
    save_rate = rate_bytes_per_second(saves)
    save_seconds = checkpoint_bytes / save_rate if save_rate else 0.0
    sent = checkpoint_bytes if upload_bytes is None else upload_bytes
    return save_seconds + sent / upload_rate + overhead_seconds


def assess(
    checkpoint_bytes: int,
    saves: list[Transfer],
    uploads: list[Transfer],
    grace_seconds: float,
    safety_margin_seconds: float,
    overhead_seconds: float = DEFAULT_OVERHEAD_SECONDS,
    upload_bytes: int | None = None,
) -> DeadlineAssessment:
    """Compare the expected emergency duration with the usable grace period."""
    budget = max(0.0, grace_seconds - safety_margin_seconds)
    expected = expected_seconds(checkpoint_bytes, saves, uploads, overhead_seconds, upload_bytes)
    at_risk = expected is not None and expected > budget
    return DeadlineAssessment(expected_seconds=expected, budget_seconds=budget, at_risk=at_risk)


def notice_deadline(
    announced: float | None,
    now: float,
    grace_seconds: float,
    safety_margin_seconds: float,
) -> float:
    """The deadline of the checkpoint request a preemption notice turns into.

    The provider's announced time minus the safety margin; without an
    announced time, ``now`` + grace period − margin, as for SIGTERM. An
    announced time that leaves nothing after the margin (the notice was read
    late, clock skew, Azure's empty ``NotBefore``) would make the trainer
    refuse the request outright, yet the machine is evidently still up: such
    a notice gets the same deadline as one without a time, a best effort that
    SIGTERM's own deadline supersedes when it comes.
    """
    fallback = now + max(0.0, grace_seconds - safety_margin_seconds)
    if announced is None:
        return fallback
    deadline = announced - safety_margin_seconds
    return deadline if deadline > now else fallback


def progress_deadline(deadline: float, span: float, before: object, seen: object, now: float) -> float:
    """Pure: the deadline of a wait that gives up only ``span`` seconds after
    its last progress. ``before`` and ``seen`` are what was observed at the
    previous look and now (None: nothing yet); a change is progress and moves
    the deadline to ``now + span`` (never earlier than it was). A first look
    is no progress: what was there already says nothing about what still comes."""
    if before is None or seen is None or seen == before:
        return deadline
    return max(deadline, now + span)


class ThroughputTracker:
    """Keeps the last few save and upload measurements (a small stateful shell
    around the pure functions above)."""

    def __init__(
        self,
        grace_seconds: float,
        safety_margin_seconds: float,
        window: int = DEFAULT_WINDOW,
        overhead_seconds: float = DEFAULT_OVERHEAD_SECONDS,
    ) -> None:
        self.grace_seconds = grace_seconds
        self.safety_margin_seconds = safety_margin_seconds
        self.overhead_seconds = overhead_seconds
        self._saves: deque[Transfer] = deque(maxlen=window)
        self._uploads: deque[Transfer] = deque(maxlen=window)
        self._save_bytes: int | None = None
        self._upload_bytes: int | None = None

    def record_save(self, nbytes: int, seconds: float) -> None:
        """Record one local save (snapshot + persist) of ``nbytes``."""
        self._saves.append(Transfer(nbytes, seconds))
        self._save_bytes = nbytes

    def record_upload(self, nbytes: int, seconds: float) -> None:
        """Record one upload (including verification) that sent ``nbytes``
        (for a checkpoint stored incrementally, only its new chunks)."""
        self._uploads.append(Transfer(nbytes, seconds))
        self._upload_bytes = nbytes

    def assessment(self) -> DeadlineAssessment:
        """Assess the newest checkpoint against the grace period: the newest
        save's size to write, the newest upload's bytes to send."""
        saved = self._save_bytes if self._save_bytes is not None else self._upload_bytes or 0
        return assess(
            saved,
            list(self._saves),
            list(self._uploads),
            self.grace_seconds,
            self.safety_margin_seconds,
            self.overhead_seconds,
            upload_bytes=self._upload_bytes,
        )
