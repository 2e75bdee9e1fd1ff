"""A sidecar that stops while its trainer trains: classified, decided, counted."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import generate_latest

from spotguard.operator.classify import PodEnd, classify_pod_end
from spotguard.operator.decide import decide
from spotguard.operator.jobstatus import Decision, Member, Observation, condition
from spotguard.operator.metrics import OperatorMetrics
from spotguard.operator.spec import TrainingJobSpec, parse
from spotguard.operator.testing import metric_value

SIDECAR = "spotguard-sidecar"
RESTORE = "spotguard-restore"
T0 = datetime(2030, 1, 1, tzinfo=UTC)
KILLED_LOG = "sidecar: shipping step 40\nKilled"


def term(
    name: str, code: int, message: str | None = None, finished: str = "2030-01-01T00:00:10Z", reason: str | None = None
) -> dict[str, Any]:
    t: dict[str, Any] = {
        "exitCode": code,
        "reason": reason or ("Completed" if code == 0 else "Error"),
        "startedAt": "2030-01-01T00:00:00Z",
        "finishedAt": finished,
    }
    if message is not None:
        t["message"] = message
    return {"name": name, "restartCount": 0, "state": {"terminated": t}}


def running(name: str) -> dict[str, Any]:
    return {"name": name, "restartCount": 0, "state": {"running": {"startedAt": "2030-01-01T00:00:00Z"}}}


def native_sidecar(
    state: dict[str, Any], code: int = 1, restarts: int = 0, message: str | None = None
) -> dict[str, Any]:
    """A native sidecar's status: ``state`` now, its last crash in ``lastState``."""
    last: dict[str, Any] = {"exitCode": code, "reason": "Error", "finishedAt": "2030-01-01T00:00:10Z"}
    if message is not None:
        last["message"] = message
    return {"name": SIDECAR, "restartCount": restarts, "state": state, "lastState": {"terminated": last}}


def pod(
    phase: str, containers: list[dict[str, Any]], init: list[dict[str, Any]] | None = None, deleting: bool = False
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "containerStatuses": containers}
    if init is not None:
        status["initContainerStatuses"] = init
    meta: dict[str, Any] = {"name": "job-a1", "namespace": "ns"}
    if deleting:
        meta["deletionTimestamp"] = "2030-01-01T00:00:30Z"
    return {"metadata": meta, "spec": {"nodeName": "spot-1", "containers": [{"name": "trainer"}]}, "status": status}


def classic_down(code: int = 137, message: str | None = KILLED_LOG) -> dict[str, Any]:
    """A classic sidecar that died while the trainer runs: what kubelet reports."""
    return pod("Running", [running("trainer"), term(SIDECAR, code, message)], init=[term(RESTORE, 0)])


def classic_up() -> dict[str, Any]:
    return pod("Running", [running("trainer"), running(SIDECAR)], init=[term(RESTORE, 0)])


# --- classification -----------------------------------------------------------------


def test_a_classic_sidecar_that_died_beside_a_running_trainer_ends_the_attempt() -> None:
    end = classify_pod_end(classic_down())
    assert (end.kind, end.reason, end.stop_pod) == ("failed", "SidecarExited", "graceful")
    assert "spotguard-sidecar" in end.message and "137" in end.message and "Killed" in end.message
    assert "trainer" in end.message
    assert end.ended_at == "2030-01-01T00:00:10Z"


@pytest.mark.parametrize("report", [None, '{"preempted": false, "reason": "finished", "step": 59}'])
def test_a_sidecar_that_exited_0_is_not_down(report: str | None) -> None:
    # It exits 0 once its trainer said it finished and everything is shipped; kubelet may still
    # show the trainer's container running for a moment (seen in the fleet: a finished job was
    # failed three times over).
    end = classify_pod_end(classic_down(0, report))
    assert (end.kind, end.reason) == ("running", "Running")
    assert (classify_pod_end(classic_down(1, report)).kind, classify_pod_end(classic_down(1, report)).reason) == (
        "failed",
        "SidecarExited",
    )


def test_a_sidecar_that_reported_a_preemption_waits_for_its_trainer() -> None:
    # After a cloud notice the sidecar leaves its report and exits; the trainer follows.
    report = '{"preempted": true, "reason": "notice:aws", "step": 40}'
    end = classify_pod_end(classic_down(0, report))
    assert (end.kind, end.reason) == ("running", "Running")


def test_a_running_sidecar_is_said_to_run() -> None:
    end = classify_pod_end(classic_up())
    assert (end.kind, end.reason) == ("running", "Running") and end.sidecar_running
    waiting = pod("Running", [running("trainer"), {"name": SIDECAR, "state": {"waiting": {"reason": "X"}}}])
    assert not classify_pod_end(waiting).sidecar_running


