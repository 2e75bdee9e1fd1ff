"""The operator's side of the Kubernetes API: the Context its calls carry, and every read and write.

:class:`Context` is created once at startup and handed to every look at a job:
the API clients, the fence, this replica's identity and the caches the
handlers, the reconcile and the storage probe share. The functions below are
the operator's only calls to the apiserver: reads of jobs, pods and nodes;
writes of pods, Services, status and Events; and the allocation of host ports
(claim, check, confirm; its rules are in ``hostports.py``).

Every write first calls ``ctx.fence()``: with leader election
(``spotguard.operator.leader``) a replica that may have lost its Lease exits
there instead of writing. Status writes carry the job's ``resourceVersion``,
so one based on a stale read (another replica wrote since) fails with 409 and
is redone from a fresh read; one whose job changed only in its metadata (a
finalizer, annotations) is written again at the new version.

``reconcile.py`` decides what to call and when; nothing here decides anything
about a job.
"""

from __future__ import annotations

import copy
import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from spotguard.operator import hostports as hp
from spotguard.operator.apierrors import api_reason, api_status
from spotguard.operator.classify import sidecar_report
from spotguard.operator.jobstatus import Event
from spotguard.operator.metrics import OperatorMetrics
from spotguard.operator.podbuilder import ANNOTATION_OPERATOR_INSTANCE, OperatorConfig
from spotguard.operator.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION, TrainingJobSpec
from spotguard.operator.times import format_time

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


#: Pods :meth:`Context.remember_report` keeps at the most (a pod is a few KiB).
REPORTED_PODS = 1024


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
    #: Why the storage probe cannot read a job's checkpoints now: (reason, message); the reconcile reports it.
    storage_problems: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    #: Namespaces served (empty: all); the jobs whose host ports are taken are listed there.
    namespaces: tuple[str, ...] = ()
    #: Host ports handed to hostNetwork jobs (first, last).
    host_port_range: tuple[int, int] = hp.DEFAULT_RANGE
    #: Serializes this process's allocations of host ports.
    port_lock: threading.Lock = field(default_factory=threading.Lock)
    #: Jobs waiting for a free pair of host ports (woken when a job finishes or goes).
    port_waiting: set[tuple[str, str]] = field(default_factory=set)
    #: Failed staging cleanup pods already reported by an Event (``namespace/pod``; see stagingdirs).
    reported_cleanups: set[str] = field(default_factory=set)
    waiting_lock: threading.Lock = field(default_factory=threading.Lock)
    #: Each job pod as the pod watch last showed it with its sidecar's report ((namespace, pod) -> pod),
    #: the oldest dropped past ``REPORTED_PODS``: see :meth:`remember_report`.
    reported_pods: dict[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)

    def remember_report(self, namespace: str, pod: Mapping[str, Any]) -> None:
        """Keep ``pod`` (a watch event's object) when its sidecar shows a report: a pod can be gone before a
        look reads it, and a kubelet before 1.22 can remove a deleted pod's containers before it publishes
        their final states again. Only the replica that saw it knows it (a standby that takes over reads
        the pod, or records a bare deletion)."""
        if sidecar_report(pod) is None:
            return
        meta = pod.get("metadata") or {}
        kept = copy.deepcopy(
            {
                "metadata": {"name": meta.get("name"), "ownerReferences": meta.get("ownerReferences") or []},
                "spec": {"nodeName": (pod.get("spec") or {}).get("nodeName")},
                "status": pod.get("status") or {},
            }
        )
        self.reported_pods[(namespace, str(meta.get("name")))] = kept
        while len(self.reported_pods) > REPORTED_PODS:
            self.reported_pods.pop(next(iter(self.reported_pods)), None)

    def reported_pod(self, namespace: str, name: str, uid: str | None) -> Mapping[str, Any] | None:
        """The pod :meth:`remember_report` kept for ``namespace/name``, if the job ``uid`` owned it."""
        pod = self.reported_pods.get((namespace, name))
        return pod if pod is not None and (not uid or owned_by(pod, uid)) else None

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
    except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
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
    except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
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
    except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
        if api_status(exc) == 404:
            return "gone"
        raise
    conditions = ((json.loads(node.data).get("status") or {}).get("conditions")) or []
    for cond in conditions:
        if (
            cond.get("type") == "Ready"
            and cond.get("status") != "True"
            and NODE_SHUTTING_DOWN in str(cond.get("message") or "")
        ):
            return "shutting-down"
    return "up"


