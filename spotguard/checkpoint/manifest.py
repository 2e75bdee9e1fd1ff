"""The checkpoint manifest: what a checkpoint holds, and how to check it.

Pure code: building, serializing, parsing and validating manifests; no I/O.
See ``docs/checkpoint-format.md`` for the format.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from spotguard import __version__
from spotguard.checkpoint.checksum import ALGORITHMS

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
POINTER_NAME = "latest"
NAME_PREFIX = "ckpt-"
_NAME_RE = re.compile(r"^ckpt-(\d{12})$")
_HEX_LEN = {"crc32c": 8, "sha256": 64}
_HEX_RE = re.compile(r"^[0-9a-f]+$")
MAX_STEP = 10**12 - 1


class ManifestError(ValueError):
    """A manifest is malformed or unsafe; the message names what is wrong."""


def checkpoint_name(step: int) -> str:
    """``ckpt-<step:012d>``, the name of the checkpoint taken after ``step``."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"checkpoint step must be an integer in [0, {MAX_STEP}], got {step!r}")
    return f"{NAME_PREFIX}{step:012d}"


def parse_checkpoint_name(name: str) -> int | None:
    """The step of a checkpoint name, or None when ``name`` is not one."""
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


def check_file_path(path: object) -> str:
    """Validate a manifest file path: relative, inside the checkpoint, plain.

    Rejects absolute paths, ``..``/``.``/empty segments, backslashes, control
    characters, and the manifest's own name.
    """
    if not isinstance(path, str) or not path:
        raise ManifestError(f"file path {path!r} is not a non-empty string")
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise ManifestError(f"file path {path!r} is absolute")
    if "\\" in path:
        raise ManifestError(f"file path {path!r} contains a backslash")
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise ManifestError(f"file path {path!r} contains a control character")
    parts = path.split("/")
    if ".." in parts:
        raise ManifestError(f"file path {path!r} escapes the checkpoint ('..')")
    if any(p in ("", ".") for p in parts):
        raise ManifestError(f"file path {path!r} has an empty or '.' segment")
    if path == MANIFEST_NAME:
        raise ManifestError(f"file path {path!r} names the manifest itself")
    return path


