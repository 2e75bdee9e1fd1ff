"""What a TrainingJob's policies say, as pure functions: failure rules, deadlines, avoided nodes, fallback.

The state machine (``decide``) asks these at its turns; the reconcile applies
the placement to the pods it builds. Nothing here does I/O or reads a clock.

Placement. A job's pods go where its template says (the *primary* placement,
typically a spot pool). With ``spec.fallback`` they move to a second placement
(an on-demand pool) after ``afterPreemptions`` preemptions within
``preemptionWindowSeconds``, or once a pod could not be scheduled for
``afterUnschedulableSeconds``; after ``cooldownSeconds`` there they return (the
running attempt is stopped after an emergency checkpoint, like a suspend, and
the next one starts on the primary placement). A move is never counted as a
preemption or a failure. The checkpoint carries over: resume is the same
wherever the pods run. The record is ``status.placement``.

Avoided nodes. With ``spec.avoidNodes`` a node on which an attempt of the job
ended ``afterEnds`` times (preempted or failed) is kept out of the job's pods
(a required node affinity on ``metadata.name``) for ``forSeconds``. The record
is ``status.avoidedNodes``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from spotguard.operator.classify import PodEnd
from spotguard.operator.spec import FailureRule, TrainingJobSpec
from spotguard.operator.times import format_time, parse_time

PRIMARY = "primary"
FALLBACK = "fallback"

#: Condition: the job runs on its fallback placement.
COND_FALLBACK = "OnFallback"
R_TO_FALLBACK = "FallbackPlacement"
R_TO_PRIMARY = "PrimaryPlacement"
#: The running attempt is stopped (after a checkpoint) to return to the primary placement.
R_RETURNING = "ReturningToPrimary"
R_DEADLINE = "DeadlineExceeded"
R_RULE_FAIL = "FailedByRule"
R_NODE_AVOIDED = "NodeAvoided"
#: An attempt stopped to move the job (not a preemption, not a failure).
MOVED = "moved"
#: The most nodes remembered in ``status.avoidedNodes`` (the newest stay).
MAX_NODE_RECORDS = 32


# --- failure rules ------------------------------------------------------------------


def rule_matches(rule: FailureRule, end: PodEnd) -> bool:
    """Whether a failed attempt's end matches a rule (both conditions, when it has both)."""
    if end.kind != "failed":
        return False
    if rule.reasons and end.reason not in rule.reasons:
        return False
    if rule.exit_codes:
        if end.exit_code is None:
            return False
        if rule.container is not None and end.container != rule.container:
            return False
        if (end.exit_code in rule.exit_codes) != (rule.exit_operator == "In"):
            return False
    return True


def failure_action(rules: Sequence[FailureRule], end: PodEnd) -> tuple[str, int | None]:
    """``(action, index of the rule)``: the first rule that matches decides; none: ``Count`` (the default)."""
    for i, rule in enumerate(rules):
        if rule_matches(rule, end):
            return rule.action, i
    return "Count", None


def describe_rule(rule: FailureRule, index: int) -> str:
    """``spec.failurePolicy.rules[i]`` and what it matched, for messages."""
    parts = []
    if rule.exit_codes:
        on = f"exit code {rule.exit_operator} {list(rule.exit_codes)}"
        parts.append(on + (f" of container {rule.container}" if rule.container else ""))
    if rule.reasons:
        parts.append(f"reason in {list(rule.reasons)}")
    return f"spec.failurePolicy.rules[{index}] ({' and '.join(parts)}: {rule.action})"


# --- deadline and TTL -----------------------------------------------------------------


def deadline_at(spec: TrainingJobSpec, status: Mapping[str, Any]) -> datetime | None:
    """When ``spec.activeDeadlineSeconds`` runs out (counted from ``status.startTime``), if set and started."""
    start = parse_time(status.get("startTime"))
    if spec.active_deadline_seconds is None or start is None:
        return None
    return start + timedelta(seconds=spec.active_deadline_seconds)


def ttl_expires_at(spec: TrainingJobSpec, status: Mapping[str, Any]) -> datetime | None:
    """When a finished job's object is to be deleted (``ttlSecondsAfterFinished`` after ``completionTime``)."""
    done = parse_time(status.get("completionTime"))
    if spec.ttl_seconds_after_finished is None or done is None:
        return None
    return done + timedelta(seconds=spec.ttl_seconds_after_finished)


# --- avoided nodes ----------------------------------------------------------------------


def note_end_on_node(status: dict[str, Any], spec: TrainingJobSpec, node: str | None, now: datetime) -> str | None:
    """Count an attempt that ended on ``node``; returns a message when the node is now avoided."""
    avoid = spec.avoid_nodes
    if avoid is None or not node:
        return None
    records = [dict(r) for r in status.get("avoidedNodes") or [] if isinstance(r, Mapping)]
    records = [r for r in records if not _expired(r, now, avoid.for_seconds)]
    record = next((r for r in records if r.get("node") == node), None)
    if record is None:
        record = {"node": node, "ends": 0}
        records.append(record)
    ends = int(record.get("ends") or 0) + 1
    record["ends"] = ends
    record["lastEnd"] = format_time(now)
    message = None
    if ends >= avoid.after_ends:
        until = now + timedelta(seconds=avoid.for_seconds)
        if parse_time(record.get("until")) is None:
            message = (
                f"node {node} is avoided until {format_time(until)}: attempts of this job ended on it"
                f" {ends} times (spec.avoidNodes.afterEnds {avoid.after_ends})"
            )
        record["until"] = format_time(until)
    records.sort(key=lambda r: str(r.get("lastEnd") or ""))
    status["avoidedNodes"] = records[-MAX_NODE_RECORDS:]
    return message


