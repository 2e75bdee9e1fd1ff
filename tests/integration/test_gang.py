"""TrainingJobs of several nodes ("gangs") against the real kube-apiserver and process nodes.

Every pod really runs (restore init container, trainer, sidecar as local
processes on a process node), but the trainer is a shell loop, never torch, so
that each test takes seconds. Preemptions are the process nodes' own: drain
(cordon + eviction API), graceful node shutdown, and a node that is killed and
replaced. A watch on the job's pods records, in the apiserver's order, when
each pod appeared and when it stopped running (terminal phase or gone): the
next attempt's first pod must appear only after every pod of the previous one
has stopped.
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from spotguard.operator.testing import OperatorProcess, ProcessExited, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "trainingjob.yaml"
GROUP, VERSION, PLURAL = "spotguard.dev", "v1alpha1", "trainingjobs"
IMAGE = "spotguard:test"

#: The trainer: says who it is, then sleeps until SIGTERM (exit 143 at once), or,
#: on rank $FAIL_RANK, exits 1 after $FAIL_AFTER seconds. $IGNORE_TERM keeps it
#: alive through SIGTERM, so that its pod takes the whole grace period to end.
TRAINER = r"""
echo "rank=$NODE_RANK pet_rank=$PET_NODE_RANK nnodes=$PET_NNODES master=$MASTER_ADDR:$MASTER_PORT world=$WORLD_SIZE"
if [ -n "$IGNORE_TERM" ]; then trap '' TERM; else trap 'kill $! 2>/dev/null; exit 143' TERM; fi
if [ "$NODE_RANK" = "${FAIL_RANK:-none}" ]; then sleep "${FAIL_AFTER:-1}"; echo "rank $NODE_RANK fails"; exit 1; fi
while true; do sleep 1 & wait $!; done
"""


# --- fixtures -------------------------------------------------------------------


def kubectl(kube: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(kube.bin_dir / "kubectl"), "--kubeconfig", str(kube.kubeconfig), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def apis(kube: Any) -> tuple[Any, Any]:
    from kubernetes import client

    api = kube.api_client()
    return client.CoreV1Api(api), client.CustomObjectsApi(api)


@pytest.fixture(scope="module")
def crd(kube: Any) -> None:
    kubectl(kube, "apply", "-f", str(CRD))
    kubectl(kube, "wait", "--for", "condition=established", "crd/trainingjobs.spotguard.dev", "--timeout=60s")


def new_namespace(core: Any, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: core.read_namespaced_service_account("default", name), "the default ServiceAccount", timeout=60)
    return name


def start_operator(kube: Any, namespace: str, log_path: Path) -> OperatorProcess:
    return OperatorProcess(
        [
            "-n",
            namespace,
            "--image",
            IMAGE,
            "--native-sidecar",
            "off",
            "--resync-seconds",
            "2",
            "--checkpoint-poll-seconds",
            "5",
        ],
        env=kube.env(),
        log_path=log_path,
    ).start()


def delete_jobs(apis: tuple[Any, Any], ns: str) -> None:
    """Delete every TrainingJob (while its operator runs: it owns their finalizer), then their pods at once."""
    core, custom = apis
    custom.delete_collection_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)
    wait_for(
        lambda: not custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"],
        f"the TrainingJobs in {ns} to be deleted",
        timeout=60,
    )
    # The garbage collector would stop them gracefully; the next test wants their GPUs now.
    core.delete_collection_namespaced_pod(ns, label_selector="spotguard.dev/job", grace_period_seconds=0)
    wait_for(
        lambda: not core.list_namespaced_pod(ns, label_selector="spotguard.dev/job").items,
        f"the pods in {ns} to be gone",
        timeout=60,
    )


@dataclass
class Env:
    kube: Any
    core: Any
    custom: Any
    ns: str
    nodes: Any  # ProcessNodes
    log_dir: Path
    operator: OperatorProcess | None = None
    watches: list[PodWatch] = field(default_factory=list)

    def watch(self, job: str) -> PodWatch:
        w = PodWatch(self.core, self.ns, job)
        self.watches.append(w)
        return w.start()


@pytest.fixture(scope="module")
def env_module(
    kube: Any, apis: tuple[Any, Any], crd: None, process_nodes: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Env]:
    core, custom = apis
    ns = new_namespace(core, "gang")
    log_dir = tmp_path_factory.mktemp("gang")
    e = Env(kube, core, custom, ns, process_nodes, log_dir)
    e.operator = start_operator(kube, ns, log_dir / "operator.log")
    try:
        yield e
    finally:
        if e.operator is None:  # a test stopped it and could not start another
            e.operator = start_operator(kube, ns, log_dir / "operator-final.log")
        try:
            delete_jobs(apis, ns)
        finally:
            e.operator.stop()
            print(f"--- operator log ({e.operator.log_path}) ---\n{e.operator.log_tail(40)}")
            core.delete_namespace(ns)


@pytest.fixture
def env(env_module: Env, apis: tuple[Any, Any]) -> Iterator[Env]:
    """The module's namespace and operator; each test's jobs and pods are gone after it."""
    try:
        yield env_module
    finally:
        for w in env_module.watches:
            w.stop()
        env_module.watches.clear()
        if env_module.operator is None:
            env_module.operator = start_operator(env_module.kube, env_module.ns, env_module.log_dir / "operator-3.log")
        delete_jobs(apis, env_module.ns)


# --- the pod watch --------------------------------------------------------------


@dataclass
class PodLife:
    """One pod as the watch saw it; ``added``/``stopped`` are positions in the watch's event order."""

    name: str
    attempt: int
    uids: set[str] = field(default_factory=set)
    added: int | None = None
    stopped: int | None = None
    added_at: float = 0.0
    stopped_at: float = 0.0
    #: Each state it went through: phase, "deleting" while it had a deletionTimestamp, its DisruptionTarget reason.
    states: list[str] = field(default_factory=list)


