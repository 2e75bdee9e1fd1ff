"""The checkpoint manifest: what a checkpoint holds, and how to check it.

Pure code: building, serializing, parsing and validating manifests; no I/O.
See ``docs/checkpoint-format.md`` for the format.
"""

from __future__ import annotations

import json
import math
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, TypedDict, Unpack

from spotguard.storage.checksum import ALGORITHMS
from spotguard.version import __version__

#: The newest format this spotguard reads and writes. A manifest without
#: ``sharding`` (one process) is still written as version 1, byte for byte
#: what earlier versions wrote; a sharded one (``sharding`` set) as version 2,
#: which a spotguard that only knows version 1 refuses instead of mistaking a
#: part of a distributed checkpoint for a whole one.
FORMAT_VERSION = 3
FORMAT_VERSION_SINGLE = 1
FORMAT_VERSION_SHARDED = 2
#: A checkpoint stored incrementally: every file is a sequence of
#: content-addressed chunks (``chunks/<aa>/<sha256>`` below the job's root)
#: shared with the job's other checkpoints. Only storage holds this version;
#: a restored local copy keeps it, and its files are whole. A distributed
#: checkpoint stored incrementally has version 3 and ``sharding``: each part
#: manifest lists its files' chunks, and the global manifest lists every
#: part's files with their chunks and the part manifests themselves
#: (``parts/<i>.json``) as whole files, the only entries without chunks.
FORMAT_VERSION_CHUNKED = 3
CHUNKS_DIR = "chunks"
MANIFEST_NAME = "manifest.json"
PARTS_DIR = "parts"
#: A distributed checkpoint's DCP directory (``torch.distributed.checkpoint``), and DCP's metadata file in it.
DCP_DIR = "dcp"
DCP_METADATA = ".metadata"
POINTER_NAME = "latest"
NAME_PREFIX = "ckpt-"
_NAME_RE = re.compile(r"^ckpt-(\d{12})$")
_HEX_LEN = {"crc32c": 8, "sha256": 64}
_HEX_RE = re.compile(r"^[0-9a-f]+$")
_SAVE_ID_RE = re.compile(r"^[A-Za-z0-9-]{1,64}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_CRC_RE = re.compile(r"^[0-9a-f]{8}$")
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


def checkpoint_step(name: str) -> int:
    """The step of checkpoint ``name`` (``ckpt-000000000042`` → 42); ValueError when it is not one."""
    step = parse_checkpoint_name(name)
    if step is None:
        raise ValueError(f"not a checkpoint name: {name!r}")
    return step


def part_manifest_path(part: int) -> str:
    """``parts/<part:05d>.json``: where part ``part``'s manifest is stored below its checkpoint."""
    if not isinstance(part, int) or isinstance(part, bool) or not 0 <= part <= 99999:
        raise ValueError(f"part index must be an integer in [0, 99999], got {part!r}")
    return f"{PARTS_DIR}/{part:05d}.json"


_PART_PATH_RE = re.compile(r"^parts/(\d{5})\.json$")


def parse_part_manifest_path(path: str) -> int | None:
    """The part index of a ``parts/<i:05d>.json`` path, or None."""
    m = _PART_PATH_RE.match(path)
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
class ChunkRef:
    """One content-addressed chunk of a file stored incrementally.

    ``hash`` (SHA-256 of the chunk's bytes, lowercase hex) names the object
    ``chunks/<hash[:2]>/<hash>``; ``checksum`` is the CRC32C of the same
    bytes, which the store checks on receipt and keeps, so a chunk is
    verified without reading it back.
    """

    hash: str
    size: int
    checksum: str

    @property
    def key(self) -> str:
        """The chunk's key below the job's storage root."""
        return chunk_key(self.hash)


def chunk_key(digest: str) -> str:
    """``chunks/<digest[:2]>/<digest>``: where the chunk with SHA-256 ``digest`` is stored."""
    if not isinstance(digest, str) or not _SHA256_RE.match(digest):
        raise ValueError(f"not a SHA-256 hex digest: {digest!r}")
    return f"{CHUNKS_DIR}/{digest[:2]}/{digest}"


_CHUNK_KEY_RE = re.compile(r"^chunks/([0-9a-f]{2})/([0-9a-f]{64})$")


def parse_chunk_key(key: str) -> str | None:
    """The digest of a ``chunks/<aa>/<digest>`` key, or None when it is not one."""
    m = _CHUNK_KEY_RE.match(key)
    return m.group(2) if m and m.group(2).startswith(m.group(1)) else None


@dataclass(frozen=True)
class FileEntry:
    """One data file of a checkpoint; ``chunks`` is set (in order, covering
    the file) only in a checkpoint stored incrementally (format version 3)."""

    path: str
    size: int
    checksum: str
    chunks: tuple[ChunkRef, ...] | None = None


@dataclass(frozen=True)
class Sharding:
    """How a distributed checkpoint is split.

    ``world_size`` ranks wrote it, grouped into ``parts`` parts (one per
    node); ``part`` is this manifest's part index (None for the global
    manifest, which covers every part) and ``ranks`` the global ranks it
    covers, sorted. ``save_id`` names the collective save that wrote the
    part (drawn once per save and the same on every rank): parts of two
    saves of one step (two attempts that reached it, which nondeterministic
    kernels make differ) never make one checkpoint.
    """

    world_size: int
    parts: int
    part: int | None
    ranks: tuple[int, ...]
    save_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The ``sharding`` object of the manifest."""
        doc: dict[str, Any] = {
            "world_size": self.world_size,
            "parts": self.parts,
            "part": self.part,
            "ranks": list(self.ranks),
        }
        if self.save_id is not None:
            doc["save_id"] = self.save_id
        return doc


class ManifestMeta(TypedDict, total=False):
    """What a save says about itself in its manifest, beside its files (the keywords of
    :func:`new_manifest` and of a local commit; each a :class:`Manifest` field)."""

    epoch: int | None
    metrics: Mapping[str, Any] | None
    job: str | None
    attempt: int | None
    reason: str | None
    request_id: str | None
    timing: Mapping[str, float] | None


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
    format_version: int = FORMAT_VERSION_SINGLE
    sharding: Sharding | None = None

    @property
    def is_part(self) -> bool:
        """A part manifest: one node's files of a distributed checkpoint."""
        return self.sharding is not None and self.sharding.part is not None

    @property
    def is_global(self) -> bool:
        """The global manifest of a distributed checkpoint (covers every part)."""
        return self.sharding is not None and self.sharding.part is None

    @property
    def locally_complete(self) -> bool:
        """Whether a directory with this manifest can be loaded without any
        other node's files: not a part, or the only part."""
        return self.sharding is None or self.sharding.part is None or self.sharding.parts == 1

    @property
    def chunked(self) -> bool:
        """Stored incrementally: files are sequences of shared chunks."""
        return self.format_version == FORMAT_VERSION_CHUNKED

    def chunk_refs(self) -> dict[str, ChunkRef]:
        """Every chunk the checkpoint references, once each, by digest."""
        return {c.hash: c for f in self.files for c in (f.chunks or ())}

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
        }
        if self.sharding is not None:
            doc["sharding"] = self.sharding.to_dict()
        doc["files"] = [_file_dict(f) for f in self.files]
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
        """Serialized manifest (UTF-8, stable key order): indented, each file's chunk list on one line
        (written by Python's C encoder: a file of a few GiB has hundreds of chunks, and the indenting
        encoder, pure Python, took most of the time of an emergency upload's manifests)."""
        doc = self.to_dict()
        lists: list[str] = []
        token = f"\x00{uuid.uuid4().hex}:"  # in no string of the document (a fresh random token)
        for entry in doc["files"]:
            if "chunks" in entry:
                lists.append(json.dumps(entry["chunks"], separators=(",", ":"), allow_nan=False))
                entry["chunks"] = f"{token}{len(lists) - 1}"
        text = json.dumps(doc, indent=1, allow_nan=False)
        if lists:
            quoted = re.escape(json.dumps(token)[:-1])  # the token as the encoder writes it, its closing quote cut
            text = re.sub(quoted + r'(\d+)"', lambda m: lists[int(m.group(1))], text)
        return (text + "\n").encode()


