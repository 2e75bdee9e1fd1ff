"""End to end on real nodes: the chart installed by ``helm install``, its images pulled from a registry.

The promises of ``tests/e2e/test_operator_e2e.py``, shown where a kubelet
(v1.20, containerd, runc, CNI) runs the pods instead of the process node's
stand-in: the operator's two replicas are pods on nodes of their own, talking
to the apiserver through the ``kubernetes`` Service address with their
ServiceAccount; the training pods run the ``spotguard-torch`` image; the
sidecar uploads to the S3 store on the host; the DDP example's gang of two pods
meets at rank 0's stable name through the node set's cluster DNS. Spot deaths
are the real ones: ``kubectl drain``, the eviction API, a pod delete, and a node
lost with its kubelet, containerd and containers (``RealNodes.kill``). The nodes
are the session's shared set (``testenv.pytest_realnodes``); a lost node gets a
replacement, as a spot pool scales back up. The webhook on real nodes has a
module of its own (``tests/e2e/test_realnode_webhook.py``): here the chart's
webhooks stay off, as in the dev values.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from spotguard.operator.leader import LOST_EXIT_CODE, pod_of
from spotguard.operator.podbuilder import ANNOTATION_OPERATOR_INSTANCE
from spotguard.operator.spec import RESTORE_CONTAINER, SIDECAR_CONTAINER
from spotguard.operator.testing import free_ports, wait_for
from testenv import trials
from testenv.e2e import (
    DDP_EXAMPLE,
    DEV_VALUES,
    GANG_STEPS,
    GROUP,
    OPERATOR_NS,
    PLURAL,
    RELEASE,
    VERSION,
    LogFollower,
    RealNodeEnv,
    assert_final_bitwise,
    container_cgroup,
    create_bucket_and_secret,
    delete_jobs,
    example,
    final_digest,
    freeze,
    helm_install,
    last_step,
    leader,
    operator_pods,
    preempted_after,
    process_status,
    reference_ddp_digest,
    resumed_from,
    set_steps,
    verified_step,
)
from testenv.kubetest import audit_writes
from testenv.pytest_realnodes import ensure_real_nodes
from testenv.realnode import RealNodes
from testenv.realnode.config import BUSYBOX_IMAGE
from testenv.require import missing

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

#: Two for the operator's replicas, two for training (a lost node gets a replacement, as a spot pool does).
NODES = 4
#: Where the operator's replicas run: nodes labelled so, one replica each.
OPERATOR_ROLE = "spotguard-test/role"
SERVICES_HINT = (
    "pods on real nodes reach the apiserver (10.0.0.1:443) and the host's services through the node set's "
    "host-service proxy (testenv/realnode)"
)


def probe_pod(name: str, script: str, node: str) -> dict[str, Any]:
    container = {"name": "probe", "image": BUSYBOX_IMAGE, "command": ["sh", "-c", script]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "nodeName": node, "containers": [container]},
    }


def require_pod_services(e: RealNodeEnv, node: str) -> None:
    """The operator's pods call the API at 10.0.0.1:443: without the route there, nothing here can run."""
    name = f"apiserver-probe-{uuid.uuid4().hex[:6]}"
    e.core.create_namespaced_pod(e.ns, probe_pod(name, "nc -w 5 10.0.0.1 443 </dev/null", node))

    def ended() -> str | None:
        phase = e.core.read_namespaced_pod(name, e.ns).status.phase
        return str(phase) if phase in ("Succeeded", "Failed") else None

    phase = wait_for(ended, "the apiserver probe pod to end", timeout=120, interval=0.5)
    e.core.delete_namespaced_pod(name, e.ns, grace_period_seconds=0)
    if phase != "Succeeded":
        missing("a pod on a real node cannot reach the apiserver at 10.0.0.1:443", SERVICES_HINT)


