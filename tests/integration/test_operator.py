"""The operator against a real kube-apiserver (plus controller-manager and scheduler).

No kubelet runs here: pods stay Pending (a nodeSelector no node matches keeps
them off any process node another test may have started), and each way a pod
can end is produced by patching its status through the apiserver, as kubelet,
the node-shutdown manager or the eviction API would.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from kubernetes.client.exceptions import ApiException

from spotguard import notice_relay
from spotguard.operator.podbuilder import OperatorConfig, build_pod
from spotguard.operator.spec import parse
from spotguard.operator.testing import OperatorProcess, metric_value
from testenv.kubetest import (
    GROUP,
    IMAGE,
    NO_NODE,
    PLURAL,
    VERSION,
    cond,
    create_job,
    delete_jobs,
    events,
    fail_pod,
    get_job,
    kubectl,
    new_namespace,
    no_node_job,
    patch_pod_status,
    pod_names,
    run_pod,
    shutdown_pod,
    start_operator,
    succeed_pod,
    terminated,
    wait_events,
    wait_for,
    wait_pod,
    wait_status,
)
from testenv.silentlink import SilentLink

pytestmark = pytest.mark.integration

#: The namespace of this module (the ``ns`` fixture).
NS_PREFIX = "op"


# --- fixtures -------------------------------------------------------------------


# --- helpers --------------------------------------------------------------------


# --- tests ----------------------------------------------------------------------


def test_pod_layout_preemption_and_success(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path, kube: Any
) -> None:
    core, _ = apis
    job = create_job(apis, ns, no_node_job("life", f"file://{tmp_path}/store"))
    pod = wait_pod(apis, ns, "life-a1")
    meta = pod.metadata
    assert meta.labels["spotguard.dev/job"] == "life" and meta.labels["spotguard.dev/attempt"] == "1"
    ref = meta.owner_references[0]
    assert (ref.kind, ref.name, ref.uid, ref.controller) == ("TrainingJob", "life", job["metadata"]["uid"], True)
    assert [c.name for c in pod.spec.init_containers] == ["spotguard-restore"]
    assert [c.name for c in pod.spec.containers] == ["trainer", "spotguard-sidecar"]
    assert pod.spec.restart_policy == "Never" and pod.spec.termination_grace_period_seconds == 5
    assert pod.spec.node_selector == NO_NODE
    assert pod.spec.containers[0].resources.limits == {"nvidia.com/gpu": "1"}
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    assert env["SPOTGUARD_STORAGE_URI"] == f"file://{tmp_path}/store/{ns}/life"
    st = wait_status(apis, ns, "life", "Pending, attempt 1", lambda s: s.get("attempt") == 1)
    assert st["phase"] == "Pending" and st["currentPod"] == "life-a1"

    run_pod(apis, ns, "life-a1")
    wait_status(apis, ns, "life", "Running", lambda s: s.get("phase") == "Running")
    table = kubectl(kube, "get", "trainingjob", "life", "-n", ns).stdout
    assert table.split("\n")[0].split() == ["NAME", "PHASE", "ATTEMPT", "NODES", "PREEMPTIONS", "VERIFIED-STEP", "AGE"]
    assert table.split("\n")[1].split()[:5] == ["life", "Running", "1", "1", "0"]

    shutdown_pod(apis, ns, "life-a1")
    st = wait_status(apis, ns, "life", "attempt 2 after a preemption", lambda s: s.get("attempt") == 2)
    assert st["preemptions"] == 1 and st["failures"] == 0
    assert st["lastPodEnd"]["kind"] == "preempted" and st["lastPodEnd"]["reason"] == "TerminationByKubelet"
    assert cond(st, "Preempted")["status"] == "True"
    wait_pod(apis, ns, "life-a2")
    assert pod_names(apis, ns, "life") == ["life-a1", "life-a2"]

    run_pod(apis, ns, "life-a2")
    succeed_pod(apis, ns, "life-a2")
    st = wait_status(apis, ns, "life", "Succeeded", lambda s: s.get("phase") == "Succeeded")
    assert cond(st, "Succeeded")["status"] == "True" and st["attempt"] == 2
    wait_events(apis, ns, "life", {"PodCreated", "PodRunning", "Preempted", "Completed"})

    text = operator.metrics()
    labels = {"namespace": ns, "trainingjob": "life"}
    assert metric_value(text, "spotguard_job_preemptions_total", labels) == 1.0
    assert metric_value(text, "spotguard_job_restarts_total", labels) == 1.0
    assert metric_value(text, "spotguard_job_failures_total", labels) in (None, 0.0)
    assert metric_value(text, "spotguard_reschedule_latency_seconds_count") is not None
    assert (metric_value(text, "spotguard_jobs", {"phase": "Succeeded"}) or 0) >= 1


def test_failure_consumes_backoff_limit(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    create_job(apis, ns, no_node_job("crash", f"file://{tmp_path}/store"))
    wait_pod(apis, ns, "crash-a1")
    fail_pod(apis, ns, "crash-a1", code=1)
    wait_pod(apis, ns, "crash-a2")
    fail_pod(apis, ns, "crash-a2", code=1)
    st = wait_status(apis, ns, "crash", "Failed", lambda s: s.get("phase") == "Failed")
    assert st["failures"] == 2 and st["preemptions"] == 0
    failed = cond(st, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "BackoffLimitExceeded"
    assert "exited with code 1" in failed["message"]
    assert pod_names(apis, ns, "crash") == ["crash-a1", "crash-a2"]
    wait_events(apis, ns, "crash", {"BackoffLimitExceeded"})
    crash = {"namespace": ns, "trainingjob": "crash"}
    assert metric_value(operator.metrics(), "spotguard_job_failures_total", crash) == 2.0


def test_invalid_spec_refused_or_marked(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    with pytest.raises(ApiException) as err:
        create_job(apis, ns, no_node_job("bad", "az://bucket/x"))
    assert err.value.status == 422 and "spec.checkpoint.storage" in err.value.body
    with pytest.raises(ApiException) as err:
        create_job(apis, ns, no_node_job("bad", f"file://{tmp_path}", preemption={"maxPreemptions": -1}))
    assert "spec.preemption.maxPreemptions" in err.value.body

    # What the schema cannot say, the operator does, as a condition (and no pod).
    body = no_node_job("reserved", f"file://{tmp_path}")
    body["spec"]["template"]["spec"]["containers"][0]["name"] = "spotguard-sidecar"
    create_job(apis, ns, body)
    st = wait_status(apis, ns, "reserved", "Invalid", lambda s: cond(s, "Invalid").get("status") == "True")
    assert st["phase"] == "Failed"
    assert "spec.template.spec.containers[0].name" in cond(st, "Invalid")["message"]
    assert pod_names(apis, ns, "reserved") == []
    wait_events(apis, ns, "reserved", {"InvalidSpec"})
    # Fixing the spec recovers the job. A replace names the version it read: one the operator's own
    # writes (status, annotations) moved on meanwhile is refused (409), and read again, as kubectl edit does.
    _, custom = apis
    for _ in range(10):
        fixed = get_job(apis, ns, "reserved")
        fixed["spec"]["template"]["spec"]["containers"][0]["name"] = "trainer"
        try:
            custom.replace_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "reserved", fixed)
            break
        except ApiException as e:
            if e.status != 409:
                raise
    else:
        pytest.fail("the fixed spec could not be written in 10 tries: the job's version kept moving")
    wait_pod(apis, ns, "reserved-a1")
    st = wait_status(apis, ns, "reserved", "valid", lambda s: cond(s, "Invalid").get("status") == "False")
    assert st["phase"] == "Pending"


def test_pod_deleted_out_of_band(apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path) -> None:
    core, _ = apis
    create_job(apis, ns, no_node_job("gone", f"file://{tmp_path}"))
    wait_pod(apis, ns, "gone-a1")
    core.delete_namespaced_pod("gone-a1", ns, grace_period_seconds=0)
    st = wait_status(
        apis, ns, "gone", "attempt 2", lambda s: s.get("attempt") == 2, describe=lambda: operator.log_tail(40)
    )
    assert st["lastPodEnd"]["reason"] == "PodDeleted" and st["preemptions"] == 1
    wait_pod(apis, ns, "gone-a2")


def test_an_apiserver_gone_silent_holds_no_reconcile_for_good(
    kube: Any, apis: tuple[Any, Any], crd: None, tmp_path: Path
) -> None:
    """The apiserver stops answering on the connections the operator holds, without closing them (a
    network fault, an apiserver restarted behind a load balancer), for a few seconds; meanwhile a pod is
    deleted. Once it answers new connections again, the operator sees the deletion and starts the next
    attempt: each request waited ``--api-timeout-seconds`` at most. Without a timeout the reconcile
    waits on its dead connection for ever, and the job with it."""
    core, custom = apis
    namespace = new_namespace(core, "silent")  # an operator of its own, through the link
    server = urlsplit(kube.server)
    with SilentLink((server.hostname or "127.0.0.1", server.port or 443)) as link:
        config = json.loads(kube.kubeconfig.read_text())  # written as JSON
        config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{link.port}"
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(json.dumps(config))
        kubeconfig.chmod(0o600)
        args = ["-n", namespace, "--image", IMAGE, "--native-sidecar", "off", "--resync-seconds", "0.5"]
        args += ["--checkpoint-poll-seconds", "1", "--api-timeout-seconds", "2"]
        op = OperatorProcess(args, env={"KUBECONFIG": str(kubeconfig)}, log_path=tmp_path / "operator.log")
        try:
            with op:
                create_job(apis, namespace, no_node_job("quiet", f"file://{tmp_path}"))
                wait_pod(apis, namespace, "quiet-a1")
                wait_status(apis, namespace, "quiet", "pending", lambda s: s.get("phase") == "Pending")
                link.silence()
                core.delete_namespaced_pod("quiet-a1", namespace, grace_period_seconds=0)
                time.sleep(4)  # reconciles every half second, each on a dead connection
                link.speak()
                st = wait_status(
                    apis,
                    namespace,
                    "quiet",
                    "attempt 2",
                    lambda s: s.get("attempt") == 2,
                    timeout=60,
                    describe=lambda: op.log_tail(30),
                )
                assert st["lastPodEnd"]["reason"] == "PodDeleted", st["lastPodEnd"]
                wait_pod(apis, namespace, "quiet-a2")
        finally:
            # kopf's own watches may still wait on dead connections: the finalizer is taken off by hand.
            with contextlib.suppress(ApiException):
                custom.patch_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, "quiet", {"metadata": {"finalizers": None}}
                )
            with contextlib.suppress(ApiException):
                custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "quiet")
            core.delete_namespace(namespace)


def test_vanished_node_is_a_preemption_at_once(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    core, _ = apis
    node = f"h4-spot-{uuid.uuid4().hex[:6]}"
    label = {"spotguard.dev/test-node-for": node}
    core.create_node(
        {
            "metadata": {"name": node, "labels": label},
            "status": {
                "capacity": {"cpu": "4", "memory": "8Gi", "pods": "10", "nvidia.com/gpu": "1"},
                "allocatable": {"cpu": "4", "memory": "8Gi", "pods": "10", "nvidia.com/gpu": "1"},
            },
        }
    )
    try:
        core.patch_node_status(
            node,
            {
                "status": {
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "reason": "KubeletReady",
                            "message": "ready",
                            "lastHeartbeatTime": "2030-01-01T00:00:00Z",
                            "lastTransitionTime": "2030-01-01T00:00:00Z",
                        }
                    ]
                }
            },
        )
        body = no_node_job("lost", f"file://{tmp_path}")
        body["spec"]["template"]["spec"]["nodeSelector"] = label
        create_job(apis, ns, body)
        wait_for(lambda: core.read_namespaced_pod("lost-a1", ns).spec.node_name == node, "binding to the node")
        run_pod(apis, ns, "lost-a1")
        wait_status(apis, ns, "lost", "Running", lambda s: s.get("phase") == "Running")
    finally:
        core.delete_node(node)
    # Preempted at once (not after the pod GC's ~50 s), and the orphan removed.
    st = wait_status(apis, ns, "lost", "attempt 2", lambda s: s.get("attempt") == 2, timeout=30)
    assert st["lastPodEnd"]["reason"] == "NodeLost" and st["preemptions"] == 1
    wait_for(lambda: "lost-a1" not in pod_names(apis, ns, "lost"), "the orphan pod to be deleted", timeout=30)


def test_suspend_and_resume(apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path) -> None:
    _, custom = apis
    create_job(apis, ns, no_node_job("pause", f"file://{tmp_path}"))
    wait_pod(apis, ns, "pause-a1")
    # Suspended once the status names the attempt (a suspend before that: the test after this one).
    wait_status(apis, ns, "pause", "attempt 1", lambda s: s.get("attempt") == 1)
    custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "pause", {"spec": {"suspend": True}})
    st = wait_status(apis, ns, "pause", "Suspended", lambda s: s.get("phase") == "Suspended")
    assert st["preemptions"] == 0 and st["failures"] == 0 and cond(st, "Suspended")["status"] == "True"
    wait_for(lambda: pod_names(apis, ns, "pause") == [], "the pod to be stopped")
    custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "pause", {"spec": {"suspend": False}})
    wait_pod(apis, ns, "pause-a2")
    st = wait_status(apis, ns, "pause", "resumed", lambda s: cond(s, "Suspended").get("status") == "False")
    assert st["attempt"] == 2 and st["preemptions"] == 0


def test_a_suspend_stops_a_pod_whose_creation_the_status_lost(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    core, custom = apis
    body = no_node_job("stray", f"file://{tmp_path}")
    body["spec"]["suspend"] = True
    job = create_job(apis, ns, body)
    wait_status(apis, ns, "stray", "Suspended", lambda s: s.get("phase") == "Suspended")
    # What a look leaves when its status write is lost to a conflict: attempt 1's pod, the status at 0.
    stray = build_pod("stray", ns, job["metadata"]["uid"], parse(job["spec"]), 1, OperatorConfig(image=IMAGE))
    core.create_namespaced_pod(ns, stray)
    wait_for(lambda: pod_names(apis, ns, "stray") == [], "the suspended job's stray pod to be stopped", timeout=30)
    assert get_job(apis, ns, "stray")["status"]["attempt"] == 0
    custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "stray", {"spec": {"suspend": False}})
    wait_pod(apis, ns, "stray-a1")
    st = wait_status(apis, ns, "stray", "attempt 1", lambda s: s.get("attempt") == 1)
    assert st["preemptions"] == 0 and st["failures"] == 0


def test_verified_checkpoint_reported_and_kept_after_delete(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    from spotguard.checkpoint import snapshot_state, upload_checkpoint, write_checkpoint
    from spotguard.storage import open_storage

    core, custom = apis
    create_job(apis, ns, no_node_job("keep", f"file://{tmp_path}/store"))
    wait_pod(apis, ns, "keep-a1")
    remote = tmp_path / "store" / ns / "keep"
    local = write_checkpoint(tmp_path / "local", 30, snapshot_state({"step": 30}))
    upload_checkpoint(local, open_storage(f"file://{remote}"))
    st = wait_status(
        apis, ns, "keep", "lastVerifiedCheckpoint", lambda s: (s.get("lastVerifiedCheckpoint") or {}).get("step") == 30
    )
    assert st["lastVerifiedCheckpoint"]["uri"].endswith("/keep/ckpt-000000000030")
    wait_for(
        lambda: (
            metric_value(
                operator.metrics(), "spotguard_job_last_verified_step", {"namespace": ns, "trainingjob": "keep"}
            )
            == 30.0
        ),
        "the last verified step metric",
    )

    custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "keep")
    wait_for(lambda: pod_names(apis, ns, "keep") == [], "the job's pods to be deleted")
    wait_for(
        lambda: (
            metric_value(operator.metrics(), "spotguard_job_attempt", {"namespace": ns, "trainingjob": "keep"}) is None
        ),
        "the job's series to be removed",
    )
    assert (remote / "ckpt-000000000030" / "manifest.json").is_file()  # checkpoints are never deleted


def test_operator_restart_mid_preemption_creates_no_duplicate(
    apis: tuple[Any, Any], kube: Any, crd: None, tmp_path: Path
) -> None:
    core, _ = apis
    ns2 = new_namespace(core, "oprestart")
    op = start_operator(kube, ns2, tmp_path / f"operator-{ns2}.log")
    try:
        job = create_job(apis, ns2, no_node_job("again", f"file://{tmp_path}/store"))
        wait_pod(apis, ns2, "again-a1")
        wait_status(apis, ns2, "again", "attempt 1", lambda s: s.get("attempt") == 1)
        # Crash while a preemption happens: the pod ends while no operator runs.
        op.kill()
        shutdown_pod(apis, ns2, "again-a1")
        op.start()
        st = wait_status(apis, ns2, "again", "attempt 2", lambda s: s.get("attempt") == 2)
        assert st["preemptions"] == 1
        # Crash between creating the next pod and recording it: the pod exists, the status lags.
        op.kill()
        shutdown_pod(apis, ns2, "again-a2")
        spec = parse(job["spec"])
        early = build_pod("again", ns2, job["metadata"]["uid"], spec, 3, OperatorConfig(image=IMAGE))
        core.create_namespaced_pod(ns2, early)
        op.start()
        st = wait_status(apis, ns2, "again", "attempt 3", lambda s: s.get("attempt") == 3)
        assert st["preemptions"] == 2
        # Several resyncs later, still exactly one pod per attempt.
        wait_status(apis, ns2, "again", "a resync", lambda s: s.get("phase") == "Pending")
        assert pod_names(apis, ns2, "again") == ["again-a1", "again-a2", "again-a3"]
        assert "already existed: adopted" in op.log_path.read_text()
        delete_jobs(apis, ns2, pods=False)
    finally:
        op.stop()
        print(f"--- operator log ---\n{op.log_tail(40)}")
        core.delete_namespace(ns2)


# --- notices, start problems, the storage probe -----------------------------------


def pod_token(core: Any, ns: str, account: str, pod: Any | None, audience: str = notice_relay.AUDIENCE) -> str:
    """A token as kubelet's projected serviceAccountToken volume gets it: TokenRequest bound to the pod."""
    spec: dict[str, Any] = {"audiences": [audience], "expirationSeconds": 600}
    if pod is not None:
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": pod.metadata.name, "uid": pod.metadata.uid}
    return str(core.create_namespaced_service_account_token(account, ns, {"spec": spec}).status.token)