def _file_dict(entry: FileEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"path": entry.path, "size": entry.size, "checksum": entry.checksum}
    if entry.chunks is not None:
        doc["chunks"] = [[c.hash, c.size, c.checksum] for c in entry.chunks]
    return doc


def to_chunked(manifest: Manifest, chunks: Mapping[str, Iterable[ChunkRef]]) -> Manifest:
    """The manifest of ``manifest``'s checkpoint stored incrementally (format
    version 3): the same fields, each file with its chunks. ``chunks`` maps
    every file's path to its chunks in order; validated as on parsing."""
    files = []
    for f in manifest.files:
        if manifest.is_global and f.path.split("/", 1)[0] == PARTS_DIR:
            files.append(f)  # a part manifest: stored whole
            continue
        if f.path not in chunks:
            raise ManifestError(f"{f.path}: no chunks given")
        files.append(FileEntry(f.path, f.size, f.checksum, tuple(chunks[f.path])))
    out = replace(manifest, files=tuple(files), format_version=FORMAT_VERSION_CHUNKED)
    return parse_manifest(out.to_json())


def to_plain(manifest: Manifest) -> Manifest:
    """The manifest of the same checkpoint with whole files (version 1 or 2):
    what a self-contained copy of a checkpoint stored incrementally carries."""
    if not manifest.chunked:
        return manifest
    files = tuple(FileEntry(f.path, f.size, f.checksum) for f in manifest.files)
    version = FORMAT_VERSION_SINGLE if manifest.sharding is None else FORMAT_VERSION_SHARDED
    out = replace(manifest, files=files, format_version=version)
    return parse_manifest(out.to_json())


