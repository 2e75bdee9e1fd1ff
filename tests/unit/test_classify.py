"""Table tests of classify_pod_end: pod status shapes from each way a pod can end."""

from __future__ import annotations

import json
from typing import Any

import pytest

from spotguard.operator.classify import PodEnd, classify_pod_end, sidecar_report

SIDECAR = "spotguard-sidecar"
RESTORE = "spotguard-restore"


def term(
    name: str, code: int, reason: str | None = None, message: str | None = None, finished: str = "2030-01-01T00:00:10Z"
) -> dict[str, Any]:
    t: dict[str, Any] = {
        "exitCode": code,
        "reason": reason or ("Completed" if code == 0 else "Error"),
        "finishedAt": finished,
    }
    if message is not None:
        t["message"] = message
    return {"name": name, "state": {"terminated": t}}


def running(name: str) -> dict[str, Any]:
    return {"name": name, "state": {"running": {"startedAt": "2030-01-01T00:00:00Z"}}}


def pod(
    phase: str | None,
    *,
    containers: list[dict[str, Any]] | None = None,
    init: list[dict[str, Any]] | None = None,
    reason: str | None = None,
    message: str | None = None,
    conditions: list[dict[str, Any]] | None = None,
    deleting: bool = False,
    node: str | None = "spot-gpu-1",
) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if phase:
        status["phase"] = phase
    if containers is not None:
        status["containerStatuses"] = containers
    if init is not None:
        status["initContainerStatuses"] = init
    if reason:
        status["reason"] = reason
    if message:
        status["message"] = message
    if conditions:
        status["conditions"] = conditions
    meta: dict[str, Any] = {"name": "job-a1", "namespace": "ns"}
    if deleting:
        meta["deletionTimestamp"] = "2030-01-01T00:00:30Z"
    spec: dict[str, Any] = {"containers": [{"name": "trainer"}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": meta, "spec": spec, "status": status}


def report(preempted: bool, step: int, reason: str = "notice:aws", trainer_step: int | None = None) -> str:
    doc: dict[str, Any] = {"preempted": preempted, "reason": reason, "step": step}
    if trainer_step is not None:
        doc["trainerStep"] = trainer_step
    return json.dumps(doc)


DISRUPTION = {"type": "DisruptionTarget", "status": "True"}
OK = [term("trainer", 0), term(SIDECAR, 0)]

CASES: list[tuple[str, dict[str, Any] | None, bool, str, str]] = [
    # (case, pod, node_exists, kind, reason)
    ("pod object gone", None, True, "preempted", "PodDeleted"),
    ("finished", pod("Succeeded", containers=OK), True, "succeeded", "Completed"),
    ("finished, node gone since", pod("Succeeded", containers=OK), False, "succeeded", "Completed"),
    (
        "drain: evicted, trainer saved and exited 0",
        pod("Succeeded", containers=OK, deleting=True),
        True,
        "preempted",
        "PodDeleted",
    ),
    (
        "drain: trainer killed by SIGTERM (143)",
        pod("Failed", containers=[term("trainer", 143), term(SIDECAR, 0)], deleting=True),
        True,
        "preempted",
        "PodDeleted",
    ),
    (
        "graceful node shutdown, 1.26+ (DisruptionTarget)",
        pod(
            "Failed",
            containers=OK,
            reason="Terminated",
            message="Pod was terminated in response to imminent node shutdown.",
            conditions=[{**DISRUPTION, "reason": "TerminationByKubelet"}],
        ),
        True,
        "preempted",
        "TerminationByKubelet",
    ),
    (
        "graceful node shutdown, before 1.26",
        pod("Failed", containers=OK, reason="Shutdown"),
        True,
        "preempted",
        "NodeShutdown",
    ),
    (
        "graceful node shutdown, reason only",
        pod("Failed", containers=OK, reason="Terminated"),
        True,
        "preempted",
        "NodeShutdown",
    ),
    (
        "eviction API (DisruptionTarget)",
        pod("Failed", containers=OK, conditions=[{**DISRUPTION, "reason": "EvictionByEvictionAPI"}]),
        True,
        "preempted",
        "EvictionByEvictionAPI",
    ),
    (
        "taint manager (DisruptionTarget)",
        pod(
            "Failed", containers=[term("trainer", 137)], conditions=[{**DISRUPTION, "reason": "DeletionByTaintManager"}]
        ),
        True,
        "preempted",
        "DeletionByTaintManager",
    ),
    (
        "scheduler preemption (DisruptionTarget)",
        pod(
            "Failed", containers=[term("trainer", 143)], conditions=[{**DISRUPTION, "reason": "PreemptionByScheduler"}]
        ),
        True,
        "preempted",
        "PreemptionByScheduler",
    ),
    (
        "node-pressure eviction",
        pod("Failed", reason="Evicted", message="The node was low on resource: memory."),
        True,
        "preempted",
        "Evicted",
    ),
    (
        "kubelet admission: GPU gone",
        pod("Failed", reason="OutOfnvidia.com/gpu"),
        True,
        "preempted",
        "OutOfnvidia.com/gpu",
    ),
    ("node controller: NodeLost (terminal)", pod("Failed", reason="NodeLost"), True, "preempted", "NodeLost"),
    (
        "DisruptionTarget False is ignored",
        pod(
            "Failed",
            containers=[term("trainer", 1), term(SIDECAR, 0)],
            conditions=[{"type": "DisruptionTarget", "status": "False"}],
        ),
        True,
        "failed",
        "Error",
    ),
    ("user exit 1", pod("Failed", containers=[term("trainer", 1), term(SIDECAR, 0)]), True, "failed", "Error"),
    (
        "user exit 2, second container",
        pod("Failed", containers=[term("trainer", 0), term("helper", 2)]),
        True,
        "failed",
        "Error",
    ),
    (
        "OOMKilled",
        pod("Failed", containers=[term("trainer", 137, "OOMKilled"), term(SIDECAR, 0)]),
        True,
        "failed",
        "OOMKilled",
    ),
    (
        "killed (137) without deletion: user's problem",
        pod("Failed", containers=[term("trainer", 137), term(SIDECAR, 0)]),
        True,
        "failed",
        "Error",
    ),
    ("activeDeadlineSeconds", pod("Failed", reason="DeadlineExceeded"), True, "failed", "DeadlineExceeded"),
    ("restore init container failed", pod("Failed", init=[term(RESTORE, 1)]), True, "failed", "RestoreFailed"),
    (
        "user init container failed",
        pod("Failed", init=[term(RESTORE, 0), term("fetch-data", 3)]),
        True,
        "failed",
        "InitContainerFailed",
    ),
    (
        "classic sidecar failed alone",
        pod("Failed", containers=[term("trainer", 0), term(SIDECAR, 1)]),
        True,
        "failed",
        "SidecarFailed",
    ),
    ("failed without details", pod("Failed"), True, "failed", "Failed"),
    (
        "notice: trainer stopped early, exit 0",
        pod("Succeeded", containers=[term("trainer", 0), term(SIDECAR, 0, message=report(True, 120))]),
        True,
        "preempted",
        "notice:aws",
    ),
    (
        "notice: sidecar says not preempted",
        pod("Succeeded", containers=[term("trainer", 0), term(SIDECAR, 0, message=report(False, 300))]),
        True,
        "succeeded",
        "Completed",
    ),
    (
        "native sidecar report in initContainerStatuses",
        pod(
            "Succeeded",
            containers=[term("trainer", 0)],
            init=[term(RESTORE, 0), term(SIDECAR, 0, message=report(True, 7, "sigterm"))],
        ),
        True,
        "preempted",
        "sigterm",
    ),
    ("running", pod("Running", containers=[running("trainer"), running(SIDECAR)]), True, "running", "Running"),
    (
        "running, node vanished (abrupt loss)",
        pod("Running", containers=[running("trainer")]),
        False,
        "preempted",
        "NodeLost",
    ),
    ("pending on a node that vanished", pod("Pending"), False, "preempted", "NodeLost"),
    ("unknown phase, node controller NodeLost", pod("Unknown", reason="NodeLost"), True, "preempted", "NodeLost"),
    ("unknown phase, node still there", pod("Unknown"), True, "running", "Pending"),
    ("terminating", pod("Running", containers=[running("trainer")], deleting=True), True, "running", "Terminating"),
    (
        "node shutdown under way (DisruptionTarget on a running pod)",
        pod(
            "Running",
            containers=[term("trainer", 137), running(SIDECAR)],
            conditions=[{**DISRUPTION, "reason": "TerminationByKubelet"}],
        ),
        True,
        "running",
        "Terminating",
    ),
    (
        "classic sidecar keeps a crashed trainer's pod running",
        pod("Running", containers=[term("trainer", 1), running(SIDECAR)]),
        True,
        "failed",
        "Error",
    ),
    (
        "OOM beside a running classic sidecar",
        pod("Running", containers=[term("trainer", 137, "OOMKilled"), running(SIDECAR)]),
        True,
        "failed",
        "OOMKilled",
    ),
    (
        "trainer done, classic sidecar still shipping",
        pod("Running", containers=[term("trainer", 0), running(SIDECAR)]),
        True,
        "running",
        "Running",
    ),
    (
        "unscheduled, no node",
        pod(
            "Pending",
            node=None,
            conditions=[
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
                }
            ],
        ),
        False,
        "running",
        "Unschedulable",
    ),
    ("no status yet", pod(None, node=None), True, "running", "Pending"),
]


@pytest.mark.parametrize(("case", "pod_obj", "node_exists", "kind", "reason"), CASES, ids=[c[0] for c in CASES])
def test_classify(case: str, pod_obj: dict[str, Any] | None, node_exists: bool, kind: str, reason: str) -> None:
    end = classify_pod_end(pod_obj, node_exists)
    assert (end.kind, end.reason) == (kind, reason), end


def test_failure_message_names_container_and_code() -> None:
    end = classify_pod_end(pod("Failed", containers=[term("trainer", 3), term(SIDECAR, 0)]))
    assert end.message == "container trainer exited with code 3"


def test_unschedulable_message_is_kept() -> None:
    p = pod(
        "Pending",
        node=None,
        conditions=[
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/2 nodes: no GPU"}
        ],
    )
    assert classify_pod_end(p).message == "0/2 nodes: no GPU"


def test_sidecar_report_gives_step_and_lost_steps() -> None:
    p = pod("Succeeded", containers=[term("trainer", 0), term(SIDECAR, 0, message=report(True, 100, trainer_step=104))])
    end = classify_pod_end(p)
    assert (end.kind, end.step, end.lost_steps) == ("preempted", 100, 4)


def test_end_time_is_the_last_container_finish() -> None:
    p = pod(
        "Succeeded",
        containers=[
            term("trainer", 0, finished="2030-01-01T00:00:10Z"),
            term(SIDECAR, 0, finished="2030-01-01T00:00:12Z"),
        ],
    )
    assert classify_pod_end(p).ended_at == "2030-01-01T00:00:12Z"
    assert classify_pod_end(pod("Running", containers=[running("trainer")])).ended_at is None


@pytest.mark.parametrize("message", ["", "not json", "{broken", "[1, 2]", json.dumps({"step": "x"})])
def test_malformed_sidecar_messages_are_ignored(message: str) -> None:
    p = pod("Succeeded", containers=[term("trainer", 0), term(SIDECAR, 0, message=message)])
    assert classify_pod_end(p) == PodEnd("succeeded", "Completed", "training finished", ended_at="2030-01-01T00:00:10Z")
    if message.startswith("{") and message != "{broken":
        assert sidecar_report(p) is not None
    else:
        assert sidecar_report(p) is None


@pytest.mark.parametrize(
    ("pod_obj", "node_exists", "stop"),
    [
        (pod("Running", containers=[running("trainer")]), False, "force"),
        (pod("Unknown", reason="NodeLost"), True, "force"),
        (pod("Running", containers=[term("trainer", 2), running(SIDECAR)]), True, "graceful"),
        (pod("Failed", containers=[term("trainer", 2), term(SIDECAR, 0)]), True, None),
        (pod("Succeeded", containers=OK, deleting=True), True, None),
        (None, True, None),
    ],
)
def test_which_ended_pods_must_be_stopped(pod_obj: dict[str, Any] | None, node_exists: bool, stop: str | None) -> None:
    assert classify_pod_end(pod_obj, node_exists).stop_pod == stop


def waiting(name: str, reason: str, message: str = "", image: str = "trainer:1") -> dict[str, Any]:
    w: dict[str, Any] = {"reason": reason}
    if message:
        w["message"] = message
    return {"name": name, "image": image, "state": {"waiting": w}}


SCHEDULED = [{"type": "PodScheduled", "status": "True"}]

START_CASES: list[tuple[str, dict[str, Any], str, str | None, str]] = [
    # (case, pod, reason, start_problem, words in the message)
    (
        "credentials Secret missing (restore init container)",
        pod(
            "Pending",
            init=[waiting(RESTORE, "CreateContainerConfigError", 'secret "spotguard-s3" not found')],
            containers=[waiting("trainer", "PodInitializing")],
            conditions=SCHEDULED,
        ),
        "CreateContainerConfigError",
        "blocked",
        'container spotguard-restore: secret "spotguard-s3" not found',
    ),
    (
        "ConfigMap missing (trainer)",
        pod(
            "Pending",
            init=[term(RESTORE, 0)],
            containers=[waiting("trainer", "CreateContainerConfigError", 'configmap "hp" not found'), running(SIDECAR)],
        ),
        "CreateContainerConfigError",
        "blocked",
        'configmap "hp" not found',
    ),
    (
        "image cannot be pulled",
        pod("Pending", containers=[waiting("trainer", "ErrImagePull", "manifest unknown", image="trainer:nope")]),
        "ErrImagePull",
        "blocked",
        "container trainer (image trainer:nope): manifest unknown",
    ),
    (
        "image pull backing off",
        pod("Pending", containers=[waiting("trainer", "ImagePullBackOff", 'Back-off pulling image "x"')]),
        "ImagePullBackOff",
        "blocked",
        "Back-off pulling image",
    ),
    (
        "invalid image name",
        pod("Pending", containers=[waiting("trainer", "InvalidImageName", image="Bad::x")]),
        "InvalidImageName",
        "blocked",
        "image Bad::x",
    ),
    (
        "image never pulled",
        pod("Pending", containers=[waiting("trainer", "ErrImageNeverPull")]),
        "ErrImageNeverPull",
        "blocked",
        "container trainer",
    ),
    (
        "beside a running classic sidecar the pod is Running, but the trainer never started",
        pod("Running", containers=[waiting("trainer", "ImagePullBackOff"), running(SIDECAR)]),
        "ImagePullBackOff",
        "blocked",
        "container trainer",
    ),
    (
        "unschedulable",
        pod(
            "Pending",
            node=None,
            conditions=[
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/2 nodes: no GPU",
                    "lastTransitionTime": "2030-01-01T00:00:00Z",
                }
            ],
        ),
        "Unschedulable",
        "unschedulable",
        "0/2 nodes: no GPU",
    ),
    (
        "still creating containers: not a problem",
        pod("Pending", containers=[waiting("trainer", "ContainerCreating")], conditions=SCHEDULED),
        "Pending",
        None,
        "",
    ),
    ("running", pod("Running", containers=[running("trainer"), running(SIDECAR)]), "Running", None, ""),
]