def chart_values(e: RealNodeEnv, registry: Any, metrics_port: int, liveness_port: int) -> Path:
    """The values a user on this cluster gives: the registry, two replicas on nodes of their own, and
    the dev values' rule that keeps them off the training pods' nodes."""
    tag = registry.refs["spotguard"].rsplit(":", 1)[1]
    dev = yaml.safe_load(DEV_VALUES.read_text())
    anti = dev["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    anti[0]["namespaces"] = [e.ns]
    # One replica a node: freezing one must leave the other running.
    operator_label = {"app.kubernetes.io/component": "operator"}
    anti.append({"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": operator_label}})
    # The dev values' webhook setting stays (off): the webhooks on real nodes have a module of their own
    # (test_realnode_webhook.py).
    dev.update(
        {
            "image": {"registry": registry.address, "tag": tag},
            "replicaCount": 2,
            "nodeSelector": {OPERATOR_ROLE: "operator"},
            "metrics": {"address": "0.0.0.0", "port": metrics_port},
            "liveness": {"address": "0.0.0.0", "port": liveness_port},
            "operator": {
                **dev["operator"],
                "watchNamespaces": [e.ns],
                "resyncSeconds": 2,
                "checkpointPollSeconds": 1,
            },
        }
    )
    path = e.log_dir / "values.yaml"
    path.write_text(yaml.safe_dump(dev))
    return path


@pytest.fixture(scope="module")
def world(
    kube: Any,
    s3_store: Any,
    image_registry: Any,
    real_nodes: RealNodes,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RealNodeEnv]:
    """The session's real nodes (``NODES`` of them) pulling from the registry with both images, a namespace,
    and its pods' logs followed."""
    from kubernetes import client

    log_dir = tmp_path_factory.mktemp("realnode-e2e")
    api = kube.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ensure_real_nodes(real_nodes, NODES)
    ns = f"rn-e2e-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    follower = LogFollower(kube, core, [ns, OPERATOR_NS], log_dir / "logs")
    metrics_port = free_ports(1)[0]
    e = RealNodeEnv(kube, core, custom, ns, metrics_port, s3_store, real_nodes, log_dir, follower=follower)
    e.images = dict(image_registry.refs)
    try:
        wait_for(lambda: core.read_namespaced_service_account("default", ns).secrets, "the token", timeout=60)
        yield e
    finally:
        core.delete_namespace(ns)
        follower.stop()


@pytest.fixture(scope="module")
def env(world: RealNodeEnv, image_registry: Any) -> Iterator[RealNodeEnv]:
    """The chart installed by Helm on ``world``: two operator replicas on nodes of their own, the images
    from the registry, the bucket and Secret as examples/dev-setup.sh makes them."""
    e = world
    operator_nodes = e.nodes.node_names()[:2]
    for name in operator_nodes:
        e.core.patch_node(name, {"metadata": {"labels": {OPERATOR_ROLE: "operator"}}})
    require_pod_services(e, e.nodes.node_names()[0])
    create_bucket_and_secret(e.core, e.s3, e.ns)
    liveness_port = free_ports(1)[0]
    try:
        helm_install(e, chart_values(e, image_registry, e.metrics_port, liveness_port))
        wait_for(lambda: two_replicas_one_leader(e), "two operator replicas, one leading", timeout=300, interval=1)
        yield e
    finally:
        delete_jobs(e)
        for p in e.core.list_namespaced_pod(OPERATOR_NS).items:
            log = e.container_log(OPERATOR_NS, p.metadata.name, "operator")
            print(f"--- operator log ({p.metadata.name}) ---\n" + "\n".join(log.splitlines()[-60:]))
        e.tool("helm", "uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait", check=False)
        for name in set(operator_nodes) & set(e.nodes.node_names()):  # the nodes go on serving other modules
            e.core.patch_node(name, {"metadata": {"labels": {OPERATOR_ROLE: None}}})


