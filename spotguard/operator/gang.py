"""Gangs: an attempt of several nodes, one pod each, that lives and ends as one.

A gang runs while every member runs. The first member that ends (a
preemption the node or cloud reported outranks any other end) ends the
attempt: :func:`decide_gang` records why in ``status.teardown`` before
deleting any pod (a restarted operator reads it), stops the other members,
waits until every pod is gone, and only then accounts the end once
(``accounting.account``). A gang that waits for nodes says which ranks are
missing and why.

Pure (no I/O, no clock); ``decide.py`` calls it for a current attempt of
``status.nodes`` > 1, and the reconcile observes the members
(``reconcile.observe_gang``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from spotguard.operator import policy
from spotguard.operator.accounting import account, moved
from spotguard.operator.classify import FINAL_UNVERIFIED, PodEnd
from spotguard.operator.jobstatus import (
    COND_PREEMPTED,
    COND_RUNNING,
    COND_SIDECAR,
    COND_SUSPENDED,
    PENDING,
    R_GANG_STARTING,
    R_GANG_STOPPING,
    R_NODES_MISSING,
    R_POD_RUNNING,
    R_RESUMED,
    R_SIDECAR_EXITED,
    R_SUSPENDED,
    RESTARTING,
    RUNNING,
    SUSPENDED,
    Decision,
    Draft,
    Event,
    Member,
    clear_blocked,
    condition_is,
    finish,
    member_pod_name,
    note_start_problem,
    sidecar_up,
)
from spotguard.operator.policy import FALLBACK, MOVED, PRIMARY
from spotguard.operator.spec import TrainingJobSpec
from spotguard.operator.times import format_time

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


def decide_gang(d: Draft, spec: TrainingJobSpec, members: Sequence[Member]) -> Decision:
    """One look at a gang: running, waiting for nodes, stopping, or ended (accounted once, when all are gone)."""
    st = d.st
    attempt = st["attempt"]
    nodes = d.int("nodes")
    if len(members) != nodes:
        # Not observed (the reconcile always lists them); treat every missing rank as gone.
        have = {m.rank for m in members}
        members = [*members] + [
            Member(
                r,
                member_pod_name(d.job, attempt, r, nodes),
                PodEnd("preempted", "PodDeleted", "the pod was deleted before it finished"),
                present=False,
                settled=True,
            )
            for r in range(nodes)
            if r not in have
        ]
    members = sorted(members, key=lambda m: m.rank)
    teardown = st.get("teardown")
    if not isinstance(teardown, Mapping) or teardown.get("attempt") != attempt:
        teardown = None

    if teardown is None:
        if all(m.end.kind == "succeeded" for m in members):
            last = max(members, key=lambda m: m.end.ended_at or "")
            step = max((m.end.step for m in members if m.end.step is not None), default=None)
            end = PodEnd("succeeded", "Completed", f"all {nodes} pods succeeded", step, ended_at=last.end.ended_at)
            unverified = [m for m in members if m.end.reason == FINAL_UNVERIFIED]
            if unverified:
                message = f"{_member_where(unverified[0])}: {unverified[0].end.message}"
                end = replace(end, reason=FINAL_UNVERIFIED, message=message)
            return account(d, spec, end, None, who=f"attempt {attempt} (all {nodes} pods)")
        trigger = gang_trigger(members)
        if trigger is None and spec.suspend:
            return _start_teardown(d, members, None, "suspended", "Suspended", "spec.suspend is true")
        if trigger is None and policy.return_due(spec, st, d.now) == 0:
            return _start_teardown(d, members, None, MOVED, policy.R_TO_PRIMARY, "the fallback's cool-down is over")
        if trigger is not None:
            if trigger.end.reason == R_SIDECAR_EXITED:
                _gang_sidecar_exited(d, spec, members, trigger)
            return _start_teardown(d, members, trigger, trigger.end.kind, trigger.end.reason, trigger.end.message)
        return _gang_running(d, spec, members)

    # Stopping: upgrade the cause if the machine turns out to have gone, then wait for every pod.
    if teardown.get("kind") != "suspended" and teardown.get("strength", 0) < 2:
        trigger = gang_trigger(members)
        if trigger is not None and _strength(trigger.end) == 2:
            st["teardown"] = {
                **teardown,
                **_teardown_cause(trigger, "preempted", trigger.end.reason, trigger.end.message),
            }
            teardown = st["teardown"]
    pending = [m for m in members if not m.settled]
    if pending:
        deletes = tuple(
            (m.pod, m.end.stop_pod == "force")
            for m in pending
            if m.present and (not m.deleting or m.end.stop_pod == "force")
        )
        waiting = ", ".join(m.pod for m in pending)
        d.cond(COND_RUNNING, False, R_GANG_STOPPING, f"stopping attempt {attempt}: waiting for {waiting} to end")
        return finish(d, delete_pods=deletes, requeue_after=None if not deletes else 2.0)
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


def _gang_sidecar_exited(d: Draft, spec: TrainingJobSpec, members: Sequence[Member], trigger: Member) -> None:
    """SidecarHealthy False and a Warning when a gang member's sidecar stopped while its trainer ran."""
    grace, limit = spec.preemption.grace_period_seconds, spec.preemption.backoff_limit
    message = (
        f"{_member_where(trigger)}: {trigger.end.message}. Checkpoints were no longer uploaded:"
        f" stopping the {len(members)} pods of attempt {d.st['attempt']} (the trainers have {grace}s to"
        f" save a checkpoint); it counts as a failure (backoffLimit {limit})"
    )
    d.cond(COND_SIDECAR, False, R_SIDECAR_EXITED, message)
    d.events.append(Event("Warning", R_SIDECAR_EXITED, message))


