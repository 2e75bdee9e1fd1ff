"""Classify how a training pod ended: one pure function, table-tested.

Every attempt ends in exactly one of three ways, and the budgets differ:

* ``succeeded``: the training finished;
* ``preempted``: the machine went away (eviction or drain, graceful node
  shutdown, a node that vanished, a ``DisruptionTarget`` condition, a cloud
  notice the sidecar acted on) -> counts against ``maxPreemptions``;
* ``failed``: the user's code or configuration failed (non-zero exit, OOM,
  deadline) -> counts against ``backoffLimit``. So does a failure of
  spotguard's own containers (the sidecar, the restore init container), so
  that a crash loop ends too; its reason (``SidecarFailed``,
  ``RestoreFailed``) and message say it was spotguard's, not the training code.
  A sidecar that stops while the trainer still trains ends the attempt too
  (``SidecarExited``): checkpoints are no longer uploaded.

``running`` means the attempt has not ended yet.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from spotguard.contract.report import METRICS_ERROR, TerminationReport
from spotguard.operator.spec import RESTORE_CONTAINER, SIDECAR_CONTAINER

Kind = Literal["succeeded", "preempted", "failed", "running"]

# Pod-level ``status.reason`` values that mean the node, not the user's code,
# ended the pod. "Shutdown"/"Terminated": graceful node shutdown (before/after
# 1.26); "Evicted": node-pressure eviction; "NodeLost": node controller;
# "Preempting": kubelet made room for a critical pod; the admission reasons
# mean the pod never ran on a node that was not what the scheduler thought.
_NODE_REASONS = frozenset(
    {
        "Shutdown",
        "Terminated",
        "NodeShutdown",
        "Evicted",
        "NodeLost",
        "Preempting",
        "NodeAffinity",
        "UnexpectedAdmissionError",
    }
)


@dataclass(frozen=True, slots=True)
class PodEnd:
    """How an attempt ended (or that it is still running)."""

    kind: Kind
    reason: str
    message: str = ""
    #: Newest verified step the sidecar reported on its way out, if it did.
    step: int | None = None
    #: Steps trained after that checkpoint and lost, if the sidecar knew them.
    lost_steps: int | None = None
    #: When the last container stopped (RFC 3339), if the pod says.
    ended_at: str | None = None
    #: The attempt ended but its pod lingers: "force" (its node is gone) or
    #: "graceful" (the trainer failed while a classic sidecar keeps the pod up).
    stop_pod: Literal["force", "graceful"] | None = None
    #: A pod that has not started: "blocked" (it cannot start until someone acts:
    #: a missing Secret or ConfigMap, an image that cannot be pulled) or
    #: "unschedulable" (no node fits; worth a word only after a while, see ``since``).
    start_problem: Literal["blocked", "unschedulable"] | None = None
    #: When the start problem began (RFC 3339), if the pod says.
    since: str | None = None
    #: The pod runs and so does spotguard's sidecar.
    sidecar_running: bool = False
    #: A failure: the container blamed and its exit code (for ``spec.failurePolicy`` rules).
    #: (Details beside the classification: not compared.)
    container: str | None = field(default=None, compare=False)
    exit_code: int | None = field(default=None, compare=False)
    #: The node the pod ran on, for an attempt that ended (``spec.avoidNodes``).
    node: str | None = field(default=None, compare=False)
    #: The trainer's last save found the pod's checkpoint volume full: what the sidecar reported.
    staging_full: str | None = field(default=None, compare=False)


#: Reason of an attempt whose sidecar stopped while the trainer still ran.
SIDECAR_EXITED = "SidecarExited"
#: Reason of an attempt whose training finished but whose last checkpoint the sidecar could not verify.
FINAL_UNVERIFIED = "FinalCheckpointUnverified"


#: Container ``state.waiting.reason`` values with which a pod will not start
#: until someone changes something (kubelet keeps retrying, the pod stays Pending).
START_FAILURES = frozenset(
    {
        "CreateContainerConfigError",  # a Secret, ConfigMap or key the env/volumes name is missing
        "CreateContainerError",
        "ErrImagePull",
        "ImagePullBackOff",
        "ErrImageNeverPull",
        "InvalidImageName",
    }
)


def _start_failure(status: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first container (init containers first) waiting for a reason it will not get past alone."""
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in _container_statuses(status, key):
            state = cs.get("state") or {}
            waiting = state.get("waiting") if isinstance(state, Mapping) else None
            if not isinstance(waiting, Mapping) or waiting.get("reason") not in START_FAILURES:
                continue
            reason = str(waiting["reason"])
            detail = str(waiting.get("message") or "").strip()
            image = cs.get("image")
            what = f"container {cs.get('name')}"
            if reason in ("ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName") and image:
                what += f" (image {image})"
            return reason, f"{what}: {detail}" if detail else what
    return None