@dataclass(frozen=True)
class FileEntry:
    """One data file of a checkpoint."""

    path: str
    size: int
    checksum: str


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` of one checkpoint."""

    step: int
    files: tuple[FileEntry, ...]
    checksum_algorithm: str
    created: str
    writer: str = f"spotguard {__version__}"
    epoch: int | None = None
    metrics: Mapping[str, float | None] = field(default_factory=dict)
    job: str | None = None
    attempt: int | None = None
    reason: str | None = None
    request_id: str | None = None
    timing: Mapping[str, float] | None = None
    format_version: int = FORMAT_VERSION

    @property
    def name(self) -> str:
        """The checkpoint's name, ``ckpt-<step:012d>``."""
        return checkpoint_name(self.step)

    @property
    def total_size(self) -> int:
        """Bytes of all data files (the manifest excluded)."""
        return sum(f.size for f in self.files)

    @property
    def created_at(self) -> datetime:
        """``created`` as an aware datetime."""
        return parse_rfc3339(self.created)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written to ``manifest.json``."""
        doc: dict[str, Any] = {
            "format_version": self.format_version,
            "step": self.step,
            "epoch": self.epoch,
            "metrics": dict(self.metrics),
            "created": self.created,
            "writer": self.writer,
            "checksum_algorithm": self.checksum_algorithm,
            "files": [{"path": f.path, "size": f.size, "checksum": f.checksum} for f in self.files],
        }
        if self.job is not None:
            doc["job"] = self.job
        if self.attempt is not None:
            doc["attempt"] = self.attempt
        if self.reason is not None:
            doc["reason"] = self.reason
        if self.request_id is not None:
            doc["request_id"] = self.request_id
        if self.timing is not None:
            doc["timing"] = dict(self.timing)
        return doc

    def to_json(self) -> bytes:
        """Serialized manifest (UTF-8, stable key order)."""
        return (json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n").encode()


def rfc3339(ts: datetime | None = None) -> str:
    """RFC 3339 UTC time with microseconds, e.g. ``2025-01-02T03:04:05.123456Z``."""
    ts = ts or datetime.now(UTC)
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_rfc3339(value: str) -> datetime:
    """Parse an RFC 3339 time; naive values are taken as UTC."""
    ts = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def clean_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float | None]:
    """Metrics as JSON-safe floats; non-finite values become None (JSON has no NaN)."""
    out: dict[str, float | None] = {}
    for key, value in (metrics or {}).items():
        if not isinstance(key, str):
            raise ValueError(f"metric names must be strings, got {key!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metric {key!r} is not a number: {value!r}") from None
        out[key] = number if math.isfinite(number) else None
    return out


def new_manifest(
    step: int,
    files: Iterable[FileEntry],
    checksum_algorithm: str,
    *,
    epoch: int | None = None,
    metrics: Mapping[str, Any] | None = None,
    job: str | None = None,
    attempt: int | None = None,
    created: str | None = None,
    reason: str | None = None,
    request_id: str | None = None,
    timing: Mapping[str, float] | None = None,
) -> Manifest:
    """Build a manifest, validating every field the way :func:`parse_manifest` does."""
    manifest = Manifest(
        step=step,
        files=tuple(files),
        checksum_algorithm=checksum_algorithm,
        created=created or rfc3339(),
        epoch=epoch,
        metrics=clean_metrics(metrics),
        job=job,
        attempt=attempt,
        reason=reason,
        request_id=request_id,
        timing=timing,
    )
    return parse_manifest(manifest.to_json())


def _int(doc: Mapping[str, Any], key: str, *, optional: bool = False) -> int | None:
    value = doc.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ManifestError(f"field {key!r} must be an integer, got {value!r}")
    return value


def parse_manifest(data: bytes | str, *, expected_name: str | None = None) -> Manifest:
    """Parse and validate ``manifest.json``; raises :class:`ManifestError`.

    ``expected_name`` is the checkpoint directory/prefix the manifest was read
    from; its step must match the manifest's.
    """
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestError(f"malformed JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ManifestError("malformed manifest: top level is not a JSON object")
    version = _int(doc, "format_version")
    assert version is not None
    if version < 1 or version > FORMAT_VERSION:
        raise ManifestError(
            f"format_version {version} is not supported by spotguard {__version__} "
            f"(supports 1..{FORMAT_VERSION}); upgrade spotguard"
        )
    step = _int(doc, "step")
    assert step is not None
    if not 0 <= step <= MAX_STEP:
        raise ManifestError(f"step {step} out of range")
    if expected_name is not None and checkpoint_name(step) != expected_name:
        raise ManifestError(f"step {step} does not match the checkpoint name {expected_name!r}")
    epoch = _int(doc, "epoch", optional=True)
    algorithm = doc.get("checksum_algorithm")
    if algorithm not in ALGORITHMS:
        raise ManifestError(f"unknown checksum_algorithm {algorithm!r}")
    created = doc.get("created")
    if not isinstance(created, str):
        raise ManifestError(f"field 'created' must be an RFC 3339 string, got {created!r}")
    try:
        parse_rfc3339(created)
    except ValueError:
        raise ManifestError(f"field 'created' is not an RFC 3339 time: {created!r}") from None
    writer = doc.get("writer", "")
    if not isinstance(writer, str):
        raise ManifestError("field 'writer' must be a string")
    metrics_doc = doc.get("metrics") or {}
    if not isinstance(metrics_doc, dict):
        raise ManifestError("field 'metrics' must be an object")
    metrics: dict[str, float | None] = {}
    for key, value in metrics_doc.items():
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise ManifestError(f"metric {key!r} is not a number: {value!r}")
        metrics[key] = None if value is None else float(value)
    job = doc.get("job")
    if job is not None and not isinstance(job, str):
        raise ManifestError("field 'job' must be a string")
    attempt = _int(doc, "attempt", optional=True)
    reason = doc.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise ManifestError("field 'reason' must be a string")
    request_id = doc.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise ManifestError("field 'request_id' must be a string")
    timing_doc = doc.get("timing")
    timing: dict[str, float] | None = None
    if timing_doc is not None:
        if not isinstance(timing_doc, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in timing_doc.values()
        ):
            raise ManifestError("field 'timing' must map names to seconds")
        timing = {str(k): float(v) for k, v in timing_doc.items()}
    files_doc = doc.get("files")
    if not isinstance(files_doc, list):
        raise ManifestError("field 'files' must be a list")
    files: list[FileEntry] = []
    seen: set[str] = set()
    for entry in files_doc:
        if not isinstance(entry, dict):
            raise ManifestError(f"file entry {entry!r} is not an object")
        path = check_file_path(entry.get("path"))
        if path in seen:
            raise ManifestError(f"file path {path!r} is listed twice")
        seen.add(path)
        size = entry.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"{path}: size must be a non-negative integer, got {size!r}")
        checksum = entry.get("checksum")
        if (
            not isinstance(checksum, str)
            or len(checksum) != _HEX_LEN[algorithm]
            or not _HEX_RE.match(checksum)
        ):
            raise ManifestError(f"{path}: checksum {checksum!r} is not a {algorithm} hex digest")
        files.append(FileEntry(path=path, size=size, checksum=checksum))
    return Manifest(
        step=step,
        files=tuple(files),
        checksum_algorithm=algorithm,
        created=created,
        writer=writer,
        epoch=epoch,
        metrics=metrics,
        job=job,
        attempt=attempt,
        reason=reason,
        request_id=request_id,
        timing=timing,
        format_version=version,
    )


def pointer_json(step: int) -> bytes:
    """The ``latest`` pointer document for ``step``."""
    return json.dumps({"step": step, "name": checkpoint_name(step)}).encode()


def parse_pointer(data: bytes) -> int | None:
    """The step a ``latest`` pointer names, or None when it is unreadable."""
    try:
        doc = json.loads(data)
        step = doc["step"]
        if isinstance(step, int) and not isinstance(step, bool) and doc.get("name") == checkpoint_name(step):
            return step
    except (ValueError, KeyError, TypeError):
        pass
    return None
