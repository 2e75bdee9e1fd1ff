"""Kubernetes helpers for the operator's tests and benchmarks, against a real apiserver.

``kube`` is a :class:`testenv.cluster.ControlPlane` (or anything with its
``kubeconfig``, ``bin_dir``, ``api_client()`` and ``env()``); ``apis`` is the
pair of clients :func:`apis` returns, ``(CoreV1Api, CustomObjectsApi)``.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard.operator.testing import OperatorProcess, ProcessExited, wait_for

__all__ = [
    "CRD",
    "GROUP",
    "IMAGE",
    "PLURAL",
    "VERSION",
    "AuditWrite",
    "Env",
    "PodLife",
    "PodWatch",
    "apis",
    "audit_writes",
    "cond",
    "create_job",
    "delete_jobs",
    "events",
    "fast_preemption",
    "get_job",
    "install_crd",
    "job_body",
    "kubectl",
    "lease_holder",
    "new_namespace",
    "operator_namespace",
    "operator_process",
    "shell_trainer",
    "start_operator",
    "status",
    "trainer_log",
    "wait_event",
    "wait_events",
    "wait_for",
    "wait_status",
]

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "crds" / "trainingjob.yaml"
GROUP, VERSION, PLURAL = "spotguard.dev", "v1alpha1", "trainingjobs"
#: The image the operator puts into its pods' spotguard containers (process nodes ignore images).
IMAGE = "spotguard:test"

Apis = tuple[Any, Any]


# --- the control plane ------------------------------------------------------------


class KubectlError(subprocess.CalledProcessError):
    """A kubectl command failed; its message carries what kubectl said."""

    def __str__(self) -> str:
        said = (self.stderr or self.output or "").strip()
        return f"{super().__str__()}: {said[-2000:]}" if said else super().__str__()


def kubectl(kube: Any, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    argv = [str(kube.bin_dir / "kubectl"), "--kubeconfig", str(kube.kubeconfig), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise KubectlError(done.returncode, argv, done.stdout, done.stderr)
    return done


def apis(kube: Any) -> Apis:
    """``(CoreV1Api, CustomObjectsApi)`` on one API client."""
    from kubernetes import client

    api = kube.api_client()
    return client.CoreV1Api(api), client.CustomObjectsApi(api)


def install_crd(kube: Any) -> None:
    """Apply the TrainingJob CRD and wait until the apiserver serves it."""
    kubectl(kube, "apply", "-f", str(CRD))
    # Seconds on an idle machine; a control plane sharing two cores with the heavy test lane can take longer,
    # and a request can fail while it is busy: asked again, and what kubectl said is in the error.
    argv = ("wait", "--for", "condition=established", "crd/trainingjobs.spotguard.dev", "--timeout=120s")
    for attempt in range(3):
        done = kubectl(kube, *argv, check=attempt == 2, timeout=150)
        if done.returncode == 0:
            return
        time.sleep(2)


def new_namespace(core: Any, prefix: str) -> str:
    """A new namespace ``prefix-xxxxxx``, once its default ServiceAccount exists (pods need it)."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: core.read_namespaced_service_account("default", name), "the default ServiceAccount", timeout=60)
    return name


# --- the apiserver's audit log -------------------------------------------------------

#: The User-Agent of the operator's requests names the process (``spotguard.operator.handlers.user_agent``).
OPERATOR_AGENT = re.compile(r"^spotguard-operator/\S+ \((?P<identity>[^)]+)\)")


@dataclass(frozen=True)
class AuditWrite:
    """One write as the apiserver's audit log has it (``testenv.cluster.AUDIT_POLICY``)."""

    #: When the apiserver received it (its own clock, microseconds: one clock for every writer).
    at: str
    verb: str
    #: ``pods``, ``trainingjobs/status``, ``leases``...
    resource: str
    namespace: str
    name: str
    code: int
    user: str
    agent: str

    @property
    def identity(self) -> str | None:
        """The operator process that sent it (None: not the operator's own client, e.g. kopf's)."""
        m = OPERATOR_AGENT.match(self.agent)
        return m.group("identity") if m else None

    @property
    def ok(self) -> bool:
        return 200 <= self.code < 300


