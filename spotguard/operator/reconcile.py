"""The operator's thin shell: observe -> decide (pure) -> apply -> report.

Runs in a worker thread (the kubernetes client is blocking); kopf's async
handlers call it through ``asyncio.to_thread``. One reconcile reads the job and
its current pod fresh from the apiserver, so it is level-based and idempotent:
an operator restarted at any instant picks up where the last one stopped, and
a pod that already exists under its deterministic name is adopted, never
duplicated.

Every write goes through the helpers under "writes" below, and each first
calls ``ctx.fence()``: with leader election (``spotguard.operator.leader``) a
replica that may have lost its Lease exits there instead of writing. Status
writes carry the job's ``resourceVersion``, so one based on a stale read
(another replica wrote since) fails with 409 and is redone from a fresh read.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from spotguard.operator import hostports as hp
from spotguard.operator import policy
from spotguard.operator.apierrors import api_reason, api_status
from spotguard.operator.classify import SIDECAR_EXITED, classify_pod_end
from spotguard.operator.decide import (
    COND_INVALID,
    TERMINAL_PHASES,
    Decision,
    Event,
    Member,
    Observation,
    attempt_pods,
    condition_is,
    decide,
    format_time,
    on_create_error,
    parse_time,
    pod_name,
    status_patch,
)
from spotguard.operator.metrics import OperatorMetrics
from spotguard.operator.podbuilder import (
    ANNOTATION_OPERATOR_INSTANCE,
    LABEL_ATTEMPT,
    LABEL_JOB,
    OperatorConfig,
    build_pods,
    build_service,
)
from spotguard.operator.spec import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    SpecError,
    TrainingJobSpec,
    check_name,
    parse,
)

log = logging.getLogger("spotguard.operator")

MERGE_PATCH = "application/merge-patch+json"


def no_fence() -> None:
    """The fence of an operator that runs alone (no leader election): every write may go ahead."""


@dataclass
class VerifiedCache:
    """Newest verified checkpoint per job, filled by the background probe."""

    entries: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, namespace: str, job: str) -> dict[str, Any] | None:
        """The cached entry of a job, if any."""
        with self.lock:
            entry = self.entries.get((namespace, job))
            return dict(entry) if entry else None

    def put(self, namespace: str, job: str, entry: dict[str, Any]) -> bool:
        """Store; True when the step changed."""
        with self.lock:
            old = self.entries.get((namespace, job))
            self.entries[(namespace, job)] = entry
            return old is None or old.get("step") != entry.get("step")

    def forget(self, namespace: str, job: str) -> None:
        """Drop a deleted job's entry."""
        with self.lock:
            self.entries.pop((namespace, job), None)


@dataclass
class Context:
    """Everything the handlers need, created once at startup and kept in kopf's memo."""

    core: Any  # kubernetes.client.CoreV1Api
    custom: Any  # kubernetes.client.CustomObjectsApi
    config: OperatorConfig
    metrics: OperatorMetrics
    verified: VerifiedCache = field(default_factory=VerifiedCache)
    resync_seconds: float = 30.0
    checkpoint_poll_seconds: float = 30.0
    #: Read storage (and the credentials Secrets) to report the newest verified checkpoint.
    read_checkpoints: bool = True
    #: This operator process (the leader election's identity): Events' reportingInstance, pods' annotation.
    instance: str = field(default_factory=socket.gethostname)
    #: Called before every write; exits the process when this replica may no longer act (see leader.py).
    fence: Callable[[], None] = no_fence
    #: Phase of each job as the last reconcile left it (the probe and daemon read it).
    phases: dict[tuple[str, str], str] = field(default_factory=dict)
    #: Each job as the last reconcile read it (the storage probe reads its spec from here).
    jobs: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    #: Namespaces served (empty: all); the jobs whose host ports are taken are listed there.
    namespaces: tuple[str, ...] = ()
    #: Host ports handed to hostNetwork jobs (first, last).
    host_port_range: tuple[int, int] = hp.DEFAULT_RANGE
    #: Serializes this process's allocations of host ports.
    port_lock: threading.Lock = field(default_factory=threading.Lock)
    #: Jobs waiting for a free pair of host ports (woken when a job finishes or goes).
    port_waiting: set[tuple[str, str]] = field(default_factory=set)
    waiting_lock: threading.Lock = field(default_factory=threading.Lock)

    def waiting_for_ports(self) -> list[tuple[str, str]]:
        """The jobs waiting for host ports now."""
        with self.waiting_lock:
            return sorted(self.port_waiting)

    def set_waiting_for_ports(self, key: tuple[str, str], waiting: bool) -> None:
        """Note whether a job waits for host ports."""
        with self.waiting_lock:
            if waiting:
                self.port_waiting.add(key)
            else:
                self.port_waiting.discard(key)