def relay(
    op: OperatorProcess, token: str | None, path: str = notice_relay.POD_PATH, body: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any]]:
    """Ask the operator's notice relay as a sidecar would (its HTTP client): (status, JSON answer)."""
    import json

    from spotguard.sidecar.notices import http_request

    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    data = json.dumps(body).encode() if body is not None else None
    resp = http_request(
        f"http://127.0.0.1:{op.liveness_port}{path}",
        method="POST" if data else "GET",
        headers=headers,
        data=data,
        timeout=10,
    )
    return resp.status, json.loads(resp.body)


def plain_pod(core: Any, ns: str, name: str, labels: dict[str, str]) -> Any:
    """A pod no node takes (only its identity matters)."""
    return core.create_namespaced_pod(
        ns,
        {
            "metadata": {"name": name, "labels": labels},
            "spec": {"nodeSelector": NO_NODE, "containers": [{"name": "c", "image": "busybox", "command": ["true"]}]},
        },
    )


def test_k8s_notices_a_pod_learns_only_its_own_disruption_through_the_operator(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    """The operator makes no ServiceAccount and no RoleBinding: the pod keeps its template's account and its
    sidecar asks the operator, with the pod's bound token, for that pod's disruption state, and nothing else."""
    from kubernetes import client

    from spotguard.sidecar.events import REASON_METRICS_PORT_UNAVAILABLE, post_pod_event
    from spotguard.sidecar.notices import KubernetesDisruptionNotices

    core, _ = apis
    rbac = client.RbacAuthorizationV1Api(core.api_client)
    # The template's own account, with the k8s source (refused by earlier releases).
    core.create_namespaced_service_account(ns, {"metadata": {"name": "trainer-sa"}})
    wait_for(lambda: core.read_namespaced_service_account("trainer-sa", ns).secrets, "trainer-sa's token", timeout=60)
    body = no_node_job(
        "notice",
        f"file://{tmp_path}/store",
        preemption={"maxPreemptions": 3, "gracePeriodSeconds": 5, "notices": ["k8s", "aws"]},
    )
    body["spec"]["template"]["spec"]["serviceAccountName"] = "trainer-sa"
    create_job(apis, ns, body)
    create_job(apis, ns, no_node_job("other", f"file://{tmp_path}/store", preemption={"notices": ["k8s"]}))
    pod, other = wait_pod(apis, ns, "notice-a1"), wait_pod(apis, ns, "other-a1")
    assert pod.spec.service_account_name == "trainer-sa" and other.spec.service_account_name == "default"
    sidecar = next(c for c in pod.spec.containers if c.name == "spotguard-sidecar")
    assert {e.name: e.value for e in sidecar.env}["SPOTGUARD_NOTICES"] == "k8s,aws"
    assert sorted(a.metadata.name for a in core.list_namespaced_service_account(ns).items) == ["default", "trainer-sa"]
    assert rbac.list_namespaced_role_binding(ns).items == [] and rbac.list_namespaced_role(ns).items == []

    token = pod_token(core, ns, "trainer-sa", pod)
    other_token = pod_token(core, ns, "default", other)
    status, view = relay(operator, token)
    assert status == 200, view
    assert view == {
        "metadata": {"uid": pod.metadata.uid, "deletionTimestamp": None},
        "spec": {"terminationGracePeriodSeconds": 5, "nodeName": None},
        "status": {"conditions": view["status"]["conditions"]},
    }
    assert all(c["type"] != "DisruptionTarget" for c in view["status"]["conditions"])
    # Each token answers for its own pod only.
    status, seen = relay(operator, other_token)
    assert status == 200 and seen["metadata"]["uid"] == other.metadata.uid != pod.metadata.uid

    # The sidecar's source, polling the relay with the token file as mounted.
    token_file = tmp_path / "token"
    token_file.write_text(token)
    source = KubernetesDisruptionNotices(
        None,
        None,
        relay_url=f"http://127.0.0.1:{operator.liveness_port}{notice_relay.POD_PATH}",
        token_file=str(token_file),
    )
    assert source.poll() is None and source.last_error is None
    core.patch_namespaced_pod_status(
        "notice-a1",
        ns,
        {
            "status": {
                "conditions": [
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "reason": "TerminationByKubelet",
                        "message": "Pod was terminated in response to imminent node shutdown.",
                    }
                ]
            }
        },
    )
    notice = wait_for(source.poll, "the DisruptionTarget through the relay", timeout=20)
    assert notice.key == f"k8s:{pod.metadata.uid}:TerminationByKubelet" and notice.preempt
    assert notice.deadline is not None and notice.deadline > 0
    assert token not in str(source.last_error)
    status, seen = relay(operator, other_token)
    assert all(c["type"] != "DisruptionTarget" for c in seen["status"]["conditions"])

    # Refused: no token, not a token, the apiserver's audience, a token bound to no pod, a pod not
    # spotguard's, a namespace not served, a pod gone.
    assert relay(operator, None)[0] == 401
    assert relay(operator, "not-a-token")[0] == 401
    assert relay(operator, pod_token(core, ns, "trainer-sa", pod, audience="https://kubernetes.default.svc"))[0] == 401
    assert relay(operator, pod_token(core, ns, "trainer-sa", None)) == (
        403,
        {"error": "the token is not bound to a pod: use a projected serviceAccountToken volume of the pod"},
    )
    stranger = plain_pod(core, ns, "stranger", {"app": "web"})
    status, answer = relay(operator, pod_token(core, ns, "default", stranger))
    assert status == 403 and "not spotguard's" in answer["error"]
    elsewhere = plain_pod(core, "default", f"elsewhere-{uuid.uuid4().hex[:6]}", {"spotguard.dev/job": "x"})
    try:
        status, answer = relay(operator, pod_token(core, "default", "default", elsewhere))
        assert (status, answer["error"]) == (403, "namespace default is not served by this operator")
    finally:
        core.delete_namespaced_pod(elsewhere.metadata.name, "default", grace_period_seconds=0)
    stray = plain_pod(core, ns, "stray", {"spotguard.dev/job": "stray"})
    stray_token = pod_token(core, ns, "default", stray)
    assert relay(operator, stray_token)[0] == 200
    core.delete_namespaced_pod("stray", ns, grace_period_seconds=0)
    wait_for(lambda: relay(operator, stray_token)[0] in (401, 404), "the gone pod's token to be refused", timeout=15)

    # Events: one of the fixed reasons, on the caller's own pod, through the sidecar's client.
    env = {
        "SPOTGUARD_NOTICE_URL": f"http://127.0.0.1:{operator.liveness_port}{notice_relay.POD_PATH}",
        "SPOTGUARD_NOTICE_TOKEN_FILE": str(token_file),
    }
    assert post_pod_event(REASON_METRICS_PORT_UNAVAILABLE, "cannot serve metrics on :9400", env) is True
    posted = wait_for(
        lambda: [
            e
            for e in core.list_namespaced_event(ns, field_selector="involvedObject.name=notice-a1").items
            if e.reason == REASON_METRICS_PORT_UNAVAILABLE
        ],
        "the relayed Event",
    )
    assert [(e.type, e.message, e.involved_object.uid) for e in posted] == [
        ("Warning", "cannot serve metrics on :9400", pod.metadata.uid)
    ]
    assert relay(operator, token, notice_relay.EVENT_PATH, {"reason": REASON_METRICS_PORT_UNAVAILABLE})[0] == 429
    assert relay(operator, other_token, notice_relay.EVENT_PATH, {"reason": "Killing", "message": "x"})[0] == 400
    assert token not in operator.log_tail(400) and other_token not in operator.log_tail(400)
    for name in ("stranger",):
        core.delete_namespaced_pod(name, ns, grace_period_seconds=0)


