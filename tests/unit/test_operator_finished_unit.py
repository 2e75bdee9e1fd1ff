"""A finished job is never run again: pod shapes of a training that finished, classified and
decided without a cluster (one pod, and a gang whose last part could not be verified)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from spotguard.operator.classify import classify_pod_end
from spotguard.operator.decide import decide
from spotguard.operator.jobstatus import Decision, Member, Observation, condition
from spotguard.operator.spec import TrainingJobSpec, parse

T0 = datetime(2030, 1, 1, tzinfo=UTC)
SIDECAR = "spotguard-sidecar"
FINISHED = json.dumps({"preempted": False, "reason": "finished", "step": 30, "trainerStep": 40})


def spec(nodes: int = 1) -> TrainingJobSpec:
    return parse(
        {
            "nodes": nodes,
            "template": {"spec": {"containers": [{"name": "trainer", "image": "t"}]}},
            "checkpoint": {"storage": "s3://bkt/p"},
            "preemption": {"maxPreemptions": 3, "backoffLimit": 3, "backoff": {"initialSeconds": 0}},
        }
    )


def term(name: str, code: int, message: str | None = None) -> dict[str, Any]:
    t: dict[str, Any] = {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}
    t["finishedAt"] = "2030-01-01T00:10:00Z"
    if message is not None:
        t["message"] = message
    return {"name": name, "state": {"terminated": t}}


def pod(
    phase: str,
    sidecar_code: int,
    *,
    deleting: bool = False,
    native: bool = False,
    trainer_code: int = 0,
    report: str = FINISHED,
    **status_extra: Any,
) -> dict[str, Any]:
    sidecar = term(SIDECAR, sidecar_code, report)
    status: dict[str, Any] = {"phase": phase, "containerStatuses": [term("trainer", trainer_code)], **status_extra}
    if native:
        status["initContainerStatuses"] = [term("spotguard-restore", 0), sidecar]
    else:
        status["containerStatuses"].append(sidecar)
    meta: dict[str, Any] = {"name": "job-a1", "namespace": "ns"}
    if deleting:
        meta["deletionTimestamp"] = "2030-01-01T00:10:30Z"
    return {"metadata": meta, "spec": {"nodeName": "spot-1"}, "status": status}


UNVERIFIED = (
    "training finished, but spotguard's sidecar could not verify its last checkpoint in storage (newest verified: "
    "step 30); see the sidecar's log. Not run again: the training is done"
)
PREEMPTED = json.dumps({"preempted": True, "reason": "sigterm", "step": 30})
SHUTDOWN = {"reason": "Terminated", "conditions": [{"type": "DisruptionTarget", "status": "True"}]}
CLASSIFIED: list[tuple[str, dict[str, Any], tuple[str, str, str]]] = [
    # (case, pod, (kind, reason, message)): the training finished, whatever happened to the pod afterwards.
    ("classic sidecar gave up (exit 1)", pod("Failed", 1), ("succeeded", "FinalCheckpointUnverified", UNVERIFIED)),
    (
        "drained while the classic sidecar waited for the other parts",
        pod("Failed", 1, deleting=True),
        ("succeeded", "FinalCheckpointUnverified", UNVERIFIED),
    ),
    (
        "drained after it was verified",
        pod("Succeeded", 0, deleting=True),
        ("succeeded", "Completed", "training finished"),
    ),
    ("node shut down after it finished", pod("Failed", 0, **SHUTDOWN), ("succeeded", "Completed", "training finished")),
    (
        "native sidecar stopped before it verified",
        pod("Succeeded", 1, native=True),
        ("succeeded", "FinalCheckpointUnverified", UNVERIFIED),
    ),
    # Not finished: the rule does not apply.
    (
        "the trainer failed: the report's word does not make it finished",
        pod("Failed", 0, trainer_code=1),
        ("failed", "Error", "container trainer exited with code 1"),
    ),
    (
        "a preemption's report",
        pod("Failed", 1, report=PREEMPTED),
        ("preempted", "sigterm", "the trainer stopped early after a checkpoint"),
    ),
    (
        "no report: the sidecar's failure stays its own",
        pod("Failed", 1, report=""),
        (
            "failed",
            "SidecarFailed",
            "spotguard's container spotguard-sidecar exited with code 1 (not the training code): the newest"
            " checkpoint could not be verified in storage; see its log",
        ),
    ),
]


@pytest.mark.parametrize(("case", "pod_obj", "want"), CLASSIFIED, ids=[c[0] for c in CLASSIFIED])
def test_a_finished_training_is_classified_succeeded(
    case: str, pod_obj: dict[str, Any], want: tuple[str, str, str]
) -> None:
    end = classify_pod_end(pod_obj)
    assert (end.kind, end.reason, end.message) == want, end


def running(sp: TrainingJobSpec) -> dict[str, Any]:
    d = decide("job", None, sp, Observation(), T0, 1)
    assert d.create_attempt == 1
    return d.status


# (case, pod of the attempt): the trainer exited 0 and the sidecar reported "finished".
SHAPES: list[tuple[str, dict[str, Any]]] = [
    ("classic sidecar gave up on the last checkpoint", pod("Failed", 1)),
    ("classic sidecar drained while it waited", pod("Failed", 1, deleting=True)),
    ("native sidecar stopped before it verified", pod("Succeeded", 1, native=True)),
    ("verified, then the pod was deleted", pod("Succeeded", 0, deleting=True)),
]


@pytest.mark.parametrize(("case", "pod_obj"), SHAPES, ids=[c[0] for c in SHAPES])
def test_one_pod_that_finished_ends_the_job(case: str, pod_obj: dict[str, Any]) -> None:
    sp = spec()
    end = classify_pod_end(pod_obj)
    d = decide("job", running(sp), sp, Observation(pod_end=end), T0, 1)
    assert d.status["phase"] == "Succeeded", (case, end, d.status)
    assert d.create_attempt is None and d.status["failures"] == 0 and d.status["preemptions"] == 0
    assert (condition(d.status, "Succeeded") or {}).get("status") == "True"
    unverified = pod_obj["status"].get("initContainerStatuses", pod_obj["status"]["containerStatuses"])[-1]
    if unverified["state"]["terminated"]["exitCode"] != 0:
        warnings = [e for e in d.events if e.type == "Warning"]
        assert [e.reason for e in warnings] == ["FinalCheckpointUnverified"]
        assert "could not verify its last checkpoint in storage (newest verified: step 30)" in warnings[0].message


def gang_step(status: dict[str, Any] | None, sp: TrainingJobSpec, *ends: Any) -> Decision:
    members = tuple(
        Member(rank, f"job-a1-{rank}", end, node=f"spot-{rank}", settled=end.kind != "running")
        for rank, end in enumerate(ends)
    )
    return decide("job", status, sp, Observation(members=members), T0, 1)


def test_a_gang_whose_last_part_waited_too_long_succeeds_and_is_never_run_again() -> None:
    sp = spec(nodes=2)
    st = gang_step(None, sp).status
    st = gang_step(st, sp, classify_pod_end(pod("Running", 0)), classify_pod_end(pod("Running", 0))).status
    # Rank 0's sidecar gave up waiting for rank 1's part, which is still uploading: no teardown.
    gave_up = classify_pod_end(pod("Failed", 1))
    d = gang_step(st, sp, gave_up, classify_pod_end({"status": {"phase": "Running"}, "spec": {}, "metadata": {}}))
    assert d.delete_pods == () and d.create_attempt is None and "teardown" not in d.status
    # Rank 1 finished too: the job succeeded, with a warning naming rank 0's pod.
    d = gang_step(d.status, sp, gave_up, classify_pod_end(pod("Succeeded", 0)))
    assert d.status["phase"] == "Succeeded" and d.create_attempt is None and d.status["failures"] == 0
    warnings = [e for e in d.events if e.type == "Warning"]
    assert [e.reason for e in warnings] == ["FinalCheckpointUnverified"]
    assert warnings[0].message.startswith("attempt 1 (all 2 pods): pod job-a1-0 on node spot-0: training finished")