# --- reads ---------------------------------------------------------------------


def get_job(ctx: Context, namespace: str, name: str) -> dict[str, Any] | None:
    """The TrainingJob, or None when it is gone."""
    try:
        body: dict[str, Any] = ctx.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        return body
    except Exception as exc:
        if api_status(exc) == 404:
            return None
        raise


def get_pod(ctx: Context, namespace: str, name: str) -> dict[str, Any] | None:
    """A pod as a plain dict, or None when it does not exist."""
    try:
        # Raw JSON: exactly what the apiserver says, in the shape the classifier reads.
        resp = ctx.core.read_namespaced_pod(name, namespace, _preload_content=False)
        pod: dict[str, Any] = json.loads(resp.data)
        return pod
    except Exception as exc:
        if api_status(exc) == 404:
            return None
        raise


def node_exists(ctx: Context, name: str) -> bool:
    """Whether the Node object still exists."""
    return node_state(ctx, name) != "gone"


#: The Ready condition's message kubelet reports while a graceful node shutdown runs.
NODE_SHUTTING_DOWN = "node is shutting down"


def node_state(ctx: Context, name: str) -> str:
    """``gone`` (no Node object), ``shutting-down`` (kubelet's graceful shutdown has begun), else ``up``."""
    try:
        node = ctx.core.read_node(name, _preload_content=False)
    except Exception as exc:
        if api_status(exc) == 404:
            return "gone"
        raise
    conditions = ((json.loads(node.data).get("status") or {}).get("conditions")) or []
    for cond in conditions:
        if cond.get("type") == "Ready" and cond.get("status") != "True" and \
                NODE_SHUTTING_DOWN in str(cond.get("message") or ""):
            return "shutting-down"
    return "up"


def _owned_by(pod: Mapping[str, Any], uid: str) -> bool:
    refs = (pod.get("metadata") or {}).get("ownerReferences") or []
    return any(isinstance(r, Mapping) and r.get("uid") == uid for r in refs)


# --- writes --------------------------------------------------------------------


class NotOursYet(Exception):
    """A pod with the attempt's name exists but belongs to an older, deleted job."""


class JobChanged(Exception):
    """A status write based on a stale read of the job (409): read it again and redo the look."""


def create_pod(ctx: Context, pod: dict[str, Any], owner_uid: str) -> bool:
    """Create the pod; if it already exists and is ours, adopt it. True when created now.

    The pod is annotated with the operator's instance: which replica made it.
    """
    namespace = pod["metadata"]["namespace"]
    pod = {**pod, "metadata": {**pod["metadata"], "annotations": {
        **(pod["metadata"].get("annotations") or {}), ANNOTATION_OPERATOR_INSTANCE: ctx.instance}}}
    ctx.fence()
    try:
        ctx.core.create_namespaced_pod(namespace, pod)
        return True
    except Exception as exc:
        if api_status(exc) != 409:
            raise
    existing = get_pod(ctx, namespace, pod["metadata"]["name"])
    if existing is not None and not _owned_by(existing, owner_uid):
        raise NotOursYet(pod["metadata"]["name"])
    return False