def _conditions(status: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
    conds = status.get("conditions")
    return conds if isinstance(conds, list) else []


def _container_statuses(status: Mapping[str, Any], key: str) -> Sequence[Mapping[str, Any]]:
    items = status.get(key)
    return items if isinstance(items, list) else []


def _terminated(cs: Mapping[str, Any]) -> Mapping[str, Any] | None:
    state = cs.get("state") or {}
    term = state.get("terminated") if isinstance(state, Mapping) else None
    if not isinstance(term, Mapping):
        last = cs.get("lastState") or {}
        term = last.get("terminated") if isinstance(last, Mapping) else None
    return term if isinstance(term, Mapping) else None


def sidecar_report(pod: Mapping[str, Any]) -> TerminationReport | None:
    """The report the sidecar left as its termination message, if any.

    The sidecar ends with a :class:`~spotguard.contract.report.TerminationReport`
    in its termination message; it is the only way to tell a trainer that
    stopped early because of a cloud notice from one that finished, when both
    exit 0.
    """
    status = pod.get("status") or {}
    for key in ("containerStatuses", "initContainerStatuses"):
        for cs in _container_statuses(status, key):
            if cs.get("name") != SIDECAR_CONTAINER:
                continue
            term = _terminated(cs)
            return _parse_report(term.get("message") if term else None)
    return None


def _parse_report(message: Any) -> TerminationReport | None:
    if not isinstance(message, str) or not message.strip().startswith("{"):
        return None
    try:
        return TerminationReport.parse(message)
    except ValueError:
        return None


def staging_full(report: TerminationReport | None) -> str | None:
    """What the sidecar's report says about a full checkpoint volume (``stagingFull``), as one sentence."""
    full = report.staging_full if report else None
    if full is None:
        return None
    if full.error:
        return full.error
    at = f" of step {full.step}" if full.step is not None else ""
    return (
        f"the checkpoint{at} was not written: the checkpoint volume is full. Give it more room"
        " (spec.checkpoint.staging: emptyDir.sizeLimit or ephemeral.size)"
    )


def _report_step(report: TerminationReport | None) -> int | None:
    return report.step if report is not None else None


def _crashed_beside_sidecar(status: Mapping[str, Any]) -> tuple[str, str, str, int | None] | None:
    """A user container that already failed in a pod that is still running."""
    for cs in _container_statuses(status, "containerStatuses"):
        if cs.get("name") == SIDECAR_CONTAINER:
            continue
        state = cs.get("state") or {}
        term = state.get("terminated") if isinstance(state, Mapping) else None
        if not isinstance(term, Mapping):
            continue
        name, code = str(cs.get("name")), _code(term.get("exitCode"))
        if term.get("reason") == "OOMKilled":
            return "OOMKilled", f"container {name} was killed for using too much memory (OOMKilled)", name, code
        if term.get("exitCode", 0) != 0:
            return "Error", f"container {name} exited with code {term.get('exitCode')}", name, code
    return None


def _code(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _reported_preemption(message: Any) -> bool:
    """Whether a sidecar's termination message is its report of a preemption (its trainer stops next)."""
    report = _parse_report(message)
    return report is not None and report.preempted is True


def _sidecar_status(status: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """(status key, container status) of spotguard's sidecar, if the pod reports it."""
    for key in ("containerStatuses", "initContainerStatuses"):
        for cs in _container_statuses(status, key):
            if cs.get("name") == SIDECAR_CONTAINER:
                return key, cs
    return None


def _sidecar_runs(status: Mapping[str, Any]) -> bool:
    found = _sidecar_status(status)
    state = (found[1].get("state") or {}) if found else {}
    return isinstance(state, Mapping) and isinstance(state.get("running"), Mapping)


def sidecar_down(status: Mapping[str, Any]) -> str | None:
    """Why spotguard's sidecar no longer runs beside a trainer that does, or None.

    A classic sidecar (a regular container) is down once it terminated, unless
    it exited 0 (it does only once its trainer said it is done and everything
    is shipped) or left its report of a preemption (its trainer then stops by
    itself). A
    native one (an init container with ``restartPolicy: Always``) is restarted
    by kubelet: down only while kubelet backs off (``CrashLoopBackOff``).
    """
    trainers = [
        str(cs.get("name"))
        for cs in _container_statuses(status, "containerStatuses")
        if cs.get("name") not in OWN_CONTAINERS and isinstance((cs.get("state") or {}).get("running"), Mapping)
    ]
    found = _sidecar_status(status)
    if not trainers or found is None:
        return None
    key, cs = found
    state = cs.get("state") or {}
    beside = f"while container {trainers[0]} was still running (not the training code)"
    if key == "containerStatuses":
        term = state.get("terminated")
        if not isinstance(term, Mapping) or _reported_preemption(term.get("message")):
            return None
        if term.get("exitCode") == 0:
            # It exits 0 only once its trainer is done (everything shipped): kubelet may
            # still show the trainer's container running for a moment.
            return None
        how = f"exited with code {term.get('exitCode')}"
    else:
        waiting = state.get("waiting")
        last = (cs.get("lastState") or {}).get("terminated")
        if not isinstance(waiting, Mapping) or waiting.get("reason") != "CrashLoopBackOff":
            return None
        term = last if isinstance(last, Mapping) else {}
        how = (
            f"keeps crashing (CrashLoopBackOff, {cs.get('restartCount', 0)} restarts;"
            f" last exited with code {term.get('exitCode')})"
        )
    if term.get("reason") == "OOMKilled":
        how += " after running out of memory (OOMKilled): give it more memory (spec.sidecar.resources)"
    message = term.get("message")
    detail = _last_line(message) if isinstance(message, str) else ""
    text = f"spotguard's container {SIDECAR_CONTAINER} {how} {beside}"
    return f"{text}: {detail}" if detail else f"{text}; see its log"


def _disruption(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for cond in _conditions(status):
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            return cond
    return None


#: spotguard's own containers: their failure is spotguard's, not the training code's.
OWN_CONTAINERS = frozenset({SIDECAR_CONTAINER, RESTORE_CONTAINER})

# Longest detail taken from a container's termination message.
_DETAIL_MAX = 300


@dataclass(frozen=True, slots=True)
class _Failed:
    """One container that ended badly: non-zero exit or OOMKilled."""

    name: str
    code: Any
    oom: bool
    finished: dt.datetime | None
    message: str


def _parse_time(value: Any) -> dt.datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _failed(cs: Mapping[str, Any], current_only: bool = False) -> _Failed | None:
    """``cs`` as a failure, or None. ``current_only``: ignore a crash it has restarted from."""
    if current_only:
        state = cs.get("state") or {}
        term = state.get("terminated") if isinstance(state, Mapping) else None
        running = isinstance(state, Mapping) and isinstance(state.get("running"), Mapping)
        if not isinstance(term, Mapping) and not running:
            term = _terminated(cs)  # waiting to restart: its last crash still stands
    else:
        term = _terminated(cs)
    if not isinstance(term, Mapping):
        return None
    oom = term.get("reason") == "OOMKilled"
    code = term.get("exitCode", 0)
    if not oom and code == 0:
        return None
    message = term.get("message")
    return _Failed(
        str(cs.get("name")), code, oom, _parse_time(term.get("finishedAt")), message if isinstance(message, str) else ""
    )


def _last_line(text: str) -> str:
    """The last non-empty line of a termination message (the sidecar's JSON report says nothing here)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError:
            doc = None
        if isinstance(doc, Mapping):
            detail = doc.get("error") or doc.get(METRICS_ERROR)
            return str(detail)[:_DETAIL_MAX] if detail else ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:_DETAIL_MAX] if lines else ""


def _spotguard_failure(f: _Failed) -> tuple[str, str]:
    """(reason, message) for a failure of spotguard's own container: named, and said not to be the user's."""
    how = "was killed for using too much memory (OOMKilled)" if f.oom else f"exited with code {f.code}"
    message = f"spotguard's container {f.name} {how} (not the training code)"
    detail = _last_line(f.message)
    if f.name == RESTORE_CONTAINER:
        reason = "RestoreFailed"
        message += ": could not stage the latest verified checkpoint (check the storage URI and credentials)"
    else:
        reason = "SidecarFailed"
        if f.oom:
            message += ": give it more memory (spec.sidecar.resources)"
        elif not detail and f.code == 1:
            message += ": the newest checkpoint could not be verified in storage"
    return reason, f"{message}: {detail}" if detail else f"{message}; see its log"


def _user_message(f: _Failed) -> tuple[str, str]:
    if f.oom:
        return "OOMKilled", f"container {f.name} was killed for using too much memory (OOMKilled)"
    return "Error", f"container {f.name} exited with code {f.code}"


def _pod_failure(status: Mapping[str, Any]) -> tuple[str, str, _Failed] | None:
    """Why a Failed pod failed: (reason, message), naming the container to blame.

    Init containers run one after another before the rest, so a failed one
    (spotguard's restore or the user's) is the cause. Otherwise, when both
    the training code and spotguard's sidecar ended badly, the one that
    ended first is the cause (by ``finishedAt``; a tie or an unknown time
    blames the training code, whose own exit is the first thing to read),
    and the message mentions the other.
    """
    for cs in _container_statuses(status, "initContainerStatuses"):
        if cs.get("name") == SIDECAR_CONTAINER:
            continue
        f = _failed(cs)
        if f is None:
            continue
        if f.name in OWN_CONTAINERS:
            return (*_spotguard_failure(f), f)
        return "InitContainerFailed", f"init container {f.name} exited with code {f.code}", f
    user: list[_Failed] = []
    sidecar: _Failed | None = None
    for key in ("containerStatuses", "initContainerStatuses"):
        for cs in _container_statuses(status, key):
            name = cs.get("name")
            if name == SIDECAR_CONTAINER:
                # A native sidecar that kubelet restarted and that runs again has recovered.
                sidecar = sidecar or _failed(cs, current_only=key == "initContainerStatuses")
            elif key == "containerStatuses" and (f := _failed(cs)) is not None:
                user.append(f)
    if not user:
        return (*_spotguard_failure(sidecar), sidecar) if sidecar is not None else None
    # An OOM kill is the clearest word on the user's side; else the first container that failed.
    first_user = next((f for f in user if f.oom), user[0])
    if sidecar is None:
        return (*_user_message(first_user), first_user)
    earliest_user = min((f.finished for f in user if f.finished is not None), default=None)
    if sidecar.finished is not None and earliest_user is not None and sidecar.finished < earliest_user:
        reason, message = _spotguard_failure(sidecar)
        return reason, f"{message} (then container {first_user.name} failed too)", sidecar
    reason, message = _user_message(first_user)
    how = "was OOMKilled" if sidecar.oom else f"exited with code {sidecar.code}"
    return reason, f"{message} (spotguard's container {sidecar.name} also {how}, not before it)", first_user


def _trainer_finished(status: Mapping[str, Any], report: TerminationReport | None) -> PodEnd | None:
    """The end of an attempt whose training finished, whatever came after, or None.

    Finished: every container of the training code exited 0 and the sidecar's
    report says so (``"reason": "finished"``, not preempted: the trainer had
    exited on its own before any signal). The attempt succeeded even when the
    sidecar then failed to verify the last checkpoint (it gave up, exit code 1)
    or the pod was deleted while it tried: running the finished training again
    would only repeat it.
    """
    if report is None or report.preempted is not False or report.reason != "finished":
        return None
    user = [cs for cs in _container_statuses(status, "containerStatuses") if cs.get("name") not in OWN_CONTAINERS]
    terms = [_terminated(cs) for cs in user]
    if not terms or any(t is None or t.get("exitCode") != 0 or t.get("reason") == "OOMKilled" for t in terms):
        return None
    step = _report_step(report)
    found = _sidecar_status(status)
    sidecar = _terminated(found[1]) if found is not None else None
    if sidecar is not None and sidecar.get("exitCode") not in (0, None):
        newest = f"step {step}" if step is not None else "none"
        message = (
            "training finished, but spotguard's sidecar could not verify its last checkpoint in storage"
            f" (newest verified: {newest}); see the sidecar's log. Not run again: the training is done"
        )
        return PodEnd("succeeded", FINAL_UNVERIFIED, message, step)
    return PodEnd("succeeded", "Completed", "training finished", step)


def classify_pod_end(
    pod: Mapping[str, Any] | None, node_exists: bool = True, last_seen: Mapping[str, Any] | None = None
) -> PodEnd:
    """Classify an attempt's pod: succeeded, preempted, failed, or still running.

    ``pod`` is the pod object as the apiserver returns it, or ``None`` when it no
    longer exists. ``node_exists`` says whether the node it was bound to still
    exists; a pod whose node vanished counts as preempted at once, without
    waiting for the pod garbage collector. ``last_seen``: for a pod that no
    longer exists, the pod as the watch last showed it with its sidecar's
    report (a pod can be gone before a look reads it, and kubelets before 1.22
    can publish a deleted pod's last status without its containers' final
    states): a reported preemption is taken from there.
    """
    end = _classify(pod, node_exists)
    if pod is None and last_seen is not None:
        report = sidecar_report(last_seen)
        if report is not None and report.preempted is True:
            pod = last_seen
            why = "the pod was deleted after its sidecar reported a preemption"
            end = PodEnd("preempted", report.reason or "Preempted", why, report.step)
    if end.kind == "running" or pod is None:
        return end
    node = (pod.get("spec") or {}).get("nodeName")
    if isinstance(node, str) and node:
        end = replace(end, node=node)
    report = sidecar_report(pod)
    full = staging_full(report)
    if full is not None:
        end = replace(end, staging_full=full)
    trainer_step = report.trainer_step if report else None
    if end.kind == "preempted" and trainer_step is not None and end.step is not None:
        end = replace(end, lost_steps=max(0, trainer_step - end.step))
    finished = [
        str(term["finishedAt"])
        for key in ("containerStatuses", "initContainerStatuses")
        for cs in _container_statuses(pod.get("status") or {}, key)
        if (term := _terminated(cs)) and term.get("finishedAt")
    ]
    return replace(end, ended_at=max(finished)) if finished else end


def _classify(pod: Mapping[str, Any] | None, node_exists: bool) -> PodEnd:
    if pod is None:
        return PodEnd("preempted", "PodDeleted", "the pod was deleted before it finished")
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    phase = status.get("phase")
    node = spec.get("nodeName")
    deleting = bool(meta.get("deletionTimestamp"))
    report = sidecar_report(pod)
    step = _report_step(report)
    reported_preempt = bool(report and report.preempted)
    pod_reason = status.get("reason")
    pod_message = status.get("message") or ""

    finished = _trainer_finished(status, report) if phase in ("Succeeded", "Failed") else None
    if finished is not None:
        # The training code finished: never run again, whatever happened to the pod afterwards.
        return finished

    if phase == "Succeeded":
        if reported_preempt:
            reason = (report.reason if report else None) or "Preempted"
            return PodEnd("preempted", reason, "the trainer stopped early after a checkpoint", step)
        if deleting:
            # A drain or eviction: kubelet sent SIGTERM, the trainer saved and exited 0.
            return PodEnd("preempted", "PodDeleted", "the pod was deleted (drain or eviction)", step)
        return PodEnd("succeeded", "Completed", "training finished", step)

    if phase == "Failed":
        disruption = _disruption(status)
        if disruption is not None:
            reason = str(disruption.get("reason") or "DisruptionTarget")
            message = str(disruption.get("message") or pod_message or "the pod was disrupted")
            return PodEnd("preempted", reason, message, step)
        if isinstance(pod_reason, str) and (pod_reason in _NODE_REASONS or pod_reason.startswith("OutOf")):
            reason = "NodeShutdown" if pod_reason in ("Shutdown", "Terminated") else pod_reason
            return PodEnd("preempted", reason, pod_message or f"the node ended the pod ({pod_reason})", step)
        if deleting:
            return PodEnd("preempted", "PodDeleted", "the pod was deleted (drain or eviction)", step)
        if reported_preempt:
            reason = (report.reason if report else None) or "Preempted"
            return PodEnd("preempted", reason, "the trainer stopped early after a checkpoint", step)
        if pod_reason == "DeadlineExceeded":
            return PodEnd("failed", "DeadlineExceeded", pod_message or "activeDeadlineSeconds passed", step)
        failure = _pod_failure(status)
        if failure is not None:
            reason, message, f = failure
            return PodEnd("failed", reason, message, step, container=f.name, exit_code=_code(f.code))
        return PodEnd("failed", str(pod_reason or "Failed"), pod_message or "the pod failed", step)

    # Pending, Running, Unknown or no phase yet: not ended, unless its node is gone.
    if node and not node_exists:
        return PodEnd("preempted", "NodeLost", f"node {node} is gone", step, stop_pod="force")
    if pod_reason == "NodeLost":
        return PodEnd("preempted", "NodeLost", pod_message or f"node {node} is unreachable", step, stop_pod="force")
    if deleting or _disruption(status) is not None:
        return PodEnd("running", "Terminating", "the pod is shutting down")
    # Before "Running": beside a classic sidecar that runs, the pod is Running
    # while the trainer's image cannot be pulled.
    blocked = _start_failure(status)
    if blocked is not None:
        return PodEnd("running", blocked[0], blocked[1], start_problem="blocked")
    if phase == "Running":
        crashed = _crashed_beside_sidecar(status)
        if crashed is not None:
            # A classic sidecar may not see that its trainer is gone and would
            # keep the pod running: the attempt has failed, stop the pod.
            return PodEnd(
                "failed", crashed[0], crashed[1], step, stop_pod="graceful", container=crashed[2], exit_code=crashed[3]
            )
        down = sidecar_down(status)
        if down is not None:
            # Checkpoints are no longer uploaded: stop the pod (the trainer gets
            # its grace period) and count a failed attempt.
            return PodEnd("failed", SIDECAR_EXITED, down, step, stop_pod="graceful")
        return PodEnd("running", "Running", sidecar_running=_sidecar_runs(status))
    for cond in _conditions(status):
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            reason = str(cond.get("reason") or "Pending")
            since = cond.get("lastTransitionTime")
            return PodEnd(
                "running",
                reason,
                str(cond.get("message") or ""),
                start_problem="unschedulable" if reason == "Unschedulable" else None,
                since=since if isinstance(since, str) else None,
            )
    return PodEnd("running", "Pending", pod_message)
