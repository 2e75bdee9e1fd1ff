"""The operator's thin shell: observe -> decide (pure) -> apply -> report.

Runs in a worker thread (the kubernetes client is blocking); kopf's async
handlers call it through ``asyncio.to_thread``. One reconcile reads the job and
its current pod fresh from the apiserver, so it is level-based and idempotent:
an operator restarted at any instant picks up where the last one stopped, and
a pod that already exists under its deterministic name is adopted, never
duplicated.

Every call to the apiserver goes through ``kubeapi.py`` (each write fenced,
status writes conditional on the job's ``resourceVersion``); the decision is
``decide.decide``'s. This module only puts them in order: what to look at,
what to carry out, what to report.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from spotguard.operator import hostports as hp
from spotguard.operator import policy
from spotguard.operator.accounting import on_create_error
from spotguard.operator.apierrors import api_reason, api_status
from spotguard.operator.classify import SIDECAR_EXITED, classify_pod_end
from spotguard.operator.decide import decide
from spotguard.operator.jobstatus import (
    COND_INVALID,
    TERMINAL_PHASES,
    Decision,
    Event,
    Member,
    Observation,
    attempt_pods,
    condition_is,
    note_checkpoint_reads,
    pod_name,
    status_patch,
)
from spotguard.operator.kubeapi import (
    Context,
    JobChanged,
    NotOursYet,
    create_pod,
    delete_finished_job,
    delete_pod,
    ensure_host_ports,
    ensure_service,
    get_job,
    get_pod,
    node_exists,
    node_state,
    owned_by,
    patch_status,
    post_event,
)
from spotguard.operator.podbuilder import LABEL_ATTEMPT, LABEL_JOB, build_pods, build_service, last_checkpoint_bytes
from spotguard.operator.spec import TrainingJobSpec, check_name, parse
from spotguard.operator.specchange import hold
from spotguard.operator.specfields import SpecError
from spotguard.operator.staging import check_host_path
from spotguard.operator.stagingdirs import clean_staging
from spotguard.operator.times import parse_time

log = logging.getLogger("spotguard.operator")


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
        suspended = bool((job.get("spec") or {}).get("suspend")) and status.get("phase") not in TERMINAL_PHASES
        strays = stray_pods(ctx, namespace, name, uid, attempt + 1) if suspended else ()
        return Observation(pod_end=None, last_verified=verified, strays=strays)
    nodes = status.get("nodes")
    if isinstance(nodes, int) and nodes > 1:
        return Observation(last_verified=verified, members=observe_gang(ctx, namespace, name, uid, attempt, nodes))
    pod = get_pod(ctx, namespace, pod_name(name, attempt))
    if pod is not None and uid and not owned_by(pod, uid):
        pod = None  # a leftover of an older job with the same name
    exists = True
    if pod is not None:
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if node and phase not in ("Succeeded", "Failed"):
            exists = node_exists(ctx, node)
    end = classify_pod_end(pod, exists, ctx.reported_pod(namespace, pod_name(name, attempt), uid))
    # The final checkpoint of a success is recorded by the probe's next read (the
    # daemon asks for one at once): storage is never read on this path, so a slow
    # or dead store cannot delay the handling of a pod end.
    return Observation(pod_end=end, last_verified=verified)


def stray_pods(ctx: Context, namespace: str, job: str, uid: str | None, attempt: int) -> tuple[str, ...]:
    """The pods of ``attempt`` that still run though the status does not name the attempt (one list call).

    A look creates the next attempt's pods first and records the attempt in the status after; when that
    write is lost (a conflict) and the job is suspended before a look is redone, the pods would run on.
    """
    listed = ctx.core.list_namespaced_pod(
        namespace, label_selector=f"{LABEL_JOB}={job},{LABEL_ATTEMPT}={attempt}", _preload_content=False
    )
    return tuple(
        sorted(
            p["metadata"]["name"]
            for p in json.loads(listed.data).get("items") or []
            if (not uid or owned_by(p, uid))
            and not p["metadata"].get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        )
    )


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
        if pod is not None and uid and not owned_by(pod, uid):
            pod = None
        node = ((pod or {}).get("spec") or {}).get("nodeName")
        phase = ((pod or {}).get("status") or {}).get("phase")
        state = "up"
        if pod is not None and node and phase not in ("Succeeded", "Failed"):
            if node not in node_states:
                node_states[node] = node_state(ctx, node)
            state = node_states[node]
        end = classify_pod_end(pod, state != "gone", ctx.reported_pod(namespace, pod_name_, uid))
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
        check_host_path(spec.checkpoint.staging, ctx.config.host_path_prefix)
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
    if isinstance(spec, TrainingJobSpec):
        # A change a running job must not take is not acted on (whether or not the webhook refused it).
        spec, draft, held_events = hold(job, spec, draft, now, generation)
        allocated_events += held_events
    observation = observe(ctx, job)
    decision = decide(name, draft, spec, observation, now, generation)
    decision = note_checkpoint_reads(decision, ctx.storage_problems.get((namespace, name)), now, generation)
    if allocated_events:
        decision = replace(decision, events=allocated_events + decision.events)
    decision = apply(ctx, job, spec, decision, now, ports)
    if isinstance(spec, TrainingJobSpec):
        clean_staging(ctx, job, spec, now)  # hostPath staging: the directories of ended pods
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
        log.info("stopping pod %s/%s%s", namespace, pod_to_delete, why)
    if decision.create_attempt is not None and isinstance(spec, TrainingJobSpec):
        if ports is None and hp.needs_host_ports(spec):
            return Decision(status=dict(job.get("status") or {}), requeue_after=hp.WAIT_SECONDS)
        pods = [
            {**pod, "spec": policy.placed(pod["spec"], spec, decision.status, now)}
            for pod in build_pods(
                name,
                namespace,
                uid,
                spec,
                decision.create_attempt,
                ctx.config,
                ports,
                last_checkpoint_bytes(decision.status),
            )
        ]
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
        except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
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
