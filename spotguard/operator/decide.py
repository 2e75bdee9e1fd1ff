"""The TrainingJob state machine as a pure function.

``decide(status, spec, observation, now)`` returns the next status, whether to
create the next attempt's pod or delete the current one, when to look again,
and the Events to post. The handlers only gather the observation and apply the
decision, so every transition is testable without a cluster.

Phases: Pending -> Running -> (Restarting -> Pending -> Running)* -> Succeeded | Failed;
Suspended while ``spec.suspend`` is true.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from spotguard.operator import policy
from spotguard.operator.classify import SIDECAR_EXITED, PodEnd
from spotguard.operator.policy import COND_FALLBACK, FALLBACK, MOVED, PRIMARY
from spotguard.operator.spec import SpecError, TrainingJobSpec
from spotguard.operator.times import format_time as format_time  # re-exported: the state machine's clock format
from spotguard.operator.times import parse_time as parse_time

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
class _Draft:
    """Mutable working copy used while deciding."""

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


def _finish(d: _Draft, **kw: Any) -> Decision:
    if d.generation is not None:
        d.st["observedGeneration"] = d.generation
    return Decision(status=d.st, events=tuple(d.events), **kw)


def decide(
    job: str,
    status: Mapping[str, Any] | None,
    spec: TrainingJobSpec | SpecError,
    observation: Observation,
    now: datetime,
    generation: int | None = None,
) -> Decision:
    """Decide the next step for one TrainingJob. Pure: no I/O, no clock."""
    decision = _decide(job, status, spec, observation, now, generation)
    if isinstance(spec, SpecError) or decision.status.get("phase") in TERMINAL_PHASES:
        return decision
    # Wake up in time for what the policies will do by the clock alone.
    due = [decision.requeue_after] if decision.requeue_after is not None else []
    deadline = policy.deadline_at(spec, decision.status)
    if deadline is not None and decision.status.get("phase") != SUSPENDED:
        due.append(max(0.05, (deadline - now).total_seconds()))
    back = policy.return_due(spec, decision.status, now)
    if back:
        due.append(back)
    return replace(decision, requeue_after=min(due)) if due else decision


def _decide(
    job: str,
    status: Mapping[str, Any] | None,
    spec: TrainingJobSpec | SpecError,
    observation: Observation,
    now: datetime,
    generation: int | None = None,
) -> Decision:
    d = _Draft(job=job, st=copy.deepcopy(dict(status or {})), now=now, generation=generation)
    st = d.st
    for key in ("attempt", "preemptions", "failures"):
        st[key] = d.int(key)
    if observation.last_verified is not None:
        st["lastVerifiedCheckpoint"] = dict(observation.last_verified)

    if isinstance(spec, SpecError):
        message = f"invalid spec: {spec}"
        before = condition(st, COND_INVALID) or {}
        if before.get("status") != "True" or before.get("message") != message:
            d.events.append(Event("Warning", R_INVALID_SPEC, message))
        d.cond(COND_INVALID, True, R_INVALID_SPEC, message)
        d.cond(COND_FAILED, True, R_INVALID_SPEC, message)
        st["phase"] = FAILED
        return _finish(d)

    if condition_is(st, COND_INVALID):
        d.cond(COND_INVALID, False, R_SPEC_VALID, "the spec is valid")
        failed = condition(st, COND_FAILED) or {}
        if st.get("phase") == FAILED and failed.get("reason") == R_INVALID_SPEC:
            d.cond(COND_FAILED, False, R_SPEC_VALID, "the spec was corrected")
            st["phase"] = RESTARTING if st["attempt"] else PENDING
            d.events.append(Event("Normal", R_SPEC_VALID, "the spec is valid now"))

    if st.get("phase") in TERMINAL_PHASES:
        return _finish(d)

    attempt = st["attempt"]
    last_end = st.get("lastPodEnd") or {}
    accounted_attempt = last_end.get("attempt") if isinstance(last_end, Mapping) else None
    current = pod_name(job, attempt) if attempt else None

    deadline = policy.deadline_at(spec, st)
    suspended = spec.suspend or st.get("phase") == SUSPENDED or condition_is(st, COND_SUSPENDED)
    if deadline is not None and deadline <= now and not suspended:  # suspended: the count restarts on resume
        live = bool(attempt) and accounted_attempt != attempt
        return _deadline_exceeded(d, spec, observation if live else Observation(), current if live else None)

    # 1. The current attempt, if its end is not accounted for yet.
    if attempt and accounted_attempt != attempt and d.int("nodes") > 1:
        return _gang(d, spec, observation.members)
    if attempt and accounted_attempt != attempt:
        end = observation.pod_end
        if end is None:
            end = PodEnd("preempted", "PodDeleted", f"pod {current} disappeared before it ended")
        if end.kind == "running":
            if spec.suspend:
                d.cond(COND_SUSPENDED, True, R_SUSPENDED, f"stopping pod {current} after a checkpoint")
                return _finish(d, delete_pod=current if end.reason != "Terminating" else None)
            back = policy.return_due(spec, st, now)
            if back == 0 and end.reason != "Terminating":
                return _return_to_primary(d, spec, current, running=end.reason == "Running")
            if end.reason == "Running":
                d.cond(COND_RUNNING, True, R_POD_RUNNING, f"pod {current} is running")
                d.phase(RUNNING, Event("Normal", R_POD_RUNNING, f"pod {current} is running (attempt {attempt})"))
                if condition_is(st, COND_PREEMPTED):
                    d.cond(COND_PREEMPTED, False, R_RESUMED, f"resumed in pod {current}")
                _clear_blocked(d, f"pod {current} is running")
                if end.sidecar_running:
                    _sidecar_up(d, f"the sidecar of pod {current} is running")
            else:
                d.cond(COND_RUNNING, False, end.reason, end.message or f"pod {current} is {end.reason}")
                if st.get("phase") != RUNNING:
                    d.phase(PENDING)
                waited = policy.unschedulable_for(end, now)
                move = policy.unschedulable_move(spec, st, waited) if waited is not None else None
                if move == 0:
                    message = f"pod {current} could not be scheduled for {waited:.0f}s: {end.message}"
                    return _moved(d, spec, FALLBACK, "Unschedulable", message, delete_pod=current)
                wait = _start_problem(d, end, current)
                waits = [w for w in (wait, move) if w is not None]
                if waits:
                    return _finish(d, requeue_after=min(waits))
            return _finish(d)
        decision = _account(d, spec, end, current)
        return _sidecar_exited(d, spec, end, decision, current) if end.reason == R_SIDECAR_EXITED else decision

    # 2. Between attempts (new job, restarting, suspended).
    if spec.suspend:
        if d.cond(COND_SUSPENDED, True, R_SUSPENDED, "spec.suspend is true"):
            d.events.append(Event("Normal", R_SUSPENDED, "job suspended"))
        d.cond(COND_RUNNING, False, R_SUSPENDED, "the job is suspended")
        st["phase"] = SUSPENDED
        st.pop("restartAt", None)
        return _finish(d)
    if st.get("phase") == SUSPENDED or condition_is(st, COND_SUSPENDED):
        d.cond(COND_SUSPENDED, False, R_RESUMED, "spec.suspend is false")
        d.events.append(Event("Normal", R_RESUMED, "job resumed"))
        st.pop("restartAt", None)
        st["phase"] = RESTARTING if attempt else PENDING
        if spec.active_deadline_seconds is not None and attempt:
            # As a Kubernetes Job: the deadline counts from the resume (time suspended is not counted).
            st["startTime"] = format_time(now)

    restart_at = parse_time(st.get("restartAt"))
    if restart_at is not None and restart_at > now:
        return _finish(d, requeue_after=(restart_at - now).total_seconds())
    return _create_next(d, spec)


def start_problem_message(end: PodEnd, pod: str | None) -> str:
    """What the TrainingJob says about a pod that cannot start: what is wrong, then what to do."""
    detail = f": {end.message}" if end.message else ""
    hint = _START_HINTS.get(end.reason)
    return f"pod {pod} cannot start ({end.reason}){detail}" + (f". {hint[:1].upper()}{hint[1:]}" if hint else "")


def _start_problem(d: _Draft, end: PodEnd, current: str | None) -> float | None:
    """Set (or clear) the PodBlocked condition for a pod that has not started.

    Returns seconds until an unschedulable pod has waited long enough to be
    reported, or None. An Event is posted when the condition turns on or its
    reason changes, not at every look.
    """
    if end.start_problem is None:
        _clear_blocked(d, f"pod {current} is {end.reason}")
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


def _clear_blocked(d: _Draft, message: str) -> None:
    if condition_is(d.st, COND_BLOCKED):
        d.cond(COND_BLOCKED, False, R_UNBLOCKED, message)
        d.events.append(Event("Normal", R_UNBLOCKED, message))


def _sidecar_up(d: _Draft, message: str) -> None:
    """Turn SidecarHealthy back to True once a sidecar runs again (it is set only after one went down)."""
    if condition_is(d.st, COND_SIDECAR, False):
        d.cond(COND_SIDECAR, True, R_SIDECAR_RUNNING, message)
        d.events.append(Event("Normal", R_SIDECAR_RUNNING, message))


def _sidecar_exited(d: _Draft, spec: TrainingJobSpec, end: PodEnd, decision: Decision, pod: str | None) -> Decision:
    """Say that a pod's sidecar stopped while its trainer ran, and what the accounted end does next.

    The SidecarExited Warning takes the place of the PodFailed one; the counting
    was done by ``_account``, as for any failed attempt.
    """
    st = decision.status
    failures, limit = st.get("failures"), spec.preemption.backoff_limit
    if st.get("phase") == FAILED:
        then = f"the job failed: {failures} failures (backoffLimit {limit})"
    elif st.get("phase") == SUSPENDED:
        then = "the job is suspended"
    else:
        nxt = decision.create_attempt or int(st.get("attempt") or 0) + 1
        when = "now" if decision.create_attempt is not None else f"at {st.get('restartAt')}"
        then = f"attempt {nxt} starts {when} (failure {failures} of backoffLimit {limit})"
    grace = spec.preemption.grace_period_seconds
    message = (f"pod {pod}: {end.message}. Checkpoints were no longer uploaded: stopping the pod"
               f" (the trainer has {grace}s to save a checkpoint); {then}")  # fmt: skip
    set_condition(st.setdefault("conditions", []), COND_SIDECAR, False, R_SIDECAR_EXITED, message, d.now,
                  d.generation)  # fmt: skip
    warning = Event("Warning", R_SIDECAR_EXITED, message)
    events = [warning if e.reason == R_POD_FAILED else e for e in decision.events]
    if warning not in events:
        events.insert(0, warning)
    return replace(decision, events=tuple(events))


def _create_next(d: _Draft, spec: TrainingJobSpec) -> Decision:
    st = d.st
    nodes = spec.nodes
    if policy.return_due(spec, st, d.now) == 0:
        _switch(d, spec, PRIMARY, policy.R_TO_PRIMARY, "the fallback's cool-down is over")
    attempt = st["attempt"] + 1
    name = attempt_pods(d.job, attempt, nodes)[0]
    st["attempt"] = attempt
    st["currentPod"] = name
    if nodes > 1:
        st["nodes"] = nodes
    else:
        st.pop("nodes", None)
    st.pop("teardown", None)
    st.pop("restartAt", None)
    st.setdefault("startTime", format_time(d.now))
    st["phase"] = PENDING
    if nodes <= 1:
        d.cond(COND_CREATED, True, R_POD_CREATED, f"pod {name} created (attempt {attempt})")
        d.cond(COND_RUNNING, False, R_POD_PENDING, f"pod {name} is pending")
        d.events.append(Event("Normal", R_POD_CREATED, f"created pod {name} (attempt {attempt})"))
    else:
        pods = ", ".join(attempt_pods(d.job, attempt, nodes))
        d.cond(COND_CREATED, True, R_POD_CREATED, f"{nodes} pods created (attempt {attempt}): {pods}")
        d.cond(COND_RUNNING, False, R_POD_PENDING, f"{nodes} pods are pending")
        d.events.append(Event("Normal", R_POD_CREATED, f"created {nodes} pods (attempt {attempt}): {pods}"))
    return _finish(d, create_attempt=attempt)


def _account(d: _Draft, spec: TrainingJobSpec, end: PodEnd, current: str | None, who: str | None = None) -> Decision:
    """Account an attempt's end once; ``who`` says what ended it (default: its pod)."""
    st = d.st
    who = who or f"pod {current}"
    attempt = st["attempt"]
    prior = st.get("lastVerifiedCheckpoint") or {}
    step = end.step if end.step is not None else prior.get("step")
    record: dict[str, Any] = {
        "attempt": attempt,
        "kind": end.kind,
        "reason": end.reason,
        "message": end.message,
        "time": end.ended_at or format_time(d.now),
    }
    if isinstance(step, int):
        record["step"] = step
    st["lastPodEnd"] = record
    # An orphan whose node is gone would linger ~a minute, and a pod whose
    # trainer failed beside a classic sidecar might never end: remove them now.
    delete = current if end.stop_pod else None
    force = end.stop_pod == "force"
    d.cond(COND_RUNNING, False, R_POD_ENDED, f"{who} ended: {end.reason}")
    if condition_is(st, COND_BLOCKED):
        d.cond(COND_BLOCKED, False, R_POD_ENDED, f"{who} ended: {end.reason}")

    if end.kind == "succeeded":
        st["phase"] = SUCCEEDED
        st["completionTime"] = format_time(d.now)
        d.cond(COND_SUCCEEDED, True, R_COMPLETED, f"training finished in {who}")
        d.events.append(Event("Normal", R_COMPLETED, f"training finished in {who}"))
        return _finish(d, accounted=end, delete_pod=delete, force_delete=force)

    if spec.suspend:
        # Stopped because we asked it to: not a preemption, not a failure.
        st["phase"] = SUSPENDED
        d.cond(COND_SUSPENDED, True, R_SUSPENDED, "spec.suspend is true")
        d.cond(COND_RUNNING, False, R_SUSPENDED, "the job is suspended")
        d.events.append(Event("Normal", R_SUSPENDED, f"job suspended; {who} stopped"))
        return _finish(d, delete_pod=delete, force_delete=force)

    placement = st.get("placement") or {}
    if placement.get("returning") == attempt:
        # Stopped to go back to the primary placement: not a preemption, not a failure.
        record["kind"] = MOVED
        return replace(_moved(d, spec, PRIMARY, policy.R_TO_PRIMARY, "the fallback's cool-down is over",
                              record=record), delete_pod=delete, force_delete=force)  # fmt: skip

    at = f" at step {step}" if isinstance(step, int) else ""
    avoided = policy.note_end_on_node(st, spec, end.node, d.now)
    if avoided:
        d.events.append(Event("Warning", policy.R_NODE_AVOIDED, avoided))
    if end.kind == "preempted":
        st["preemptions"] += 1
        n, limit = st["preemptions"], spec.preemption.max_preemptions
        d.cond(COND_PREEMPTED, True, end.reason, f"{who}: {end.message or end.reason}")
        if n > limit:
            return _fail(d, R_PREEMPTION_LIMIT, f"preempted {n} times (maxPreemptions {limit})", end, delete, force)
        delay = spec.preemption.preemption_backoff.delay(n)
        d.events.append(
            Event(
                "Warning",
                "Preempted",
                f"{who} preempted ({end.reason}){at}; restarting ({n}/{limit} preemptions)",
            )
        )
        why = policy.note_preemption(st, spec, d.now)
        if why is not None:
            _switch(d, spec, FALLBACK, "Preemptions", why)
    elif (rule := policy.failure_action(spec.failure_rules, end))[0] != "Count":
        action, index = rule
        assert index is not None
        said = policy.describe_rule(spec.failure_rules[index], index)
        if action == "FailJob":
            return _fail(d, policy.R_RULE_FAIL, f"{who} failed ({end.reason}): {end.message}; {said}", end, delete,
                         force)  # fmt: skip
        st["ignoredFailures"] = d.int("ignoredFailures") + 1
        d.events.append(Event("Warning", R_POD_FAILED,
                              f"{who} failed ({end.reason}): {end.message}; not counted, {said}"))  # fmt: skip
        delay = spec.preemption.backoff.delay(1)
    else:
        st["failures"] += 1
        n, limit = st["failures"], spec.preemption.backoff_limit
        d.events.append(Event("Warning", R_POD_FAILED, f"{who} failed ({end.reason}): {end.message}"))
        if n > limit:
            return _fail(
                d,
                R_BACKOFF_LIMIT,
                f"{n} failures (backoffLimit {limit}); last: {end.reason}: {end.message}",
                end,
                delete,
                force,
            )
        delay = spec.preemption.backoff.delay(n)

    st["phase"] = RESTARTING
    if delay > 0:
        st["restartAt"] = format_time(d.now + timedelta(seconds=delay))
        return _finish(d, accounted=end, delete_pod=delete, force_delete=force, requeue_after=delay)
    st.pop("restartAt", None)
    decision = _create_next(d, spec)
    return Decision(
        status=decision.status,
        create_attempt=decision.create_attempt,
        delete_pod=delete,
        force_delete=force,
        events=decision.events,
        accounted=end,
    )


