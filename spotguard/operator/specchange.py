"""Which spec changes may not happen while a TrainingJob runs: one definition for the webhook and the operator.

A TrainingJob that has started (``status.attempt`` >= 1) and is not finished
resumes every attempt from its newest verified checkpoint. A few spec fields
decide *which* checkpoints those are, or whether a resume is exact; changing
them would silently throw the run's progress away (see :func:`forbidden_changes`).
Unless the job carries the annotation ``spotguard.dev/allow-restart-from-scratch:
"true"``, such a change is refused twice over:

* by the validating webhook, at once (:func:`restart_refusal` on the old and
  new object), when it is installed and reachable;
* by the operator itself (:func:`hold`), which records the values the job runs
  with in ``status.runsWith``, keeps running it with them, and says so in the
  condition ``SpecChangeRefused`` and a Warning Event, until the change is
  reverted or allowed by the annotation. This holds while the webhook is off,
  down (its failure policy is ``Ignore``) or bypassed.

Pure: no I/O, no clock (``now`` is passed in).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

from spotguard.operator.jobstatus import TERMINAL_PHASES, Event, condition, set_condition
from spotguard.operator.spec import PodTemplate, TrainingJobSpec, gpu_limit

#: ``"true"`` on a TrainingJob lets a change through that would restart it from nothing (or reshard it).
ALLOW_RESTART_ANNOTATION = "spotguard.dev/allow-restart-from-scratch"
#: The values a running job keeps: ``{storage, endpoint, nodes, nprocPerNode}``.
STATUS_FIELD = "runsWith"
#: True while the spec asks for a change the running job does not take.
COND_SPEC_CHANGE_REFUSED = "SpecChangeRefused"
R_SPEC_CHANGE_REFUSED = "SpecChangeRefused"
R_SPEC_CHANGE_APPLIED = "SpecChangeApplied"
R_SPEC_CHANGE_REVERTED = "SpecChangeReverted"


def started_and_running(status: Mapping[str, Any]) -> bool:
    """Pure: whether the job has started an attempt and has not finished."""
    attempt = status.get("attempt")
    started = isinstance(attempt, int) and not isinstance(attempt, bool) and attempt >= 1
    return started and status.get("phase") not in TERMINAL_PHASES


def allows_restart(meta: Any) -> bool:
    """Pure: whether the object's annotations allow a restart from scratch."""
    annotations = (meta.get("metadata") or {}).get("annotations") if isinstance(meta, Mapping) else None
    return isinstance(annotations, Mapping) and annotations.get(ALLOW_RESTART_ANNOTATION) == "true"


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _world(spec: Any) -> tuple[int | None, int | None, bool]:
    """``(nodes, processes per node, whether the latter follows the GPU limit)`` as the operator runs them.

    As ``spec.parse`` reads them (``nodes`` 1, ``nprocPerNode`` the trainer's
    GPU limit, else 1), without needing the rest of the spec to be valid.
    """
    raw: Mapping[str, Any] = spec if isinstance(spec, Mapping) else {}
    nodes = raw.get("nodes", 1)
    explicit = raw.get("nprocPerNode")
    if explicit is not None:
        return _int_or_none(nodes), _int_or_none(explicit), False
    template = raw.get("template")
    pod_spec = template.get("spec") if isinstance(template, Mapping) else None
    limit = gpu_limit(PodTemplate({}, {}, pod_spec)) if isinstance(pod_spec, Mapping) else None
    return _int_or_none(nodes), limit or 1, True


def pinned(spec: Any) -> dict[str, Any]:
    """Pure: the values of a raw spec that may not change while the job runs (``status.runsWith``'s shape)."""
    raw: Mapping[str, Any] = spec if isinstance(spec, Mapping) else {}
    checkpoint = raw.get("checkpoint")
    ckpt: Mapping[str, Any] = checkpoint if isinstance(checkpoint, Mapping) else {}
    nodes, nproc, _ = _world(raw)
    storage, endpoint = ckpt.get("storage"), ckpt.get("endpoint")
    return {
        "storage": storage if isinstance(storage, str) else None,
        "endpoint": endpoint if isinstance(endpoint, str) and endpoint else None,
        "nodes": nodes,
        "nprocPerNode": nproc,
    }


def _job_uri(storage: str, namespace: str, name: str) -> str:
    return f"{storage.rstrip('/')}/{namespace}/{name}"


