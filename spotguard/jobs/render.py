"""Pure: what ``spotguard jobs`` prints, from TrainingJobs, Events and pods as plain dicts.

Everything here takes what the apiserver sends (camelCase dicts, as
``kubectl get -o json`` shows them) and ``now``; nothing reads a clock, a
cluster or a store, so each table and each reconstruction is tested without one.

The history of a job's attempts is rebuilt from two sources: the operator's
Events on the TrainingJob (one per transition, with the cause in its message;
most clusters drop Events after an hour) and ``status.lastPodEnd`` (the last
attempt's end, kept for good). Where they overlap the status wins: it is the
record the operator acted on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from spotguard.operator.spec import KIND, PreemptionSpec
from spotguard.operator.times import parse_time

#: kubectl's table: columns three spaces apart, headers in capitals.
_GAP = "   "
#: Attempts ``describe`` lists (the newest); older ones are counted.
MAX_ATTEMPTS = 30
#: Events ``describe`` lists (the newest).
MAX_EVENTS = 25

_PRE = PreemptionSpec()


# --- small formatting ------------------------------------------------------------


def human_duration(seconds: float) -> str:
    """A duration as kubectl prints ages (``45s``, ``3m20s``, ``17m``, ``5h3m``, ``3d4h``, ``2y13d``)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    days = hours // 24
    if hours < 24 * 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if days < 365 * 2:
        return f"{days}d"
    years, rest = divmod(days, 365)
    if years < 8 and rest:
        return f"{years}y{rest}d"
    return f"{years}y"


def age(timestamp: Any, now: datetime) -> str:
    """How long ago an RFC 3339 timestamp was, kubectl-style; ``<unknown>`` without one."""
    t = parse_time(timestamp)
    return human_duration((now - t).total_seconds()) if t is not None else "<unknown>"


def when(timestamp: Any, now: datetime) -> str:
    """``2030-01-01T00:00:00Z (5m ago)``, or ``in 3m`` for a time ahead; ``-`` without one."""
    t = parse_time(timestamp)
    if t is None:
        return "-"
    delta = (now - t).total_seconds()
    rel = f"{human_duration(delta)} ago" if delta >= -1 else f"in {human_duration(-delta)}"
    return f"{t.strftime('%Y-%m-%dT%H:%M:%SZ')} ({rel})"