def _fail(d: _Draft, reason: str, message: str, end: PodEnd, delete: str | None, force: bool) -> Decision:
    d.st["phase"] = FAILED
    d.st["completionTime"] = format_time(d.now)
    d.st.pop("restartAt", None)
    d.cond(COND_FAILED, True, reason, message)
    d.events.append(Event("Warning", reason, message))
    return _finish(d, accounted=end, delete_pod=delete, force_delete=force)


def _switch(d: _Draft, spec: TrainingJobSpec, to: str, reason: str, message: str) -> None:
    """Move the job's next pods to ``to``: status.placement, the OnFallback condition, an Event."""
    if policy.pool(d.st) == to:
        return
    record = policy.switch(d.st, to, reason, d.now, spec)
    if to == FALLBACK:
        text = f"moving to the fallback placement: {message}; back at {record.get('returnAt')}"
        d.cond(COND_FALLBACK, True, reason, text)
        d.events.append(Event("Warning", policy.R_TO_FALLBACK, text))
    else:
        text = f"moving back to the primary placement: {message}"
        d.cond(COND_FALLBACK, False, reason, text)
        d.events.append(Event("Normal", policy.R_TO_PRIMARY, text))


def _moved(
    d: _Draft,
    spec: TrainingJobSpec,
    to: str,
    reason: str,
    message: str,
    *,
    delete_pod: str | None = None,
    record: dict[str, Any] | None = None,
) -> Decision:
    """The attempt ends to move the job (not counted); the next one starts at once where it goes."""
    st = d.st
    st["lastPodEnd"] = record or {"attempt": st["attempt"], "kind": MOVED, "reason": reason, "message": message,
                                  "time": format_time(d.now)}  # fmt: skip
    _switch(d, spec, to, reason, message)
    st.get("placement", {}).pop("returning", None)
    return replace(_create_next(d, spec), delete_pod=delete_pod)


