"""The words of the TrainingJob state machine, and the helpers that write a status.

What the state machine reads (:class:`Observation`, a gang's :class:`Member`),
what it writes (phases, condition types and reasons, :class:`Event`, the
:class:`Decision`), the attempt's pod names, and the small helpers that edit a
status in place: conditions whose ``lastTransitionTime`` moves only on a flip,
the working copy (:class:`Draft`) a decision is built in, and the PodBlocked
and SidecarHealthy conditions that describe the current attempt's pods.

Pure, like its neighbours: ``decide.py`` (the entry and the one-pod attempt),
``accounting.py`` (an attempt's end, counted once, and what follows) and
``gang.py`` (attempts of several nodes) build on it; the reconcile and the
``spotguard jobs`` CLI read its names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Literal

from spotguard.operator.classify import SIDECAR_EXITED, PodEnd
from spotguard.operator.times import format_time, parse_time

# Phases
PENDING = "Pending"
RUNNING = "Running"
RESTARTING = "Restarting"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
SUSPENDED = "Suspended"
TERMINAL_PHASES = frozenset({SUCCEEDED, FAILED})

# Condition types
COND_CREATED = "Created"
COND_RUNNING = "Running"
COND_PREEMPTED = "Preempted"
COND_SUSPENDED = "Suspended"
COND_SUCCEEDED = "Succeeded"
COND_FAILED = "Failed"
COND_INVALID = "Invalid"
#: The current attempt's pod cannot start (reason: kubelet's or the scheduler's).
COND_BLOCKED = "PodBlocked"
#: spotguard's sidecar runs beside the trainer; set once a sidecar went down.
COND_SIDECAR = "SidecarHealthy"
#: The last attempt's trainer could not write a checkpoint: its staging volume was full.
COND_STAGING_FULL = "StagingFull"
#: The operator reads the job's checkpoints for its status; set once a read failed.
COND_CHECKPOINTS_READABLE = "CheckpointsReadable"

# Reasons (conditions and Events)
R_INVALID_SPEC = "InvalidSpec"
R_SPEC_VALID = "SpecValid"
R_POD_CREATED = "PodCreated"
R_POD_RUNNING = "PodRunning"
R_POD_PENDING = "PodPending"
R_POD_ENDED = "PodEnded"
R_COMPLETED = "Completed"
R_BACKOFF_LIMIT = "BackoffLimitExceeded"
R_PREEMPTION_LIMIT = "PreemptionLimitExceeded"
R_POD_CREATE_FAILED = "PodCreateFailed"
R_SUSPENDED = "Suspended"
R_RESUMED = "Resumed"
R_RESTARTING = "Restarting"
R_POD_FAILED = "PodFailed"
R_UNBLOCKED = "Unblocked"
R_GANG_STOPPING = "StoppingGang"
R_NODES_MISSING = "NodesMissing"
R_GANG_STARTING = "GangStarting"
R_SIDECAR_EXITED = SIDECAR_EXITED
R_SIDECAR_RUNNING = "SidecarRunning"
R_STAGING_FULL = "StagingFull"
R_STAGING_HAD_ROOM = "StagingHadRoom"
# Why the operator cannot read a job's checkpoints (CheckpointsReadable), and that it can again.
R_ENDPOINT_NOT_ALLOWED = "EndpointNotAllowed"
R_STORE_TOO_SLOW = "StoreTooSlow"
R_OBJECT_TOO_LARGE = "StoredObjectTooLarge"
R_STORAGE_UNREADABLE = "StorageUnreadable"
R_CHECKPOINTS_READ = "CheckpointsRead"

#: How long a pod may wait for a node before the job says so (a cluster
#: autoscaler often needs a few minutes to add a GPU node).
UNSCHEDULABLE_WARN_SECONDS = 300.0

#: What to do about each start problem (the kubelet's or scheduler's own message comes first).
_START_HINTS = {
    "CreateContainerConfigError": (
        "a Secret or ConfigMap (or a key in it) that the pod's environment or volumes name does not exist:"
        " create it in the job's namespace, or correct spec.checkpoint.credentialsSecret or the template"
    ),
    "CreateContainerError": "the container runtime could not create the container: see the message",
    "ErrImagePull": (
        "the image cannot be pulled: check its name and tag, that the registry is reachable from the node,"
        " and imagePullSecrets for a private registry (spec.sidecar.image for spotguard's containers)"
    ),
    "ErrImageNeverPull": "the image is not on the node and imagePullPolicy is Never",
    "InvalidImageName": "the image reference is not valid: correct it in the template (or spec.sidecar.image)",
    "Unschedulable": (
        "no node can run the pod: check its resources (nvidia.com/gpu), nodeSelector, tolerations and affinity,"
        " or add nodes that fit"
    ),
}
_START_HINTS["ImagePullBackOff"] = _START_HINTS["ErrImagePull"]

EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True, slots=True)
class Event:
    """A Kubernetes Event to post on the TrainingJob."""

    type: EventType
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Member:
    """One pod of a gang (an attempt of several nodes), as observed."""

    rank: int
    pod: str
    #: Its classification (a pod that does not exist: preempted, ``PodDeleted``).
    end: PodEnd
    #: The node it is bound to, if any.
    node: str | None = None
    #: The pod object exists.
    present: bool = True
    #: No process of it can run any more: gone, or ``Succeeded``/``Failed``.
    settled: bool = False
    #: It is being deleted already (``deletionTimestamp``).
    deleting: bool = False
    #: Its node reports a graceful shutdown under way (kubelet's Ready condition).
    node_shutting_down: bool = False


@dataclass(frozen=True, slots=True)
class Observation:
    """What the operator saw of the current attempt."""

    #: Classification of the current attempt's pod; None when no such pod exists.
    pod_end: PodEnd | None = None
    #: Newest verified checkpoint ``{"step", "uri", "time"}`` if freshly read.
    last_verified: Mapping[str, Any] | None = None
    #: Every pod of the current attempt by node rank, when it has several nodes.
    members: tuple[Member, ...] = ()
    #: Running pods of the next attempt that the status does not name: made by a look whose status
    #: write was lost (a conflict) before the job was suspended. Read only for a suspended job.
    strays: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do now."""

    status: dict[str, Any]
    #: Attempt number whose pod must be created now (create is idempotent).
    create_attempt: int | None = None
    #: Name of a pod to delete, and whether at once (its node is gone).
    delete_pod: str | None = None
    force_delete: bool = False
    #: Pods of a gang to delete: (name, at once).
    delete_pods: tuple[tuple[str, bool], ...] = ()
    #: Seconds until the next look (backoff), or None for "on the next event".
    requeue_after: float | None = None
    events: tuple[Event, ...] = ()
    #: The attempt end this decision accounted for (for metrics), if any.
    accounted: PodEnd | None = None


