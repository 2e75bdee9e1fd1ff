"""The TrainingJob state machine, step by step, without a cluster."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from spotguard.operator.accounting import on_create_error
from spotguard.operator.classify import PodEnd
from spotguard.operator.decide import decide
from spotguard.operator.jobstatus import Decision, Observation, condition, status_patch
from spotguard.operator.spec import TrainingJobSpec, parse
from spotguard.operator.specfields import SpecError

T0 = datetime(2030, 1, 1, tzinfo=UTC)
RUNNING = PodEnd("running", "Running")
PENDING = PodEnd("running", "Pending")
DONE = PodEnd("succeeded", "Completed", "training finished")
DRAINED = PodEnd("preempted", "PodDeleted", "the pod was deleted (drain or eviction)", step=40)
LOST = PodEnd("preempted", "NodeLost", "node spot-1 is gone", stop_pod="force")
CRASH = PodEnd("failed", "Error", "container trainer exited with code 1")


def spec(**pre: Any) -> TrainingJobSpec:
    raw: dict[str, Any] = {
        "template": {"spec": {"containers": [{"name": "trainer", "image": "t"}]}},
        "checkpoint": {"storage": "s3://bkt/p"},
        "preemption": {
            "maxPreemptions": 3,
            "backoffLimit": 1,
            "backoff": {"initialSeconds": 10, "maxSeconds": 60, "factor": 2},
            **pre,
        },
    }
    return parse(raw)


def step(status: dict[str, Any] | None, end: PodEnd | None, now: datetime = T0, sp: Any = None, **obs: Any) -> Decision:
    return decide("job", status, sp if sp is not None else spec(), Observation(pod_end=end, **obs), now, 1)


def cond(d: Decision, type_: str) -> tuple[str | None, str | None]:
    c = condition(d.status, type_) or {}
    return c.get("status"), c.get("reason")


def test_new_job_creates_attempt_one() -> None:
    d = step(None, None)
    assert d.create_attempt == 1
    assert d.status["phase"] == "Pending" and d.status["attempt"] == 1 and d.status["currentPod"] == "job-a1"
    assert d.status["startTime"] == "2030-01-01T00:00:00Z"
    assert cond(d, "Created") == ("True", "PodCreated")
    assert [e.reason for e in d.events] == ["PodCreated"]
    assert d.status["observedGeneration"] == 1


def test_pending_then_running_then_steady() -> None:
    s = step(None, None).status
    d = step(s, PodEnd("running", "Unschedulable", "0/2 nodes are available"))
    assert d.status["phase"] == "Pending" and d.create_attempt is None
    assert cond(d, "Running") == ("False", "Unschedulable")
    d = step(d.status, RUNNING, T0 + timedelta(seconds=5))
    assert d.status["phase"] == "Running" and cond(d, "Running") == ("True", "PodRunning")
    assert [e.reason for e in d.events] == ["PodRunning"]
    again = step(d.status, RUNNING, T0 + timedelta(seconds=50))
    assert again.status == d.status and again.events == ()  # nothing changed: no patch, no Event
    assert status_patch(d.status, again.status) == {}


def test_success() -> None:
    s = step(step(None, None).status, RUNNING).status
    d = step(s, DONE)
    assert d.status["phase"] == "Succeeded" and cond(d, "Succeeded") == ("True", "Completed")
    assert d.status["lastPodEnd"]["kind"] == "succeeded" and d.accounted == DONE
    assert d.create_attempt is None and "completionTime" in d.status
    assert step(d.status, None).status == d.status  # terminal: nothing more happens


def test_preemption_restarts_at_once_and_counts() -> None:
    s = step(step(None, None).status, RUNNING).status
    d = step(s, DRAINED)
    assert d.accounted == DRAINED
    assert d.status["preemptions"] == 1 and d.status["failures"] == 0
    assert d.create_attempt == 2 and d.status["attempt"] == 2 and d.status["phase"] == "Pending"
    assert d.status["lastPodEnd"] == {
        "attempt": 1,
        "kind": "preempted",
        "reason": "PodDeleted",
        "message": DRAINED.message,
        "time": "2030-01-01T00:00:00Z",
        "step": 40,
    }
    assert cond(d, "Preempted") == ("True", "PodDeleted")
    assert [e.reason for e in d.events] == ["Preempted", "PodCreated"]
    assert d.events[0].type == "Warning" and "at step 40" in d.events[0].message
    # once the new pod runs, Preempted flips back
    r = step(d.status, RUNNING)
    assert cond(r, "Preempted") == ("False", "Resumed")


def test_node_lost_deletes_the_orphan_at_once() -> None:
    s = step(step(None, None).status, RUNNING).status
    d = step(s, LOST)
    assert d.delete_pod == "job-a1" and d.force_delete
    assert d.create_attempt == 2


def test_crash_beside_a_classic_sidecar_stops_the_pod() -> None:
    s = step(step(None, None).status, RUNNING).status
    d = step(s, PodEnd("failed", "Error", "container trainer exited with code 1", stop_pod="graceful"))
    assert d.delete_pod == "job-a1" and not d.force_delete
    assert d.status["failures"] == 1


def test_pod_that_vanished_counts_as_preempted() -> None:
    s = step(step(None, None).status, RUNNING).status
    d = step(s, None)
    assert d.status["lastPodEnd"]["reason"] == "PodDeleted" and d.status["preemptions"] == 1
    assert d.create_attempt == 2


def test_preemption_budget() -> None:
    s = step(None, None).status
    for attempt in range(1, 4):
        d = step(s, DRAINED)
        assert d.create_attempt == attempt + 1
        s = d.status
    d = step(s, DRAINED)
    assert d.status["phase"] == "Failed" and d.create_attempt is None
    assert cond(d, "Failed") == ("True", "PreemptionLimitExceeded")
    assert d.status["preemptions"] == 4
    assert "completionTime" in d.status


def test_failure_backoff_then_restart() -> None:
    s = step(step(None, None).status, RUNNING).status
    d = step(s, CRASH)
    assert d.status["failures"] == 1 and d.status["phase"] == "Restarting"
    assert d.create_attempt is None and d.requeue_after == 10.0
    assert d.status["restartAt"] == "2030-01-01T00:00:10Z"
    assert [e.reason for e in d.events] == ["PodFailed"]
    early = step(d.status, None, T0 + timedelta(seconds=4))
    assert early.create_attempt is None and early.requeue_after == pytest.approx(6.0)
    assert early.status == d.status
    later = step(d.status, None, T0 + timedelta(seconds=10))
    assert later.create_attempt == 2 and "restartAt" not in later.status


def test_backoff_limit_fails_the_job_with_a_reason() -> None:
    s = step(None, None).status
    s = step(s, CRASH).status
    s = step(s, None, T0 + timedelta(seconds=10)).status
    d = step(s, CRASH, T0 + timedelta(seconds=20))
    assert d.status["phase"] == "Failed" and d.status["failures"] == 2
    status, reason = cond(d, "Failed")
    assert (status, reason) == ("True", "BackoffLimitExceeded")
    assert "exited with code 1" in (condition(d.status, "Failed") or {})["message"]


def test_failures_and_preemptions_have_separate_budgets() -> None:
    s = step(None, None).status
    s = step(s, CRASH).status  # failure 1 of 1 allowed
    s = step(s, None, T0 + timedelta(seconds=10)).status
    for _ in range(3):  # 3 preemptions allowed
        d = step(s, DRAINED, T0 + timedelta(seconds=20))
        assert d.create_attempt is not None
        s = d.status
    assert (s["failures"], s["preemptions"], s["phase"]) == (1, 3, "Pending")


def test_invalid_spec_is_marked_and_recovers() -> None:
    bad = SpecError("spec.checkpoint.storage", "must be s3://<bucket>[/prefix] or file:///<path>, not 'gs://x'")
    d = step(None, None, sp=bad)
    assert d.status["phase"] == "Failed" and d.create_attempt is None
    assert cond(d, "Invalid") == ("True", "InvalidSpec")
    assert "spec.checkpoint.storage" in (condition(d.status, "Invalid") or {})["message"]
    assert [e.reason for e in d.events] == ["InvalidSpec"]
    assert step(d.status, None, sp=bad).events == ()  # no Event storm
    fixed = step(d.status, None)
    assert cond(fixed, "Invalid") == ("False", "SpecValid")
    assert fixed.create_attempt == 1 and fixed.status["phase"] == "Pending"


def test_suspend_and_resume() -> None:
    s = step(step(None, None).status, RUNNING).status
    sus = spec()
    sus = TrainingJobSpec(sus.template, sus.checkpoint, sus.preemption, sus.sidecar, suspend=True)
    d = step(s, RUNNING, sp=sus)
    assert d.delete_pod == "job-a1" and not d.force_delete
    d2 = step(d.status, PodEnd("running", "Terminating"), sp=sus)
    assert d2.delete_pod is None
    d3 = step(d2.status, DRAINED, sp=sus)
    assert d3.status["phase"] == "Suspended" and d3.status["preemptions"] == 0 and d3.create_attempt is None
    assert d3.accounted is None
    d4 = step(d3.status, None, sp=sus)
    assert d4.status == d3.status and d4.create_attempt is None
    d5 = step(d4.status, None)
    assert d5.create_attempt == 2 and cond(d5, "Suspended") == ("False", "Resumed")
    assert [e.reason for e in d5.events] == ["Resumed", "PodCreated"]


def test_suspended_before_start() -> None:
    sus = spec()
    sus = TrainingJobSpec(sus.template, sus.checkpoint, sus.preemption, sus.sidecar, suspend=True)
    d = step(None, None, sp=sus)
    assert d.status["phase"] == "Suspended" and d.create_attempt is None and d.status["attempt"] == 0
    assert step(d.status, None).create_attempt == 1


def test_restart_after_operator_crash_repeats_the_same_create() -> None:
    # Accounted and Restarting, but the pod create never made it into the status: same attempt again.
    s = step(step(None, None).status, RUNNING).status
    crashed = step(s, CRASH).status
    first = step(crashed, None, T0 + timedelta(seconds=11))
    second = step(crashed, None, T0 + timedelta(seconds=12))
    assert first.create_attempt == second.create_attempt == 2


def test_last_verified_checkpoint_is_recorded() -> None:
    lv = {"step": 120, "uri": "s3://bkt/p/ns/job/ckpt-000000000120", "time": "2030-01-01T00:00:05Z"}
    s = step(step(None, None).status, RUNNING).status
    d = step(s, RUNNING, last_verified=lv)
    assert d.status["lastVerifiedCheckpoint"] == lv
    end = step(d.status, PodEnd("preempted", "NodeLost", "gone"))
    assert end.status["lastPodEnd"]["step"] == 120  # the step the next attempt resumes from


def test_transition_time_moves_only_on_flips() -> None:
    s = step(None, None).status
    r1 = step(s, RUNNING, T0 + timedelta(seconds=1)).status
    r2 = step(r1, RUNNING, T0 + timedelta(seconds=99)).status
    assert (
        (condition(r1, "Running") or {})["lastTransitionTime"]
        == (condition(r2, "Running") or {})["lastTransitionTime"]
        == "2030-01-01T00:00:01Z"
    )


def test_create_errors() -> None:
    s = step(None, None).status
    bad = on_create_error("job", s, 1, 422, 'Pod "job-a1" is invalid: spec.containers[0].image: Required value', T0)
    assert bad.status["phase"] == "Failed" and cond(bad, "Failed") == ("True", "PodCreateFailed")
    quota = on_create_error("job", s, 1, 403, "exceeded quota", T0)
    assert quota.status == s and quota.requeue_after == 10.0 and quota.events[0].type == "Warning"


def test_status_patch_removes_keys() -> None:
    assert status_patch({"a": 1, "restartAt": "x"}, {"a": 1}) == {"restartAt": None}
    assert status_patch(None, {"a": 1}) == {"a": 1}


NO_SECRET = PodEnd(
    "running",
    "CreateContainerConfigError",
    'container spotguard-restore: secret "s3" not found',
    start_problem="blocked",
)
NO_IMAGE = PodEnd(
    "running",
    "ImagePullBackOff",
    "container trainer (image trainer:nope): Back-off pulling image",
    start_problem="blocked",
)


def unschedulable(since: datetime) -> PodEnd:
    return PodEnd(
        "running",
        "Unschedulable",
        "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
        start_problem="unschedulable",
        since=since.strftime("%Y-%m-%dT%H:%M:%SZ"),
    )


def test_pod_that_cannot_start_says_why_and_what_to_do() -> None:
    s = step(None, None).status
    d = step(s, NO_SECRET, T0 + timedelta(seconds=3))
    assert d.status["phase"] == "Pending" and d.create_attempt is None and d.delete_pod is None
    assert cond(d, "PodBlocked") == ("True", "CreateContainerConfigError")
    message = (condition(d.status, "PodBlocked") or {})["message"]
    assert message.startswith(
        'pod job-a1 cannot start (CreateContainerConfigError): container spotguard-restore: secret "s3" not found'
    )
    assert ". A Secret or ConfigMap" in message and "create it in the job's namespace" in message
    assert [(e.type, e.reason, e.message) for e in d.events] == [("Warning", "CreateContainerConfigError", message)]
    # Seen again: no second Event, no status change.
    again = step(d.status, NO_SECRET, T0 + timedelta(seconds=30))
    assert again.events == () and status_patch(d.status, again.status) == {}
    # Another reason: a new Event.
    image = step(again.status, NO_IMAGE, T0 + timedelta(seconds=40))
    assert cond(image, "PodBlocked") == ("True", "ImagePullBackOff")
    assert [e.reason for e in image.events] == ["ImagePullBackOff"]
    assert "imagePullSecrets" in image.events[0].message
    # Fixed: the pod runs, the condition clears.
    ok = step(image.status, RUNNING, T0 + timedelta(seconds=60))
    assert ok.status["phase"] == "Running" and cond(ok, "PodBlocked") == ("False", "Unblocked")
    assert [e.reason for e in ok.events] == ["PodRunning", "Unblocked"]


def test_unschedulable_is_reported_only_after_a_while() -> None:
    s = step(None, None).status
    early = step(s, unschedulable(T0), T0 + timedelta(seconds=60))
    assert cond(early, "PodBlocked") == (None, None) and early.events == ()
    assert early.requeue_after == pytest.approx(240.0)
    late = step(early.status, unschedulable(T0), T0 + timedelta(seconds=301))
    assert cond(late, "PodBlocked") == ("True", "Unschedulable")
    assert [e.reason for e in late.events] == ["Unschedulable"]
    assert "nvidia.com/gpu" in late.events[0].message and "nodeSelector, tolerations" in late.events[0].message
    assert late.status["phase"] == "Pending"


def test_a_blocked_pod_that_is_deleted_clears_the_condition() -> None:
    s = step(step(None, None).status, NO_SECRET).status
    d = step(s, None, T0 + timedelta(seconds=10))  # deleted by the user: counted as a preemption
    assert d.create_attempt == 2 and cond(d, "PodBlocked") == ("False", "PodEnded")


def test_a_suspend_stops_pods_whose_creation_the_status_lost() -> None:
    # Attempt 1's pod was made but its status write lost (a conflict); then the job was suspended.
    sus = spec()
    sus = TrainingJobSpec(sus.template, sus.checkpoint, sus.preemption, sus.sidecar, suspend=True)
    d = step(None, None, sp=sus, strays=("job-a1",))
    assert d.status["phase"] == "Suspended" and d.status["attempt"] == 0 and d.create_attempt is None
    assert d.delete_pods == (("job-a1", False),)  # gracefully: it saves a checkpoint first
    # Gone (or going): nothing more to stop, and the resume makes attempt 1 again.
    assert step(d.status, None, sp=sus).delete_pods == ()
    assert step(d.status, None).create_attempt == 1