def _return_to_primary(d: _Draft, spec: TrainingJobSpec, current: str | None, *, running: bool) -> Decision:
    """The fallback's cool-down is over: a pod not yet running moves now; a running one stops after a checkpoint."""
    if not running:
        return _moved(d, spec, PRIMARY, policy.R_TO_PRIMARY, "the fallback's cool-down is over", delete_pod=current)
    placement = d.st.setdefault("placement", {})
    if placement.get("returning") != d.st["attempt"]:
        placement["returning"] = d.st["attempt"]
        d.events.append(Event("Normal", policy.R_RETURNING, f"the fallback's cool-down is over: stopping pod"
                              f" {current} after a checkpoint; the next attempt runs on the primary placement"))
    return _finish(d, delete_pod=current)


def _deadline_exceeded(d: _Draft, spec: TrainingJobSpec, observation: Observation, current: str | None) -> Decision:
    """``spec.activeDeadlineSeconds`` ran out: the job fails; its pods stop after an emergency checkpoint."""
    message = (f"the job ran longer than spec.activeDeadlineSeconds ({spec.active_deadline_seconds}s since"
               f" {d.st.get('startTime')}); its checkpoints are kept")  # fmt: skip
    members = tuple((m.pod, False) for m in observation.members if m.present and not m.settled)
    single = current if current is not None and not observation.members else None
    decision = _fail(d, policy.R_DEADLINE, message, PodEnd("failed", policy.R_DEADLINE, message), single, False)
    d.st.pop("teardown", None)
    return replace(decision, delete_pods=members)