@pytest.mark.parametrize(
    ("case", "pod_obj", "kind", "reason"),
    [
        (
            "trainer crashed, then the sidecar exited: the trainer's failure, as before",
            pod("Running", [term("trainer", 1, finished="2030-01-01T00:00:05Z"), term(SIDECAR, 137)]),
            "failed",
            "Error",
        ),
        (
            "both ended, pod Failed: the existing blame rules",
            pod("Failed", [term("trainer", 143, finished="2030-01-01T00:00:20Z"), term(SIDECAR, 137)]),
            "failed",
            "SidecarFailed",
        ),
        (
            "trainer finished, sidecar done, phase not updated yet",
            pod("Running", [term("trainer", 0), term(SIDECAR, 0)]),
            "running",
            "Running",
        ),
        (
            "trainer finished, sidecar still shipping",
            pod("Running", [term("trainer", 0), running(SIDECAR)]),
            "running",
            "Running",
        ),
        (
            "the pod is being deleted",
            pod("Running", [running("trainer"), term(SIDECAR, 143)], deleting=True),
            "running",
            "Terminating",
        ),
    ],
)
def test_when_the_trainer_ended_too_the_existing_rules_apply(
    case: str, pod_obj: dict[str, Any], kind: str, reason: str
) -> None:
    end = classify_pod_end(pod_obj)
    assert (end.kind, end.reason) == (kind, reason), end


@pytest.mark.parametrize(
    ("case", "sidecar", "kind", "reason"),
    [
        (
            "just exited: kubelet restarts it",
            native_sidecar({"terminated": {"exitCode": 1, "reason": "Error"}}),
            "running",
            "Running",
        ),
        (
            "restarted and running again",
            native_sidecar({"running": {"startedAt": "2030-01-01T00:00:11Z"}}, restarts=1),
            "running",
            "Running",
        ),
        (
            "crash-looping",
            native_sidecar(
                {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}},
                code=2,
                restarts=3,
                message="error: s3 unreachable\n",
            ),
            "failed",
            "SidecarExited",
        ),
    ],
)
def test_a_native_sidecar_is_left_to_kubelet_unless_it_crash_loops(
    case: str, sidecar: dict[str, Any], kind: str, reason: str
) -> None:
    p = pod("Running", [running("trainer")], init=[term(RESTORE, 0), sidecar])
    end = classify_pod_end(p)
    assert (end.kind, end.reason) == (kind, reason), end
    if kind == "failed":
        assert end.stop_pod == "graceful"
        assert "code 2" in end.message and "s3 unreachable" in end.message and "3 restarts" in end.message


def test_a_restarted_native_sidecar_runs() -> None:
    p = pod(
        "Running",
        [running("trainer")],
        init=[term(RESTORE, 0), native_sidecar({"running": {"startedAt": "x"}}, restarts=1)],
    )
    assert classify_pod_end(p).sidecar_running


# --- the decision ---------------------------------------------------------------------


def spec(backoff: int = 0, limit: int = 3, nodes: int | None = None) -> TrainingJobSpec:
    raw: dict[str, Any] = {
        "template": {"spec": {"containers": [{"name": "trainer", "image": "t"}]}},
        "checkpoint": {"storage": "s3://bkt/p"},
        "preemption": {
            "maxPreemptions": 3,
            "backoffLimit": limit,
            "gracePeriodSeconds": 45,
            "backoff": {"initialSeconds": backoff},
        },
    }
    if nodes:
        raw["nodes"] = nodes
    return parse(raw)


def step(status: dict[str, Any] | None, p: dict[str, Any] | None, sp: TrainingJobSpec, now: datetime = T0) -> Decision:
    end = classify_pod_end(p) if p is not None else None
    return decide("job", status, sp, Observation(pod_end=end), now, 1)


def cond(d: Decision, type_: str) -> dict[str, Any]:
    return dict(condition(d.status, type_) or {})


def running_job(sp: TrainingJobSpec) -> dict[str, Any]:
    d = step(None, None, sp)
    d = step(d.status, classic_up(), sp)
    assert d.status["phase"] == "Running"
    return d.status