@pytest.mark.parametrize(
    ("case", "pod_obj", "reason", "problem", "words"), START_CASES, ids=[c[0] for c in START_CASES]
)
def test_pods_that_cannot_start(
    case: str, pod_obj: dict[str, Any], reason: str, problem: str | None, words: str
) -> None:
    end = classify_pod_end(pod_obj)
    assert (end.kind, end.reason, end.start_problem) == ("running", reason, problem), end
    assert words in end.message


def test_unschedulable_carries_since() -> None:
    p = START_CASES[7][1]
    assert classify_pod_end(p).since == "2030-01-01T00:00:00Z"


# -- whose container failed: spotguard's own or the training code's --------------------------------------------------


def at(second: int) -> str:
    return f"2030-01-01T00:00:{second:02d}Z"


def restarted_native(code: int, finished: str) -> dict[str, Any]:
    """A native sidecar that crashed once and runs again (kubelet restarted it)."""
    return {
        "name": SIDECAR,
        "state": {"running": {"startedAt": finished}},
        "lastState": {"terminated": {"exitCode": code, "reason": "Error", "finishedAt": finished}},
    }


def crashlooping_native(code: int, finished: str) -> dict[str, Any]:
    """A native sidecar that crashed and waits to be restarted."""
    return {
        "name": SIDECAR,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": code, "reason": "Error", "finishedAt": finished}},
    }