# --- gangs: an attempt of several nodes, one pod each -------------------------------

#: Sidecar reasons that only say the trainer got a SIGTERM: from a drain, or
#: from the operator stopping the rest of a gang. They never outrank a failure.
_WEAK_REASONS = frozenset({"PodDeleted", "sigterm", "sigint"})


def _strength(end: PodEnd) -> int:
    """How much an end says about why a gang stopped: the machine went (2), the code failed (1), a signal (1)."""
    if end.kind == "preempted" and end.reason not in _WEAK_REASONS:
        return 2
    return 1 if end.kind in ("failed", "preempted") else 0


def gang_trigger(members: Sequence[Member]) -> Member | None:
    """The member whose end ends the attempt, or None while every member runs (or some succeeded).

    A preemption the node or cloud reported beats everything (the other ranks
    failing because a peer vanished is a consequence); otherwise the member
    that ended first (a pod that is gone first of all), then the lowest rank.
    """
    ended = [_being_deleted(m) for m in members]
    ended = [m for m in ended if _strength(m.end) > 0]
    if not ended:
        return None
    strong = [m for m in ended if _strength(m.end) == 2]
    pool = strong or ended
    return min(pool, key=lambda m: (m.end.ended_at is not None and m.present, m.end.ended_at or "", m.rank))