def human_size(n: Any) -> str:
    """Bytes in binary units (``512 B``, ``1.5 MiB``); ``-`` when unknown."""
    if not isinstance(n, int | float) or isinstance(n, bool):
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A kubectl-style table: left-aligned columns three spaces apart, no trailing blanks."""
    cells = [[str(h) for h in headers]] + [["-" if c is None or c == "" else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [_GAP.join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def to_json(obj: Any) -> str:
    """JSON as ``kubectl -o json`` writes it (indent 4, keys in the order given)."""
    return json.dumps(obj, indent=4, default=str)


def to_yaml(obj: Any) -> str:
    """YAML as ``kubectl -o yaml`` writes it (block style, keys in the order given)."""
    import yaml  # PyYAML comes with the kubernetes client

    return str(yaml.safe_dump(_plain(obj), sort_keys=False, default_flow_style=False, allow_unicode=True)).rstrip("\n")


def dump(obj: Any, output: str) -> str:
    """``obj`` in the ``-o`` format ``json`` or ``yaml``."""
    if output == "json":
        return to_json(obj)
    if output == "yaml":
        return to_yaml(obj)
    raise ValueError(f"unknown output format {output!r}: use json or yaml")


def _plain(obj: Any) -> Any:
    """Only the types ``yaml.safe_dump`` writes (tuples become lists, the rest strings)."""
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


# --- ls ----------------------------------------------------------------------------

LS_HEADERS = ("NAME", "PHASE", "ATTEMPT", "PREEMPTIONS", "FAILURES", "VERIFIED STEP", "PLACEMENT", "AGE")


def job_row(job: Mapping[str, Any], now: datetime) -> list[str]:
    """One ``ls`` row: name, phase, attempt, preemptions, failures, verified step, placement pool, age."""
    meta, st = _map(job.get("metadata")), _map(job.get("status"))
    verified = _int(_map(st.get("lastVerifiedCheckpoint")).get("step"))
    return [
        str(meta.get("name") or "-"),
        str(st.get("phase") or "-"),
        str(_int(st.get("attempt")) or 0),
        str(_int(st.get("preemptions")) or 0),
        str(_int(st.get("failures")) or 0),
        str(verified) if verified is not None else "-",
        _str(_map(st.get("placement")).get("pool")) or "-",
        age(meta.get("creationTimestamp"), now),
    ]


def ls_table(jobs: Sequence[Mapping[str, Any]], now: datetime, *, all_namespaces: bool = False) -> str:
    """The ``ls`` table, sorted by namespace then name; a NAMESPACE column first with ``-A``."""
    ordered = sorted(
        jobs, key=lambda j: (str(_map(j.get("metadata")).get("namespace")), str(_map(j.get("metadata")).get("name")))
    )
    if not all_namespaces:
        return table(LS_HEADERS, (job_row(j, now) for j in ordered))
    rows = ([str(_map(j.get("metadata")).get("namespace") or "-"), *job_row(j, now)] for j in ordered)
    return table(("NAMESPACE", *LS_HEADERS), rows)


def without_managed_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The object without ``metadata.managedFields``, which kubectl hides too (``--show-managed-fields``)."""
    out = dict(obj)
    meta = _map(out.get("metadata"))
    if "managedFields" in meta:
        out["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    return out


def job_list(jobs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The jobs as ``kubectl get -o json`` lists them: a ``v1`` ``List`` of the whole objects."""
    items = [without_managed_fields(j) for j in jobs]
    return {"apiVersion": "v1", "kind": "List", "items": items, "metadata": {"resourceVersion": ""}}


# --- Events and the history of attempts -------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobEvent:
    """One Event on the TrainingJob, reduced to what ``describe`` shows."""

    type: str
    reason: str
    message: str
    time: str | None
    count: int = 1


@dataclass(slots=True)
class AttemptEnd:
    """How an attempt ended: ``preempted``, ``failed``, ``succeeded``, ``suspended`` or ``moved``."""

    kind: str
    reason: str
    message: str = ""
    step: int | None = None
    time: str | None = None
    pod: str | None = None
    node: str | None = None
    #: Where this came from: ``status`` (lastPodEnd) or ``event``.
    source: str = "event"


@dataclass(slots=True)
class Attempt:
    """One attempt of a job, as far as its Events and status tell."""

    attempt: int
    created: str | None = None
    running: str | None = None
    end: AttemptEnd | None = None
    current: bool = False
    #: Other things the operator said then: a node avoided, a move to the fallback pool, the job's end.
    notes: list[str] = field(default_factory=list)


def _event_time(ev: Mapping[str, Any]) -> str | None:
    for key in ("lastTimestamp", "eventTime", "firstTimestamp"):
        value = ev.get(key)
        if parse_time(value) is not None:
            return str(value)
    created = _map(ev.get("metadata")).get("creationTimestamp")
    return str(created) if parse_time(created) is not None else None


def job_events(job: Mapping[str, Any], events: Iterable[Mapping[str, Any]]) -> list[JobEvent]:
    """The Events on this TrainingJob (not an earlier one of the same name), oldest first, duplicates once."""
    meta = _map(job.get("metadata"))
    name, uid = meta.get("name"), meta.get("uid")
    seen: set[tuple[str, str, str | None]] = set()
    keyed: list[tuple[float, int, JobEvent]] = []
    for i, ev in enumerate(events):
        obj = _map(ev.get("involvedObject"))
        if obj.get("kind") != KIND or obj.get("name") != name:
            continue
        if uid and obj.get("uid") and obj.get("uid") != uid:
            continue
        t = _event_time(ev)
        item = JobEvent(
            str(ev.get("type") or "Normal"),
            str(ev.get("reason") or ""),
            str(ev.get("message") or ""),
            t,
            _int(ev.get("count")) or 1,
        )
        key = (item.reason, item.message, item.time)
        if key in seen:
            continue
        seen.add(key)
        parsed = parse_time(t)
        # Timestamps have one-second precision: within a second, the apiserver's order of writes.
        rv = str(_map(ev.get("metadata")).get("resourceVersion") or "")
        keyed.append((parsed.timestamp() if parsed else 0.0, int(rv) if rv.isdigit() else i, item))
    return [e for _t, _i, e in sorted(keyed, key=lambda k: (k[0], k[1]))]


_ATTEMPT_RE = re.compile(r"\battempt (\d+)\b")
_POD_RE = re.compile(r"\bpod (\S+?)(?=[\s:;,]|$)")
_NODE_RE = re.compile(r" on node (\S+?)(?=[\s:;,)]|$)")
_PREEMPTED_RE = re.compile(r"^(?P<who>.*?) preempted \((?P<reason>[^()]*)\)(?: at step (?P<step>\d+))?;")
_FAILED_RE = re.compile(r"^(?P<who>.*?) failed \((?P<reason>[^()]*)\)(?:: (?P<message>.*))?$", re.S)
_GANG_RE = re.compile(
    r"^(?P<who>.*?) (?P<kind>preempted|failed) \((?P<reason>[^()]*)\)(?:: (?P<message>.*?))?"
    r"(?:; stopping \d+ other pod\(s\) of attempt (?P<attempt>\d+): .*)?$",
    re.S,
)
_SIDECAR_RE = re.compile(
    r"^(?P<who>pod \S+?(?: on node \S+?)?): (?P<message>.*?)\. Checkpoints were no longer uploaded", re.S
)

#: Events that say something about the job at the time, noted on the attempt they came with.
_NOTE_REASONS = frozenset(
    {
        "PreemptionLimitExceeded",
        "BackoffLimitExceeded",
        "FailedByRule",
        "DeadlineExceeded",
        "NodeAvoided",
        "FallbackPlacement",
        "PrimaryPlacement",
        "PodCreateFailed",
        "InvalidSpec",
    }
)


def pod_attempt(job: str, pod: str) -> int | None:
    """The attempt of one of the job's pods: ``<job>-a<N>`` or ``<job>-a<N>-<rank>``."""
    m = re.fullmatch(rf"{re.escape(job)}-a(\d+)(?:-\d+)?", pod)
    return int(m.group(1)) if m else None


def _who(job: str, text: str) -> tuple[int | None, str | None, str | None]:
    """(attempt, pod, node) named in the ``who`` part of an operator message."""
    pod_m = _POD_RE.search(text)
    pod = pod_m.group(1) if pod_m else None
    attempt = pod_attempt(job, pod) if pod else None
    if attempt is None:
        m = _ATTEMPT_RE.search(text)
        attempt = int(m.group(1)) if m else None
    node_m = _NODE_RE.search(text)
    return attempt, pod, node_m.group(1) if node_m else None


def attempt_history(job: str, status: Mapping[str, Any], events: Sequence[JobEvent]) -> list[Attempt]:
    """Every attempt of the job (1 to ``status.attempt``), with when it was created, ran and ended, and why.

    Reads the operator's Events (``PodCreated``, ``PodRunning``, ``Preempted``,
    ``PodFailed``, ``SidecarExited``, ``StoppingGang``, ``Completed``,
    ``Suspended``, and the job-level ones noted on the attempt they came with),
    then ``status.lastPodEnd``, which overrides what the Events said of its attempt.
    """
    attempts: dict[int, Attempt] = {}
    #: What a gang's StoppingGang said of its first cause, per attempt (its message has the details).
    gang_cause: dict[int, AttemptEnd] = {}
    latest = 0

    def get(n: int) -> Attempt:
        nonlocal latest
        latest = max(latest, n)
        return attempts.setdefault(n, Attempt(n))

    def set_end(n: int | None, end: AttemptEnd) -> None:
        if n is None:
            return
        a = get(n)
        if a.end is not None and a.end.kind == end.kind:
            end.message = end.message or a.end.message
            end.step = end.step if end.step is not None else a.end.step
            end.node = end.node or a.end.node
        a.end = end

    for ev in events:
        msg = ev.message
        if ev.reason == "PodCreated":
            m = _ATTEMPT_RE.search(msg)
            if m:
                a = get(int(m.group(1)))
                a.created = a.created or ev.time
        elif ev.reason == "PodRunning":
            m = _ATTEMPT_RE.search(msg)
            if m:
                a = get(int(m.group(1)))
                a.running = a.running or ev.time
        elif ev.reason == "Preempted" and (pm := _PREEMPTED_RE.match(msg)):
            n, pod, node = _who(job, pm.group("who"))
            step = pm.group("step")
            set_end(n, AttemptEnd("preempted", pm.group("reason"), "", int(step) if step else None, ev.time, pod, node))
        elif ev.reason == "PodFailed" and (fm := _FAILED_RE.match(msg)):
            n, pod, node = _who(job, fm.group("who"))
            set_end(
                n,
                AttemptEnd("failed", fm.group("reason"), (fm.group("message") or "").strip(), None, ev.time, pod, node),
            )
        elif ev.reason == "SidecarExited" and (sm := _SIDECAR_RE.match(msg)):
            n, pod, node = _who(job, sm.group("who"))
            if n is not None and n not in gang_cause:
                set_end(n, AttemptEnd("failed", "SidecarExited", sm.group("message"), None, ev.time, pod, node))
        elif ev.reason == "StoppingGang" and (gm := _GANG_RE.match(msg)):
            n, pod, node = _who(job, gm.group("who"))
            if gm.group("attempt"):
                n = int(gm.group("attempt"))
            if n is not None:
                gang_cause[n] = AttemptEnd(
                    gm.group("kind"), gm.group("reason"), (gm.group("message") or "").strip(), None, ev.time, pod, node
                )
                get(n)
        elif ev.reason == "Completed":
            n, pod, node = _who(job, msg)
            set_end(n, AttemptEnd("succeeded", "Completed", msg, None, ev.time, pod, node))
        elif ev.reason == "Suspended" and msg.startswith("job suspended; pod "):
            n, pod, node = _who(job, msg)
            set_end(n, AttemptEnd("suspended", "Suspended", "spec.suspend is true", None, ev.time, pod, node))
        elif ev.reason in _NOTE_REASONS:
            n = latest or _int(status.get("attempt"))
            if n:
                get(n).notes.append(f"{ev.reason}: {msg}")

    # A gang's end Event says only "(reason)": its StoppingGang Event has the words.
    for n, cause in gang_cause.items():
        a = get(n)
        if a.end is None:
            continue
        if not a.end.message and a.end.reason == cause.reason:
            a.end.message = cause.message
        a.end.node = a.end.node or cause.node
        a.end.pod = a.end.pod or cause.pod

    last = _map(status.get("lastPodEnd"))
    n = _int(last.get("attempt"))
    if n:
        a = get(n)
        before = a.end
        a.end = AttemptEnd(
            str(last.get("kind") or (before.kind if before else "ended")),
            str(last.get("reason") or (before.reason if before else "")),
            _str(last.get("message")) or (before.message if before else ""),
            _int(last.get("step")) if _int(last.get("step")) is not None else (before.step if before else None),
            _str(last.get("time")) or (before.time if before else None),
            _str(last.get("pod")) or (before.pod if before else None),
            _str(last.get("node")) or (before.node if before else None),
            "status",
        )

    current = _int(status.get("attempt")) or 0
    for i in range(1, max(current, latest) + 1):
        get(i)
    if current:
        get(current).current = True
    return [attempts[k] for k in sorted(attempts)]


def history_gaps(status: Mapping[str, Any], attempts: Sequence[Attempt]) -> list[str]:
    """What the history lacks: preemptions or failures counted in the status whose Events are gone."""
    notes: list[str] = []
    for kind, key in (("preempted", "preemptions"), ("failed", "failures")):
        counted = _int(status.get(key)) or 0
        shown = sum(1 for a in attempts if a.end is not None and a.end.kind == kind)
        if counted > shown:
            notes.append(
                f"{counted - shown} of {counted} {key} have no record left: the Events of older attempts"
                " have expired (most clusters keep Events for an hour)"
            )
    return notes


# --- pods ---------------------------------------------------------------------------


def pod_status(pod: Mapping[str, Any]) -> str:
    """What kubectl's STATUS column says: Terminating, a container's waiting/terminated reason, the phase."""
    meta, st = _map(pod.get("metadata")), _map(pod.get("status"))
    if meta.get("deletionTimestamp"):
        return "Terminating"
    if _str(st.get("reason")):
        return str(st["reason"])
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in st.get(key) or []:
            state = _map(_map(cs).get("state"))
            waiting = _map(state.get("waiting"))
            if _str(waiting.get("reason")) and waiting.get("reason") != "PodInitializing":
                return str(waiting["reason"])
    return str(st.get("phase") or "Unknown")


def pod_rows(job: str, pods: Sequence[Mapping[str, Any]], current: int) -> list[dict[str, Any]]:
    """The pods to show for the job: the current attempt's, and older ones still present (stopping)."""
    out: list[dict[str, Any]] = []
    for p in pods:
        meta, spec = _map(p.get("metadata")), _map(p.get("spec"))
        name = str(meta.get("name") or "")
        labels = _map(meta.get("labels"))
        attempt = pod_attempt(job, name)
        if attempt is None:
            raw = labels.get("spotguard.dev/attempt")
            attempt = int(raw) if isinstance(raw, str) and raw.isdigit() else None
        rank = labels.get("spotguard.dev/node-rank")
        out.append(
            {
                "name": name,
                "attempt": attempt,
                "rank": int(rank) if isinstance(rank, str) and rank.isdigit() else None,
                "status": pod_status(p),
                "node": _str(spec.get("nodeName")),
                "created": _str(meta.get("creationTimestamp")),
                "current": attempt == current,
            }
        )
    return sorted(out, key=lambda r: (-(r["attempt"] or 0), r["rank"] or 0, r["name"]))


# --- describe -------------------------------------------------------------------------


def job_storage(job: Mapping[str, Any]) -> str | None:
    """The job's own checkpoint root ``<spec.checkpoint.storage>/<namespace>/<name>``, if the spec has one."""
    meta = _map(job.get("metadata"))
    storage = _str(_map(_map(job.get("spec")).get("checkpoint")).get("storage"))
    if storage is None or not meta.get("namespace") or not meta.get("name"):
        return None
    return f"{storage.rstrip('/')}/{meta['namespace']}/{meta['name']}"


def describe(
    job: Mapping[str, Any], events: Iterable[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]], now: datetime
) -> dict[str, Any]:
    """Everything ``describe`` shows, as one plain dict (also what ``-o json|yaml`` prints)."""
    meta, spec, st = _map(job.get("metadata")), _map(job.get("spec")), _map(job.get("status"))
    name = str(meta.get("name") or "")
    evs = job_events(job, events)
    attempts = attempt_history(name, st, evs)
    current = _int(st.get("attempt")) or 0
    pre = _map(spec.get("preemption"))
    max_pre = _int(pre.get("maxPreemptions"))
    limit = _int(pre.get("backoffLimit"))
    omitted = max(0, len(attempts) - MAX_ATTEMPTS)
    return {
        "name": name,
        "namespace": meta.get("namespace"),
        "created": meta.get("creationTimestamp"),
        "phase": st.get("phase") or "-",
        "attempt": current,
        "currentPod": st.get("currentPod"),
        "nodes": _int(spec.get("nodes")) or 1,
        "preemptions": {
            "count": _int(st.get("preemptions")) or 0,
            "limit": max_pre if max_pre is not None else _PRE.max_preemptions,
        },
        "failures": {
            "count": _int(st.get("failures")) or 0,
            "limit": limit if limit is not None else _PRE.backoff_limit,
        },
        "restartAt": st.get("restartAt"),
        "storage": job_storage(job),
        "lastVerifiedCheckpoint": dict(_map(st.get("lastVerifiedCheckpoint"))) or None,
        "lastPodEnd": dict(_map(st.get("lastPodEnd"))) or None,
        "placement": dict(_map(st.get("placement"))) or None,
        "avoidedNodes": [dict(_map(r)) for r in st.get("avoidedNodes") or [] if isinstance(r, Mapping)],
        "conditions": [dict(_map(c)) for c in st.get("conditions") or [] if isinstance(c, Mapping)],
        "attempts": [asdict(a) for a in attempts[omitted:]],
        "attemptsOmitted": omitted,
        "historyGaps": history_gaps(st, attempts),
        "pods": [r for r in pod_rows(name, pods, current) if r["current"] or r["status"] == "Terminating"],
        "events": [asdict(e) for e in evs],
    }


def _end_line(end: Mapping[str, Any], now: datetime) -> str:
    kind = end.get("kind") or "ended"
    step = f" at step {end['step']}" if end.get("step") is not None else ""
    where = f" on node {end['node']}" if end.get("node") else ""
    return f"{kind} ({end.get('reason') or '?'}){step}{where}, {when(end.get('time'), now)}"


def _attempt_lines(a: Mapping[str, Any], now: datetime, phase: str) -> list[str]:
    n = a["attempt"]
    head = f"  #{n}{' (current)' if a.get('current') else ''}: "
    parts = []
    if a.get("created"):
        parts.append(f"created {age(a['created'], now)} ago")
    if a.get("running"):
        parts.append(f"running {age(a['running'], now)} ago")
    end = a.get("end")
    if end:
        parts.append(_end_line(end, now))
    elif a.get("current"):
        if not (a.get("running") and phase == "Running"):
            parts.append(f"now {phase}")
    else:
        parts.append("ended, no record left (its Events have expired)")
    lines = [head + "; ".join(parts)]
    if end and end.get("message"):
        lines.append(f"      cause: {end['message']}")
    lines += [f"      {note}" for note in a.get("notes") or []]
    return lines


def render_describe(desc: Mapping[str, Any], now: datetime) -> str:
    """``describe`` as text, in the manner of ``kubectl describe``."""
    out: list[str] = []

    def field_(label: str, value: Any) -> None:
        out.append(f"{label + ':':<14}{value}")

    field_("Name", desc["name"])
    field_("Namespace", desc.get("namespace") or "-")
    field_("Created", when(desc.get("created"), now))
    field_("Phase", desc["phase"])
    pod = f" (pod {desc['currentPod']})" if desc.get("currentPod") else ""
    nodes = f", {desc['nodes']} nodes each" if desc.get("nodes", 1) > 1 else ""
    field_("Attempt", f"{desc['attempt']}{pod}{nodes}")
    p, f = desc["preemptions"], desc["failures"]
    field_("Preemptions", f"{p['count']} (maxPreemptions {p['limit']})")
    field_("Failures", f"{f['count']} (backoffLimit {f['limit']})")
    if desc.get("restartAt"):
        field_("Restart at", when(desc["restartAt"], now))
    if desc.get("storage"):
        field_("Storage", desc["storage"])
    ckpt = desc.get("lastVerifiedCheckpoint")
    if ckpt:
        out.append("Last verified checkpoint:")
        out.append(f"  Step:  {ckpt.get('step', '-')}")
        out.append(f"  URI:   {ckpt.get('uri') or '-'}")
        out.append(f"  Time:  {when(ckpt.get('time'), now)}")
    else:
        out.append("Last verified checkpoint: none yet")
    placement = desc.get("placement")
    if placement:
        pool = placement.get("pool") or "primary"
        text = f"{pool} since {when(placement.get('since'), now)}"
        if placement.get("reason"):
            text += f", reason {placement['reason']}"
        if placement.get("returnAt"):
            text += f"; back to primary at {when(placement['returnAt'], now)}"
        field_("Placement", text)
    avoided = desc.get("avoidedNodes") or []
    if avoided:
        out.append("Avoided nodes:")
        rows = [
            (r.get("node"), r.get("ends"), when(r.get("until"), now) if r.get("until") else "not avoided yet")
            for r in avoided
        ]
        out += ["  " + line for line in table(("NODE", "ENDS", "AVOIDED UNTIL"), rows).splitlines()]
    conds = desc.get("conditions") or []
    if conds:
        out.append("Conditions:")
        cond_lines = [
            (c.get("type"), c.get("status"), c.get("reason"), age(c.get("lastTransitionTime"), now), c.get("message"))
            for c in conds
        ]
        out += ["  " + line for line in table(("TYPE", "STATUS", "REASON", "AGE", "MESSAGE"), cond_lines).splitlines()]
    out.append("Attempts:")
    if desc.get("attemptsOmitted"):
        out.append(f"  ({desc['attemptsOmitted']} older attempts not shown)")
    if not desc.get("attempts"):
        out.append("  none yet")
    for a in desc.get("attempts") or []:
        out += _attempt_lines(a, now, str(desc["phase"]))
    out += [f"  note: {gap}" for gap in desc.get("historyGaps") or []]
    pods = desc.get("pods") or []
    label = f"Pods (attempt {desc['attempt']}):" if desc.get("attempt") else "Pods:"
    if pods:
        out.append(label)
        pod_lines = [(r["name"], r["status"], r.get("node") or "<none>", age(r.get("created"), now)) for r in pods]
        out += ["  " + line for line in table(("NAME", "STATUS", "NODE", "AGE"), pod_lines).splitlines()]
    else:
        out.append(f"{label} none")
    evs = desc.get("events") or []
    if evs:
        shown = evs[-MAX_EVENTS:]
        more = f" (the last {len(shown)} of {len(evs)})" if len(evs) > len(shown) else ""
        out.append(f"Events{more}:")
        ev_lines = [(e["type"], e["reason"], age(e.get("time"), now), e["message"]) for e in shown]
        out += ["  " + line for line in table(("TYPE", "REASON", "AGE", "MESSAGE"), ev_lines).splitlines()]
    else:
        out.append("Events:       <none>")
    return "\n".join(out)


# --- checkpoints ---------------------------------------------------------------------

CHECKPOINT_HEADERS = ("STEP", "CREATED", "SIZE", "VERIFIED")


def checkpoints_table(rows: Sequence[Mapping[str, Any]], now: datetime, *, quick: bool = False) -> str:
    """The ``checkpoints`` table; ``*`` marks the step the ``latest`` pointer names."""
    ok = "yes (sizes only)" if quick else "yes"
    lines = []
    for r in rows:
        mark = "*" if r.get("latest") else ""
        created = r.get("created")
        stamp = f"{str(created)[:19].replace('T', ' ')} ({age(created, now)} ago)" if created else "-"
        verified = ok if r.get("verified") else "no: " + "; ".join(r.get("problems") or ["unknown"])
        lines.append((f"{r['step']}{mark}", stamp, human_size(r.get("size")), verified))
    return table(CHECKPOINT_HEADERS, lines)