def _start_teardown(
    d: Draft, members: Sequence[Member], trigger: Member | None, kind: str, reason: str, message: str
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
    return finish(d, requeue_after=0.05)


def _end_gang(d: Draft, spec: TrainingJobSpec, members: Sequence[Member], teardown: Mapping[str, Any]) -> Decision:
    """Every pod of the attempt is gone: account its end once, then the next attempt or the end."""
    st = d.st
    st.pop("teardown", None)
    kind = str(teardown.get("kind") or "preempted")
    step = max((m.end.step for m in members if m.end.step is not None), default=None)
    where = str(teardown.get("pod") or "")
    node = teardown.get("node")
    if kind == "suspended":
        st["lastPodEnd"] = {
            "attempt": st["attempt"],
            "kind": "suspended",
            "reason": R_SUSPENDED,
            "message": "spec.suspend is true",
            "time": format_time(d.now),
        }
        st["phase"] = SUSPENDED
        d.cond(COND_RUNNING, False, R_SUSPENDED, "the job is suspended")
        d.events.append(Event("Normal", R_SUSPENDED, f"job suspended; the {len(members)} pods stopped"))
        return finish(d)
    if kind == MOVED:
        to = PRIMARY if teardown.get("reason") == policy.R_TO_PRIMARY else FALLBACK
        st.get("placement", {}).pop("returning", None)
        return moved(d, spec, to, str(teardown.get("reason")), str(teardown.get("message") or ""))
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
    decision = account(d, spec, end, where, who=who)
    record = decision.status.get("lastPodEnd")
    if isinstance(record, dict):
        record["pod"] = where
        if node:
            record["node"] = node
    return decision


def _gang_running(d: Draft, spec: TrainingJobSpec, members: Sequence[Member]) -> Decision:
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
        clear_blocked(d, f"all {nodes} pods are running")
        if all(m.end.sidecar_running for m in members):
            sidecar_up(d, f"the sidecars of all {nodes} pods of attempt {attempt} are running")
        return finish(d)
    if st.get("phase") != RUNNING:
        d.phase(PENDING)
    unschedulable = [m for m in members if m.end.start_problem == "unschedulable"]
    blocked = [m for m in members if m.end.start_problem == "blocked"]
    move: float | None = None
    if unschedulable:
        waited = max(policy.unschedulable_for(m.end, d.now) or 0.0 for m in unschedulable)
        move = policy.unschedulable_move(spec, st, waited)
        if move == 0:
            message = (
                f"{len(unschedulable)} of {nodes} pods could not be scheduled for {waited:.0f}s:"
                f" {unschedulable[0].end.message}"
            )
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
        wait = note_start_problem(d, problem.end, problem.pod)
        waits = [w for w in (wait, move) if w is not None]
        if waits:
            return finish(d, requeue_after=min(waits))
    else:
        clear_blocked(d, f"{len(running)} of {nodes} pods running")
    return finish(d)