def ensure_service(ctx: Context, service: dict[str, Any], owner_uid: str) -> None:
    """Create a gang's headless Service; an existing one of this job is kept (its spec never changes)."""
    namespace = service["metadata"]["namespace"]
    ctx.fence()
    try:
        ctx.core.create_namespaced_service(namespace, service)
        return
    except Exception as exc:
        if api_status(exc) != 409:
            raise
    existing = ctx.core.read_namespaced_service(service["metadata"]["name"], namespace)
    refs = existing.metadata.owner_references or []
    if not any(r.uid == owner_uid for r in refs):
        raise NotOursYet(f"service {service['metadata']['name']}")


def delete_pod(ctx: Context, namespace: str, name: str, *, force: bool) -> None:
    """Delete a pod (at once when ``force``: its node is gone); a missing pod is fine."""
    ctx.fence()
    try:
        if force:
            ctx.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        else:
            ctx.core.delete_namespaced_pod(name, namespace)
    except Exception as exc:
        if api_status(exc) != 404:
            raise


def patch_status(ctx: Context, job: Mapping[str, Any], patch: Mapping[str, Any]) -> None:
    """Merge-patch the status subresource (never the spec), if the job is still as read.

    Raises :class:`JobChanged` when the job changed since it was read (409):
    the decision may rest on a stale status (another replica's, or a pod end
    counted meanwhile), so it is made again from a fresh read.
    """
    meta = job["metadata"]
    body = {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "status": dict(patch)}
    ctx.fence()
    try:
        ctx.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], body, _content_type=MERGE_PATCH
        )
    except Exception as exc:
        if api_status(exc) == 409:
            raise JobChanged(f"{meta['namespace']}/{meta['name']}") from None
        if api_status(exc) != 404:
            raise


def post_event(ctx: Context, job: Mapping[str, Any], event: Event, now: datetime) -> None:
    """Post an Event on the TrainingJob; failures are logged, never fatal."""
    meta = job.get("metadata") or {}
    stamp = format_time(now)
    body = {
        "metadata": {"generateName": f"{meta.get('name')}.", "namespace": meta.get("namespace")},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "reason": event.reason,
        "message": event.message[:1024],
        "type": event.type,
        "source": {"component": "spotguard-operator"},
        "reportingComponent": "spotguard.dev/operator",
        "reportingInstance": ctx.instance[:128],
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
    ctx.fence()
    try:
        ctx.core.create_namespaced_event(meta.get("namespace"), body)
    except Exception as exc:  # an Event is a report; losing one must not stop the job
        log.warning("could not post event %s on %s: %s", event.reason, meta.get("name"), api_reason(exc))


# --- host ports ----------------------------------------------------------------------

#: Tries of one allocation before it is left to the next look (other writers of the job meanwhile).
ALLOCATION_TRIES = 10


@dataclass(frozen=True, slots=True)
class PortsResult:
    """The outcome of :func:`ensure_host_ports`."""

    #: The job as last read or written.
    job: dict[str, Any]
    #: The job's confirmed (master, metrics) pair; None while it has none.
    ports: tuple[int, int] | None = None
    #: Why it has none: every pair of the range is held (None: try again soon).
    exhausted: str | None = None


def list_jobs(ctx: Context) -> list[dict[str, Any]]:
    """Every TrainingJob the operator serves, read fresh from the apiserver."""
    if not ctx.namespaces:
        items = ctx.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
    else:
        items = [i for ns in ctx.namespaces
                 for i in ctx.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]]  # fmt: skip
    return list(items)