def forbidden_changes(
    before: Mapping[str, Any], after: Mapping[str, Any], namespace: str, name: str, *, implicit: bool = False
) -> tuple[list[str], str]:
    """Pure: the changes from ``before`` to ``after`` (both :func:`pinned`) a running job must not take.

    Returns one sentence per change (what the next attempt would do) and a
    hint on how to keep the progress (empty when there is none to give):

    * ``storage``: the job's checkpoints live under ``<storage>/<namespace>/<name>``;
      under another root there are none, so the next attempt starts from step 0;
    * ``endpoint``: another endpoint may be another store, with none of them either;
    * ``nodes`` and ``nprocPerNode`` (``implicit``: the latter follows the
      trainer's GPU limit) when their product, the world size, changes: the
      restore reshards model and optimizer, but per-rank RNG states, the data
      order and the effective batch size do not carry over. The same world
      size laid out otherwise (2 nodes of 4 processes for 1 of 8) restores
      exactly, and passes.

    Everything else is safe to change on a running job: ``checksum`` (each
    manifest names its own algorithm), ``incremental`` (a restore reads both
    kinds), the intervals, retention, credentials, the pod template.
    """
    problems: list[str] = []
    copy_hint = ""
    old_storage, new_storage = before.get("storage"), after.get("storage")
    if (
        isinstance(old_storage, str)
        and isinstance(new_storage, str)
        and old_storage.rstrip("/") != new_storage.rstrip("/")
    ):
        old_uri, new_uri = _job_uri(old_storage, namespace, name), _job_uri(new_storage, namespace, name)
        problems.append(
            f"changing spec.checkpoint.storage from {old_storage} to {new_storage} would restart"
            f" training from nothing ({new_uri} has none of this job's checkpoints; they are in"
            f" {old_uri})"
        )
        copy_hint = (
            f" To keep the progress, first copy everything under {old_uri}/ to {new_uri}/ (with the"
            f" store's own tools; `spotguard ckpt ls {new_uri}` then lists the checkpoints there)"
            " and annotate as said."
        )
    if (before.get("endpoint") or None) != (after.get("endpoint") or None):
        was, now = before.get("endpoint") or "(none)", after.get("endpoint") or "(none)"
        problems.append(
            f"changing spec.checkpoint.endpoint from {was} to {now} would restart training from"
            " nothing if it names another store (that store has none of this job's checkpoints)"
        )
    old_nodes, old_nproc = _int_or_none(before.get("nodes")), _int_or_none(before.get("nprocPerNode"))
    new_nodes, new_nproc = _int_or_none(after.get("nodes")), _int_or_none(after.get("nprocPerNode"))
    old_world = old_nodes * old_nproc if old_nodes is not None and old_nproc is not None else None
    new_world = new_nodes * new_nproc if new_nodes is not None and new_nproc is not None else None
    # The same world size laid out otherwise (2 nodes x 4 for 1 x 8) restores exactly: the ranks are the same.
    if (old_nodes, old_nproc) != (new_nodes, new_nproc) and (old_world != new_world or old_world is None):
        world_changes = []
        if old_nodes != new_nodes:
            world_changes.append(f"spec.nodes from {old_nodes} to {new_nodes}")
        if old_nproc != new_nproc:
            source = " (the trainer's nvidia.com/gpu limit)" if implicit else ""
            world_changes.append(f"spec.nprocPerNode{source} from {old_nproc} to {new_nproc}")
        sizes = f" ({new_world} training processes instead of {old_world})" if old_world and new_world else ""
        problems.append(
            f"changing {' and '.join(world_changes)} would resume at another world size{sizes}: the"
            " checkpoint is resharded, not resumed exactly (per-rank RNG states, the data order and"
            " the effective batch size change)"
        )
    return problems, copy_hint


def how_to_allow(namespace: str, name: str) -> str:
    """What a user does to make such a change on purpose."""
    return (
        f"To do it on purpose, set the annotation {ALLOW_RESTART_ANNOTATION}=true in the same update (or"
        f" before it: `kubectl annotate trainingjob {name} -n {namespace} {ALLOW_RESTART_ANNOTATION}=true`,"
        " and remove it afterwards), or delete the job and create a new one."
    )


