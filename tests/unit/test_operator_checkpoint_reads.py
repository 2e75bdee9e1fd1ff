"""CheckpointsReadable: the storage probe's problems as a condition and Events (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from spotguard.operator.jobstatus import (
    COND_CHECKPOINTS_READABLE,
    R_CHECKPOINTS_READ,
    R_ENDPOINT_NOT_ALLOWED,
    R_STORE_TOO_SLOW,
    Decision,
    condition,
    note_checkpoint_reads,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
SLOW = (R_STORE_TOO_SLOW, "reading s3://b/p took more than 60s")
DENIED = (R_ENDPOINT_NOT_ALLOWED, "the operator does not connect to evil.example")


def test_a_job_whose_reads_never_failed_gets_no_condition() -> None:
    decision = Decision(status={"phase": "Running"})
    assert note_checkpoint_reads(decision, None, NOW, 1) is decision


def test_a_problem_sets_the_condition_and_one_event_until_it_changes() -> None:
    old = {"phase": "Running", "conditions": [{"type": "Running", "status": "True"}]}
    first = note_checkpoint_reads(Decision(status=old), SLOW, NOW, 3)
    cond = condition(first.status, COND_CHECKPOINTS_READABLE)
    assert cond is not None
    assert (cond["status"], cond["reason"], cond["message"], cond["observedGeneration"]) == ("False", *SLOW, 3)
    assert [(e.type, e.reason, e.message) for e in first.events] == [("Warning", *SLOW)]
    assert "conditions" in old and len(old["conditions"]) == 1  # the status it was given is not edited

    # The same problem at the next look: nothing new, no Event.
    again = note_checkpoint_reads(Decision(status=first.status), SLOW, NOW + timedelta(seconds=30), 3)
    assert again.events == () and again.status == first.status
    # The same reason in other words: the message follows, no Event.
    worded = note_checkpoint_reads(Decision(status=first.status), (R_STORE_TOO_SLOW, "took 61s"), NOW, 3)
    assert worded.events == ()
    assert (condition(worded.status, COND_CHECKPOINTS_READABLE) or {}).get("message") == "took 61s"
    # Another reason: an Event for it; the transition time stays (still False).
    other = note_checkpoint_reads(Decision(status=first.status), DENIED, NOW + timedelta(seconds=60), 3)
    assert [(e.type, e.reason) for e in other.events] == [("Warning", R_ENDPOINT_NOT_ALLOWED)]
    moved = condition(other.status, COND_CHECKPOINTS_READABLE) or {}
    assert moved["reason"] == R_ENDPOINT_NOT_ALLOWED and moved["lastTransitionTime"] == cond["lastTransitionTime"]


def test_a_read_that_succeeds_again_turns_it_true_once() -> None:
    failing = note_checkpoint_reads(Decision(status={"phase": "Running"}), DENIED, NOW, 1)
    later = NOW + timedelta(minutes=5)
    back = note_checkpoint_reads(Decision(status=failing.status, events=()), None, later, 2)
    cond = condition(back.status, COND_CHECKPOINTS_READABLE) or {}
    assert (cond["status"], cond["reason"]) == ("True", R_CHECKPOINTS_READ)
    assert [(e.type, e.reason) for e in back.events] == [("Normal", R_CHECKPOINTS_READ)]
    assert note_checkpoint_reads(Decision(status=back.status), None, later, 2).events == ()