def _being_deleted(m: Member) -> Member:
    """A running member someone else is deleting (a drain, an eviction, kubectl) ends the attempt now.

    Waiting until it is gone would lose its node from the record and keep the
    other ranks training until its grace period is over. A running member whose
    node is shutting down is preempted by the machine (the strongest cause):
    a peer that fails meanwhile, its rendezvous or collective cut off, fails
    because of it. The pod's own end (``DisruptionTarget``) may never be seen:
    the gang's teardown deletes it.
    """
    if m.end.kind == "running" and m.node_shutting_down:
        return replace(m, end=PodEnd("preempted", "NodeShutdown", f"node {m.node} is shutting down"))
    if m.end.kind == "running" and m.deleting:
        return replace(m, end=PodEnd("preempted", "PodDeleted", "the pod is being deleted (drain or eviction)"))
    return m


def _member_where(m: Member) -> str:
    return f"pod {m.pod}" + (f" on node {m.node}" if m.node else "")


def _gang(d: _Draft, spec: TrainingJobSpec, members: Sequence[Member]) -> Decision:
    """One look at a gang: running, waiting for nodes, stopping, or ended (accounted once, when all are gone)."""
    st = d.st
    attempt = st["attempt"]
    nodes = d.int("nodes")
    if len(members) != nodes:
        # Not observed (the reconcile always lists them); treat every missing rank as gone.
        have = {m.rank for m in members}
        members = [*members] + [
            Member(r, member_pod_name(d.job, attempt, r, nodes),
                   PodEnd("preempted", "PodDeleted", "the pod was deleted before it finished"),
                   present=False, settled=True)
            for r in range(nodes) if r not in have
        ]  # fmt: skip
    members = sorted(members, key=lambda m: m.rank)
    teardown = st.get("teardown")
    if not isinstance(teardown, Mapping) or teardown.get("attempt") != attempt:
        teardown = None

    if teardown is None:
        if all(m.end.kind == "succeeded" for m in members):
            last = max(members, key=lambda m: m.end.ended_at or "")
            step = max((m.end.step for m in members if m.end.step is not None), default=None)
            end = PodEnd("succeeded", "Completed", f"all {nodes} pods succeeded", step, ended_at=last.end.ended_at)
            return _account(d, spec, end, None, who=f"attempt {attempt} (all {nodes} pods)")
        trigger = gang_trigger(members)
        if trigger is None and spec.suspend:
            return _start_teardown(d, members, None, "suspended", "Suspended", "spec.suspend is true")
        if trigger is None and policy.return_due(spec, st, d.now) == 0:
            return _start_teardown(d, members, None, MOVED, policy.R_TO_PRIMARY, "the fallback's cool-down is over")
        if trigger is not None:
            if trigger.end.reason == R_SIDECAR_EXITED:
                _gang_sidecar_exited(d, spec, members, trigger)
            return _start_teardown(d, members, trigger, trigger.end.kind, trigger.end.reason,
                                   trigger.end.message)  # fmt: skip
        return _gang_running(d, spec, members)

    # Stopping: upgrade the cause if the machine turns out to have gone, then wait for every pod.
    if teardown.get("kind") != "suspended" and teardown.get("strength", 0) < 2:
        trigger = gang_trigger(members)
        if trigger is not None and _strength(trigger.end) == 2:
            st["teardown"] = {**teardown, **_teardown_cause(trigger, "preempted", trigger.end.reason,
                                                            trigger.end.message)}  # fmt: skip
            teardown = st["teardown"]
    pending = [m for m in members if not m.settled]
    if pending:
        deletes = tuple((m.pod, m.end.stop_pod == "force") for m in pending
                        if m.present and (not m.deleting or m.end.stop_pod == "force"))  # fmt: skip
        waiting = ", ".join(m.pod for m in pending)
        d.cond(COND_RUNNING, False, R_GANG_STOPPING, f"stopping attempt {attempt}: waiting for {waiting} to end")
        return _finish(d, delete_pods=deletes, requeue_after=None if not deletes else 2.0)
    return _end_gang(d, spec, members, teardown)