class PodWatch:
    """A watch on one job's pods, in a thread: when each appeared and stopped running.

    Events of one watch come in the apiserver's order (resourceVersion), so
    comparing their positions says what happened first, with no clock involved.
    """

    def __init__(self, core: Any, ns: str, job: str) -> None:
        self.core, self.ns, self.job = core, ns, job
        self.selector = f"spotguard.dev/job={job}"
        self.pods: dict[str, PodLife] = {}
        self.seq = 0
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"watch-{job}")

    def start(self) -> PodWatch:
        self._thread.start()
        if not self._started.wait(30):
            raise TimeoutError(f"the watch on {self.job}'s pods did not start")
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)

    def _record(self, kind: str, pod: Any) -> None:
        meta = pod.metadata
        attempt = int((meta.labels or {}).get("spotguard.dev/attempt", "0"))
        phase = pod.status.phase if pod.status else None
        with self.lock:
            self.seq += 1
            now = time.monotonic()
            life = self.pods.setdefault(meta.name, PodLife(meta.name, attempt))
            life.uids.add(meta.uid)
            if life.added is None:
                life.added, life.added_at = self.seq, now
            if life.stopped is None and (kind == "DELETED" or phase in ("Succeeded", "Failed")):
                life.stopped, life.stopped_at = self.seq, now
            disruption = next((c.reason for c in (pod.status.conditions if pod.status else None) or []
                               if c.type == "DisruptionTarget" and c.status == "True"), None)  # fmt: skip
            state = " ".join(x for x in (kind if kind == "DELETED" else phase, meta.deletion_timestamp and "deleting",
                                         disruption) if x)  # fmt: skip
            if not life.states or life.states[-1] != state:
                life.states.append(state)

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    listed = self.core.list_namespaced_pod(self.ns, label_selector=self.selector)
                    for pod in listed.items:
                        self._record("LISTED", pod)
                    rv = listed.metadata.resource_version
                    self._started.set()
                stream = watch.Watch().stream(
                    self.core.list_namespaced_pod,
                    self.ns,
                    label_selector=self.selector,
                    resource_version=rv,
                    timeout_seconds=2,
                )
                for ev in stream:
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        rv = None
                        break
                    rv = obj.metadata.resource_version
                    self._record(ev["type"], obj)
            except ApiException as exc:
                if exc.status == 410:
                    # Expired: list again. Events in between are lost, so say so.
                    self.errors.append("watch expired (410): events may be missing")
                    rv = None
                    continue
                self.errors.append(repr(exc))
                time.sleep(0.2)
            except Exception as exc:  # a dropped connection: resume from rv
                self.errors.append(repr(exc))
                time.sleep(0.2)

    def lives(self) -> dict[str, PodLife]:
        with self.lock:
            return {
                k: PodLife(v.name, v.attempt, set(v.uids), v.added, v.stopped, v.added_at, v.stopped_at, list(v.states))
                for k, v in self.pods.items()
            }

    def attempt_pods(self, attempt: int) -> list[PodLife]:
        return sorted((p for p in self.lives().values() if p.attempt == attempt), key=lambda p: p.name)

    def assert_no_overlap(self, attempts: int, nodes: int) -> None:
        """Each attempt 1..attempts had ``nodes`` pods, each name once; attempt n+1's first pod
        appeared after the last pod of attempt n stopped running."""
        lives = self.lives()
        assert not [e for e in self.errors if "410" in e], self.errors
        for p in lives.values():
            assert len(p.uids) == 1, f"pod {p.name} was created {len(p.uids)} times: {p.uids}"
        for a in range(1, attempts + 1):
            names = sorted(p.name for p in lives.values() if p.attempt == a)
            assert names == [f"{self.job}-a{a}-{r}" for r in range(nodes)], (a, names)
        for a in range(1, attempts):
            old = [p for p in lives.values() if p.attempt == a]
            new = [p for p in lives.values() if p.attempt == a + 1]
            assert all(p.stopped is not None for p in old), [(p.name, p.stopped) for p in old]
            last_stop = max(old, key=lambda p: p.stopped or 0)
            first_new = min(new, key=lambda p: p.added or 0)
            assert (first_new.added or 0) > (last_stop.stopped or 0), (
                f"attempt {a + 1}'s pod {first_new.name} appeared (event {first_new.added}) before attempt {a}'s "
                f"pod {last_stop.name} stopped (event {last_stop.stopped})"
            )
            gap = first_new.added_at - last_stop.stopped_at
            print(f"attempt {a} -> {a + 1}: {first_new.name} appeared {gap:.2f}s after {last_stop.name} stopped")