def _expired(record: Mapping[str, Any], now: datetime, for_seconds: float) -> bool:
    until = parse_time(record.get("until"))
    if until is not None:
        return until <= now
    last = parse_time(record.get("lastEnd"))
    return last is None or last + timedelta(seconds=for_seconds) <= now


def avoided_nodes(status: Mapping[str, Any], now: datetime) -> list[str]:
    """Names of the nodes the job's next pods must not run on."""
    out = []
    for r in status.get("avoidedNodes") or []:
        until = parse_time(r.get("until")) if isinstance(r, Mapping) else None
        if until is not None and until > now and r.get("node"):
            out.append(str(r["node"]))
    return sorted(out)


# --- fallback placement ---------------------------------------------------------------


def pool(status: Mapping[str, Any]) -> str:
    """The placement the job's next pods get: ``primary`` or ``fallback``."""
    placement = status.get("placement")
    return FALLBACK if isinstance(placement, Mapping) and placement.get("pool") == FALLBACK else PRIMARY


def switch(status: dict[str, Any], to: str, reason: str, now: datetime, spec: TrainingJobSpec) -> dict[str, Any]:
    """Record a move to ``to``; returns the new ``status.placement``."""
    record: dict[str, Any] = {"pool": to, "since": format_time(now), "reason": reason}
    if to == FALLBACK and spec.fallback is not None:
        record["returnAt"] = format_time(now + timedelta(seconds=spec.fallback.cooldown_seconds))
    status["placement"] = record
    return record


def note_preemption(status: dict[str, Any], spec: TrainingJobSpec, now: datetime) -> str | None:
    """Count a preemption on the primary placement; returns why the job moves to its fallback, or None."""
    fb = spec.fallback
    if fb is None or pool(status) != PRIMARY:
        return None
    placement = dict(status.get("placement") or {"pool": PRIMARY})
    since = now - timedelta(seconds=fb.window_seconds)
    times = [t for t in placement.get("recentPreemptions") or [] if (p := parse_time(t)) is not None and p > since]
    times.append(format_time(now))
    if len(times) >= fb.after_preemptions:
        return (
            f"preempted {len(times)} times within {fb.window_seconds:g}s on the primary placement"
            f" (spec.fallback.afterPreemptions {fb.after_preemptions})"
        )
    placement["recentPreemptions"] = times[-fb.after_preemptions :]
    status["placement"] = placement
    return None


def unschedulable_for(end: PodEnd, now: datetime) -> float | None:
    """Seconds a pod has waited for a node, if it is unschedulable."""
    if end.start_problem != "unschedulable":
        return None
    since = parse_time(end.since)
    return (now - since).total_seconds() if since else 0.0


def unschedulable_move(spec: TrainingJobSpec, status: Mapping[str, Any], waited: float) -> float | None:
    """0 when a pod waiting ``waited`` s for a node moves the job to its fallback now; else seconds until it
    would; None when it never will (no fallback, that trigger off, or already there)."""
    fb = spec.fallback
    if fb is None or fb.after_unschedulable_seconds is None or pool(status) != PRIMARY:
        return None
    return max(0.0, fb.after_unschedulable_seconds - waited)


def return_due(spec: TrainingJobSpec, status: Mapping[str, Any], now: datetime) -> float | None:
    """0 when a job on its fallback is due back on the primary placement; else seconds until then; None off."""
    if pool(status) != FALLBACK:
        return None
    at = parse_time((status.get("placement") or {}).get("returnAt"))
    if at is None or spec.fallback is None:
        return 0.0  # the spec's fallback was removed: back now
    return max(0.0, (at - now).total_seconds())


def placed(pod_spec: dict[str, Any], spec: TrainingJobSpec, status: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """The pod spec with the job's current placement and avoided nodes applied (a new dict)."""
    out = copy.deepcopy(pod_spec)
    if pool(status) == FALLBACK and spec.fallback is not None:
        where = spec.fallback.placement
        if where.node_selector is not None:
            out["nodeSelector"] = dict(where.node_selector)
        if where.tolerations is not None:
            out["tolerations"] = [dict(t) for t in where.tolerations]
        if where.affinity is not None:
            out["affinity"] = copy.deepcopy(dict(where.affinity))
    avoided = avoided_nodes(status, now)
    if avoided:
        _keep_off(out, avoided)
    return out


def _keep_off(pod_spec: dict[str, Any], nodes: list[str]) -> None:
    """Add ``metadata.name NotIn nodes`` to every required node selector term (one term if none)."""
    affinity = pod_spec.setdefault("affinity", {})
    node_affinity = affinity.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    expression = {"key": "metadata.name", "operator": "NotIn", "values": list(nodes)}
    required["nodeSelectorTerms"] = [
        {**term, "matchFields": [*(term.get("matchFields") or []), expression]} for term in terms
    ]