def stored_as(stored: bytes, local: bytes) -> bool:
    """Pure: whether ``stored`` (a manifest read from storage) is the manifest of the local
    checkpoint whose manifest is ``local``: the same bytes, or the same manifest stored
    incrementally (with chunk lists)."""
    if stored == local:
        return True
    try:
        manifest = parse_manifest(stored)
    except ManifestError:
        return False
    return manifest.chunked and to_plain(manifest).to_json() == local


#: Chunk lists already parsed and found consistent, by their whole content (the file's size, checksum and
#: algorithm, every chunk's name, size and CRC32C): the same file's list is parsed again and again (the part
#: manifest and the global one, each checkpoint that links the file), each time combining every chunk's CRC32C.
_PARSED_CHUNKS: dict[tuple[Any, ...], tuple[ChunkRef, ...]] = {}
_PARSED_CHUNKS_MAX = 4096
_PARSED_CHUNKS_LOCK = threading.Lock()


def _parse_chunks(path: str, value: Any, size: int, checksum: str, algorithm: str) -> tuple[ChunkRef, ...]:
    """The chunks of one file of a version 3 manifest: ``[[sha256, size, crc32c], ...]``,
    sizes adding up to the file's, and (for a CRC32C manifest) the chunks'
    CRC32Cs combining to the file's."""
    if not isinstance(value, list):
        raise ManifestError(f"{path}: 'chunks' must be a list")
    try:
        key: tuple[Any, ...] | None = (size, checksum, algorithm, *map(tuple, value))
        known = _PARSED_CHUNKS.get(key)  # type: ignore[arg-type]
    except TypeError:  # an item that is no list of plain values: checked (and refused) below
        key, known = None, None
    if known is not None:
        return known
    refs = _checked_chunks(path, value, size, checksum, algorithm)
    if key is not None:
        with _PARSED_CHUNKS_LOCK:  # parsed from several threads (an operator's probes, an uploader's workers)
            while len(_PARSED_CHUNKS) >= _PARSED_CHUNKS_MAX:
                del _PARSED_CHUNKS[next(iter(_PARSED_CHUNKS))]  # the oldest
            _PARSED_CHUNKS[key] = refs
    return refs