def _teardown_cause(m: Member, kind: str, reason: str, message: str) -> dict[str, Any]:
    # No None values: the stored status has no such keys, and a status that
    # differs from what is stored would be patched again at every look.
    cause = {
        "kind": kind,
        "reason": reason,
        "message": message,
        "pod": m.pod,
        "rank": m.rank,
        "node": m.node,
        "strength": _strength(m.end),
        "endedAt": m.end.ended_at,
        "lostSteps": m.end.lost_steps,
        "container": m.end.container,
        "exitCode": m.end.exit_code,
    }
    return {k: v for k, v in cause.items() if v is not None}


def _gang_sidecar_exited(d: _Draft, spec: TrainingJobSpec, members: Sequence[Member], trigger: Member) -> None:
    """SidecarHealthy False and a Warning when a gang member's sidecar stopped while its trainer ran."""
    grace, limit = spec.preemption.grace_period_seconds, spec.preemption.backoff_limit
    message = (f"{_member_where(trigger)}: {trigger.end.message}. Checkpoints were no longer uploaded:"
               f" stopping the {len(members)} pods of attempt {d.st['attempt']} (the trainers have {grace}s to"
               f" save a checkpoint); it counts as a failure (backoffLimit {limit})")  # fmt: skip
    d.cond(COND_SIDECAR, False, R_SIDECAR_EXITED, message)
    d.events.append(Event("Warning", R_SIDECAR_EXITED, message))