def audit_writes(kube: Any, namespaces: Collection[str]) -> list[AuditWrite] | None:
    """The writes in ``namespaces`` in the order the apiserver received them; None without an audit log
    (a cluster the tests did not start)."""
    path = getattr(kube, "audit_log", None)
    if path is None or not Path(path).exists():
        return None
    out = []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue  # a line being written
        ref = ev.get("objectRef") or {}
        if ev.get("stage") != "ResponseComplete" or ref.get("namespace") not in namespaces:
            continue
        resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        out.append(
            AuditWrite(
                ev.get("requestReceivedTimestamp", ""),
                ev.get("verb", ""),
                resource,
                ref["namespace"],
                ref.get("name", ""),
                int((ev.get("responseStatus") or {}).get("code", 0)),
                (ev.get("user") or {}).get("username", ""),
                ev.get("userAgent", ""),
            )
        )
    return sorted(out, key=lambda w: w.at)


def lease_holder(api_client: Any, namespace: str, name: str) -> str | None:
    """The holderIdentity of a Lease (None: released, or no Lease); ``api_client`` a kubernetes ApiClient."""
    from kubernetes import client

    try:
        lease = client.CoordinationV1Api(api_client).read_namespaced_lease(name, namespace)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return lease.spec.holder_identity or None


# --- the operator -----------------------------------------------------------------


def operator_process(
    kube: Any,
    namespace: str,
    log_path: Path,
    *,
    image: str = IMAGE,
    resync_seconds: float | None = 2,
    poll_seconds: float = 1,
    extra_args: Iterable[str] = (),
) -> OperatorProcess:
    """The operator watching ``namespace`` with classic sidecars, not started yet.

    ``resync_seconds`` None leaves the operator's default; ``poll_seconds`` is
    how often it reads each job's newest verified checkpoint. Every store of
    the test world listens on 127.0.0.1: the operator may connect there
    (``extra_args`` may say ``--allowed-endpoints`` again, the last one counts).
    """
    args = ["-n", namespace, "--image", image, "--native-sidecar", "off", "--allowed-endpoints", "127.0.0.1"]
    if resync_seconds is not None:
        args += ["--resync-seconds", f"{resync_seconds:g}"]
    args += ["--checkpoint-poll-seconds", f"{poll_seconds:g}", *extra_args]
    return OperatorProcess(args, env=kube.env(), log_path=log_path)


def start_operator(kube: Any, namespace: str, log_path: Path, **options: Any) -> OperatorProcess:
    """:func:`operator_process`, started (it answers on its endpoints)."""
    return operator_process(kube, namespace, log_path, **options).start()


# --- TrainingJobs -----------------------------------------------------------------