# --- helpers --------------------------------------------------------------------


def job_body(
    name: str,
    storage: str,
    nodes: int = 2,
    *,
    env: dict[str, str] | None = None,
    node_selector: dict[str, str] | None = None,
    grace: int = 5,
    **preemption: Any,
) -> dict[str, Any]:
    trainer: dict[str, Any] = {
        "name": "trainer",
        "image": "busybox",
        "command": ["sh", "-c", TRAINER],
        # One GPU per pod, one per process node: each pod of a gang on a node of its own.
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
    }
    template: dict[str, Any] = {"containers": [trainer]}
    if node_selector:
        template["nodeSelector"] = node_selector
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "nodes": nodes,
            "template": {"spec": template},
            "checkpoint": {"storage": storage},
            # Pods of process nodes may share the host's network: no metrics port to collide on.
            "sidecar": {"metricsPort": 0},
            "preemption": {
                "maxPreemptions": 5,
                "backoffLimit": 2,
                "gracePeriodSeconds": grace,
                "backoff": {"initialSeconds": 0},
                "preemptionBackoff": {"initialSeconds": 0},
                **preemption,
            },
        },
    }


def store(tmp_path: Path, e: Env, job: str) -> str:
    """A file store for ``job`` (its directory must exist: the restore reads it)."""
    (tmp_path / "store" / e.ns / job).mkdir(parents=True, exist_ok=True)
    return f"file://{tmp_path}/store"