def _start_teardown(
    d: _Draft, members: Sequence[Member], trigger: Member | None, kind: str, reason: str, message: str
) -> Decision:
    """Record why the attempt ends (before any pod is deleted: a restarted operator reads it), then look again."""
    st = d.st
    attempt = st["attempt"]
    record: dict[str, Any] = {"attempt": attempt, "since": format_time(d.now)}
    if trigger is not None:
        record.update(_teardown_cause(trigger, kind, reason, message))
    else:
        record.update({"kind": kind, "reason": reason, "message": message})
    st["teardown"] = record
    others = [m.pod for m in members if not m.settled and (trigger is None or m.rank != trigger.rank)]
    if trigger is not None:
        what = "preempted" if kind == "preempted" else "failed"
        text = f"{_member_where(trigger)} {what} ({reason})" + (f": {message}" if message else "")
    else:
        text = message
    stop = f"; stopping {len(others)} other pod(s) of attempt {attempt}: {', '.join(others)}" if others else ""
    d.cond(COND_RUNNING, False, R_GANG_STOPPING, f"{text}{stop}")
    if st.get("phase") not in (SUSPENDED,) and kind != "suspended":
        st["phase"] = RESTARTING
    if kind == "suspended":
        d.cond(COND_SUSPENDED, True, R_SUSPENDED, f"stopping the {len(others)} pods of attempt {attempt}")
    d.events.append(Event("Normal" if kind == "suspended" else "Warning", R_GANG_STOPPING, f"{text}{stop}"))
    return _finish(d, requeue_after=0.05)


def _end_gang(d: _Draft, spec: TrainingJobSpec, members: Sequence[Member], teardown: Mapping[str, Any]) -> Decision:
    """Every pod of the attempt is gone: account its end once, then the next attempt or the end."""
    st = d.st
    st.pop("teardown", None)
    kind = str(teardown.get("kind") or "preempted")
    step = max((m.end.step for m in members if m.end.step is not None), default=None)
    where = str(teardown.get("pod") or "")
    node = teardown.get("node")
    if kind == "suspended":
        st["lastPodEnd"] = {"attempt": st["attempt"], "kind": "suspended", "reason": R_SUSPENDED,
                            "message": "spec.suspend is true", "time": format_time(d.now)}  # fmt: skip
        st["phase"] = SUSPENDED
        d.cond(COND_RUNNING, False, R_SUSPENDED, "the job is suspended")
        d.events.append(Event("Normal", R_SUSPENDED, f"job suspended; the {len(members)} pods stopped"))
        return _finish(d)
    if kind == MOVED:
        to = PRIMARY if teardown.get("reason") == policy.R_TO_PRIMARY else FALLBACK
        st.get("placement", {}).pop("returning", None)
        return _moved(d, spec, to, str(teardown.get("reason")), str(teardown.get("message") or ""))
    lost = teardown.get("lostSteps")
    code = teardown.get("exitCode")
    end = PodEnd(
        "failed" if kind == "failed" else "preempted",
        str(teardown.get("reason") or kind),
        str(teardown.get("message") or ""),
        step,
        lost_steps=lost if isinstance(lost, int) else None,
        ended_at=teardown.get("endedAt") if isinstance(teardown.get("endedAt"), str) else None,
        container=teardown.get("container") if isinstance(teardown.get("container"), str) else None,
        exit_code=code if isinstance(code, int) else None,
        node=node if isinstance(node, str) else None,
    )
    who = f"pod {where}" + (f" on node {node}" if node else "") + f" (rank {teardown.get('rank')})"
    decision = _account(d, spec, end, where, who=who)
    record = decision.status.get("lastPodEnd")
    if isinstance(record, dict):
        record["pod"] = where
        if node:
            record["node"] = node
    return decision