def shell_trainer(script: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """A trainer container that runs ``script`` with ``sh`` and asks for one GPU.

    One GPU per pod and one per process node: each pod on a node of its own.
    """
    container: dict[str, Any] = {
        "name": "trainer",
        "image": "busybox",
        "command": ["sh", "-c", script],
        "resources": {"limits": {"nvidia.com/gpu": 1}},
    }
    if env is not None:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return container


def fast_preemption(max_preemptions: int, backoff_limit: int, grace: int, **extra: Any) -> dict[str, Any]:
    """``spec.preemption`` with no backoff before the next attempt, after a failure or a preemption."""
    return {
        "maxPreemptions": max_preemptions,
        "backoffLimit": backoff_limit,
        "gracePeriodSeconds": grace,
        "backoff": {"initialSeconds": 0},
        "preemptionBackoff": {"initialSeconds": 0},
        **extra,
    }


def job_body(
    name: str,
    storage: str,
    trainer: dict[str, Any],
    *,
    nodes: int | None = None,
    node_selector: dict[str, str] | None = None,
    pod_spec: dict[str, Any] | None = None,
    every_steps: int | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A TrainingJob whose pods run the one container ``trainer``.

    ``pod_spec`` adds fields to the pod template's spec; ``spec`` sets (replaces)
    top-level fields of the job's spec, such as ``preemption`` or ``checkpoint``.
    """
    template: dict[str, Any] = {**(pod_spec or {}), "containers": [trainer]}
    if node_selector:
        template["nodeSelector"] = node_selector
    checkpoint: dict[str, Any] = {"storage": storage}
    if every_steps is not None:
        checkpoint["everySteps"] = every_steps
    body_spec: dict[str, Any] = {"template": {"spec": template}, "checkpoint": checkpoint}
    if nodes is not None:
        body_spec["nodes"] = nodes
    body_spec.update(spec)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob", "metadata": {"name": name}, "spec": body_spec}


def create_job(apis: Apis, ns: str, body: dict[str, Any]) -> dict[str, Any]:
    _, custom = apis
    result: dict[str, Any] = custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
    return result


def get_job(apis: Apis, ns: str, name: str) -> dict[str, Any]:
    _, custom = apis
    result: dict[str, Any] = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    return result


def status(apis: Apis, ns: str, name: str) -> dict[str, Any]:
    return dict(get_job(apis, ns, name).get("status") or {})


def cond(st: dict[str, Any], type_: str) -> dict[str, Any]:
    """The condition ``type_`` of a job's status, {} if it has none."""
    return next((c for c in st.get("conditions") or [] if c["type"] == type_), {})


def wait_status(
    apis: Apis,
    ns: str,
    name: str,
    what: str,
    pred: Callable[[dict[str, Any]], Any],
    timeout: float = 60,
    interval: float = 0.2,
    *,
    stop_if_failed: bool = False,
    describe: Callable[[], str] | None = None,
) -> dict[str, Any]:
    """Wait until ``pred(status)`` holds; the status then.

    ``stop_if_failed``: a job that reaches phase Failed first fails the wait at
    once. ``describe`` adds what it returns to the error.
    """

    def check() -> dict[str, Any] | None:
        st = status(apis, ns, name)
        if pred(st):
            return st
        if stop_if_failed and st.get("phase") == "Failed":
            raise ProcessExited(f"the job failed: {cond(st, 'Failed')}")
        return None

    try:
        return wait_for(check, f"{ns}/{name}: {what}", timeout=timeout, interval=interval)
    except (TimeoutError, ProcessExited) as exc:
        more = f"\n{describe()}" if describe else ""
        raise AssertionError(f"{exc}; status now: {status(apis, ns, name)}{more}") from None


def events(apis: Apis, ns: str, name: str) -> list[tuple[str, str, str]]:
    """``(type, reason, message)`` of each Event on the TrainingJob ``name``."""
    core, _ = apis
    items = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
    return [(e.type, e.reason, e.message) for e in items if e.involved_object.kind == "TrainingJob"]


def wait_events(apis: Apis, ns: str, name: str, wanted: set[str]) -> None:
    """Wait until the job has Events with every reason in ``wanted``: kopf posts
    Events from a background queue, so they may land just after the status."""
    try:
        wait_for(lambda: wanted <= {r for _t, r, _m in events(apis, ns, name)}, f"Events {sorted(wanted)}", timeout=30)
    except TimeoutError:
        raise AssertionError(f"{name}: Events {[r for _t, r, _m in events(apis, ns, name)]}") from None


def wait_event(
    apis: Apis, ns: str, name: str, what: str, pred: Callable[[str, str, str], Any], timeout: float = 30
) -> tuple[str, str, str]:
    """An Event on the job for which ``pred(type, reason, message)`` holds (kopf posts them a little later)."""

    def check() -> tuple[str, str, str] | None:
        return next((ev for ev in events(apis, ns, name) if pred(*ev)), None)

    try:
        return wait_for(check, f"an Event on {name}: {what}", timeout=timeout)
    except TimeoutError:
        raise AssertionError(f"no Event on {name} {what}: {events(apis, ns, name)}") from None


def delete_jobs(apis: Apis, ns: str, *, pods: bool = True) -> None:
    """Delete every TrainingJob of ``ns`` while the operator still runs (it owns their finalizer).

    ``pods``: then delete their pods at once and wait until they are gone (the
    garbage collector would stop them gracefully; the next test wants their GPUs now).
    """
    core, custom = apis
    custom.delete_collection_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)
    wait_for(
        lambda: not custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"],
        f"the TrainingJobs in {ns} to be deleted",
        timeout=60,
    )
    if pods:
        core.delete_collection_namespaced_pod(ns, label_selector="spotguard.dev/job", grace_period_seconds=0)
        wait_for(
            lambda: not core.list_namespaced_pod(ns, label_selector="spotguard.dev/job").items,
            f"the pods in {ns} to be gone",
            timeout=60,
        )


# --- a namespace with its own operator, on process nodes ------------------------------


@dataclass
class Env:
    """A namespace watched by an operator of its own, with process nodes that run its pods."""

    kube: Any
    core: Any
    custom: Any
    ns: str
    nodes: Any  # testenv.processnode.ProcessNodes
    log_dir: Path
    operator: OperatorProcess | None = None
    watches: list[PodWatch] = field(default_factory=list)
    #: What :meth:`start_operator` passes to :func:`start_operator`.
    operator_options: dict[str, Any] = field(default_factory=dict)

    @property
    def apis(self) -> Apis:
        return self.core, self.custom

    def start_operator(self, log_path: Path) -> OperatorProcess:
        self.operator = start_operator(self.kube, self.ns, log_path, **self.operator_options)
        return self.operator

    def watch(self, job: str) -> PodWatch:
        w = PodWatch(self.core, self.ns, job)
        self.watches.append(w)
        return w.start()

    def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        return create_job(self.apis, self.ns, body)

    def status(self, name: str) -> dict[str, Any]:
        return status(self.apis, self.ns, name)

    def events(self, name: str) -> list[tuple[str, str, str]]:
        return events(self.apis, self.ns, name)

    def describe(self, job: str) -> str:
        """The job's pods and Events, for an error message."""
        pods = self.core.list_namespaced_pod(self.ns, label_selector=f"spotguard.dev/job={job}").items
        lines = [
            f"{p.metadata.name} {p.status.phase} node={p.spec.node_name} deleting={bool(p.metadata.deletion_timestamp)}"
            for p in pods
        ]
        evs = [f"{r}: {m}" for _t, r, m in self.events(job)]
        return "pods:\n  " + "\n  ".join(lines) + "\nevents:\n  " + "\n  ".join(evs)

    def wait_status(
        self, name: str, what: str, pred: Callable[[dict[str, Any]], Any], timeout: float = 90, interval: float = 0.2
    ) -> dict[str, Any]:
        """:func:`wait_status`, given up at once when the job fails first."""
        return wait_status(
            self.apis,
            self.ns,
            name,
            what,
            pred,
            timeout,
            interval,
            stop_if_failed=True,
            describe=lambda: self.describe(name),
        )

    def wait_event(
        self, name: str, what: str, pred: Callable[[str, str, str], Any], timeout: float = 30
    ) -> tuple[str, str, str]:
        return wait_event(self.apis, self.ns, name, what, pred, timeout)


@contextlib.contextmanager
def operator_namespace(
    kube: Any, apis: Apis, nodes: Any, prefix: str, log_dir: Path, **operator_options: Any
) -> Iterator[Env]:
    """A new namespace ``prefix-...`` and its operator (logging to ``log_dir``) for the block.

    At the end every TrainingJob and pod of it is deleted (by a new operator
    if a test left none running), then the operator stops and the namespace goes.
    """
    core, custom = apis
    ns = new_namespace(core, prefix)
    e = Env(kube, core, custom, ns, nodes, log_dir, operator_options=operator_options)
    e.start_operator(log_dir / "operator.log")
    try:
        yield e
    finally:
        if e.operator is None:  # a test stopped it and could not start another
            e.start_operator(log_dir / "operator-final.log")
        assert e.operator is not None
        try:
            delete_jobs(apis, ns)
        finally:
            e.operator.stop()
            print(f"--- operator log ({e.operator.log_path}) ---\n{e.operator.log_tail(40)}")
            core.delete_namespace(ns)


def trainer_log(e: Env, pod: str) -> str:
    """What the trainer container of ``pod`` (on a process node) has written so far."""
    path = e.nodes.log_path(e.ns, pod, "trainer")
    return path.read_text(errors="replace") if path.exists() else ""


# --- the pod watch ----------------------------------------------------------------


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
            disruption = next(
                (
                    c.reason
                    for c in (pod.status.conditions if pod.status else None) or []
                    if c.type == "DisruptionTarget" and c.status == "True"
                ),
                None,
            )
            state = " ".join(
                x
                for x in (kind if kind == "DELETED" else phase, meta.deletion_timestamp and "deleting", disruption)
                if x
            )
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
            except Exception as exc:  # noqa: BLE001 - a dropped connection (urllib3, socket errors): resume from rv
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


# --- pods without a kubelet: each end a pod can have, as kubelet would write it ---------

#: A nodeSelector no node matches: the pod stays Pending, off every process node.
NO_NODE = {"spotguard.dev/test-no-node": "true"}


def no_node_job(name: str, storage: str, **spec: Any) -> dict[str, Any]:
    """A one-pod job whose pod no node takes; ``spec`` replaces top-level fields of the job's spec."""
    trainer = {
        "name": "trainer",
        "image": "trainer:1",
        "command": ["python", "-m", "train"],
        "resources": {"limits": {"nvidia.com/gpu": 1}},
    }
    preemption = {"maxPreemptions": 3, "backoffLimit": 1, "gracePeriodSeconds": 5, "backoff": {"initialSeconds": 0}}
    return job_body(name, storage, trainer, node_selector=NO_NODE, every_steps=10, **{"preemption": preemption, **spec})


def pod_names(apis: tuple[Any, Any], ns: str, job: str) -> list[str]:
    core, _ = apis
    pods = core.list_namespaced_pod(ns, label_selector=f"spotguard.dev/job={job}").items
    return sorted(p.metadata.name for p in pods if p.metadata.deletion_timestamp is None)


def wait_pod(apis: tuple[Any, Any], ns: str, name: str) -> Any:
    core, _ = apis
    return wait_for(lambda: core.read_namespaced_pod(name, ns), f"pod {ns}/{name}", timeout=60)


def patch_pod_status(apis: tuple[Any, Any], ns: str, pod: str, st: dict[str, Any]) -> None:
    core, _ = apis
    core.patch_namespaced_pod_status(pod, ns, {"status": st})


def terminated(name: str, code: int, reason: str | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "ready": False,
        "restartCount": 0,
        "image": "x",
        "imageID": "",
        "state": {
            "terminated": {
                "exitCode": code,
                "reason": reason or ("Completed" if code == 0 else "Error"),
                "startedAt": "2030-01-01T00:00:00Z",
                "finishedAt": "2030-01-01T00:01:00Z",
            }
        },
    }


def run_pod(apis: tuple[Any, Any], ns: str, pod: str) -> None:
    patch_pod_status(apis, ns, pod, {"phase": "Running"})


def succeed_pod(apis: tuple[Any, Any], ns: str, pod: str) -> None:
    patch_pod_status(
        apis,
        ns,
        pod,
        {"phase": "Succeeded", "containerStatuses": [terminated("trainer", 0), terminated("spotguard-sidecar", 0)]},
    )


def fail_pod(apis: tuple[Any, Any], ns: str, pod: str, code: int = 1) -> None:
    patch_pod_status(
        apis,
        ns,
        pod,
        {"phase": "Failed", "containerStatuses": [terminated("trainer", code), terminated("spotguard-sidecar", 0)]},
    )


def shutdown_pod(apis: tuple[Any, Any], ns: str, pod: str) -> None:
    """What kubelet's graceful node shutdown leaves (1.26+)."""
    patch_pod_status(
        apis,
        ns,
        pod,
        {
            "phase": "Failed",
            "reason": "Terminated",
            "message": "Pod was terminated in response to imminent node shutdown.",
            "conditions": [
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "TerminationByKubelet",
                    "message": "Pod was terminated in response to imminent node shutdown.",
                }
            ],
            "containerStatuses": [terminated("trainer", 0), terminated("spotguard-sidecar", 0)],
        },
    )


def fake_node(core: Any, name: str, labels: dict[str, str]) -> None:
    """A Ready node object with one GPU and no kubelet behind it: the scheduler binds pods to it.

    The node lifecycle controller marks it NotReady once its heartbeat is
    ~40 s old: keep a test on it short, or call ``heartbeat``.
    """
    capacity = {"cpu": "4", "memory": "8Gi", "pods": "10", "nvidia.com/gpu": "1"}
    core.create_node(
        {"metadata": {"name": name, "labels": labels}, "status": {"capacity": capacity, "allocatable": capacity}}
    )
    heartbeat(core, name)


def heartbeat(core: Any, name: str) -> None:
    """Report a fake node Ready now."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_node_status(
        name,
        {
            "status": {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "ready",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ]
            }
        },
    )