def restart_refusal(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """Pure: why an update of a TrainingJob must be refused (a message for the user), or None.

    Refused while the job has started and is not finished, unless the update
    carries the annotation, are the changes of :func:`forbidden_changes`.
    Status-only updates never change the spec, so they pass; so does any
    update that leaves these fields as they are.
    """
    status = old.get("status")
    if not isinstance(status, Mapping) or not started_and_running(status) or allows_restart(new):
        return None
    old_spec, new_spec = old.get("spec"), new.get("spec")
    if old_spec == new_spec:
        return None
    meta = new.get("metadata") or old.get("metadata") or {}
    name, namespace = str(meta.get("name") or "?"), str(meta.get("namespace") or "?")
    problems, copy_hint = forbidden_changes(
        pinned(old_spec), pinned(new_spec), namespace, name, implicit=_world(new_spec)[2]
    )
    if not problems:
        return None
    return f"{'; '.join(problems)}. {how_to_allow(namespace, name)}{copy_hint}"


def kept(spec: TrainingJobSpec, runs_with: Mapping[str, Any]) -> TrainingJobSpec:
    """Pure: ``spec`` with the values the job runs with (``status.runsWith``) in place of the refused ones."""
    checkpoint = spec.checkpoint
    storage = runs_with.get("storage")
    if isinstance(storage, str) and storage:
        checkpoint = replace(checkpoint, storage=storage)
    checkpoint = replace(checkpoint, endpoint=runs_with.get("endpoint") or None)
    nodes = _int_or_none(runs_with.get("nodes")) or spec.nodes
    nproc = _int_or_none(runs_with.get("nprocPerNode")) or spec.nproc_per_node
    return replace(spec, checkpoint=checkpoint, nodes=nodes, nproc_per_node=nproc)


def hold(
    job: Mapping[str, Any], spec: TrainingJobSpec, status: Mapping[str, Any], now: datetime, generation: int | None
) -> tuple[TrainingJobSpec, dict[str, Any], tuple[Event, ...]]:
    """Pure: the spec the operator acts on, the status with ``runsWith`` and the condition, and Events.

    While the job runs, a change of :func:`forbidden_changes` from the values
    in ``status.runsWith`` is not acted on: the returned spec keeps those
    values, the condition ``SpecChangeRefused`` is True saying what and what to
    do, and a Warning Event is posted when the refused change is new. Once the
    spec is reverted, or the annotation allows the change, or the job is not
    running, ``runsWith`` follows the spec and the condition turns False.
    """
    meta = job.get("metadata") or {}
    namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
    raw = job.get("spec")
    wanted = pinned(raw)
    st = copy.deepcopy(dict(status))
    before = st.get(STATUS_FIELD)
    events: list[Event] = []
    refused = condition(st, COND_SPEC_CHANGE_REFUSED) or {}
    if isinstance(before, Mapping) and started_and_running(st) and not allows_restart(job):
        problems, copy_hint = forbidden_changes(before, wanted, namespace, name, implicit=_world(raw)[2])
        if problems:
            message = (
                f"not applied while the job runs, which keeps its current values: {'; '.join(problems)}."
                f" Revert the change to clear this, or: {how_to_allow(namespace, name)}{copy_hint}"
            )
            if refused.get("status") != "True" or refused.get("message") != message:
                events.append(Event("Warning", R_SPEC_CHANGE_REFUSED, message))
            set_condition(
                st.setdefault("conditions", []),
                COND_SPEC_CHANGE_REFUSED,
                True,
                R_SPEC_CHANGE_REFUSED,
                message,
                now,
                generation,
            )
            return kept(spec, before), st, tuple(events)
    if refused.get("status") == "True":
        reason = R_SPEC_CHANGE_APPLIED if allows_restart(job) or not started_and_running(st) else R_SPEC_CHANGE_REVERTED
        if reason == R_SPEC_CHANGE_REVERTED:
            message = "the spec is back to the values the job runs with"
        elif started_and_running(st):
            message = "the spec change is applied from the next attempt on (allowed by the annotation)"
        else:
            message = "the job is not running: the spec applies as it is"
        set_condition(
            st.setdefault("conditions", []), COND_SPEC_CHANGE_REFUSED, False, reason, message, now, generation
        )
        events.append(Event("Normal", reason, message))
    st[STATUS_FIELD] = {k: v for k, v in wanted.items() if v is not None}  # as the apiserver keeps it
    return spec, st, tuple(events)