def test_unknown_notice_source_is_refused_by_the_schema(
    apis: tuple[Any, Any], ns: str, crd: None, tmp_path: Path
) -> None:
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as err:
        create_job(apis, ns, no_node_job("badnotice", f"file://{tmp_path}", preemption={"notices": ["aws", "ibm"]}))
    assert err.value.status == 422 and "spec.preemption.notices" in err.value.body


def waiting(container: str, reason: str, message: str) -> dict[str, Any]:
    """A container kubelet cannot start, as kubelet reports it."""
    return {
        "name": container,
        "ready": False,
        "restartCount": 0,
        "image": "spotguard:test",
        "imageID": "",
        "state": {"waiting": {"reason": reason, "message": message}},
    }


def test_pod_that_cannot_start_is_reported_on_the_job(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    core, _ = apis
    create_job(
        apis,
        ns,
        no_node_job(
            "nosecret",
            "s3://bucket/jobs",
            checkpoint={"storage": "s3://bucket/jobs", "credentialsSecret": {"name": "absent"}},
        ),
    )
    wait_pod(apis, ns, "nosecret-a1")
    wait_status(apis, ns, "nosecret", "attempt 1", lambda s: s.get("attempt") == 1)
    # As kubelet reports a missing Secret (CreateContainerConfigError), on the restore init container.
    patch_pod_status(
        apis,
        ns,
        "nosecret-a1",
        {
            "phase": "Pending",
            "initContainerStatuses": [
                waiting("spotguard-restore", "CreateContainerConfigError", 'secret "absent" not found')
            ],
        },
    )
    st = wait_status(apis, ns, "nosecret", "PodBlocked", lambda s: cond(s, "PodBlocked").get("status") == "True")
    blocked = cond(st, "PodBlocked")
    assert blocked["reason"] == "CreateContainerConfigError"
    assert 'secret "absent" not found' in blocked["message"] and "create it" in blocked["message"]
    assert st["phase"] == "Pending" and st["failures"] == 0 and st["preemptions"] == 0
    wait_events(apis, ns, "nosecret", {"CreateContainerConfigError"})
    warning = [(t, m) for t, r, m in events(apis, ns, "nosecret") if r == "CreateContainerConfigError"]
    assert warning == [("Warning", blocked["message"])]

    # A bad image next (reason changes: a new Event), then the pod runs (the condition clears).
    patch_pod_status(
        apis,
        ns,
        "nosecret-a1",
        {
            "initContainerStatuses": [terminated("spotguard-restore", 0)],
            "containerStatuses": [waiting("trainer", "ImagePullBackOff", 'Back-off pulling image "trainer:1"')],
        },
    )
    wait_status(
        apis, ns, "nosecret", "ImagePullBackOff", lambda s: cond(s, "PodBlocked").get("reason") == "ImagePullBackOff"
    )
    wait_events(apis, ns, "nosecret", {"ImagePullBackOff"})
    core.patch_namespaced_pod_status(
        "nosecret-a1",
        ns,
        {
            "status": {
                "phase": "Running",
                "containerStatuses": [
                    {
                        "name": "trainer",
                        "ready": True,
                        "restartCount": 0,
                        "image": "trainer:1",
                        "imageID": "",
                        "state": {"running": {"startedAt": "2030-01-01T00:00:00Z"}},
                    }
                ],
            }
        },
    )
    st = wait_status(apis, ns, "nosecret", "unblocked", lambda s: cond(s, "PodBlocked").get("status") == "False")
    assert st["phase"] == "Running" and cond(st, "PodBlocked")["reason"] == "Unblocked"


def upload_verified(tmp_path: Path, remote: Path, step: int) -> None:
    from spotguard.checkpoint import snapshot_state, upload_checkpoint, write_checkpoint
    from spotguard.storage import open_storage

    local = write_checkpoint(tmp_path / f"local-{step}", step, snapshot_state({"step": step}))
    upload_checkpoint(local, open_storage(f"file://{remote}"))


def test_no_read_checkpoints_reads_no_secret_and_no_store(
    apis: tuple[Any, Any], kube: Any, crd: None, tmp_path: Path
) -> None:
    core, _ = apis
    ns2 = new_namespace(core, "noread")
    # A verified checkpoint the operator would report if it read storage.
    upload_verified(tmp_path, tmp_path / "store" / ns2 / "quiet", 30)
    op = start_operator(kube, ns2, tmp_path / "operator.log", extra_args=["--no-read-checkpoints"])
    try:
        create_job(apis, ns2, no_node_job("quiet", f"file://{tmp_path}/store"))
        wait_pod(apis, ns2, "quiet-a1")
        run_pod(apis, ns2, "quiet-a1")
        succeed_pod(apis, ns2, "quiet-a1")
        st = wait_status(apis, ns2, "quiet", "Succeeded", lambda s: s.get("phase") == "Succeeded")
        assert "lastVerifiedCheckpoint" not in st
        text = op.metrics()
        for result in ("ok", "error"):
            assert metric_value(text, "spotguard_operator_storage_reads_total", {"result": result}) is None
        log = op.log_path.read_text()
        assert "not reading checkpoints" in log and "cannot read its checkpoints" not in log
        delete_jobs(apis, ns2, pods=False)
    finally:
        op.stop()
        print(f"--- operator log ---\n{op.log_tail(40)}")
        core.delete_namespace(ns2)


def test_final_checkpoint_is_recorded_after_success(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    create_job(apis, ns, no_node_job("final", f"file://{tmp_path}/store"))
    wait_pod(apis, ns, "final-a1")
    run_pod(apis, ns, "final-a1")
    wait_status(apis, ns, "final", "Running", lambda s: s.get("phase") == "Running")
    # The sidecar ships the last checkpoint just before the pod ends.
    upload_verified(tmp_path, tmp_path / "store" / ns / "final", 99)
    succeed_pod(apis, ns, "final-a1")
    st = wait_status(
        apis,
        ns,
        "final",
        "Succeeded with step 99",
        lambda s: s.get("phase") == "Succeeded" and (s.get("lastVerifiedCheckpoint") or {}).get("step") == 99,
    )
    assert st["lastVerifiedCheckpoint"]["uri"].endswith("/final/ckpt-000000000099")
    assert (metric_value(operator.metrics(), "spotguard_operator_storage_reads_total", {"result": "ok"}) or 0) >= 1


def test_probe_reuses_one_client_per_job_settles_and_forgets(apis: tuple[Any, Any], crd: None, tmp_path: Path) -> None:
    from spotguard.operator import kubeapi as rc
    from spotguard.operator.metrics import OperatorMetrics
    from spotguard.operator.probe import CheckpointProbe
    from spotguard.storage import open_storage

    core, custom = apis
    ns2 = new_namespace(core, "probe")  # no operator watches it: only this probe reads
    ctx = rc.Context(core=core, custom=custom, config=OperatorConfig(image=IMAGE), metrics=OperatorMetrics())
    opened: list[str] = []

    def counting_open(uri: str, **options: Any) -> Any:
        opened.append(uri)
        return open_storage(uri, **options)

    probe = CheckpointProbe(ctx, workers=1, open_storage=counting_open)
    try:
        create_job(apis, ns2, no_node_job("p", f"file://{tmp_path}/store"))
        create_job(
            apis,
            ns2,
            no_node_job(
                "q", "s3://bucket/x", checkpoint={"storage": "s3://bucket/x", "credentialsSecret": {"name": "absent"}}
            ),
        )
        remote = tmp_path / "store" / ns2 / "p"
        assert probe.probe_once(ns2, "p") == "unchanged"  # nothing verified yet
        upload_verified(tmp_path, remote, 10)
        assert probe.probe_once(ns2, "p") == "changed"
        assert (ctx.verified.get(ns2, "p") or {}).get("step") == 10
        assert probe.probe_once(ns2, "p") == "unchanged"
        upload_verified(tmp_path, remote, 20)
        assert probe.probe_once(ns2, "p") == "changed"
        assert opened == [f"file://{remote}"]  # one client for every read of the job
        assert probe.clients() == 1

        assert probe.probe_once(ns2, "q") == "error"
        assert probe.errors[(ns2, "q")] == "the credentials Secret was not found"

        # A finished job: read once more, then no client is kept and no more reads are needed.
        rc.patch_status(ctx, get_job(apis, ns2, "p"), {"phase": "Succeeded"})
        assert probe.probe_once(ns2, "p") == "settled"
        assert probe.clients() == 0 and (ctx.verified.get(ns2, "p") or {}).get("step") == 20

        # A deleted job: its error and cache entry go.
        custom.delete_namespaced_custom_object(GROUP, VERSION, ns2, PLURAL, "q")
        wait_for(lambda: probe.probe_once(ns2, "q") == "gone", "q to be gone")
        assert (ns2, "q") not in probe.errors and ctx.verified.get(ns2, "q") is None
        text = ctx.metrics.registry.get_sample_value("spotguard_operator_storage_clients")
        assert text == 0.0
    finally:
        probe.shutdown()
        core.delete_namespace(ns2)


class SilentStore:
    """A TCP endpoint that accepts connections and never answers: a hung object store."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[Any] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def test_pod_end_is_handled_while_the_store_hangs(apis: tuple[Any, Any], kube: Any, crd: None, tmp_path: Path) -> None:
    core, _ = apis
    ns2 = new_namespace(core, "hung")
    store = SilentStore()
    core.create_namespaced_secret(
        ns2, {"metadata": {"name": "s3"}, "stringData": {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}}
    )
    op = start_operator(kube, ns2, tmp_path / "operator.log", extra_args=["--probe-workers", "2"])
    # More jobs than a default thread pool has threads (min(32, cores + 4)), each probe hanging on the store.
    jobs = [f"h{i}" for i in range(36)]
    try:
        for name in jobs:
            create_job(
                apis,
                ns2,
                no_node_job(
                    name,
                    "s3://bucket/jobs",
                    checkpoint={
                        "storage": "s3://bucket/jobs",
                        "endpoint": store.url,
                        "credentialsSecret": {"name": "s3"},
                    },
                ),
            )
        wait_for(lambda: len(store.conns) >= 2, "the probes to reach the hung store", timeout=60)
        for name in jobs[:3]:
            wait_pod(apis, ns2, f"{name}-a1")
            shutdown_pod(apis, ns2, f"{name}-a1")
        for name in jobs[:3]:
            st = wait_status(apis, ns2, name, "attempt 2 while the store hangs", lambda s: s.get("attempt") == 2)
            assert st["preemptions"] == 1
            wait_pod(apis, ns2, f"{name}-a2")
        delete_jobs(apis, ns2, pods=False)
    finally:
        op.stop()
        print(f"--- operator log ---\n{op.log_tail(40)}")
        store.close()
        core.delete_namespace(ns2)


def test_probe_shares_one_s3_client_between_jobs_with_the_same_credentials(
    apis: tuple[Any, Any], crd: None, s3_store: Any, tmp_path: Path
) -> None:
    from spotguard.operator import kubeapi as rc
    from spotguard.operator.metrics import OperatorMetrics
    from spotguard.operator.probe import CheckpointProbe

    core, custom = apis
    ns2 = new_namespace(core, "probe-s3")  # no operator watches it: only this probe reads
    core.create_namespaced_secret(
        ns2,
        {
            "metadata": {"name": "s3"},
            "stringData": {
                "AWS_ACCESS_KEY_ID": s3_store.access_key,
                "AWS_SECRET_ACCESS_KEY": s3_store.secret_key,
                "AWS_ENDPOINT_URL": s3_store.endpoint_url,
            },
        },
    )
    ctx = rc.Context(core=core, custom=custom, config=OperatorConfig(image=IMAGE), metrics=OperatorMetrics())
    probe = CheckpointProbe(ctx, workers=1, allowed_endpoints=("127.0.0.1",))  # the Secret names the test store
    storage = f"s3://{s3_store.bucket}/probe-{ns2}"
    try:
        for name in ("a", "b", "c"):
            create_job(
                apis,
                ns2,
                no_node_job(name, storage, checkpoint={"storage": storage, "credentialsSecret": {"name": "s3"}}),
            )
        for _ in range(2):
            for name in ("a", "b", "c"):
                assert probe.probe_once(ns2, name) == "unchanged", probe.errors
        assert probe.clients() == 3 and probe.connections() == 1
        for name in ("a", "b", "c"):
            custom.delete_namespaced_custom_object(GROUP, VERSION, ns2, PLURAL, name)
            wait_for(lambda n=name: probe.probe_once(ns2, n) == "gone", f"{name} to be gone")
        assert probe.clients() == 0 and probe.connections() == 0
    finally:
        probe.shutdown()
        core.delete_namespace(ns2)


def test_a_status_write_outlives_a_change_of_metadata_alone(apis: tuple[Any, Any], crd: None, tmp_path: Path) -> None:
    """A job's first look races the operator's finalizer and annotations, added to every new job: the
    look's status write is made again at the job's new version, so the look is not redone (a redone
    look after its pod was deleted made the pod again and never counted the deletion). A status or
    spec written meanwhile is still a changed job: the look is made again."""
    from spotguard.operator import kubeapi as rc
    from spotguard.operator.metrics import OperatorMetrics

    core, custom = apis
    ns2 = new_namespace(core, "status")  # no operator watches it
    ctx = rc.Context(core=core, custom=custom, config=OperatorConfig(image=IMAGE), metrics=OperatorMetrics())
    try:
        create_job(apis, ns2, no_node_job("m", f"file://{tmp_path}/store"))
        read = get_job(apis, ns2, "m")
        patch = {"metadata": {"annotations": {"example.com/touched": "yes"}, "finalizers": ["example.com/held"]}}
        custom.patch_namespaced_custom_object(GROUP, VERSION, ns2, PLURAL, "m", patch)
        rc.patch_status(ctx, read, {"phase": "Pending", "attempt": 1})
        assert get_job(apis, ns2, "m")["status"] == {"phase": "Pending", "attempt": 1}

        read = get_job(apis, ns2, "m")
        rc.patch_status(ctx, get_job(apis, ns2, "m"), {"attempt": 2})  # another look's write
        with pytest.raises(rc.JobChanged):
            rc.patch_status(ctx, read, {"attempt": 3})
        read = get_job(apis, ns2, "m")
        custom.patch_namespaced_custom_object(GROUP, VERSION, ns2, PLURAL, "m", {"spec": {"suspend": True}})
        with pytest.raises(rc.JobChanged):
            rc.patch_status(ctx, read, {"attempt": 3})
        assert get_job(apis, ns2, "m")["status"]["attempt"] == 2
    finally:
        custom.patch_namespaced_custom_object(GROUP, VERSION, ns2, PLURAL, "m", {"metadata": {"finalizers": None}})
        core.delete_namespace(ns2)