def _patch_ports(ctx: Context, job: Mapping[str, Any], ports: hp.HostPorts | None) -> dict[str, Any] | None:
    """Write (or remove) ``status.hostPorts`` if the job is still as read; None when it changed (409) or is gone."""
    meta = job["metadata"]
    body = {
        "metadata": {"resourceVersion": meta["resourceVersion"]},
        "status": {hp.STATUS_FIELD: ports.as_status() if ports else None},
    }
    ctx.fence()
    try:
        result: dict[str, Any] = ctx.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], body, _content_type=MERGE_PATCH
        )
        return result
    except Exception as exc:
        if api_status(exc) in (404, 409):
            return None
        raise


def ensure_host_ports(ctx: Context, job: dict[str, Any], spec: TrainingJobSpec) -> PortsResult:
    """The job's pair of host ports, allocated now if it has none.

    Claim, check, confirm: the job first claims a pair no other live job holds
    (``status.hostPorts`` without ``confirmed``), then lists the jobs again;
    if another job claims or holds a port of the pair, it withdraws and picks
    another, else it confirms the pair. Claims and lists are linearizable in
    the apiserver, so of two jobs that claim one pair the later claimant's
    list always sees the earlier claim: they cannot both confirm, whichever
    operator (or replica) handles them. Every write carries the job's
    ``resourceVersion``, so a write based on a stale read of the job fails
    (409) and is redone from a fresh read. Within one operator the lock makes
    allocations take turns, so they never meet at all; pods are created only
    with a confirmed pair.
    """
    mine = hp.recorded(job.get("status"))
    if mine is not None and mine.confirmed:
        return PortsResult(job, mine.pair)
    meta = job["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
    first, last = ctx.host_port_range
    start = hp.preferred_index(uid, hp.pair_count(first, last))
    avoid: set[int] = set()
    with ctx.port_lock:
        for _ in range(ALLOCATION_TRIES):
            current = get_job(ctx, namespace, name)
            if current is None or (current.get("metadata") or {}).get("uid") != uid:
                return PortsResult(job, None)
            job = current
            mine = hp.recorded(job.get("status"))
            if mine is not None and mine.confirmed:
                return PortsResult(job, mine.pair)
            if mine is None:
                pair = hp.pick_pair(hp.taken_ports(list_jobs(ctx), uid) | avoid, first, last, start)
                if pair is None:
                    return PortsResult(job, None, hp.exhausted_message(first, last))
                mine = hp.HostPorts(*pair)
                claimed = _patch_ports(ctx, job, mine)
                if claimed is None:
                    continue
                job = claimed
            # The check: a list read after the claim was written.
            others = hp.holders(list_jobs(ctx), uid, mine.pair)
            if others:
                log.info("%s/%s: host ports %d and %d are also claimed by %s: trying another pair",
                         namespace, name, mine.master, mine.metrics, ", ".join(others))  # fmt: skip
                avoid.update(mine.pair)
                _patch_ports(ctx, job, None)
                continue
            confirmed = _patch_ports(ctx, job, replace(mine, confirmed=True))
            if confirmed is None:
                continue
            log.info("%s/%s: host ports %d (master) and %d (metrics)", namespace, name, mine.master, mine.metrics)
            return PortsResult(confirmed, mine.pair)
    return PortsResult(job, None)


def _wants_ports(spec: TrainingJobSpec, job: Mapping[str, Any]) -> bool:
    """Whether to make sure the job has its host ports now.

    Not for a job being deleted or finished (unless a corrected spec brings it
    back), nor for a suspended one that has none yet (it gets them on resuming).
    """
    status = job.get("status") or {}
    if not hp.needs_host_ports(spec) or hp.deleting(job):
        return False
    if status.get("phase") in TERMINAL_PHASES and not condition_is(status, COND_INVALID):
        return False
    return not spec.suspend or hp.recorded(status) is not None


def _attempt_live(status: Mapping[str, Any]) -> bool:
    """Whether the current attempt's end is not accounted yet (its pods may run)."""
    attempt = status.get("attempt") or 0
    return bool(attempt) and (status.get("lastPodEnd") or {}).get("attempt") != attempt


# --- the reconcile ---------------------------------------------------------------


def observe(ctx: Context, job: Mapping[str, Any]) -> Observation:
    """Look at the current attempt's pod (and its node) and the cached checkpoint."""
    meta = job.get("metadata") or {}
    namespace, name, uid = str(meta.get("namespace")), str(meta.get("name")), meta.get("uid")
    status = job.get("status") or {}
    attempt = status.get("attempt") or 0
    last_end = status.get("lastPodEnd") or {}
    verified = ctx.verified.get(namespace, name)
    if verified is not None and verified == status.get("lastVerifiedCheckpoint"):
        verified = None
    if not attempt or last_end.get("attempt") == attempt or status.get("phase") in TERMINAL_PHASES:
        return Observation(pod_end=None, last_verified=verified)
    nodes = status.get("nodes")
    if isinstance(nodes, int) and nodes > 1:
        return Observation(last_verified=verified, members=observe_gang(ctx, namespace, name, uid, attempt, nodes))
    pod = get_pod(ctx, namespace, pod_name(name, attempt))
    if pod is not None and uid and not _owned_by(pod, uid):
        pod = None  # a leftover of an older job with the same name
    exists = True
    if pod is not None:
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if node and phase not in ("Succeeded", "Failed"):
            exists = node_exists(ctx, node)
    end = classify_pod_end(pod, exists)
    # The final checkpoint of a success is recorded by the probe's next read (the
    # daemon asks for one at once): storage is never read on this path, so a slow
    # or dead store cannot delay the handling of a pod end.
    return Observation(pod_end=end, last_verified=verified)


def observe_gang(
    ctx: Context, namespace: str, job: str, uid: str | None, attempt: int, nodes: int
) -> tuple[Member, ...]:
    """Every pod of a gang's attempt (one list call), classified, with whether it is gone for good."""
    listed = ctx.core.list_namespaced_pod(
        namespace, label_selector=f"{LABEL_JOB}={job},{LABEL_ATTEMPT}={attempt}", _preload_content=False
    )
    by_name = {p["metadata"]["name"]: p for p in json.loads(listed.data).get("items") or []}
    node_states: dict[str, str] = {}
    members = []
    for rank, pod_name_ in enumerate(attempt_pods(job, attempt, nodes)):
        pod = by_name.get(pod_name_)
        if pod is not None and uid and not _owned_by(pod, uid):
            pod = None
        node = ((pod or {}).get("spec") or {}).get("nodeName")
        phase = ((pod or {}).get("status") or {}).get("phase")
        state = "up"
        if pod is not None and node and phase not in ("Succeeded", "Failed"):
            if node not in node_states:
                node_states[node] = node_state(ctx, node)
            state = node_states[node]
        end = classify_pod_end(pod, state != "gone")
        members.append(
            Member(
                rank=rank,
                pod=pod_name_,
                end=end,
                node=node,
                present=pod is not None,
                settled=pod is None or phase in ("Succeeded", "Failed"),
                deleting=bool(((pod or {}).get("metadata") or {}).get("deletionTimestamp")),
                node_shutting_down=state == "shutting-down",
            )
        )
    return tuple(members)


#: How soon to look again at a job that changed while it was being looked at.
RELOOK_SECONDS = 0.1


def reconcile(ctx: Context, namespace: str, name: str, now: datetime | None = None) -> float | None:
    """Bring one TrainingJob one step closer to done. Returns seconds until the next look."""
    try:
        return _reconcile(ctx, namespace, name, now)
    except JobChanged:
        # Its pods as decided are made (or adopted the next time); the status is decided again.
        log.info("%s/%s changed while it was being looked at: looking again", namespace, name)
        return RELOOK_SECONDS


def _reconcile(ctx: Context, namespace: str, name: str, now: datetime | None) -> float | None:
    job = get_job(ctx, namespace, name)
    if job is None or (job.get("metadata") or {}).get("deletionTimestamp"):
        ctx.jobs.pop((namespace, name), None)
        ctx.set_waiting_for_ports((namespace, name), False)
        return None
    spec: TrainingJobSpec | SpecError
    try:
        spec = parse(job.get("spec"))
        check_name(name, spec)
    except SpecError as exc:
        spec = exc
    now = now or datetime.now(UTC)
    ports: tuple[int, int] | None = None
    if isinstance(spec, TrainingJobSpec) and _wants_ports(spec, job):
        got = ensure_host_ports(ctx, job, spec)
        job, ports = got.job, got.ports
        waiting = ports is None and not _attempt_live(job.get("status") or {})
        ctx.set_waiting_for_ports((namespace, name), waiting and got.exhausted is not None)
        if waiting:
            return _wait_for_ports(ctx, job, got.exhausted, now)
    else:
        ctx.set_waiting_for_ports((namespace, name), False)
    meta = job["metadata"]
    generation = meta.get("generation")
    status = dict(job.get("status") or {})
    draft: dict[str, Any] = status
    allocated_events: tuple[Event, ...] = ()
    if ports is not None:
        draft, allocated_events = hp.note_allocated(status, hp.HostPorts(*ports, True), now, generation)
    observation = observe(ctx, job)
    decision = decide(name, draft, spec, observation, now, generation)
    if allocated_events:
        decision = replace(decision, events=allocated_events + decision.events)
    decision = apply(ctx, job, spec, decision, now, ports)
    if decision.status.get("phase") in TERMINAL_PHASES:
        decision.status.pop(hp.STATUS_FIELD, None)  # a finished job frees its host ports
    report(ctx, job, status, decision, now)
    ctx.phases[(namespace, name)] = str(decision.status.get("phase") or "")
    ctx.jobs[(namespace, name)] = {**job, "status": decision.status}
    if decision.status.get("phase") in TERMINAL_PHASES:
        later = max(decision.requeue_after or 0.0, ctx.resync_seconds * 10)
        expires = policy.ttl_expires_at(spec, decision.status) if isinstance(spec, TrainingJobSpec) else None
        if expires is None:
            return later
        if expires <= now:
            delete_finished_job(ctx, job)
            return None
        return min(later, (expires - now).total_seconds())
    return decision.requeue_after


def delete_finished_job(ctx: Context, job: Mapping[str, Any]) -> None:
    """``spec.ttlSecondsAfterFinished`` passed: delete the TrainingJob object (its checkpoints are kept).

    The delete is conditional on the object's uid, so a job recreated meanwhile
    under the same name is never deleted.
    """
    meta = job["metadata"]
    ctx.fence()
    try:
        ctx.custom.delete_namespaced_custom_object(
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"],
            body={"preconditions": {"uid": meta.get("uid")}},
        )  # fmt: skip
    except Exception as exc:
        if api_status(exc) not in (404, 409):
            raise
        return
    log.info("%s/%s: deleted %ss after it finished (spec.ttlSecondsAfterFinished); its checkpoints are kept",
             meta["namespace"], meta["name"], (job.get("spec") or {}).get("ttlSecondsAfterFinished"))  # fmt: skip


def _wait_for_ports(ctx: Context, job: dict[str, Any], exhausted: str | None, now: datetime) -> float | None:
    """No pair for a job about to start an attempt: say so (when the range is full) and look again later."""
    meta = job["metadata"]
    status = dict(job.get("status") or {})
    if exhausted is None:  # other writers of the job got in the way: soon again
        return 1.0
    decision = hp.wait_for_ports(status, exhausted, now, meta.get("generation"))
    report(ctx, job, status, decision, now)
    ctx.phases[(meta["namespace"], meta["name"])] = str(decision.status.get("phase") or "")
    ctx.jobs[(meta["namespace"], meta["name"])] = {**job, "status": decision.status}
    return decision.requeue_after


def apply(
    ctx: Context,
    job: Mapping[str, Any],
    spec: TrainingJobSpec | SpecError,
    decision: Decision,
    now: datetime,
    ports: tuple[int, int] | None = None,
) -> Decision:
    """Carry out a decision's pod operations; returns the decision that really happened.

    ``ports``: the job's confirmed host ports; a hostNetwork job that needs
    them and has none gets no pods (the next attempt waits for a pair).
    """
    meta = job["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
    if decision.delete_pod:
        delete_pod(ctx, namespace, decision.delete_pod, force=decision.force_delete)
        if decision.force_delete:
            log.info("deleted pod %s/%s at once: its node is gone", namespace, decision.delete_pod)
    for pod_to_delete, force in decision.delete_pods:
        delete_pod(ctx, namespace, pod_to_delete, force=force)
        why = " at once: its node is gone" if force else ""
        log.info("stopping pod %s/%s of a gang%s", namespace, pod_to_delete, why)
    if decision.create_attempt is not None and isinstance(spec, TrainingJobSpec):
        if ports is None and hp.needs_host_ports(spec):
            return Decision(status=dict(job.get("status") or {}), requeue_after=hp.WAIT_SECONDS)
        pods = [{**pod, "spec": policy.placed(pod["spec"], spec, decision.status, now)}
                for pod in build_pods(name, namespace, uid, spec, decision.create_attempt, ctx.config, ports)]
        made: list[str] = []
        try:
            service = build_service(name, namespace, uid, spec, ports)
            if service is not None:
                ensure_service(ctx, service, uid)
            created = True
            for pod in pods:
                created = create_pod(ctx, pod, uid) and created
                made.append(pod["metadata"]["name"])
        except NotOursYet:
            # The previous job of this name is still being cleaned up; look again soon.
            return Decision(status=dict(job.get("status") or {}), requeue_after=2.0)
        except Exception as exc:
            code = api_status(exc)
            if code is None or code >= 500:
                raise
            # Never half a gang: the pods made so far go again.
            for made_pod in made:
                delete_pod(ctx, namespace, made_pod, force=True)
            return on_create_error(
                name,
                job.get("status") or {},
                decision.create_attempt,
                code,
                api_reason(exc),
                now,
                meta.get("generation"),
            )
        if not created:
            log.info("pods of attempt %d of %s/%s already existed: adopted", decision.create_attempt, namespace, name)
        if created and decision.create_attempt > 1:  # counted once, also when a look is redone
            ended = parse_time((decision.status.get("lastPodEnd") or {}).get("time"))
            latency = (datetime.now(UTC) - ended).total_seconds() if ended else None
            ctx.metrics.restarted(namespace, name, latency)
    return decision


def report(
    ctx: Context, job: Mapping[str, Any], old_status: Mapping[str, Any], decision: Decision, now: datetime
) -> None:
    """Patch the status if it changed, post the Events, update the metrics."""
    meta = job["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    patch = status_patch(old_status, decision.status)
    if patch:
        patch_status(ctx, job, patch)
    for event in decision.events:
        post_event(ctx, job, event, now)
        log.info("%s/%s: %s: %s", namespace, name, event.reason, event.message)
    for event in decision.events:
        if event.reason in (policy.R_TO_FALLBACK, policy.R_TO_PRIMARY):
            ctx.metrics.moved(namespace, name, "fallback" if event.reason == policy.R_TO_FALLBACK else "primary")
    if (decision.status.get("ignoredFailures") or 0) > (old_status.get("ignoredFailures") or 0):
        ctx.metrics.ignored(namespace, name)
    end = decision.accounted
    if end is not None:
        if end.kind == "preempted":
            ctx.metrics.preempted(namespace, name, end.lost_steps)
        elif end.kind == "failed":
            ctx.metrics.failed(namespace, name)
            if end.reason == SIDECAR_EXITED:
                ctx.metrics.sidecar_failed(namespace, name)
    ctx.metrics.observe_job(namespace, name, decision.status)
