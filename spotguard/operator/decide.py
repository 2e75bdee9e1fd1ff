"""The TrainingJob state machine as a pure function.

``decide(status, spec, observation, now)`` returns the next status, whether to
create the next attempt's pod or delete the current one, when to look again,
and the Events to post. The handlers only gather the observation and apply the
decision, so every transition is testable without a cluster.

Phases: Pending -> Running -> (Restarting -> Pending -> Running)* -> Succeeded | Failed;
Suspended while ``spec.suspend`` is true.

This module holds the entry and its turns: an invalid spec, the deadline, the
current attempt of one pod (running, blocked, moving, ended), and the time
between attempts. Its neighbours hold the rest, all pure: ``jobstatus.py``
(the names and the status helpers), ``accounting.py`` (an attempt's end,
counted once, and the next attempt) and ``gang.py`` (attempts of several
nodes).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

from spotguard.operator import policy
from spotguard.operator.accounting import (
    account,
    create_next,
    deadline_exceeded,
    moved,
    return_to_primary,
    sidecar_exited,
)
from spotguard.operator.classify import PodEnd
from spotguard.operator.gang import decide_gang
from spotguard.operator.jobstatus import (
    COND_FAILED,
    COND_INVALID,
    COND_PREEMPTED,
    COND_RUNNING,
    COND_SUSPENDED,
    FAILED,
    PENDING,
    R_INVALID_SPEC,
    R_POD_RUNNING,
    R_RESUMED,
    R_SIDECAR_EXITED,
    R_SPEC_VALID,
    R_SUSPENDED,
    RESTARTING,
    RUNNING,
    SUSPENDED,
    TERMINAL_PHASES,
    Decision,
    Draft,
    Event,
    Observation,
    clear_blocked,
    condition,
    condition_is,
    finish,
    note_start_problem,
    pod_name,
    sidecar_up,
)
from spotguard.operator.policy import FALLBACK
from spotguard.operator.spec import TrainingJobSpec
from spotguard.operator.specfields import SpecError
from spotguard.operator.times import format_time, parse_time


def decide(
    job: str,
    status: Mapping[str, Any] | None,
    spec: TrainingJobSpec | SpecError,
    observation: Observation,
    now: datetime,
    generation: int | None = None,
) -> Decision:
    """Decide the next step for one TrainingJob. Pure: no I/O, no clock."""
    draft = Draft(job=job, st=copy.deepcopy(dict(status or {})), now=now, generation=generation)
    decision = _decide(draft, spec, observation)
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


def _decide(d: Draft, spec: TrainingJobSpec | SpecError, observation: Observation) -> Decision:
    """The turns of :func:`decide` on a working copy of the job's status."""
    job, st, now = d.job, d.st, d.now
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
        return finish(d)

    if condition_is(st, COND_INVALID):
        d.cond(COND_INVALID, False, R_SPEC_VALID, "the spec is valid")
        failed = condition(st, COND_FAILED) or {}
        if st.get("phase") == FAILED and failed.get("reason") == R_INVALID_SPEC:
            d.cond(COND_FAILED, False, R_SPEC_VALID, "the spec was corrected")
            st["phase"] = RESTARTING if st["attempt"] else PENDING
            d.events.append(Event("Normal", R_SPEC_VALID, "the spec is valid now"))

    if st.get("phase") in TERMINAL_PHASES:
        return finish(d)

    attempt = st["attempt"]
    last_end = st.get("lastPodEnd") or {}
    accounted_attempt = last_end.get("attempt") if isinstance(last_end, Mapping) else None
    current = pod_name(job, attempt) if attempt else None

    deadline = policy.deadline_at(spec, st)
    suspended = spec.suspend or st.get("phase") == SUSPENDED or condition_is(st, COND_SUSPENDED)
    if deadline is not None and deadline <= now and not suspended:  # suspended: the count restarts on resume
        live = bool(attempt) and accounted_attempt != attempt
        return deadline_exceeded(d, spec, observation if live else Observation(), current if live else None)

    # 1. The current attempt, if its end is not accounted for yet.
    if attempt and accounted_attempt != attempt and d.int("nodes") > 1:
        return decide_gang(d, spec, observation.members)
    if attempt and accounted_attempt != attempt:
        end = observation.pod_end
        if end is None:
            end = PodEnd("preempted", "PodDeleted", f"pod {current} disappeared before it ended")
        if end.kind == "running":
            if spec.suspend:
                d.cond(COND_SUSPENDED, True, R_SUSPENDED, f"stopping pod {current} after a checkpoint")
                return finish(d, delete_pod=current if end.reason != "Terminating" else None)
            back = policy.return_due(spec, st, now)
            if back == 0 and end.reason != "Terminating":
                return return_to_primary(d, spec, current, running=end.reason == "Running")
            if end.reason == "Running":
                d.cond(COND_RUNNING, True, R_POD_RUNNING, f"pod {current} is running")
                d.phase(RUNNING, Event("Normal", R_POD_RUNNING, f"pod {current} is running (attempt {attempt})"))
                if condition_is(st, COND_PREEMPTED):
                    d.cond(COND_PREEMPTED, False, R_RESUMED, f"resumed in pod {current}")
                clear_blocked(d, f"pod {current} is running")
                if end.sidecar_running:
                    sidecar_up(d, f"the sidecar of pod {current} is running")
            else:
                d.cond(COND_RUNNING, False, end.reason, end.message or f"pod {current} is {end.reason}")
                if st.get("phase") != RUNNING:
                    d.phase(PENDING)
                waited = policy.unschedulable_for(end, now)
                move = policy.unschedulable_move(spec, st, waited) if waited is not None else None
                if move == 0:
                    message = f"pod {current} could not be scheduled for {waited:.0f}s: {end.message}"
                    return moved(d, spec, FALLBACK, "Unschedulable", message, delete_pod=current)
                wait = note_start_problem(d, end, current)
                waits = [w for w in (wait, move) if w is not None]
                if waits:
                    return finish(d, requeue_after=min(waits))
            return finish(d)
        decision = account(d, spec, end, current)
        return sidecar_exited(d, spec, end, decision, current) if end.reason == R_SIDECAR_EXITED else decision

    # 2. Between attempts (new job, restarting, suspended).
    if spec.suspend:
        if d.cond(COND_SUSPENDED, True, R_SUSPENDED, "spec.suspend is true"):
            d.events.append(Event("Normal", R_SUSPENDED, "job suspended"))
        d.cond(COND_RUNNING, False, R_SUSPENDED, "the job is suspended")
        st["phase"] = SUSPENDED
        st.pop("restartAt", None)
        # A pod made just before the suspend whose status write was lost: nothing else would stop it.
        return finish(d, delete_pods=tuple((pod, False) for pod in observation.strays))
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
        return finish(d, requeue_after=(restart_at - now).total_seconds())
    return create_next(d, spec)