def _checked_chunks(path: str, value: list[Any], size: int, checksum: str, algorithm: str) -> tuple[ChunkRef, ...]:
    """:func:`_parse_chunks` without its memory."""
    from spotguard.storage.checksum import crc32c_of_parts

    refs: list[ChunkRef] = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 3):
            raise ManifestError(f"{path}: chunk {item!r} is not [sha256, size, crc32c]")
        digest, csize, crc = item
        if not isinstance(digest, str) or not _SHA256_RE.match(digest):
            raise ManifestError(f"{path}: chunk name {digest!r} is not a SHA-256 hex digest")
        if not isinstance(csize, int) or isinstance(csize, bool) or csize <= 0:
            raise ManifestError(f"{path}: chunk {digest[:12]} has size {csize!r}, not a positive integer")
        if not isinstance(crc, str) or not _CRC_RE.match(crc):
            raise ManifestError(f"{path}: chunk {digest[:12]} checksum {crc!r} is not a crc32c hex digest")
        refs.append(ChunkRef(digest, csize, crc))
    total = sum(c.size for c in refs)
    if total != size:
        raise ManifestError(f"{path}: chunks add up to {total} bytes, the file has {size}")
    combined = crc32c_of_parts((int(c.checksum, 16), c.size) for c in refs) if algorithm == "crc32c" else None
    if combined is not None and size and f"{combined:08x}" != checksum:
        raise ManifestError(f"{path}: the chunks' checksums do not combine to the file's checksum {checksum}")
    return tuple(refs)


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
    created: str | None = None,
    sharding: Sharding | None = None,
    writer: str | None = None,
    **meta: Unpack[ManifestMeta],
) -> Manifest:
    """Build a manifest, validating every field the way :func:`parse_manifest` does.

    With ``sharding`` it is a format version 2 manifest (a part, or the
    global manifest of a distributed checkpoint); without, version 1.
    """
    # Each key of ManifestMeta is a Manifest field; parse_manifest below checks their values.
    fields: dict[str, Any] = {**meta, "metrics": clean_metrics(meta.get("metrics"))}
    if writer is not None:
        fields["writer"] = writer
    manifest = Manifest(
        step=step,
        files=tuple(files),
        checksum_algorithm=checksum_algorithm,
        created=created or rfc3339(),
        format_version=FORMAT_VERSION_SINGLE if sharding is None else FORMAT_VERSION_SHARDED,
        sharding=sharding,
        **fields,
    )
    return parse_manifest(manifest.to_json())


def _int(doc: Mapping[str, Any], key: str, *, optional: bool = False) -> int | None:
    value = doc.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ManifestError(f"field {key!r} must be an integer, got {value!r}")
    return value


#: The last manifests parsed, by bytes and expected name: an upload reads the same ones several times.
_PARSED: OrderedDict[tuple[bytes | str, str | None], Manifest] = OrderedDict()
_parsed_lock = threading.Lock()


def parse_manifest(data: bytes | str, *, expected_name: str | None = None) -> Manifest:
    """Parse and validate ``manifest.json``; raises :class:`ManifestError`.

    ``expected_name`` is the checkpoint directory/prefix the manifest was read
    from; its step must match the manifest's. The same bytes parse to the same
    (immutable) :class:`Manifest`, remembered for the last few.
    """
    key = (bytes(data) if isinstance(data, bytearray | memoryview) else data, expected_name)
    with _parsed_lock:
        found = _PARSED.get(key)
    manifest = found or _parse_manifest(key[0], expected_name)
    with _parsed_lock:
        _PARSED[key] = manifest
        _PARSED.move_to_end(key)
        while len(_PARSED) > 8:
            _PARSED.popitem(last=False)
    return manifest


