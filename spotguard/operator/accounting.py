"""An attempt's end, counted once, and what follows it.

When an attempt ends (its pod, or a whole gang), :func:`account` records it in
``status.lastPodEnd`` and counts it: a preemption against
``maxPreemptions``, a failure against ``backoffLimit`` (unless a failure rule
says otherwise), a success or a suspension not at all. Then the job fails
(:func:`fail`), waits out its backoff, or starts the next attempt at once
(:func:`create_next`), possibly on the other placement (:func:`switch`,
:func:`moved`). The deadline and a pod the apiserver refuses end here too.

Pure (no I/O, no clock); ``decide.py`` and ``gang.py`` call it, and it writes
the status through the helpers of ``jobstatus.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from spotguard.operator import policy
from spotguard.operator.classify import FINAL_UNVERIFIED, PodEnd
from spotguard.operator.jobstatus import (
    COND_BLOCKED,
    COND_CREATED,
    COND_FAILED,
    COND_PREEMPTED,
    COND_RUNNING,
    COND_SIDECAR,
    COND_STAGING_FULL,
    COND_SUCCEEDED,
    COND_SUSPENDED,
    FAILED,
    PENDING,
    R_BACKOFF_LIMIT,
    R_COMPLETED,
    R_POD_CREATE_FAILED,
    R_POD_CREATED,
    R_POD_ENDED,
    R_POD_FAILED,
    R_POD_PENDING,
    R_PREEMPTION_LIMIT,
    R_SIDECAR_EXITED,
    R_STAGING_FULL,
    R_STAGING_HAD_ROOM,
    R_SUSPENDED,
    RESTARTING,
    SUCCEEDED,
    SUSPENDED,
    Decision,
    Draft,
    Event,
    Observation,
    attempt_pods,
    condition_is,
    finish,
    pod_name,
    set_condition,
)
from spotguard.operator.policy import COND_FALLBACK, FALLBACK, MOVED, PRIMARY
from spotguard.operator.spec import TrainingJobSpec
from spotguard.operator.times import format_time


def sidecar_exited(d: Draft, spec: TrainingJobSpec, end: PodEnd, decision: Decision, pod: str | None) -> Decision:
    """Say that a pod's sidecar stopped while its trainer ran, and what the accounted end does next.

    The SidecarExited Warning takes the place of the PodFailed one; the counting
    was done by ``account``, as for any failed attempt.
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
    message = (
        f"pod {pod}: {end.message}. Checkpoints were no longer uploaded: stopping the pod"
        f" (the trainer has {grace}s to save a checkpoint); {then}"
    )
    set_condition(st.setdefault("conditions", []), COND_SIDECAR, False, R_SIDECAR_EXITED, message, d.now, d.generation)
    warning = Event("Warning", R_SIDECAR_EXITED, message)
    events = [warning if e.reason == R_POD_FAILED else e for e in decision.events]
    if warning not in events:
        events.insert(0, warning)
    return replace(decision, events=tuple(events))


def note_staging(d: Draft, end: PodEnd, who: str) -> None:
    """Say whether the attempt's checkpoint volume filled up (condition StagingFull, and a Warning Event).

    The sidecar reports it on its way out; the condition turns False again
    when a later attempt ends without such a report.
    """
    if end.staging_full is not None:
        message = f"{who}: {end.staging_full}"
        d.cond(COND_STAGING_FULL, True, R_STAGING_FULL, message)
        d.events.append(Event("Warning", R_STAGING_FULL, message))
    elif condition_is(d.st, COND_STAGING_FULL):
        d.cond(COND_STAGING_FULL, False, R_STAGING_HAD_ROOM, f"{who} ended without a full checkpoint volume")


def create_next(d: Draft, spec: TrainingJobSpec) -> Decision:
    st = d.st
    nodes = spec.nodes
    if policy.return_due(spec, st, d.now) == 0:
        switch(d, spec, PRIMARY, policy.R_TO_PRIMARY, "the fallback's cool-down is over")
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
    return finish(d, create_attempt=attempt)