def create_job(e: Env, body: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = e.custom.create_namespaced_custom_object(GROUP, VERSION, e.ns, PLURAL, body)
    return result


def status(e: Env, name: str) -> dict[str, Any]:
    return dict(e.custom.get_namespaced_custom_object(GROUP, VERSION, e.ns, PLURAL, name).get("status") or {})


def cond(st: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions") or [] if c["type"] == type_), {})


def describe(e: Env, job: str) -> str:
    pods = e.core.list_namespaced_pod(e.ns, label_selector=f"spotguard.dev/job={job}").items
    lines = [
        f"{p.metadata.name} {p.status.phase} node={p.spec.node_name} deleting={bool(p.metadata.deletion_timestamp)}"
        for p in pods
    ]
    evs = [f"{r}: {m}" for _t, r, m in events(e, job)]
    return "pods:\n  " + "\n  ".join(lines) + "\nevents:\n  " + "\n  ".join(evs)


def wait_status(e: Env, name: str, what: str, pred: Any, timeout: float = 90, interval: float = 0.2) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        st = status(e, name)
        if pred(st):
            return st
        if st.get("phase") == "Failed":
            raise ProcessExited(f"the job failed: {cond(st, 'Failed')}")
        return None

    try:
        return wait_for(check, f"{e.ns}/{name}: {what}", timeout=timeout, interval=interval)
    except (TimeoutError, ProcessExited) as exc:
        raise AssertionError(f"{what}: {exc}\nstatus now: {status(e, name)}\n{describe(e, name)}") from None


def all_running(e: Env, job: str, attempt: int, nodes: int) -> bool:
    pods = e.core.list_namespaced_pod(e.ns, label_selector=f"spotguard.dev/job={job},spotguard.dev/attempt={attempt}")
    live = [p for p in pods.items if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
    return len(live) == nodes


def wait_running(e: Env, job: str, attempt: int, nodes: int = 2, timeout: float = 120) -> dict[str, Any]:
    """The job says Running for ``attempt``, and all its pods run."""
    return wait_status(
        e,
        job,
        f"attempt {attempt} Running",
        lambda s: s.get("attempt") == attempt and s.get("phase") == "Running" and all_running(e, job, attempt, nodes),
        timeout=timeout,
    )


def events(e: Env, name: str) -> list[tuple[str, str, str]]:
    items = e.core.list_namespaced_event(e.ns, field_selector=f"involvedObject.name={name}").items
    return [(ev.type, ev.reason, ev.message) for ev in items if ev.involved_object.kind == "TrainingJob"]


def wait_event(e: Env, name: str, what: str, pred: Any, timeout: float = 30) -> tuple[str, str, str]:
    """An Event on the job for which ``pred(type, reason, message)`` holds (kopf posts them a little later)."""

    def check() -> tuple[str, str, str] | None:
        return next((ev for ev in events(e, name) if pred(*ev)), None)

    try:
        return wait_for(check, f"an Event on {name}: {what}", timeout=timeout)
    except TimeoutError:
        raise AssertionError(f"no Event on {name} {what}: {events(e, name)}") from None


def trainer_log(e: Env, pod: str) -> str:
    path = e.nodes.log_path(e.ns, pod, "trainer")
    return path.read_text(errors="replace") if path.exists() else ""


def wait_trainer_log(e: Env, pod: str) -> str:
    return wait_for(lambda: trainer_log(e, pod), f"{pod}'s trainer log")


# --- tests ----------------------------------------------------------------------


def test_two_node_job_pods_service_env_and_running(env: Env, tmp_path: Path) -> None:
    e = env
    job = create_job(e, job_body("duo", store(tmp_path, e, "duo")))
    uid = job["metadata"]["uid"]
    st = wait_running(e, "duo", 1)
    assert cond(st, "Running")["status"] == "True" and st["preemptions"] == 0 and st["failures"] == 0

    pods = {p.metadata.name: p for p in e.core.list_namespaced_pod(e.ns, label_selector="spotguard.dev/job=duo").items}
    assert sorted(pods) == ["duo-a1-0", "duo-a1-1"]
    assert len({p.spec.node_name for p in pods.values()}) == 2, "one pod per node"
    for rank in (0, 1):
        pod = pods[f"duo-a1-{rank}"]
        labels = pod.metadata.labels
        assert (labels["spotguard.dev/job"], labels["spotguard.dev/attempt"], labels["spotguard.dev/node-rank"]) == (
            "duo",
            "1",
            str(rank),
        )
        assert pod.spec.hostname == f"duo-{rank}" and pod.spec.subdomain == "duo"
        assert [r.uid for r in pod.metadata.owner_references] == [uid]
        for c in pod.spec.containers:
            cenv = {v.name: v.value for v in c.env or []}
            assert cenv["PET_NNODES"] == "2" and cenv["PET_NODE_RANK"] == str(rank), (c.name, cenv)
            assert cenv["PET_NPROC_PER_NODE"] == "1" and cenv["NODE_RANK"] == str(rank)
            assert cenv["PET_MASTER_ADDR"] == cenv["MASTER_ADDR"] == f"duo-0.duo.{e.ns}.svc.cluster.local"
            assert cenv["PET_MASTER_PORT"] == cenv["MASTER_PORT"] and cenv["WORLD_SIZE"] == "2"
            port = int(cenv["MASTER_PORT"])
        # What the trainer process really got.
        log = wait_trainer_log(e, pod.metadata.name)
        assert f"rank={rank} pet_rank={rank} nnodes=2 master=duo-0.duo.{e.ns}.svc.cluster.local:" in log, log

    svc = e.core.read_namespaced_service("duo", e.ns)
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses is True
    assert svc.spec.selector == {"spotguard.dev/job": "duo"}
    assert [(p.name, p.port) for p in svc.spec.ports] == [("c10d", port)]
    ref = svc.metadata.owner_references[0]
    assert (ref.kind, ref.name, ref.uid, ref.controller) == ("TrainingJob", "duo", uid, True)
    wait_event(e, "duo", "all pods running", lambda _t, r, m: r == "PodRunning" and "all 2 pods are running" in m)


@pytest.mark.parametrize(("mode", "rank"), [("drain", 1), ("shutdown", 0), ("kill", 1)])
def test_preempting_one_member_restarts_the_whole_gang_once(env: Env, tmp_path: Path, mode: str, rank: int) -> None:
    e = env
    name = f"pre-{mode}"
    watch = e.watch(name)
    create_job(e, job_body(name, store(tmp_path, e, name)))
    wait_running(e, name, 1)
    victim = f"{name}-a1-{rank}"
    node = e.core.read_namespaced_pod(victim, e.ns).spec.node_name

    result = e.nodes.preempt(victim, e.ns, mode, grace_seconds=5)
    print(f"preempted {victim} by {mode}: {result}")
    assert result["node"] == node
    st = wait_running(e, name, 2)
    for p in watch.attempt_pods(1):
        print(f"{p.name}: {' -> '.join(p.states)}")
    assert st["preemptions"] == 1 and st["failures"] == 0, st
    end = st["lastPodEnd"]
    print(f"lastPodEnd: {end}")
    assert end["attempt"] == 1 and end["kind"] == "preempted", end
    assert cond(st, "Preempted")["status"] == "False"  # resumed
    assert "teardown" not in st
    assert len([r for _t, r, _m in events(e, name) if r == "Preempted"]) <= 1, events(e, name)
    watch.assert_no_overlap(2, 2)
    # Which pod ended the attempt, and on which node: in the status and in an Event.
    assert end["pod"] == victim and end.get("node") == node, end
    wait_event(e, name, f"naming {victim} on {node}", lambda _t, r, m: r == "Preempted" and victim in m and node in m)
    assert len([r for _t, r, _m in events(e, name) if r == "Preempted"]) == 1, events(e, name)


def test_failing_rank_restarts_the_gang_then_exhausts_the_backoff_limit(env: Env, tmp_path: Path) -> None:
    e = env
    watch = e.watch("crash")
    create_job(
        e, job_body("crash", store(tmp_path, e, "crash"), env={"FAIL_RANK": "1", "FAIL_AFTER": "4"}, backoffLimit=1)
    )
    st = wait_status(e, "crash", "attempt 2", lambda s: (s.get("attempt") or 0) >= 2, timeout=120)
    assert st["attempt"] == 2 and st["failures"] == 1 and st["preemptions"] == 0, st
    end = st["lastPodEnd"]
    assert (end["attempt"], end["kind"], end["pod"]) == (1, "failed", "crash-a1-1"), end

    st = wait_status(e, "crash", "Failed", lambda s: s.get("phase") in ("Failed", "Succeeded"), timeout=120)
    assert st["phase"] == "Failed" and st["failures"] == 2 and st["preemptions"] == 0 and st["attempt"] == 2, st
    failed = cond(st, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "BackoffLimitExceeded", failed
    assert "exited with code 1" in failed["message"], failed
    wait_event(
        e,
        "crash",
        "naming the failed pod crash-a2-1",
        lambda t, r, m: t == "Warning" and "crash-a2-1" in m and r in ("PodFailed", "BackoffLimitExceeded"),
    )
    wait_event(e, "crash", "BackoffLimitExceeded", lambda _t, r, _m: r == "BackoffLimitExceeded")
    # Every pod of the failed job has stopped; no third attempt.
    wait_for(lambda: all(p.stopped is not None for p in watch.attempt_pods(2)), "attempt 2's pods to stop", timeout=60)
    watch.assert_no_overlap(2, 2)
    assert not watch.attempt_pods(3)


def test_one_node_short_says_nodes_missing_then_runs(env: Env, tmp_path: Path) -> None:
    e = env
    key = f"spotguard.dev/gang-{uuid.uuid4().hex[:6]}"
    first, second = e.nodes.node_names()[:2]
    labelled: list[str] = []

    def label(node: str, value: str | None) -> None:
        e.core.patch_node(node, {"metadata": {"labels": {key: value}}})

    try:
        label(first, "yes")
        labelled.append(first)
        create_job(e, job_body("short", store(tmp_path, e, "short"), node_selector={key: "yes"}))
        st = wait_status(e, "short", "NodesMissing", lambda s: cond(s, "Running").get("reason") == "NodesMissing")
        running = cond(st, "Running")
        assert running["status"] == "False" and st["phase"] == "Pending", st
        assert "1 of 2 nodes missing" in running["message"], running

        # The scheduler's own message, as it is on the pod that waits.
        def scheduler_message() -> str | None:
            for p in e.core.list_namespaced_pod(e.ns, label_selector="spotguard.dev/job=short").items:
                for c in p.status.conditions or []:
                    if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                        return f"{p.metadata.name}|{c.message}"
            return None

        pod, message = wait_for(scheduler_message, "an unschedulable pod").split("|", 1)
        st = wait_status(
            e, "short", "the scheduler's message", lambda s: message in cond(s, "Running").get("message", "")
        )
        assert pod in cond(st, "Running")["message"]
        assert st["failures"] == 0 and st["preemptions"] == 0 and st["attempt"] == 1

        label(second, "yes")
        labelled.append(second)
        st = wait_running(e, "short", 1)
        assert cond(st, "Running")["reason"] == "PodRunning"
    finally:
        for node in labelled:
            try:
                label(node, None)
            except Exception as exc:  # a node a kill replaced is gone with its label
                print(f"unlabel {node}: {exc}")


def test_operator_restarted_mid_teardown_finishes_it_once(env: Env, apis: tuple[Any, Any], tmp_path: Path) -> None:
    e = env
    old = e.operator
    assert old is not None
    watch = e.watch("restart")
    # The other rank ignores SIGTERM: it ends only at the end of its grace period, so the
    # teardown lasts that long.
    create_job(e, job_body("restart", store(tmp_path, e, "restart"), env={"IGNORE_TERM": "1"}, grace=12))
    wait_running(e, "restart", 1)
    victim = "restart-a1-1"
    e.nodes.preempt(victim, e.ns, "shutdown", grace_seconds=1, wait=False)
    st = wait_status(e, "restart", "a teardown", lambda s: (s.get("teardown") or {}).get("attempt") == 1, interval=0.05)
    assert st["teardown"]["pod"] == victim, st["teardown"]
    old.kill()  # a crash, in the middle of the teardown
    e.operator = None
    survivors = [p for p in watch.attempt_pods(1) if p.stopped is None]
    print(f"operator killed; teardown {st['teardown']}; still running: {[p.name for p in survivors]}")
    assert survivors, "the teardown was over before the operator could be stopped"

    e.operator = start_operator(e.kube, e.ns, tmp_path / "operator-2.log")
    try:
        st = wait_running(e, "restart", 2)
    finally:
        print(f"--- restarted operator log ---\n{e.operator.log_tail(40)}")
    assert st["preemptions"] == 1 and st["failures"] == 0, st
    assert st["lastPodEnd"]["pod"] == victim and st["lastPodEnd"]["attempt"] == 1, st["lastPodEnd"]
    assert "teardown" not in st
    watch.assert_no_overlap(2, 2)
    time.sleep(3)  # a late duplicate would show up within a resync
    watch.assert_no_overlap(2, 2)
    assert not watch.attempt_pods(3)
    assert len([r for _t, r, _m in events(e, "restart") if r == "Preempted"]) == 1, events(e, "restart")