SETUP_ERROR = "spotguard: error: s3://b/p: the bucket does not exist"
BLAME_CASES: list[tuple[str, dict[str, Any], str, str]] = [
    # (case, pod, reason, message)
    (
        "classic sidecar failed alone, trainer finished",
        pod("Failed", containers=[term("trainer", 0), term(SIDECAR, 2)]),
        "SidecarFailed",
        "spotguard's container spotguard-sidecar exited with code 2 (not the training code); see its log",
    ),
    (
        "sidecar's own error in its termination message",
        pod("Failed", containers=[term("trainer", 0), term(SIDECAR, 2, message=f"Traceback ...\n{SETUP_ERROR}\n")]),
        "SidecarFailed",
        f"spotguard's container spotguard-sidecar exited with code 2 (not the training code): {SETUP_ERROR}",
    ),
    (
        "sidecar could not verify the last checkpoint (a preemption's report)",
        pod("Failed", containers=[term("trainer", 1), term(SIDECAR, 1, message=report(False, 30, "sigterm"))]),
        "Error",
        "container trainer exited with code 1 (spotguard's container spotguard-sidecar also exited with code 1, "
        "not before it)",
    ),
    (
        "sidecar OOMKilled",
        pod("Failed", containers=[term("trainer", 0), term(SIDECAR, 137, "OOMKilled")]),
        "SidecarFailed",
        "spotguard's container spotguard-sidecar was killed for using too much memory (OOMKilled) (not the training "
        "code): give it more memory (spec.sidecar.resources); see its log",
    ),
    (
        "sidecar died first, then the trainer failed",
        pod("Failed", containers=[term("trainer", 1, finished=at(20)), term(SIDECAR, 2, finished=at(5))]),
        "SidecarFailed",
        "spotguard's container spotguard-sidecar exited with code 2 (not the training code); see its log "
        "(then container trainer failed too)",
    ),
    (
        "native sidecar died first (init container status), then the trainer failed",
        pod(
            "Failed",
            containers=[term("trainer", 1, finished=at(20))],
            init=[term(RESTORE, 0, finished=at(1)), term(SIDECAR, 1, finished=at(5))],
        ),
        "SidecarFailed",
        "spotguard's container spotguard-sidecar exited with code 1 (not the training code): the newest checkpoint "
        "could not be verified in storage; see its log (then container trainer failed too)",
    ),
    (
        "crash-looping native sidecar died first",
        pod("Failed", containers=[term("trainer", 1, finished=at(20))], init=[crashlooping_native(2, at(5))]),
        "SidecarFailed",
        "spotguard's container spotguard-sidecar exited with code 2 (not the training code); see its log "
        "(then container trainer failed too)",
    ),
    (
        "trainer failed first, then the sidecar",
        pod("Failed", containers=[term("trainer", 3, finished=at(5)), term(SIDECAR, 1, finished=at(20))]),
        "Error",
        "container trainer exited with code 3 (spotguard's container spotguard-sidecar also exited with code 1, "
        "not before it)",
    ),
    (
        "both in the same second: the training code's own exit is the cause",
        pod("Failed", containers=[term("trainer", 3, finished=at(5)), term(SIDECAR, 1, finished=at(5))]),
        "Error",
        "container trainer exited with code 3 (spotguard's container spotguard-sidecar also exited with code 1, "
        "not before it)",
    ),
    (
        "trainer OOMKilled after the sidecar failed: still the sidecar first",
        pod("Failed", containers=[term("trainer", 137, "OOMKilled", finished=at(9)), term(SIDECAR, 2, finished=at(3))]),
        "SidecarFailed",
        "spotguard's container spotguard-sidecar exited with code 2 (not the training code); see its log "
        "(then container trainer failed too)",
    ),
    (
        "trainer OOMKilled first, sidecar failed later",
        pod("Failed", containers=[term("trainer", 137, "OOMKilled", finished=at(3)), term(SIDECAR, 1, finished=at(9))]),
        "OOMKilled",
        "container trainer was killed for using too much memory (OOMKilled) (spotguard's container spotguard-sidecar "
        "also exited with code 1, not before it)",
    ),
    (
        "native sidecar crashed once but runs again: not blamed",
        pod("Failed", containers=[term("trainer", 1, finished=at(20))], init=[restarted_native(2, at(5))]),
        "Error",
        "container trainer exited with code 1",
    ),
    (
        "restore failed, with its error",
        pod("Failed", init=[term(RESTORE, 1, message="error: no verified checkpoint readable: AccessDenied\n")]),
        "RestoreFailed",
        "spotguard's container spotguard-restore exited with code 1 (not the training code): could not stage the "
        "latest verified checkpoint (check the storage URI and credentials): error: no verified checkpoint readable: "
        "AccessDenied",
    ),
    (
        "restore failed, no message",
        pod("Failed", init=[term(RESTORE, 1)]),
        "RestoreFailed",
        "spotguard's container spotguard-restore exited with code 1 (not the training code): could not stage the "
        "latest verified checkpoint (check the storage URI and credentials); see its log",
    ),
    (
        "the user's init container failed: theirs",
        pod("Failed", init=[term(RESTORE, 0), term("fetch-data", 3)]),
        "InitContainerFailed",
        "init container fetch-data exited with code 3",
    ),
]