def pod_name(job: str, attempt: int) -> str:
    """Deterministic pod name of an attempt: ``<job>-a<attempt>``."""
    return f"{job}-a{attempt}"


def member_pod_name(job: str, attempt: int, rank: int, nodes: int) -> str:
    """Pod of node rank ``rank`` in an attempt: ``<job>-a<attempt>`` alone, ``<job>-a<attempt>-<rank>`` in a gang."""
    return pod_name(job, attempt) if nodes <= 1 else f"{job}-a{attempt}-{rank}"


def attempt_pods(job: str, attempt: int, nodes: int) -> list[str]:
    """Every pod of an attempt, by node rank."""
    return [member_pod_name(job, attempt, r, nodes) for r in range(max(1, nodes))]


def set_condition(
    conditions: list[dict[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> bool:
    """Set a condition in place; ``lastTransitionTime`` moves only when status flips.

    Returns True when the condition's status changed (a transition).
    """
    value = "True" if status else "False"
    for cond in conditions:
        if cond.get("type") == type_:
            changed = cond.get("status") != value
            cond["status"] = value
            cond["reason"] = reason
            cond["message"] = message
            if changed or not cond.get("lastTransitionTime"):
                cond["lastTransitionTime"] = format_time(now)
            if generation is not None:
                cond["observedGeneration"] = generation
            return changed
    cond = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": format_time(now),
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    conditions.append(cond)
    return True


def condition(status: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    """The condition of that type, if present."""
    for cond in status.get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == type_:
            return cond
    return None


def condition_is(status: Mapping[str, Any], type_: str, value: bool = True) -> bool:
    """Whether the condition is present with that status."""
    cond = condition(status, type_)
    return cond is not None and cond.get("status") == ("True" if value else "False")


@dataclass
class Draft:
    """Mutable working copy used while deciding (``decide``, ``accounting`` and ``gang`` all write to it)."""

    job: str
    st: dict[str, Any]
    now: datetime
    generation: int | None
    events: list[Event] = field(default_factory=list)

    @property
    def conds(self) -> list[dict[str, Any]]:
        conds = self.st.setdefault("conditions", [])
        assert isinstance(conds, list)
        return conds

    def cond(self, type_: str, status: bool, reason: str, message: str) -> bool:
        return set_condition(self.conds, type_, status, reason, message, self.now, self.generation)

    def phase(self, phase: str, event: Event | None = None) -> None:
        if self.st.get("phase") != phase:
            self.st["phase"] = phase
            if event is not None:
                self.events.append(event)

    def int(self, key: str) -> int:
        value = self.st.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0


def finish(d: Draft, **kw: Any) -> Decision:
    """The decision a draft ends in, stamped with the generation of the spec it was made for."""
    if d.generation is not None:
        d.st["observedGeneration"] = d.generation
    return Decision(status=d.st, events=tuple(d.events), **kw)


def start_problem_message(end: PodEnd, pod: str | None) -> str:
    """What the TrainingJob says about a pod that cannot start: what is wrong, then what to do."""
    detail = f": {end.message}" if end.message else ""
    hint = _START_HINTS.get(end.reason)
    return f"pod {pod} cannot start ({end.reason}){detail}" + (f". {hint[:1].upper()}{hint[1:]}" if hint else "")


def note_start_problem(d: Draft, end: PodEnd, current: str | None) -> float | None:
    """Set (or clear) the PodBlocked condition for a pod that has not started.

    Returns seconds until an unschedulable pod has waited long enough to be
    reported, or None. An Event is posted when the condition turns on or its
    reason changes, not at every look.
    """
    if end.start_problem is None:
        clear_blocked(d, f"pod {current} is {end.reason}")
        return None
    if end.start_problem == "unschedulable":
        since = parse_time(end.since)
        waited = (d.now - since).total_seconds() if since else UNSCHEDULABLE_WARN_SECONDS
        if waited < UNSCHEDULABLE_WARN_SECONDS:
            return UNSCHEDULABLE_WARN_SECONDS - waited
    message = start_problem_message(end, current)
    before = condition(d.st, COND_BLOCKED) or {}
    if before.get("status") != "True" or before.get("reason") != end.reason:
        d.events.append(Event("Warning", end.reason, message))
    d.cond(COND_BLOCKED, True, end.reason, message)
    return None


def clear_blocked(d: Draft, message: str) -> None:
    if condition_is(d.st, COND_BLOCKED):
        d.cond(COND_BLOCKED, False, R_UNBLOCKED, message)
        d.events.append(Event("Normal", R_UNBLOCKED, message))


def sidecar_up(d: Draft, message: str) -> None:
    """Turn SidecarHealthy back to True once a sidecar runs again (it is set only after one went down)."""
    if condition_is(d.st, COND_SIDECAR, False):
        d.cond(COND_SIDECAR, True, R_SIDECAR_RUNNING, message)
        d.events.append(Event("Normal", R_SIDECAR_RUNNING, message))


def note_checkpoint_reads(
    decision: Decision, problem: tuple[str, str] | None, now: datetime, generation: int | None
) -> Decision:
    """``decision`` with CheckpointsReadable set from the storage probe's last read.

    ``problem`` is ``(reason, message)`` while the operator cannot read the
    job's checkpoints: the condition is False, with a Warning Event when it
    turns False or its reason changes (not at every look). None once a read
    succeeds: True again, with a Normal Event, where it was False; a job
    whose reads never failed gets no such condition.
    """
    before = condition(decision.status, COND_CHECKPOINTS_READABLE) or {}
    if problem is None and before.get("status") != "False":
        return decision
    if problem is not None and before.get("status") == "False" and before.get("message") == problem[1]:
        return decision
    status = dict(decision.status)
    status["conditions"] = [dict(c) for c in status.get("conditions") or []]
    d = Draft("", status, now, generation)
    if problem is None:
        message = "the operator reads this job's checkpoints again"
        d.cond(COND_CHECKPOINTS_READABLE, True, R_CHECKPOINTS_READ, message)
        d.events.append(Event("Normal", R_CHECKPOINTS_READ, message))
    else:
        reason, message = problem
        if before.get("status") != "False" or before.get("reason") != reason:
            d.events.append(Event("Warning", reason, message))
        d.cond(COND_CHECKPOINTS_READABLE, False, reason, message)
    return replace(decision, status=status, events=decision.events + tuple(d.events))


def changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether a status patch is needed."""
    return dict(old or {}) != dict(new)


def status_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch turning ``old`` into ``new`` (top-level keys; removed -> None)."""
    old = old or {}
    patch: dict[str, Any] = {k: v for k, v in new.items() if old.get(k) != v}
    for k in old:
        if k not in new:
            patch[k] = None
    return patch


def phase_counts(phases: Sequence[str]) -> dict[str, int]:
    """Count jobs per phase (for the ``spotguard_jobs`` gauge)."""
    out = {p: 0 for p in (PENDING, RUNNING, RESTARTING, SUCCEEDED, FAILED, SUSPENDED)}
    for p in phases:
        out[p] = out.get(p, 0) + 1
    return out