def test_sidecar_down_stops_the_pod_says_so_and_starts_the_next_attempt() -> None:
    sp = spec()
    st = running_job(sp)
    assert "SidecarHealthy" not in [c["type"] for c in st["conditions"]]  # only after a sidecar went down
    d = step(st, classic_down(), sp)
    # the pod is stopped gracefully (the trainer gets its grace period), the next attempt starts
    assert d.delete_pod == "job-a1" and not d.force_delete
    assert d.create_attempt == 2 and d.status["attempt"] == 2
    # counted as a failed attempt, through the same path as any failure
    assert d.status["failures"] == 1 and d.status["preemptions"] == 0
    assert d.accounted is not None and d.accounted.reason == "SidecarExited"
    assert d.status["lastPodEnd"]["reason"] == "SidecarExited" and d.status["lastPodEnd"]["kind"] == "failed"
    c = cond(d, "SidecarHealthy")
    assert (c["status"], c["reason"]) == ("False", "SidecarExited")
    msg = c["message"]
    assert "job-a1" in msg and "137" in msg and "Killed" in msg
    assert "45s" in msg and "attempt 2" in msg and "1 of backoffLimit 3" in msg
    warnings = [e for e in d.events if e.type == "Warning"]
    assert [(e.reason, e.message) for e in warnings] == [("SidecarExited", msg)]
    assert "PodCreated" in [e.reason for e in d.events]


def test_the_condition_turns_true_when_the_replacements_sidecar_runs() -> None:
    sp = spec()
    d = step(running_job(sp), classic_down(), sp)
    pending = step(d.status, pod("Pending", []), sp)
    assert cond(pending, "SidecarHealthy")["status"] == "False"
    up = step(pending.status, classic_up(), sp)
    c = cond(up, "SidecarHealthy")
    assert (c["status"], c["reason"]) == ("True", "SidecarRunning") and "job-a2" in c["message"]
    assert ("Normal", "SidecarRunning") in [(e.type, e.reason) for e in up.events]
    again = step(up.status, classic_up(), sp)
    assert again.events == () and again.status == up.status


def test_with_a_backoff_the_message_says_when_the_next_attempt_starts() -> None:
    sp = spec(backoff=30)
    d = step(running_job(sp), classic_down(), sp)
    assert d.delete_pod == "job-a1" and d.create_attempt is None and d.status["phase"] == "Restarting"
    assert "attempt 2 starts at 2030-01-01T00:00:30Z" in cond(d, "SidecarHealthy")["message"]


def test_past_the_backoff_limit_the_job_fails_and_the_message_says_so() -> None:
    sp = spec(limit=0)
    d = step(running_job(sp), classic_down(), sp)
    assert d.status["phase"] == "Failed" and d.delete_pod == "job-a1" and d.create_attempt is None
    assert cond(d, "Failed")["reason"] == "BackoffLimitExceeded"
    assert "the job failed" in cond(d, "SidecarHealthy")["message"]
    assert {e.reason for e in d.events} == {"SidecarExited", "BackoffLimitExceeded"}


def test_a_sidecar_of_a_gang_member_stops_the_gang() -> None:
    sp = spec(nodes=2)
    up = PodEnd("running", "Running", sidecar_running=True)
    down = classify_pod_end(classic_down())

    def members(a: PodEnd, b: PodEnd, **kw: Any) -> tuple[Member, ...]:
        return (Member(0, "job-a1-0", a, node="n0"), Member(1, "job-a1-1", b, node="n1", **kw))

    d = decide("job", None, sp, Observation(), T0, 1)
    d = decide("job", d.status, sp, Observation(members=members(up, up)), T0, 1)
    d = decide("job", d.status, sp, Observation(members=members(up, down)), T0, 1)
    assert d.status["teardown"]["reason"] == "SidecarExited"
    c = cond(d, "SidecarHealthy")
    assert (c["status"], c["reason"]) == ("False", "SidecarExited") and "job-a1-1" in c["message"]
    assert "SidecarExited" in [e.reason for e in d.events if e.type == "Warning"]
    d = decide("job", d.status, sp, Observation(members=members(up, down)), T0, 1)
    assert sorted(d.delete_pods) == [("job-a1-0", False), ("job-a1-1", False)]
    gone = PodEnd("preempted", "PodDeleted", "the pod was deleted (drain or eviction)")
    d = decide(
        "job",
        d.status,
        sp,
        Observation(
            members=(
                Member(0, "job-a1-0", gone, present=False, settled=True),
                Member(1, "job-a1-1", gone, present=False, settled=True),
            )
        ),
        T0 + timedelta(seconds=5),
        1,
    )
    assert d.status["failures"] == 1 and d.create_attempt == 2


# --- the metric -----------------------------------------------------------------------


def test_sidecar_failures_are_counted_per_job() -> None:
    m = OperatorMetrics()
    m.sidecar_failed("ns", "a")
    m.sidecar_failed("ns", "a")
    text = generate_latest(m.registry).decode()
    assert metric_value(text, "spotguard_job_sidecar_failures_total", {"namespace": "ns", "trainingjob": "a"}) == 2.0
    m.forget("ns", "a")
    assert 'job="a"' not in generate_latest(m.registry).decode()