def two_replicas_one_leader(e: RealNodeEnv) -> str | None:
    """The Lease's holder once both replicas run on nodes of their own, the other one standing by."""
    pods = operator_pods(e)
    holder = leader(e)
    if len(pods) != 2 or len({p.spec.node_name for p in pods}) != 2 or not holder:
        return None
    standby = [p.metadata.name for p in pods if p.metadata.name != pod_of(holder)]
    if len(standby) != 1 or "standing by" not in e.container_log(OPERATOR_NS, standby[0], "operator"):
        return None
    return holder


def fresh_job(e: RealNodeEnv, doc: dict[str, Any], name: str) -> Path:
    """``doc`` as job ``name`` with the trainer's image from the registry; jobs of earlier tests deleted
    first (a failed test leaves them holding the nodes)."""
    delete_jobs(e)
    doc["metadata"]["name"] = name
    trainer = doc["spec"]["template"]["spec"]["containers"][0]
    trainer["image"] = e.images["spotguard-torch"]
    path = e.log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def pod_node(e: RealNodeEnv, pod: str) -> str:
    return str(e.core.read_namespaced_pod(pod, e.ns).spec.node_name)


def replace_lost_node(e: RealNodeEnv) -> None:
    """A lost node's replacement (a spot pool scales back up): the next attempt needs somewhere to go."""
    e.nodes.add_node(wait=True)


def preempt(e: RealNodeEnv, pod: str, mode: str) -> str:
    """End ``pod`` the ``mode`` way, as the cluster would: ``drain`` (``kubectl drain`` of its node, then
    uncordoned), ``evict`` (the eviction API), ``delete`` (a graceful delete), ``kill`` (its node lost)."""
    node = pod_node(e, pod)
    if mode == "drain":
        out = e.tool(
            "kubectl", "drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--force", "--timeout=180s"
        )
        e.tool("kubectl", "uncordon", node)
        return out.stdout.strip()
    if mode == "evict":
        body = {"apiVersion": "policy/v1beta1", "kind": "Eviction", "metadata": {"name": pod, "namespace": e.ns}}
        e.core.create_namespaced_pod_eviction(pod, e.ns, body)
        return f"evicted {pod}"
    if mode == "delete":
        e.core.delete_namespaced_pod(pod, e.ns)
        return f"deleted {pod}"
    assert mode == "kill", mode
    result = e.nodes.kill(node)
    replace_lost_node(e)
    return f"lost node {result['node']} ({len(result['pids'])} processes)"


def run_example(e: RealNodeEnv, name: str, steps: int | None = None) -> tuple[str, list[str], int, int, str]:
    """Apply the example as job ``name`` (a step slow enough to be preempted mid-way; ``steps`` to shorten
    it): returns (job, trainer args, steps, everySteps, its checkpoints' URI)."""
    doc = example()
    spec = doc["spec"]
    args = list(spec["template"]["spec"]["containers"][0]["args"])
    if steps is not None:
        args[args.index("--steps") + 1] = str(steps)
    delay = args.index("--step-delay") + 1
    args[delay] = str(max(float(args[delay]), 0.15))
    spec["template"]["spec"]["containers"][0]["args"] = args
    e.tool("kubectl", "apply", "-n", e.ns, "-f", str(fresh_job(e, doc, name)))
    total = int(args[args.index("--steps") + 1])
    uri = f"{spec['checkpoint']['storage'].rstrip('/')}/{e.ns}/{name}"
    return name, args, total, int(spec["checkpoint"]["everySteps"]), uri


def wait_training(e: RealNodeEnv, pod: str, target: int, uri: str) -> None:
    """Until ``pod``'s trainer has logged step ``target`` and a checkpoint of the job is verified."""
    e.wait_pod_running(pod, timeout=420)  # the first pod on a node pulls the torch image
    wait_for(lambda: last_step(e.trainer_log(pod)) >= target, f"{pod} at step {target}", timeout=300, interval=0.3)
    wait_for(lambda: verified_step(e, uri) >= 0, "a verified checkpoint", timeout=240, interval=0.5)