def account(d: Draft, spec: TrainingJobSpec, end: PodEnd, current: str | None, who: str | None = None) -> Decision:
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
    note_staging(d, end, who)
    if condition_is(st, COND_BLOCKED):
        d.cond(COND_BLOCKED, False, R_POD_ENDED, f"{who} ended: {end.reason}")

    if end.kind == "succeeded":
        st["phase"] = SUCCEEDED
        st["completionTime"] = format_time(d.now)
        d.cond(COND_SUCCEEDED, True, R_COMPLETED, f"training finished in {who}")
        d.events.append(Event("Normal", R_COMPLETED, f"training finished in {who}"))
        if end.reason == FINAL_UNVERIFIED:
            d.events.append(Event("Warning", FINAL_UNVERIFIED, f"{who}: {end.message}"))
        return finish(d, accounted=end, delete_pod=delete, force_delete=force)

    if spec.suspend:
        # Stopped because we asked it to: not a preemption, not a failure.
        st["phase"] = SUSPENDED
        d.cond(COND_SUSPENDED, True, R_SUSPENDED, "spec.suspend is true")
        d.cond(COND_RUNNING, False, R_SUSPENDED, "the job is suspended")
        d.events.append(Event("Normal", R_SUSPENDED, f"job suspended; {who} stopped"))
        return finish(d, delete_pod=delete, force_delete=force)

    placement = st.get("placement") or {}
    if placement.get("returning") == attempt:
        # Stopped to go back to the primary placement: not a preemption, not a failure.
        record["kind"] = MOVED
        return replace(
            moved(d, spec, PRIMARY, policy.R_TO_PRIMARY, "the fallback's cool-down is over", record=record),
            delete_pod=delete,
            force_delete=force,
        )

    at = f" at step {step}" if isinstance(step, int) else ""
    avoided = policy.note_end_on_node(st, spec, end.node, d.now)
    if avoided:
        d.events.append(Event("Warning", policy.R_NODE_AVOIDED, avoided))
    if end.kind == "preempted":
        st["preemptions"] += 1
        n, limit = st["preemptions"], spec.preemption.max_preemptions
        d.cond(COND_PREEMPTED, True, end.reason, f"{who}: {end.message or end.reason}")
        if n > limit:
            return fail(d, R_PREEMPTION_LIMIT, f"preempted {n} times (maxPreemptions {limit})", end, delete, force)
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
            switch(d, spec, FALLBACK, "Preemptions", why)
    elif (rule := policy.failure_action(spec.failure_rules, end))[0] != "Count":
        action, index = rule
        assert index is not None
        said = policy.describe_rule(spec.failure_rules[index], index)
        if action == "FailJob":
            return fail(
                d, policy.R_RULE_FAIL, f"{who} failed ({end.reason}): {end.message}; {said}", end, delete, force
            )
        st["ignoredFailures"] = d.int("ignoredFailures") + 1
        d.events.append(
            Event("Warning", R_POD_FAILED, f"{who} failed ({end.reason}): {end.message}; not counted, {said}")
        )
        delay = spec.preemption.backoff.delay(1)
    else:
        st["failures"] += 1
        n, limit = st["failures"], spec.preemption.backoff_limit
        d.events.append(Event("Warning", R_POD_FAILED, f"{who} failed ({end.reason}): {end.message}"))
        if n > limit:
            return fail(
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
        return finish(d, accounted=end, delete_pod=delete, force_delete=force, requeue_after=delay)
    st.pop("restartAt", None)
    decision = create_next(d, spec)
    return Decision(
        status=decision.status,
        create_attempt=decision.create_attempt,
        delete_pod=delete,
        force_delete=force,
        events=decision.events,
        accounted=end,
    )


def fail(d: Draft, reason: str, message: str, end: PodEnd, delete: str | None, force: bool) -> Decision:
    d.st["phase"] = FAILED
    d.st["completionTime"] = format_time(d.now)
    d.st.pop("restartAt", None)
    d.cond(COND_FAILED, True, reason, message)
    d.events.append(Event("Warning", reason, message))
    return finish(d, accounted=end, delete_pod=delete, force_delete=force)


def switch(d: Draft, spec: TrainingJobSpec, to: str, reason: str, message: str) -> None:
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


def moved(
    d: Draft,
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
    st["lastPodEnd"] = record or {
        "attempt": st["attempt"],
        "kind": MOVED,
        "reason": reason,
        "message": message,
        "time": format_time(d.now),
    }
    switch(d, spec, to, reason, message)
    st.get("placement", {}).pop("returning", None)
    return replace(create_next(d, spec), delete_pod=delete_pod)


def return_to_primary(d: Draft, spec: TrainingJobSpec, current: str | None, *, running: bool) -> Decision:
    """The fallback's cool-down is over: a pod not yet running moves now; a running one stops after a checkpoint."""
    if not running:
        return moved(d, spec, PRIMARY, policy.R_TO_PRIMARY, "the fallback's cool-down is over", delete_pod=current)
    placement = d.st.setdefault("placement", {})
    if placement.get("returning") != d.st["attempt"]:
        placement["returning"] = d.st["attempt"]
        d.events.append(
            Event(
                "Normal",
                policy.R_RETURNING,
                f"the fallback's cool-down is over: stopping pod"
                f" {current} after a checkpoint; the next attempt runs on the primary placement",
            )
        )
    return finish(d, delete_pod=current)


def deadline_exceeded(d: Draft, spec: TrainingJobSpec, observation: Observation, current: str | None) -> Decision:
    """``spec.activeDeadlineSeconds`` ran out: the job fails; its pods stop after an emergency checkpoint."""
    message = (
        f"the job ran longer than spec.activeDeadlineSeconds ({spec.active_deadline_seconds}s since"
        f" {d.st.get('startTime')}); its checkpoints are kept"
    )
    members = tuple((m.pod, False) for m in observation.members if m.present and not m.settled)
    single = current if current is not None and not observation.members else None
    decision = fail(d, policy.R_DEADLINE, message, PodEnd("failed", policy.R_DEADLINE, message), single, False)
    d.st.pop("teardown", None)
    return replace(decision, delete_pods=members)


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
    d = Draft(job=job, st=copy.deepcopy(dict(status)), now=now, generation=generation)
    name = pod_name(job, attempt)
    if code in (400, 422):
        msg = f"cannot create pod {name}: {message}"
        return fail(d, R_POD_CREATE_FAILED, msg, PodEnd("failed", R_POD_CREATE_FAILED, msg), None, False)
    retry = f"cannot create pod {name} (HTTP {code}): {message}; retrying"
    d.events.append(Event("Warning", R_POD_CREATE_FAILED, retry))
    return Decision(status=dict(status), events=tuple(d.events), requeue_after=10.0)