def owned_by(pod: Mapping[str, Any], uid: str) -> bool:
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
    pod = {
        **pod,
        "metadata": {
            **pod["metadata"],
            "annotations": {**(pod["metadata"].get("annotations") or {}), ANNOTATION_OPERATOR_INSTANCE: ctx.instance},
        },
    }
    ctx.fence()
    try:
        ctx.core.create_namespaced_pod(namespace, pod)
        return True
    except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
        if api_status(exc) != 409:
            raise
    existing = get_pod(ctx, namespace, pod["metadata"]["name"])
    if existing is not None and not owned_by(existing, owner_uid):
        raise NotOursYet(pod["metadata"]["name"])
    if existing is not None and (existing.get("metadata") or {}).get("deletionTimestamp"):
        # Being stopped (a pod a suspend found running): a dying pod is not adopted, the name is awaited.
        raise NotOursYet(pod["metadata"]["name"])
    return False


def ensure_service(ctx: Context, service: dict[str, Any], owner_uid: str) -> None:
    """Create a gang's headless Service; an existing one of this job is kept (its spec never changes)."""
    namespace = service["metadata"]["namespace"]
    ctx.fence()
    try:
        ctx.core.create_namespaced_service(namespace, service)
        return
    except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
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
    except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
        if api_status(exc) != 404:
            raise


#: How many times a status write is made again over a job whose metadata alone changed.
STATUS_WRITE_TRIES = 3


def patch_status(ctx: Context, job: Mapping[str, Any], patch: Mapping[str, Any]) -> None:
    """Merge-patch the status subresource (never the spec), if the job is still as read.

    Raises :class:`JobChanged` when the job changed since it was read (409):
    the decision may rest on a stale status (another replica's, or a pod end
    counted meanwhile), so it is made again from a fresh read. A job whose
    metadata alone changed (the operator's finalizer and annotations, added
    to every new job while its first look was made) is written again at its
    new version: the decision rests on its spec, status and deletion, and a
    look made again after its pods were made would not know it made them (a
    pod deleted meanwhile would be made again, its deletion never counted).
    """
    meta = job["metadata"]
    version = meta.get("resourceVersion")
    for tries_left in range(STATUS_WRITE_TRIES - 1, -1, -1):
        body = {"metadata": {"resourceVersion": version}, "status": dict(patch)}
        ctx.fence()
        try:
            ctx.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], body, _content_type=MERGE_PATCH
            )
            return
        except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
            if api_status(exc) == 404:
                return
            if api_status(exc) != 409:
                raise
        fresh = get_job(ctx, meta["namespace"], meta["name"]) if tries_left else None
        if fresh is None or not same_but_metadata(job, fresh):
            raise JobChanged(f"{meta['namespace']}/{meta['name']}")
        version = (fresh.get("metadata") or {}).get("resourceVersion")


def same_but_metadata(read: Mapping[str, Any], fresh: Mapping[str, Any]) -> bool:
    """Pure: whether a job read again differs from the one read before only in what no decision
    rests on (its metadata but for the generation and the deletion)."""
    before, after = read.get("metadata") or {}, fresh.get("metadata") or {}
    return (
        before.get("generation") == after.get("generation")
        and before.get("deletionTimestamp") == after.get("deletionTimestamp")
        and read.get("spec") == fresh.get("spec")
        and (read.get("status") or {}) == (fresh.get("status") or {})
    )


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
    except Exception as exc:  # noqa: BLE001 - an Event is a report; losing one must not stop the job
        log.warning("could not post event %s on %s: %s", event.reason, meta.get("name"), api_reason(exc))


def delete_finished_job(ctx: Context, job: Mapping[str, Any]) -> None:
    """``spec.ttlSecondsAfterFinished`` passed: delete the TrainingJob object (its checkpoints are kept).

    The delete is conditional on the object's uid, so a job recreated meanwhile
    under the same name is never deleted.
    """
    meta = job["metadata"]
    ctx.fence()
    try:
        ctx.custom.delete_namespaced_custom_object(
            GROUP,
            VERSION,
            meta["namespace"],
            PLURAL,
            meta["name"],
            body={"preconditions": {"uid": meta.get("uid")}},
        )
    except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
        if api_status(exc) not in (404, 409):
            raise
        return
    log.info(
        "%s/%s: deleted %ss after it finished (spec.ttlSecondsAfterFinished); its checkpoints are kept",
        meta["namespace"],
        meta["name"],
        (job.get("spec") or {}).get("ttlSecondsAfterFinished"),
    )


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
        items = [
            i
            for ns in ctx.namespaces
            for i in ctx.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
        ]
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
    except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
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
                log.info(
                    "%s/%s: host ports %d and %d are also claimed by %s: trying another pair",
                    namespace,
                    name,
                    mine.master,
                    mine.metrics,
                    ", ".join(others),
                )
                avoid.update(mine.pair)
                _patch_ports(ctx, job, None)
                continue
            confirmed = _patch_ports(ctx, job, replace(mine, confirmed=True))
            if confirmed is None:
                continue
            log.info("%s/%s: host ports %d (master) and %d (metrics)", namespace, name, mine.master, mine.metrics)
            return PortsResult(confirmed, mine.pair)
    return PortsResult(job, None)