def check_resumes(e: RealNodeEnv, pods: list[str], graceful: int, verified_at_kill: int) -> None:
    """The first ``graceful`` attempts' pods lost nothing (the next resumed where each stopped); a node loss
    after them lost at most what came after the newest verified checkpoint."""
    logs = [e.trainer_log(p) for p in pods]
    for a in range(graceful):
        stopped, resumed = preempted_after(logs[a]), resumed_from(logs[a + 1])
        assert stopped is not None and resumed == stopped, (pods[a], stopped, resumed, logs[a][-1500:])
    if verified_at_kill >= 0:
        resumed = resumed_from(logs[-1])
        assert resumed is not None and resumed >= verified_at_kill, (resumed, verified_at_kill, logs[-1][:500])


@pytest.mark.trials
@pytest.mark.timeout(1800)
def test_example_survives_drain_eviction_delete_and_node_loss_bitwise(env: RealNodeEnv, tmp_path: Path) -> None:
    """The README's example on real nodes: ``kubectl drain``, the eviction API, a pod delete, its node lost;
    Succeeded, nothing lost in the graceful ways, bitwise equal to an uninterrupted run.

    ``make test`` runs the drain (``make soak`` all four): on real nodes the DDP gang below loses a node in
    ``make test``, and the process nodes' end-to-end jobs lose theirs (``tests/e2e/test_operator_e2e.py``)."""
    job, args, steps, every, uri = run_example(env, "demo-train")
    modes = trials.variants(
        full=[("drain", 0.2), ("evict", 0.35), ("delete", 0.5), ("kill", 0.65)],
        quick=[("drain", 0.2)],
    )
    verified_at_kill = -1
    for attempt, (mode, fraction) in enumerate(modes, start=1):
        pod = f"{job}-a{attempt}"
        wait_training(env, pod, int(steps * fraction), uri)
        if mode == "kill":
            base = verified_step(env, uri)
            wait_for(lambda b=base: verified_step(env, uri) > b, "the next checkpoint", timeout=120, interval=0.05)
            verified_at_kill = verified_step(env, uri)
        print(f"{mode} {pod}: {preempt(env, pod, mode)}")
        env.wait_status(job, f"attempt {attempt + 1}", lambda s, a=attempt: (s.get("attempt") or 0) > a, timeout=300)

    last = len(modes) + 1
    st = env.wait_status(job, "Succeeded", lambda s: s.get("phase") in ("Succeeded", "Failed"), timeout=600)
    assert st["phase"] == "Succeeded", f"{st}\n{env.ends(job)}"
    assert st["preemptions"] == len(modes) and st["failures"] == 0 and st["attempt"] == last, st
    pods = [f"{job}-a{a}" for a in range(1, last + 1)]
    check_resumes(env, pods, sum(mode != "kill" for mode, _ in modes), verified_at_kill)  # a loss comes last
    assert f"finished {steps} steps" in env.trainer_log(pods[-1])
    assert_final_bitwise(env, uri, args, every, steps, tmp_path)


def gang_pods(e: RealNodeEnv, job: str, attempt: int) -> list[Any]:
    """The pods of one attempt of a gang, by rank."""
    selector = f"spotguard.dev/job={job},spotguard.dev/attempt={attempt}"
    pods = e.core.list_namespaced_pod(e.ns, label_selector=selector).items
    return sorted(pods, key=lambda p: p.metadata.name)


