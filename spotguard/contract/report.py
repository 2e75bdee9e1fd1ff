"""The sidecar's termination report: one type, its keys spelled once.

The sidecar ends by writing this JSON object to its container's termination
message (``/dev/termination-log``); the operator reads it back from the pod's
``containerStatuses[].state.terminated.message`` to tell how the attempt
ended. Both sides use :class:`TerminationReport`: the sidecar builds one and
writes :meth:`TerminationReport.to_text`, the operator reads
:meth:`TerminationReport.parse`.

The wire form (camelCase, as Kubernetes objects spell theirs)::

    {"preempted": bool, "reason": str, "step": int, "trainerStep": int,
     "metricsError": str, "stagingFull": {"step", "time", "free_bytes", "error"},
     "podDirRemoved": true}

Only ``preempted`` and ``reason`` are always written; the others only when
they say something. Reading is lenient, so that an operator and a sidecar of
different versions still understand each other: unknown keys are ignored, a
known key with a value of the wrong type reads as absent; only text that is
not a JSON object is refused. Kubelet keeps at most
:data:`TERMINATION_MESSAGE_MAX_BYTES` of a termination message, so free text
(``reason``, ``metricsError``, ``stagingFull.error``) is shortened to fit.
Standard library only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

#: Kubelet truncates a container's termination message to this many bytes.
TERMINATION_MESSAGE_MAX_BYTES = 4096

# The keys, each spelled here and nowhere else.
PREEMPTED = "preempted"
REASON = "reason"
STEP = "step"
TRAINER_STEP = "trainerStep"
METRICS_ERROR = "metricsError"
STAGING_FULL = "stagingFull"
#: The pod's own directory of its node (hostPath staging, ``SPOTGUARD_STAGING_POD_DIR``) is
#: removed, so the operator runs no cleanup of it.
POD_DIR_REMOVED = "podDirRemoved"
# ``stagingFull``'s keys: those of the trainer's ``staging-full.json`` (contract.control).
_FULL_STEP = "step"
_FULL_TIME = "time"
_FULL_FREE = "free_bytes"
_FULL_ERROR = "error"

# Longest free text kept (JSON-encoded bytes): all of them together stay far below the limit.
_REASON_MAX_BYTES = 256
_TEXT_MAX_BYTES = 1024


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _check_step(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{name} must be a non-negative integer or None, not {value!r}")


def clip_text(text: str, max_bytes: int) -> str:
    """Pure: ``text`` shortened so that its JSON encoding (quotes included) takes at most ``max_bytes``."""
    if len(json.dumps(text)) <= max_bytes:
        return text
    size, end = 2 + 3, 0  # the quotes, and the ellipsis' three dots
    for ch in text:
        size += len(json.dumps(ch)) - 2
        if size > max_bytes:
            break
        end += 1
    return text[:end] + "..."


@dataclass(frozen=True)
class StagingFull:
    """The trainer's last save found the checkpoint volume full (``staging-full.json``, passed on)."""

    error: str | None = None
    step: int | None = None
    time: float | None = None
    free_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_step("step", self.step)
        _check_step("free_bytes", self.free_bytes)

    def to_json(self) -> dict[str, Any]:
        """The wire form (keys of values it has)."""
        doc: dict[str, Any] = {}
        if self.step is not None:
            doc[_FULL_STEP] = self.step
        if self.time is not None:
            doc[_FULL_TIME] = self.time
        if self.free_bytes is not None:
            doc[_FULL_FREE] = self.free_bytes
        if self.error is not None:
            doc[_FULL_ERROR] = clip_text(self.error, _TEXT_MAX_BYTES)
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> StagingFull | None:
        """Pure: from its wire form (None when ``doc`` is not an object); ill-typed values read as absent."""
        if not isinstance(doc, dict):
            return None
        when = doc.get(_FULL_TIME)
        if not isinstance(when, int | float) or isinstance(when, bool) or not math.isfinite(when):
            when = None
        return cls(
            error=_text_or_none(doc.get(_FULL_ERROR)),
            step=_int_or_none(doc.get(_FULL_STEP)),
            time=None if when is None else float(when),
            free_bytes=_int_or_none(doc.get(_FULL_FREE)),
        )


@dataclass(frozen=True)
class TerminationReport:
    """The sidecar's last word: how the run ended and where its checkpoints stand.

    ``preempted`` and ``reason`` (``sigterm``, ``sigint``, ``notice:<source>``
    or ``finished``; see :class:`~spotguard.contract.control.RunEnd`) are
    always written; None only in a report read back whose value was not a
    boolean or a string. ``step`` is the newest checkpoint verified in
    storage, ``trainer_step`` the last step the trainer reached (so the
    operator can count lost steps), ``metrics_error`` why metrics could not be
    served, ``staging_full`` what the trainer said about a full checkpoint
    volume, ``pod_dir_removed`` that the pod's hostPath staging directory is
    gone.
    """

    preempted: bool | None
    reason: str | None
    step: int | None = None
    trainer_step: int | None = None
    metrics_error: str | None = None
    staging_full: StagingFull | None = None
    pod_dir_removed: bool = False

    def __post_init__(self) -> None:
        _check_step("step", self.step)
        _check_step("trainer_step", self.trainer_step)

    def to_json(self) -> dict[str, Any]:
        """Pure: the wire form (optional keys only when they say something; free text shortened)."""
        reason = None if self.reason is None else clip_text(self.reason, _REASON_MAX_BYTES)
        doc: dict[str, Any] = {PREEMPTED: self.preempted, REASON: reason}
        if self.step is not None:
            doc[STEP] = self.step
        if self.trainer_step is not None:
            doc[TRAINER_STEP] = self.trainer_step
        if self.metrics_error:
            doc[METRICS_ERROR] = clip_text(self.metrics_error, _TEXT_MAX_BYTES)
        if self.staging_full is not None:
            doc[STAGING_FULL] = self.staging_full.to_json()
        if self.pod_dir_removed:
            doc[POD_DIR_REMOVED] = True
        return doc

    def to_text(self) -> str:
        """Pure: the termination message; at most :data:`TERMINATION_MESSAGE_MAX_BYTES` bytes."""
        text = json.dumps(self.to_json())
        # Every free text is clipped and the rest is numbers: this holds by construction.
        assert len(text.encode()) <= TERMINATION_MESSAGE_MAX_BYTES, len(text)
        return text

    @classmethod
    def parse(cls, text: str) -> TerminationReport:
        """Pure: read a termination message back; raises ValueError when it is not a JSON object.

        Unknown keys are ignored and a known key with a value of the wrong
        type reads as absent (see the module's docstring).
        """
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("a termination report is a JSON object")
        preempted = doc.get(PREEMPTED)
        return cls(
            preempted=preempted if isinstance(preempted, bool) else None,
            reason=_text_or_none(doc.get(REASON)),
            step=_int_or_none(doc.get(STEP)),
            trainer_step=_int_or_none(doc.get(TRAINER_STEP)),
            metrics_error=_text_or_none(doc.get(METRICS_ERROR)),
            staging_full=StagingFull.from_json(doc.get(STAGING_FULL)),
            pod_dir_removed=doc.get(POD_DIR_REMOVED) is True,
        )