def _gang_running(d: _Draft, spec: TrainingJobSpec, members: Sequence[Member]) -> Decision:
    """No member ended: Running when all run, else say which nodes are missing and why."""
    st = d.st
    attempt = st["attempt"]
    nodes = len(members)
    running = [m for m in members if m.end.reason == "Running"]
    if len(running) == nodes:
        d.cond(COND_RUNNING, True, R_POD_RUNNING, f"all {nodes} pods are running")
        d.phase(RUNNING, Event("Normal", R_POD_RUNNING, f"all {nodes} pods are running (attempt {attempt})"))
        if condition_is(st, COND_PREEMPTED):
            d.cond(COND_PREEMPTED, False, R_RESUMED, f"resumed in attempt {attempt}")
        _clear_blocked(d, f"all {nodes} pods are running")
        if all(m.end.sidecar_running for m in members):
            _sidecar_up(d, f"the sidecars of all {nodes} pods of attempt {attempt} are running")
        return _finish(d)
    if st.get("phase") != RUNNING:
        d.phase(PENDING)
    unschedulable = [m for m in members if m.end.start_problem == "unschedulable"]
    blocked = [m for m in members if m.end.start_problem == "blocked"]
    move: float | None = None
    if unschedulable:
        waited = max(policy.unschedulable_for(m.end, d.now) or 0.0 for m in unschedulable)
        move = policy.unschedulable_move(spec, st, waited)
        if move == 0:
            message = (f"{len(unschedulable)} of {nodes} pods could not be scheduled for {waited:.0f}s:"
                       f" {unschedulable[0].end.message}")  # fmt: skip
            return _start_teardown(d, members, None, MOVED, "Unschedulable", message)
    if unschedulable:
        first = unschedulable[0]
        names = ", ".join(m.pod for m in unschedulable)
        message = (
            f"{len(unschedulable)} of {nodes} nodes missing: {names} cannot be scheduled"
            + (f": {first.end.message}" if first.end.message else "")
            + f" ({len(running)} of {nodes} pods running)"
        )
        d.cond(COND_RUNNING, False, R_NODES_MISSING, message)
    else:
        waiting = [m for m in members if m.end.reason != "Running"]
        detail = "; ".join(f"{m.pod}: {m.end.reason}" for m in waiting[:4])
        d.cond(COND_RUNNING, False, R_GANG_STARTING, f"{len(running)} of {nodes} pods running; waiting for {detail}")
    problem = (blocked or unschedulable)[0] if blocked or unschedulable else None
    if problem is not None:
        wait = _start_problem(d, problem.end, problem.pod)
        waits = [w for w in (wait, move) if w is not None]
        if waits:
            return _finish(d, requeue_after=min(waits))
    else:
        _clear_blocked(d, f"{len(running)} of {nodes} pods running")
    return _finish(d)


def on_create_error(
    job: str,
    status: Mapping[str, Any],
    attempt: int,
    code: int,
    message: str,
    now: datetime,
    generation: int | None = None,
) -> Decision:
    """What to do when the apiserver refused to create an attempt's pod.

    A 400/422 means the pod template itself is invalid: the job fails with the
    apiserver's message. Anything else (quota, a webhook, a hiccup) is retried.
    """
    d = _Draft(job=job, st=copy.deepcopy(dict(status)), now=now, generation=generation)
    name = pod_name(job, attempt)
    if code in (400, 422):
        msg = f"cannot create pod {name}: {message}"
        return _fail(d, R_POD_CREATE_FAILED, msg, PodEnd("failed", R_POD_CREATE_FAILED, msg), None, False)
    retry = f"cannot create pod {name} (HTTP {code}): {message}; retrying"
    d.events.append(Event("Warning", R_POD_CREATE_FAILED, retry))
    return Decision(status=dict(status), events=tuple(d.events), requeue_after=10.0)


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