@pytest.mark.timeout(1500)
def test_ddp_gang_survives_losing_rank0_node_bitwise(env: RealNodeEnv, tmp_path: Path) -> None:
    """The 2-node DDP example (torchrun, 2 processes a node, the ranks meeting at rank 0's stable name over the
    pod network) on real nodes: rank 0's node is lost (its kubelet, containerd and containers at once, the
    Node deleted); the operator ends the gang, starts it again on the node left and the replacement;
    Succeeded with one preemption (NodeLost), resumed from at least the checkpoint verified before the
    loss, and the digest of an uninterrupted 4-process run."""
    doc = yaml.safe_load(DDP_EXAMPLE.read_text())
    job = doc["metadata"]["name"]
    spec = doc["spec"]
    args, steps, every = set_steps(doc, GANG_STEPS), GANG_STEPS, int(spec["checkpoint"]["everySteps"])
    uri = f"{spec['checkpoint']['storage'].rstrip('/')}/{env.ns}/{job}"
    env.tool("kubectl", "apply", "-n", env.ns, "-f", str(fresh_job(env, doc, job)))
    rank0, rank1 = f"{job}-a1-0", f"{job}-a1-1"
    env.wait_pod_running(rank1, timeout=420)  # the first pod on a node pulls the torch image
    wait_training(env, rank0, steps // 4, uri)
    first = gang_pods(env, job, 1)
    assert len({p.spec.node_name for p in first}) == 2, [(p.metadata.name, p.spec.node_name) for p in first]
    base = verified_step(env, uri)
    wait_for(lambda: verified_step(env, uri) > base, "the next verified checkpoint", timeout=180, interval=0.05)
    verified_at_kill = verified_step(env, uri)
    lost = pod_node(env, rank0)
    print(f"kill {rank0}: {preempt(env, rank0, 'kill')}")
    assert last_step(env.trainer_log(rank0)) < steps - 1, "the gang ended before its rank 0's node was lost"

    st = env.wait_status(job, "Succeeded", lambda s: s.get("phase") in ("Succeeded", "Failed"), timeout=900)
    assert st["phase"] == "Succeeded", f"{st}\n{env.ends(job)}"
    assert st["preemptions"] == 1 and st["failures"] == 0 and st["attempt"] == 2, f"{st}\n{env.ends(job)}"
    events = env.core.list_namespaced_event(env.ns, field_selector=f"involvedObject.name={job}").items
    preempted = sorted({e.message for e in events if e.reason == "Preempted"})
    assert len(preempted) == 1 and "(NodeLost)" in preempted[0] and lost in preempted[0], preempted
    second = gang_pods(env, job, 2)
    assert [p.metadata.name for p in second] == [f"{job}-a2-0", f"{job}-a2-1"], second
    assert lost not in {p.spec.node_name for p in second}, [p.spec.node_name for p in second]
    check_resumes(env, [rank0, f"{job}-a2-0"], 0, verified_at_kill)
    log = env.trainer_log(f"{job}-a2-0")
    assert f"finished {steps} steps" in log, log[-2000:]
    got = final_digest(log)
    assert got is not None, log[-2000:]
    world_size = int(spec["nodes"]) * int(spec["nprocPerNode"])
    assert reference_ddp_digest(args, every, world_size, tmp_path) == got
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, job)