def _parse_manifest(data: bytes | str, expected_name: str | None) -> Manifest:
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
    sharding = _parse_sharding(doc.get("sharding"), version)
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
        if not isinstance(checksum, str) or len(checksum) != _HEX_LEN[algorithm] or not _HEX_RE.match(checksum):
            raise ManifestError(f"{path}: checksum {checksum!r} is not a {algorithm} hex digest")
        chunks = None
        whole = sharding is not None and sharding.part is None and path.split("/", 1)[0] == PARTS_DIR
        if version == FORMAT_VERSION_CHUNKED and not whole:
            chunks = _parse_chunks(path, entry.get("chunks"), size, checksum, algorithm)
        elif "chunks" in entry:
            if whole:
                raise ManifestError(f"{path}: a part manifest is stored whole, not as chunks")
            raise ManifestError(f"{path}: 'chunks' needs format_version {FORMAT_VERSION_CHUNKED}, got {version}")
        files.append(FileEntry(path=path, size=size, checksum=checksum, chunks=chunks))
    if sharding is not None:
        _check_sharded_files(sharding, seen)
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
        sharding=sharding,
    )


def _parse_sharding(value: Any, version: int) -> Sharding | None:
    if value is None:
        return None
    if version < FORMAT_VERSION_SHARDED:
        raise ManifestError(f"field 'sharding' needs format_version {FORMAT_VERSION_SHARDED}, got {version}")
    if not isinstance(value, dict):
        raise ManifestError("field 'sharding' must be an object")
    world_size = _int(value, "world_size")
    parts = _int(value, "parts")
    part = _int(value, "part", optional=True)
    assert world_size is not None and parts is not None
    if world_size < 1:
        raise ManifestError(f"sharding: world_size must be at least 1, got {world_size}")
    if not 1 <= parts <= min(world_size, 99999):
        raise ManifestError(f"sharding: parts must be in [1, world_size={world_size}], got {parts}")
    if part is not None and not 0 <= part < parts:
        raise ManifestError(f"sharding: part {part} out of range for {parts} part(s)")
    ranks_doc = value.get("ranks")
    if not isinstance(ranks_doc, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks_doc):
        raise ManifestError("sharding: 'ranks' must be a list of integers")
    ranks = tuple(ranks_doc)
    if not ranks:
        raise ManifestError("sharding: 'ranks' is empty")
    if list(ranks) != sorted(set(ranks)):
        raise ManifestError(f"sharding: ranks {list(ranks)} are not sorted and distinct")
    if ranks[0] < 0 or ranks[-1] >= world_size:
        raise ManifestError(f"sharding: ranks {list(ranks)} out of range for world_size {world_size}")
    if (part is None or parts == 1) and ranks != tuple(range(world_size)):
        what = "the global manifest" if part is None else "the only part"
        raise ManifestError(f"sharding: {what} must cover ranks 0..{world_size - 1}, got {list(ranks)}")
    save_id = value.get("save_id")
    if save_id is not None and (not isinstance(save_id, str) or not _SAVE_ID_RE.match(save_id)):
        raise ManifestError(f"sharding: save_id {save_id!r} is not 1-64 letters, digits or dashes")
    return Sharding(world_size=world_size, parts=parts, part=part, ranks=ranks, save_id=save_id)


def _check_sharded_files(sharding: Sharding, paths: set[str]) -> None:
    """A part lists no ``parts/`` file; the global manifest lists exactly one per part."""
    listed = {i for p in paths if (i := parse_part_manifest_path(p)) is not None}
    stray = sorted(p for p in paths if p.split("/", 1)[0] == PARTS_DIR and parse_part_manifest_path(p) is None)
    if sharding.part is not None:
        inside = sorted(p for p in paths if p.split("/", 1)[0] == PARTS_DIR)
        if inside:
            raise ManifestError(
                f"part {sharding.part} lists {inside[0]!r}, inside {PARTS_DIR}/ where the part manifests go"
            )
        return
    if stray:
        raise ManifestError(f"file {stray[0]!r} inside {PARTS_DIR}/ is not a part manifest")
    missing = [i for i in range(sharding.parts) if i not in listed]
    if missing:
        raise ManifestError(
            f"global manifest does not list {part_manifest_path(missing[0])} (part {missing[0]} of {sharding.parts})"
        )
    extra = sorted(i for i in listed if i >= sharding.parts)
    if extra:
        raise ManifestError(
            f"global manifest lists {part_manifest_path(extra[0])}, but the checkpoint has {sharding.parts} part(s)"
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