@pytest.mark.parametrize(("case", "pod_obj", "reason", "message"), BLAME_CASES, ids=[c[0] for c in BLAME_CASES])
def test_failures_name_whose_container_failed(case: str, pod_obj: dict[str, Any], reason: str, message: str) -> None:
    end = classify_pod_end(pod_obj)
    # Still a failure (it counts against backoffLimit: a crash loop must end), but attributed.
    assert (end.kind, end.reason, end.message) == ("failed", reason, message), end


def test_a_long_termination_message_is_cut() -> None:
    end = classify_pod_end(pod("Failed", containers=[term("trainer", 0), term(SIDECAR, 2, message="x" * 5000)]))
    assert end.reason == "SidecarFailed" and len(end.message) < 500


def test_a_gone_pod_ends_as_its_last_seen_report_said() -> None:
    """A pod gone before a look read it: the preemption its sidecar reported in the last status the watch
    showed (reason, step, lost steps, node) instead of a bare deletion; without one, or with a report of
    no preemption, the bare deletion."""
    seen = pod(
        "Running",
        containers=[running("trainer"), term(SIDECAR, 143, message=report(True, 40, "drain", trainer_step=43))],
        deleting=True,
    )
    end = classify_pod_end(None, True, seen)
    assert (end.kind, end.reason, end.step, end.lost_steps, end.node) == ("preempted", "drain", 40, 3, "spot-gpu-1")
    assert classify_pod_end(None, True, None).reason == "PodDeleted"
    finished = pod("Running", containers=[running("trainer"), term(SIDECAR, 0, message=report(False, 40, "finished"))])
    assert classify_pod_end(None, True, finished).reason == "PodDeleted"
    # A pod that still exists is read as it is now.
    assert classify_pod_end(pod("Running", containers=[running("trainer"), running(SIDECAR)]), True, seen).kind == (
        "running"
    )


def test_the_context_keeps_reported_pods_of_the_job_that_owned_them_bounded() -> None:
    from spotguard.operator import kubeapi

    ctx = kubeapi.Context(core=None, custom=None, config=None, metrics=None)  # type: ignore[arg-type]
    seen = pod("Running", containers=[term(SIDECAR, 143, message=report(True, 40))], deleting=True)
    seen["metadata"]["ownerReferences"] = [{"uid": "job-uid"}]
    ctx.remember_report("ns", pod("Running", containers=[running(SIDECAR)]))  # no report: not kept
    assert ctx.reported_pods == {}
    ctx.remember_report("ns", seen)
    assert sidecar_report(ctx.reported_pod("ns", "job-a1", "job-uid") or {}) is not None
    assert ctx.reported_pod("ns", "job-a1", "another-job") is None  # an older job's pod of the same name
    for i in range(kubeapi.REPORTED_PODS):
        other = json.loads(json.dumps(seen))
        other["metadata"]["name"] = f"job-b{i}"
        ctx.remember_report("ns", other)
    assert len(ctx.reported_pods) == kubeapi.REPORTED_PODS
    assert ctx.reported_pod("ns", "job-a1", "job-uid") is None  # the oldest went first