@pytest.mark.timeout(900)
def test_frozen_leader_the_standby_acts_no_duplicate_pods(env: RealNodeEnv) -> None:
    """The leading replica's container frozen (every process at once, through its freezer cgroup): the
    standby takes the Lease and starts the next attempt of a job whose pod was deleted meanwhile; each pod
    is created once; thawed, the old leader sees it lost the Lease and exits (the kubelet restarts it)."""
    job, _, steps, _, uri = run_example(env, "failover", steps=2000)
    wait_training(env, f"{job}-a1", 5, uri)
    frozen = leader(env)
    assert frozen, "no replica holds the Lease"
    frozen_pod = env.core.read_namespaced_pod(pod_of(frozen), OPERATOR_NS)
    cgroup = container_cgroup(env.nodes, frozen_pod, "operator")
    freeze(cgroup, "FROZEN")
    try:
        successor = wait_for(
            lambda: (lambda h: h if h and h != frozen else None)(leader(env)),
            "the standby to take the Lease",
            timeout=120,
            interval=0.2,
        )
        preempt(env, f"{job}-a1", "delete")
        env.wait_pod_running(f"{job}-a2", timeout=300)
    finally:
        freeze(cgroup, "THAWED")
    made_by = env.core.read_namespaced_pod(f"{job}-a2", env.ns).metadata.annotations[ANNOTATION_OPERATOR_INSTANCE]
    assert made_by == successor, (made_by, successor, frozen)
    st = env.wait_status(job, "attempt 2 counted", lambda s: (s.get("attempt") or 0) >= 2)
    assert st["attempt"] == 2 and st["preemptions"] == 1, st

    def exited_lost() -> bool:
        p = env.core.read_namespaced_pod(frozen_pod.metadata.name, OPERATOR_NS)
        cs = (p.status.container_statuses or [None])[0]
        term = cs.last_state.terminated if cs and cs.last_state else None
        return bool(term and term.exit_code == LOST_EXIT_CODE)

    wait_for(exited_lost, f"the thawed replica {frozen_pod.metadata.name} to exit", timeout=90, interval=0.5)
    assert "lost the lease" in env.container_log(OPERATOR_NS, frozen_pod.metadata.name, "operator")
    # Each pod created once, as the apiserver received the writes: none by the thawed replica.
    writes = audit_writes(env.kube, [env.ns]) or []
    creates = [w for w in writes if w.resource == "pods" and w.verb == "create" and w.ok and w.name.startswith(job)]
    assert sorted(w.name for w in creates) == [f"{job}-a1", f"{job}-a2"], creates
    made = next(w.at for w in creates if w.name == f"{job}-a2")
    assert not [w for w in writes if w.identity == frozen and w.at > made], f"{frozen} wrote after the takeover"
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, job)


class LastSeen:
    """The states of one pod the apiserver reported, its deletion included (a watch's DELETED event
    carries the pod as it was last): the last one, and every termination message its sidecar showed."""

    def __init__(self, e: RealNodeEnv, pod: str) -> None:
        from kubernetes import watch

        self.pod: Any = None
        self.messages: list[str] = []
        self.stopping = False
        self.watch = watch.Watch()
        self.thread = threading.Thread(target=self._run, args=(e, pod), daemon=True)
        self.thread.start()

    def _run(self, e: RealNodeEnv, pod: str) -> None:
        from urllib3.exceptions import ProtocolError

        selector = f"metadata.name={pod}"
        try:
            for event in self.watch.stream(
                e.core.list_namespaced_pod, e.ns, field_selector=selector, timeout_seconds=600
            ):
                self.pod = event["object"]
                for cs in self.pod.status.container_statuses or []:
                    term = cs.state.terminated if cs.name == SIDECAR_CONTAINER and cs.state else None
                    if term is not None and term.message:
                        self.messages.append(term.message)
        except ProtocolError:
            if not self.stopping:
                raise  # stopping closes the stream under the reader; anything else is a failure

    def stop(self) -> None:
        self.stopping = True
        self.watch.stop()


@pytest.mark.timeout(900)
def test_operator_reads_the_termination_message_the_kubelet_wrote(env: RealNodeEnv) -> None:
    """Drained, the sidecar ends with its report (preempted, why, the step it verified) in
    ``/dev/termination-log``; the kubelet puts it into the container's status and the operator classifies
    the attempt's end from it: its reason and step, not the bare ``PodDeleted`` of a pod that said nothing.

    The test world's kubelet publishes a deleted pod's final container states before it removes the
    containers, as 1.22+ kubelets do (``testenv/realnode/kubelet-final-status.patch``; unpatched, 1.20 lost
    the report to that race in most drains on a busy machine). So one drain must carry the report."""
    job, _, _, _, uri = run_example(env, "termination", steps=2000)
    pod = f"{job}-a1"
    wait_training(env, pod, 30, uri)
    seen = LastSeen(env, pod)
    try:
        preempt(env, pod, "drain")
        st = env.wait_status(job, "attempt 2", lambda s: (s.get("attempt") or 0) > 1)
    finally:
        seen.stop()
    end = st["lastPodEnd"]
    assert end["attempt"] == 1 and end["kind"] == "preempted", end
    assert seen.messages, f"no report reached the apiserver: {end}, {seen.pod.status.container_statuses}"
    report = json.loads(seen.messages[-1])
    assert report["preempted"] is True and isinstance(report["step"], int), report
    assert end["reason"] == report["reason"] != "PodDeleted" and end["step"] == report["step"], (end, report)
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, job)


#: What Pod Security's "restricted" level asks of a container, as the operator injects it.
RESTRICTED = {
    "allow_privilege_escalation": False,
    "read_only_root_filesystem": True,
    "run_as_non_root": True,
}


@pytest.mark.timeout(900)
def test_injected_containers_run_restricted_and_the_kubelet_enforces_it(env: RealNodeEnv) -> None:
    """The restore init container and the sidecar carry the restricted securityContext, and the kubelet
    (runc) applies it: seen from the host, the sidecar's process has a non-root uid, no capabilities,
    no_new_privs and a seccomp filter; inside, a write to its root filesystem fails."""
    job, _, _, _, uri = run_example(env, "restricted", steps=2000)
    pod_name = f"{job}-a1"
    wait_training(env, pod_name, 5, uri)
    pod = env.core.read_namespaced_pod(pod_name, env.ns)
    injected = [c for c in [*(pod.spec.init_containers or []), *pod.spec.containers] if c.name != "trainer"]
    assert {c.name for c in injected} >= {RESTORE_CONTAINER, SIDECAR_CONTAINER}, [c.name for c in injected]
    for c in injected:
        sc = c.security_context
        for key, want in RESTRICTED.items():
            assert getattr(sc, key) == want, (c.name, key, sc)
        assert sc.capabilities.drop == ["ALL"] and not sc.capabilities.add, (c.name, sc.capabilities)
        seccomp = sc.seccomp_profile or pod.spec.security_context.seccomp_profile
        assert seccomp.type == "RuntimeDefault", (c.name, seccomp)
    restore = next(cs for cs in pod.status.init_container_statuses if cs.name == RESTORE_CONTAINER)
    assert restore.state.terminated.exit_code == 0, restore

    procs = (container_cgroup(env.nodes, pod, SIDECAR_CONTAINER) / "cgroup.procs").read_text().split()
    assert procs, "the sidecar container has no process"
    for pid in procs:
        status = process_status(int(pid))
        # Real, effective, saved and filesystem uid: the securityContext's (the image's user, not root).
        sidecar = next(c for c in pod.spec.containers if c.name == SIDECAR_CONTAINER)
        want = str(sidecar.security_context.run_as_user)
        assert want != "0" and status["Uid"].split() == [want] * 4, (pid, status["Uid"], want)
        # Every capability dropped: the bounding set too (a non-root process has no effective ones anyway).
        caps = {k: int(status[k], 16) for k in ("CapBnd", "CapPrm", "CapEff", "CapInh", "CapAmb")}
        assert not any(caps.values()), (pid, caps)
        assert status["NoNewPrivs"] == "1", (pid, status["NoNewPrivs"])
        assert status["Seccomp"] == "2", (pid, status["Seccomp"])  # 2: a filter (RuntimeDefault)
    # The user's trainer beside it keeps what its template says (nothing): the runtime's defaults, which
    # these readings tell apart from the restricted context.
    trainer = process_status(int((container_cgroup(env.nodes, pod, "trainer") / "cgroup.procs").read_text().split()[0]))
    assert int(trainer["CapBnd"], 16) and trainer["NoNewPrivs"] == "0" and trainer["Seccomp"] == "0", trainer
    write = env.tool(
        "kubectl",
        *("exec", "-n", env.ns, pod_name, "-c", SIDECAR_CONTAINER, "--"),
        *("python", "-c", "open('/spotguard-probe', 'w')"),
        check=False,
    )
    assert write.returncode != 0 and "Read-only file system" in write.stderr, (write.returncode, write.stderr)
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, job)
