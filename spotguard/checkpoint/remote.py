"""Checkpoints in storage: upload, verify, find the newest verified, restore.

Layout below the storage root: ``ckpt-<step:012d>/<data files>``,
``ckpt-<step:012d>/manifest.json`` (uploaded after every data file), and the
advisory ``latest`` pointer (uploaded last). Which checkpoint is usable is
decided from the listing and the manifests alone; the pointer is never
trusted.

A distributed checkpoint is uploaded part by part (one part per node): each
uploader stores its part's data files, verifies them in storage, then stores
the part manifest as ``ckpt-<step>/parts/<i:05d>.json``, then tries the
global commit (:func:`commit_global`): whoever finds every part present
writes ``ckpt-<step>/manifest.json``, built from the part manifests alone
(so racing uploaders produce the same bytes), with a conditional put.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from spotguard.checkpoint.checksum import checksum_bytes
from spotguard.checkpoint.chunked import KnownChunks, fetch_chunks, tombstone_key, upload_chunks, verify_chunks
from spotguard.checkpoint.fetch import fetch_verified
from spotguard.checkpoint.intents import upload_intent
from spotguard.checkpoint.local import (
    TMP_PREFIX,
    list_local_committed,
    read_local_manifest,
    remove_checkpoint_dir,
    verify_local_checkpoint,
)
from spotguard.checkpoint.manifest import (
    MANIFEST_NAME,
    PARTS_DIR,
    POINTER_NAME,
    Manifest,
    ManifestError,
    build_global_manifest,
    checkpoint_name,
    parse_checkpoint_name,
    parse_manifest,
    parse_part_manifest_path,
    parse_pointer,
    part_manifest_path,
    pointer_json,
    to_plain,
)
from spotguard.checkpoint.verify import (
    METHOD_READ_BACK,
    METHOD_SIZES,
    VerifyResult,
    verify_files,
    verify_files_by_store,
)
from spotguard.storage.base import (
    UNCHANGED,
    NotFoundError,
    ObjectInfo,
    PreconditionFailedError,
    ProgressCallback,
    Storage,
    StorageError,
    StoreChecksums,
    StoredChecksum,
)
from spotguard.storage.file import fsync_dir

log = logging.getLogger(__name__)

RESTORE_TMP_PREFIX = f"{TMP_PREFIX}restore-"


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint that passed verification."""

    name: str
    step: int
    epoch: int | None
    metrics: dict[str, float | None]
    created: str
    size: int
    uri: str
    manifest: Manifest = field(repr=False)

    @classmethod
    def from_manifest(cls, manifest: Manifest, uri: str) -> CheckpointInfo:
        """Build from a manifest and the checkpoint's URI (or local path)."""
        return cls(
            name=manifest.name,
            step=manifest.step,
            epoch=manifest.epoch,
            metrics=dict(manifest.metrics),
            created=manifest.created,
            size=manifest.total_size,
            uri=uri,
            manifest=manifest,
        )


@dataclass(frozen=True)
class Skipped:
    """A checkpoint passed over while looking for the newest verified one."""

    name: str
    step: int
    reason: str


@dataclass(frozen=True)
class UploadResult:
    """What :func:`upload_checkpoint` stored."""

    step: int
    name: str
    bytes: int
    seconds: float
    uri: str
    pointer_updated: bool
    #: Whether the checkpoint is complete in storage now (its manifest is
    #: there): always for a single-process checkpoint; for a part of a
    #: distributed one, when the global manifest exists (this uploader wrote
    #: it, or another did).
    committed: bool = True
    #: Parts of the checkpoint found in storage, and how many it has (1 and 1
    #: for a single-process checkpoint).
    parts_present: int = 1
    parts_total: int = 1
    #: Of ``bytes``: data stored by this upload, and data already in storage
    #: that the checkpoint shares (stored incrementally; 0 otherwise).
    new_bytes: int = 0
    reused_bytes: int = 0
    new_chunks: int = 0
    reused_chunks: int = 0


@dataclass(frozen=True)
class GlobalCommit:
    """What :func:`commit_global` found or did.

    ``status``: ``written`` (this call wrote the global manifest), ``exists``
    (it was there already, or another uploader won the race), ``waiting``
    (parts are missing, or the stored parts do not make one checkpoint:
    ``problem`` says why). ``present``: part indices found; ``total``: the
    number of parts (None when no part could be read); ``missing``: indices
    not found.
    """

    status: str
    present: list[int]
    total: int | None
    missing: list[int]
    problem: str | None = None

    @property
    def committed(self) -> bool:
        """The global manifest is in storage."""
        return self.status in ("written", "exists")


class CheckpointCorruptError(Exception):
    """A checkpoint failed verification; ``problems`` name file and reason."""

    def __init__(self, name: str, problems: list[str]) -> None:
        super().__init__(f"{name}: " + "; ".join(problems))
        self.name = name
        self.problems = problems


def list_checkpoint_names(storage: Storage) -> list[str]:
    """Names of every ``ckpt-*`` prefix in storage (complete or not), oldest first."""
    names = [n for n in storage.list_dirs("") if parse_checkpoint_name(n) is not None]
    return sorted(names, key=lambda n: parse_checkpoint_name(n) or 0)


def read_manifest_bytes(storage: Storage, name: str) -> bytes:
    """The raw ``manifest.json`` of a checkpoint; raises :class:`NotFoundError`."""
    return storage.read_bytes(f"{name}/{MANIFEST_NAME}")


def read_manifest(storage: Storage, name: str) -> Manifest:
    """Parse a stored checkpoint's manifest; raises :class:`NotFoundError` or
    :class:`ManifestError`."""
    return parse_manifest(read_manifest_bytes(storage, name), expected_name=name)


def _listing(storage: Storage, name: str) -> dict[str, ObjectInfo]:
    prefix = f"{name}/"
    return {o.key[len(prefix) :]: o for o in storage.list_objects(prefix)}


def read_parts(storage: Storage, name: str) -> tuple[dict[int, tuple[bytes, Manifest]], list[str]]:
    """The part manifests stored below ``name/parts/``: each readable one by
    part index (its bytes and parsed form), and a problem for each that is
    not (unparsable, another step, a part manifest stored under the wrong
    index)."""
    parts: dict[int, tuple[bytes, Manifest]] = {}
    problems: list[str] = []
    prefix = f"{name}/{PARTS_DIR}/"
    for info in sorted(storage.list_objects(prefix), key=lambda o: o.key):
        rel = info.key[len(f"{name}/") :]
        index = parse_part_manifest_path(rel)
        if index is None:
            continue
        try:
            data = storage.read_bytes(info.key)
        except NotFoundError:
            continue  # deleted meanwhile
        try:
            manifest = parse_manifest(data, expected_name=name)
        except ManifestError as exc:
            problems.append(f"{rel}: {exc}")
            continue
        if manifest.sharding is None or manifest.sharding.part != index:
            problems.append(f"{rel}: not the manifest of part {index}")
            continue
        parts[index] = (data, manifest)
    return parts, problems


def _parts_total(parts: dict[int, tuple[bytes, Manifest]]) -> int | None:
    """The number of parts the stored part manifests declare (part 0's, else the lowest's)."""
    if not parts:
        return None
    sharding = parts[min(parts)][1].sharding
    return sharding.parts if sharding is not None else None


def commit_global(storage: Storage, name: str) -> GlobalCommit:
    """Write the global manifest of distributed checkpoint ``name`` if every
    part manifest is in storage and none is there yet.

    Part manifests are stored only after their part's data files are stored
    and verified, so when all are present the checkpoint is complete. The
    global manifest is :func:`build_global_manifest` of them (a pure function
    of their bytes) and is written with a conditional put (``If-None-Match:
    *``): of uploaders racing, one writes it and the others get ``exists``;
    all would have written the same bytes. Storage errors propagate.
    """
    key = f"{name}/{MANIFEST_NAME}"
    if storage.stat(key) is not None:
        return _existing_commit(storage, name)
    parts, problems = read_parts(storage, name)
    present = sorted(parts)
    total = _parts_total(parts)
    missing = [i for i in range(total) if i not in parts] if total is not None else []
    if total is None or missing or problems:
        return GlobalCommit("waiting", present, total, missing, "; ".join(problems) or None)
    try:
        manifest = build_global_manifest(parts.values())
    except ManifestError as exc:
        # Typically a part left by an earlier attempt at the same step; its
        # uploader replaces it when it ships the part again.
        log.warning("cannot commit %s yet: %s", storage.uri_for(name), exc)
        return GlobalCommit("waiting", present, total, missing, str(exc))
    try:
        storage.write_bytes(key, manifest.to_json(), if_none_match=True)
    except PreconditionFailedError:
        return GlobalCommit("exists", present, total, [])
    log.info("committed %s: all %d part(s) present, global manifest written", storage.uri_for(name), total)
    return GlobalCommit("written", present, total, [])


def _existing_commit(storage: Storage, name: str) -> GlobalCommit:
    try:
        manifest = read_manifest(storage, name)
    except (NotFoundError, ManifestError):
        return GlobalCommit("exists", [], None, [])
    total = manifest.sharding.parts if manifest.sharding is not None else 1
    return GlobalCommit("exists", list(range(total)), total, [])


def _missing_manifest_problems(storage: Storage, name: str) -> tuple[list[str], list[int] | None, int | None]:
    """Why a prefix without ``manifest.json`` is not a checkpoint: an
    interrupted upload, or a distributed checkpoint whose parts are not all
    there (which ones are, which are missing). Also the parts present and total."""
    parts, problems = read_parts(storage, name)
    if not parts and not problems:
        return [f"{MANIFEST_NAME}: missing (upload incomplete or interrupted)"], None, None
    total = _parts_total(parts)
    present = sorted(parts)
    if total is None:
        return [f"{MANIFEST_NAME}: missing; no readable part manifest", *problems], present, None
    missing = [i for i in range(total) if i not in parts]
    line = f"{MANIFEST_NAME}: missing; parts present: {len(present)} of {total}"
    if present:
        line += f" ({_indices('part', present)})"
    if missing:
        line += f"; missing {_indices('part', missing)}"
    else:
        line += "; not committed yet"
        if not problems:
            try:
                build_global_manifest(parts.values())
            except ManifestError as exc:
                problems = [f"parts do not make one checkpoint: {exc}"]
    return [line, *problems], present, total


def _indices(word: str, values: list[int]) -> str:
    shown = ", ".join(str(v) for v in values[:16]) + (", ..." if len(values) > 16 else "")
    return f"{word}{'s' if len(values) > 1 else ''} {shown}"


def _part_of_files(storage: Storage, name: str) -> dict[str, int]:
    """Which part lists each file, from the stored part manifests (those readable)."""
    owners: dict[str, int] = {}
    parts, _ = read_parts(storage, name)
    for index, (_, manifest) in parts.items():
        for entry in manifest.files:
            owners[entry.path] = index
        owners[part_manifest_path(index)] = index
    return owners


def name_parts(storage: Storage, name: str, manifest: Manifest, problems: list[str]) -> list[str]:
    """Problems of a distributed checkpoint's files, each followed by the part
    it belongs to (the part whose manifest lists the file)."""
    if manifest.sharding is None or not problems:
        return problems
    owners = _part_of_files(storage, name)
    for entry in manifest.files:
        index = parse_part_manifest_path(entry.path)
        if index is not None:
            owners.setdefault(entry.path, index)
    out: list[str] = []
    for problem in problems:
        path = next((p for p in sorted(owners, key=len, reverse=True) if problem.startswith(f"{p}: ")), None)
        if path is None:
            out.append(problem)
        elif parse_part_manifest_path(path) is not None:
            out.append(f"{problem} (manifest of part {owners[path]})")
        else:
            out.append(f"{problem} (part {owners[path]})")
    return out


def _check_against_parts(storage: Storage, name: str, manifest: Manifest) -> list[str]:
    """A global manifest must be what its (verified) part manifests make: the
    same files and sharding. Reads the part manifests (small)."""
    parts, problems = read_parts(storage, name)
    if problems:
        return problems
    try:
        expected = build_global_manifest(parts.values())
    except ManifestError as exc:
        return [f"{PARTS_DIR}/: {exc}"]
    if expected.sharding != manifest.sharding or set(expected.files) != set(manifest.files):
        extra = sorted({f.path for f in manifest.files} - {f.path for f in expected.files})
        return [f"{MANIFEST_NAME}: does not match the part manifests"
                + (f" (lists {extra[0]!r}, which no part lists)" if extra else "")]  # fmt: skip
    return []


def verify_checkpoint(
    storage: Storage, name: str, *, checksums: bool = True, deep: bool = False, workers: int = 4,
    quiet: bool = False,
) -> VerifyResult:
    """Check that every file in the checkpoint's manifest exists in storage
    with the recorded size and checksum (and that no pickle in it would run
    code). Never raises for a broken checkpoint; storage failures (network,
    credentials) propagate.

    Where the store computed a checksum on receipt (S3 additional checksums,
    :class:`~spotguard.storage.base.StoreChecksums`) it is compared with the
    manifest instead of reading the file back; files without one are read
    back. ``deep=True`` reads every byte back regardless (bit rot, a store
    that is not trusted). ``checksums=False`` checks sizes only.
    ``VerifyResult.method`` says which way was taken. The result is logged
    at INFO, or at DEBUG with ``quiet`` (a poller that looks again and again).

    A distributed checkpoint is verified by its global manifest, which lists
    every part's files and every part manifest; a problem with a file names
    the part it belongs to. A prefix with part manifests but no global
    manifest is not verified: the reason says which parts are present and
    which are missing.
    """
    if parse_checkpoint_name(name) is None:
        return VerifyResult(name, False, [f"{name!r} is not a checkpoint name (ckpt-<12 digits>)"])
    try:
        manifest = read_manifest(storage, name)
    except NotFoundError:
        problems, present, total = _missing_manifest_problems(storage, name)
        return VerifyResult(name, False, problems, parts_present=present, parts_total=total)
    except ManifestError as exc:
        return VerifyResult(name, False, [f"{MANIFEST_NAME}: {exc}"])
    if manifest.is_part:
        assert manifest.sharding is not None
        return VerifyResult(name, False, [
            f"{MANIFEST_NAME}: the manifest of part {manifest.sharding.part} of {manifest.sharding.parts}, "
            "not of the whole checkpoint"
        ])  # fmt: skip
    if manifest.chunked:
        chunk_checks = verify_chunks(storage, manifest, checksums=checksums, deep=deep, workers=max(workers, 8))
        result = VerifyResult(
            name, not chunk_checks.problems, chunk_checks.problems, manifest, chunk_checks.read_bytes,
            method=chunk_checks.method if checksums else METHOD_SIZES,
            store_checked=chunk_checks.store_checked, read_back=chunk_checks.read_back,
        )  # fmt: skip
        _log_verify(storage, name, result, "chunks", quiet)
        return result
    listing = _listing(storage, name)
    sizes = {path: info.size for path, info in listing.items()}

    def read_chunks(path: str) -> Iterable[bytes]:
        return storage.iter_chunks(f"{name}/{path}")

    if checksums and not deep and isinstance(storage, StoreChecksums):
        checker = storage

        def stored(path: str) -> StoredChecksum | None:
            return checker.stored_checksum(f"{name}/{path}")

        checks = verify_files_by_store(manifest, sizes, stored, read_chunks, workers=workers)
        result = VerifyResult(
            name, not checks.problems, checks.problems, manifest, checks.read_bytes,
            method=checks.method, store_checked=checks.store_checked, read_back=checks.read_back,
        )  # fmt: skip
    else:
        problems, nbytes = verify_files(manifest, sizes, read_chunks, checksums=checksums, workers=workers)
        method = METHOD_READ_BACK if checksums else METHOD_SIZES
        result = VerifyResult(
            name, not problems, problems, manifest, nbytes,
            method=method, read_back=len(manifest.files) if checksums else 0,
        )  # fmt: skip
    if manifest.sharding is not None:
        result.problems = name_parts(storage, name, manifest, result.problems)
        if not result.problems:
            result.problems = _check_against_parts(storage, name, manifest)
            result.ok = not result.problems
        result.parts_total = manifest.sharding.parts
        result.parts_present = list(range(manifest.sharding.parts))
    _log_verify(storage, name, result, "files", quiet)
    return result


def _log_verify(storage: Storage, name: str, result: VerifyResult, unit: str, quiet: bool = False) -> None:
    log.log(
        logging.DEBUG if quiet else logging.INFO,
        "verify %s: %s by %s (%d %s by store checksum, %d read back, %d bytes read)",
        storage.uri_for(name), "ok" if result.ok else "FAILED", result.method,
        result.store_checked, unit, result.read_back, result.checked_bytes,
    )  # fmt: skip


def latest_verified(
    storage: Storage, *, checksums: bool = True, deep: bool = False, quiet: bool = False
) -> tuple[CheckpointInfo | None, list[Skipped]]:
    """The newest checkpoint that passes verification, and every newer one that
    was passed over with the reason. ``(None, skipped)`` when none passes.
    ``checksums`` and ``deep`` as for :func:`verify_checkpoint`; ``quiet``
    logs each verification and skipped checkpoint at DEBUG instead of
    INFO/WARNING (for pollers, which report what changed themselves)."""
    skipped: list[Skipped] = []
    for name in reversed(list_checkpoint_names(storage)):
        result = verify_checkpoint(storage, name, checksums=checksums, deep=deep, quiet=quiet)
        if result.ok and result.manifest is not None:
            return CheckpointInfo.from_manifest(result.manifest, storage.uri_for(name)), skipped
        skipped.append(Skipped(name, parse_checkpoint_name(name) or 0, result.reason))
        log.log(logging.DEBUG if quiet else logging.WARNING, "skipping checkpoint %s: %s",
                storage.uri_for(name), result.reason)  # fmt: skip
    return None, skipped


#: Default of :attr:`LatestWatch.full_read_seconds`.
FULL_READ_SECONDS = 1800.0


class LatestWatch:
    """:func:`latest_verified` for a poller: a full read only when something changed.

    One watch per storage root (per job). Each :meth:`poll` reads the
    ``latest`` pointer conditionally (``If-None-Match`` with the entity tag
    seen at the last full read): while it is unchanged the poll returns the
    last full read's result, at the cost of exactly one request and no data.
    When the pointer changed or is missing, or when a full read is due
    (every ``full_read_seconds``; 0: at every poll, without reading the
    pointer at all, as :func:`latest_verified` alone), it calls
    :func:`latest_verified` and keeps the result with the pointer's tag.

    Why an unchanged pointer may stand for "nothing new": every writer moves
    the pointer (by compare-and-swap, forward only) after the checkpoint is
    complete in storage: the sidecar, ``spotguard run`` and the Checkpointer
    after it verified; :func:`upload_checkpoint` after the manifest; the
    distributed commit after the global manifest. So a new checkpoint that
    verifies changes the pointer's entity tag. The result itself never comes
    from the pointer: a full read decides from the listing and the manifests
    as :func:`latest_verified` does. The pointer is still advisory: a writer
    that crashed between its verification and the pointer move, a pointer
    write that failed, or a checkpoint removed or damaged behind spotguard's
    back is not signalled; the periodic full read catches those, at most
    ``full_read_seconds`` late. The pointer is read before the listing and
    its tag is the one kept: a pointer moved in between only costs one more
    full read at the next poll, never a stale result.

    Because the pointer only moves forward, it cannot signal a new checkpoint
    older than the step it names: when it names a step newer than the newest
    checkpoint that verifies (that one was damaged or removed, and training
    resumed from an older one), or cannot be parsed, it is not trusted and
    every poll reads in full (as without a watch) until a full read finds
    the pointer's checkpoint, or a newer one, verified.

    Storage errors propagate and change nothing kept (the next poll tries
    again). ``clock`` (monotonic seconds) is injectable for tests.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        full_read_seconds: float = FULL_READ_SECONDS,
        checksums: bool = False,
        deep: bool = False,
        quiet: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.storage = storage
        self.full_read_seconds = max(0.0, float(full_read_seconds))
        self.checksums = checksums
        self.deep = deep
        self.quiet = quiet
        self._clock = clock
        self._lock = threading.Lock()
        self._etag: str | None = None
        self._result: tuple[CheckpointInfo | None, list[Skipped]] | None = None
        self._full_at = 0.0
        #: Polls answered by a full read, and by the unchanged pointer alone.
        self.full_reads = 0
        self.unchanged_polls = 0
        #: Whether the last poll made a full read.
        self.last_full = False

    def poll(self, *, full: bool = False) -> tuple[CheckpointInfo | None, list[Skipped]]:
        """The newest verified checkpoint and the newer ones skipped, as :func:`latest_verified`;
        ``full``: a full read now, whatever the pointer says (a last look)."""
        with self._lock:
            if self.full_read_seconds <= 0:
                return self._full_read(None)
            due = self._result is None or self._etag is None or self._clock() - self._full_at >= self.full_read_seconds
            if full or due:
                pointer = self.storage.read_with_etag(POINTER_NAME)
            else:
                found = self.storage.read_if_changed(POINTER_NAME, self._etag)
                if found is UNCHANGED:
                    assert self._result is not None
                    self.unchanged_polls += 1
                    self.last_full = False
                    info, skipped = self._result
                    return info, list(skipped)
                pointer = found
            return self._full_read(pointer)

    def _full_read(self, pointer: tuple[bytes, str] | None) -> tuple[CheckpointInfo | None, list[Skipped]]:
        started = self._clock()
        info, skipped = latest_verified(self.storage, checksums=self.checksums, deep=self.deep, quiet=self.quiet)
        # The pointer's tag is kept (and stands for "nothing new" at the next polls) only when the pointer
        # is not ahead of what verifies; and only once the read succeeded: a failed one changes nothing.
        pointed = parse_pointer(pointer[0]) if pointer is not None else None
        trusted = pointer is not None and pointed is not None and info is not None and pointed <= info.step
        self._etag = pointer[1] if trusted and pointer is not None else None
        self._result = (info, list(skipped))
        self._full_at = started
        self.full_reads += 1
        self.last_full = True
        return info, skipped


def read_latest_pointer(storage: Storage) -> int | None:
    """The step the advisory ``latest`` pointer names, or None."""
    try:
        return parse_pointer(storage.read_bytes(POINTER_NAME))
    except NotFoundError:
        return None


def update_latest_pointer(storage: Storage, step: int, *, attempts: int = 8) -> bool:
    """Move the ``latest`` pointer forward to ``step`` (never backwards).

    Uses a conditional write (compare-and-swap on the entity tag) where the
    store supports it, so two writers cannot move it backwards; returns
    whether the pointer was changed.
    """
    for _ in range(attempts):
        current = storage.read_with_etag(POINTER_NAME)
        if current is not None:
            current_step = parse_pointer(current[0])
            if current_step is not None and current_step >= step:
                return False
        try:
            if current is None:
                storage.write_bytes(POINTER_NAME, pointer_json(step), if_none_match=True)
            else:
                storage.write_bytes(POINTER_NAME, pointer_json(step), if_match=current[1])
            return True
        except PreconditionFailedError:
            time.sleep(0.05)
    log.warning("could not update %s after %d attempts (concurrent writers)", storage.uri_for(POINTER_NAME), attempts)
    return False


def upload_checkpoint(
    local_ckpt_dir: Path,
    storage: Storage,
    *,
    progress: ProgressCallback | None = None,
    update_pointer: bool = True,
    incremental: bool | KnownChunks = False,
) -> UploadResult:
    """Upload a committed local checkpoint: data files (concurrently), then the
    manifest, then the ``latest`` pointer.

    ``incremental`` (True, or the :class:`KnownChunks` the caller knows to be
    in storage) stores the files as content-addressed chunks shared with the
    job's other checkpoints (format version 3, see
    :mod:`spotguard.checkpoint.chunked`): only chunks not known are uploaded,
    known ones are checked to exist. True without known chunks takes them
    from the checkpoint the ``latest`` pointer names. Distributed parts are
    always uploaded whole.

    A part of a distributed checkpoint (its local manifest is a part
    manifest) goes: data files, then a check of those files in storage
    against the part manifest (by the checksums the store computed where it
    has them, else read back), then the part manifest as
    ``parts/<i:05d>.json``, then :func:`commit_global`; the pointer moves
    (with ``update_pointer``) only when the global manifest exists.
    ``UploadResult.committed`` says whether it does. A part whose checkpoint
    is already committed with this very part manifest uploads nothing again.

    Raises :class:`ManifestError` / ``FileNotFoundError`` when the local
    checkpoint is not complete (or, for a part, when storage already holds
    the step committed from other parts), :class:`CheckpointCorruptError`
    when a part's files do not verify after the upload,
    :class:`StorageError` on storage failures.
    """
    start = time.monotonic()
    local_ckpt_dir = Path(local_ckpt_dir)
    manifest_bytes = (local_ckpt_dir / MANIFEST_NAME).read_bytes()
    manifest = parse_manifest(manifest_bytes, expected_name=local_ckpt_dir.name)
    for entry in manifest.files:
        size = (local_ckpt_dir / entry.path).stat().st_size
        if size != entry.size:
            raise ManifestError(f"{local_ckpt_dir / entry.path}: size {size}, manifest says {entry.size}")
    if manifest.is_part:
        with upload_intent(storage, manifest.name):
            return _upload_part(local_ckpt_dir, storage, manifest, manifest_bytes, progress, update_pointer, start)
    name = manifest.name
    if incremental is not False:
        known = incremental if isinstance(incremental, KnownChunks) else KnownChunks.from_storage(storage)
        with upload_intent(storage, name, known.chunks):
            if _known_source_stored(storage, known):
                return _upload_incremental(local_ckpt_dir, storage, manifest, known, progress, update_pointer, start)
        # What it knew came from a checkpoint deleted since (retention): a collector
        # that did not see this upload yet may sweep those chunks. Learn again.
        log.info("%s: %s, whose chunks this upload would reuse, is gone; using the latest pointer's",
                 storage.uri_for(name), known.source)  # fmt: skip
        known = KnownChunks.from_storage(storage)
        with upload_intent(storage, name, known.chunks):
            if not _known_source_stored(storage, known):
                known = KnownChunks()
            return _upload_incremental(local_ckpt_dir, storage, manifest, known, progress, update_pointer, start)
    with upload_intent(storage, name):
        return _upload_plain(local_ckpt_dir, storage, manifest, manifest_bytes, progress, update_pointer, start)


def _known_source_stored(storage: Storage, known: KnownChunks) -> bool:
    """Whether the checkpoint ``known`` came from still has its manifest.

    Asked after the upload's intent is written: from then on a collector
    keeps what the intent names, and until then the source's manifest (or a
    checkpoint seen by the collector that reuses its chunks) marked them.
    Knowledge without a source (a caller's own) is taken as it is.
    """
    if known.source is None or not known.chunks:
        return True
    return storage.stat(f"{known.source}/{MANIFEST_NAME}") is not None


def _upload_incremental(local_ckpt_dir: Path, storage: Storage, manifest: Manifest, known: KnownChunks,
                        progress: ProgressCallback | None, update_pointer: bool, start: float) -> UploadResult:
    name = manifest.name
    chunked = upload_chunks(local_ckpt_dir, storage, manifest, known, progress=progress)
    # The manifest goes last: its presence means every chunk it names is stored.
    storage.write_bytes(f"{name}/{MANIFEST_NAME}", chunked.manifest_bytes)
    pointer = update_latest_pointer(storage, manifest.step) if update_pointer else False
    log.info("uploaded %s incrementally: %d new chunk(s) (%d bytes), %d reused (%d bytes)",
             storage.uri_for(name), chunked.new_chunks, chunked.new_bytes, chunked.reused_chunks,
             chunked.reused_bytes)  # fmt: skip
    return UploadResult(
        step=manifest.step, name=name, bytes=chunked.new_bytes + len(chunked.manifest_bytes),
        seconds=time.monotonic() - start, uri=storage.uri_for(name), pointer_updated=pointer,
        new_bytes=chunked.new_bytes, reused_bytes=chunked.reused_bytes, new_chunks=chunked.new_chunks,
        reused_chunks=chunked.reused_chunks,
    )  # fmt: skip


def _upload_plain(local_ckpt_dir: Path, storage: Storage, manifest: Manifest, manifest_bytes: bytes,
                  progress: ProgressCallback | None, update_pointer: bool, start: float) -> UploadResult:
    name = manifest.name
    if manifest.chunked:
        # A copy restored from an incremental store, uploaded whole.
        manifest = to_plain(manifest)
        manifest_bytes = manifest.to_json()
    storage.upload_files([(local_ckpt_dir / e.path, f"{name}/{e.path}") for e in manifest.files], progress)
    # The manifest goes last: its presence means every data file is stored.
    storage.write_bytes(f"{name}/{MANIFEST_NAME}", manifest_bytes)
    pointer = update_latest_pointer(storage, manifest.step) if update_pointer else False
    return UploadResult(
        step=manifest.step,
        name=name,
        bytes=manifest.total_size + len(manifest_bytes),
        seconds=time.monotonic() - start,
        uri=storage.uri_for(name),
        pointer_updated=pointer,
        new_bytes=manifest.total_size,
    )


def verify_uploaded_files(storage: Storage, name: str, manifest: Manifest, *, workers: int = 4) -> list[str]:
    """Problems of ``manifest``'s files in storage below ``name`` (by store
    checksum where the store has one, else read back); [] when all match."""
    sizes = {path: info.size for path, info in _listing(storage, name).items()}

    def read_chunks(path: str) -> Iterable[bytes]:
        return storage.iter_chunks(f"{name}/{path}")

    if isinstance(storage, StoreChecksums):
        checker = storage

        def stored(path: str) -> StoredChecksum | None:
            return checker.stored_checksum(f"{name}/{path}")

        return verify_files_by_store(manifest, sizes, stored, read_chunks, workers=workers).problems
    problems, _ = verify_files(manifest, sizes, read_chunks, workers=workers)
    return problems


def _upload_part(
    local_ckpt_dir: Path,
    storage: Storage,
    manifest: Manifest,
    manifest_bytes: bytes,
    progress: ProgressCallback | None,
    update_pointer: bool,
    start: float,
) -> UploadResult:
    sharding = manifest.sharding
    assert sharding is not None and sharding.part is not None
    name = manifest.name
    index = sharding.part
    part_key = f"{name}/{part_manifest_path(index)}"
    uploaded = 0
    try:
        stored_global: Manifest | None = read_manifest(storage, name)
    except NotFoundError:
        stored_global = None
    if stored_global is not None:
        # Committed already (this part shipped before a restart, or an
        # earlier attempt committed the step): never overwrite the files of
        # a committed checkpoint with other bytes.
        listed = next((f for f in stored_global.files if f.path == part_manifest_path(index)), None)
        if (
            listed is None
            or listed.size != len(manifest_bytes)
            or listed.checksum != checksum_bytes(manifest_bytes, stored_global.checksum_algorithm)
        ):
            raise ManifestError(
                f"{name} is already committed in storage with a different part {index}; "
                "not overwriting the files of a committed checkpoint"
            )
        commit = _existing_commit(storage, name)
    else:
        storage.upload_files([(local_ckpt_dir / e.path, f"{name}/{e.path}") for e in manifest.files], progress)
        # The part manifest says its files are stored and verified: check them first.
        problems = verify_uploaded_files(storage, name, manifest)
        if problems:
            raise CheckpointCorruptError(name, [f"{p} (part {index})" for p in problems])
        storage.write_bytes(part_key, manifest_bytes)
        uploaded = manifest.total_size + len(manifest_bytes)
        commit = commit_global(storage, name)
    pointer = update_latest_pointer(storage, manifest.step) if update_pointer and commit.committed else False
    total = commit.total or sharding.parts
    log.info("uploaded part %d of %s: %s (%d of %d parts present)", index, storage.uri_for(name), commit.status,
             len(commit.present), total)  # fmt: skip
    return UploadResult(
        step=manifest.step,
        name=name,
        bytes=uploaded,
        seconds=time.monotonic() - start,
        uri=storage.uri_for(name),
        pointer_updated=pointer,
        committed=commit.committed,
        parts_present=len(commit.present),
        parts_total=total,
    )


def restore_checkpoint(
    storage: Storage,
    name: str,
    dest: Path,
    *,
    progress: ProgressCallback | None = None,
    plain: bool = False,
) -> CheckpointInfo:
    """Download one checkpoint into ``dest/<name>`` and verify it there.

    The directory appears only when every file is downloaded and matches the
    manifest. A matching local copy that already verifies is reused. A
    checkpoint stored incrementally is assembled from its chunks; with
    ``plain`` its copy gets the manifest of whole files (version 1), a
    self-contained checkpoint any spotguard reads (otherwise the stored
    manifest is kept, so the copy is recognized as the stored checkpoint).
    Raises :class:`CheckpointCorruptError` (with the problems) or
    :class:`StorageError`.
    """
    dest = Path(dest)
    try:
        manifest_bytes = read_manifest_bytes(storage, name)
    except NotFoundError:
        raise CheckpointCorruptError(name, _missing_manifest_problems(storage, name)[0]) from None
    try:
        manifest = parse_manifest(manifest_bytes, expected_name=name)
    except ManifestError as exc:
        raise CheckpointCorruptError(name, [f"{MANIFEST_NAME}: {exc}"]) from None
    if not manifest.locally_complete:
        raise CheckpointCorruptError(name, [f"{MANIFEST_NAME}: the manifest of one part, not of the whole checkpoint"])
    stored = manifest
    if plain and manifest.chunked:
        manifest = to_plain(manifest)
        manifest_bytes = manifest.to_json()
    final = dest / name
    if (
        (final / MANIFEST_NAME).is_file()
        and (final / MANIFEST_NAME).read_bytes() == manifest_bytes
        and verify_local_checkpoint(final).ok
    ):
        return CheckpointInfo.from_manifest(manifest, str(final))
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / f"{RESTORE_TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if stored.chunked:
            problems = fetch_chunks(storage, stored, tmp, progress=progress)
            if problems:
                raise CheckpointCorruptError(name, problems)
        else:
            listing = _listing(storage, name)
            missing = [e.path for e in manifest.files if e.path not in listing]
            if missing:
                raise CheckpointCorruptError(
                    name, name_parts(storage, name, manifest, [f"{p}: missing" for p in missing])
                )
            # One pass: each file is checked as it streams in; not fsynced, as
            # every reader verifies a local copy before using it.
            sizes = {path: info.size for path, info in listing.items()}
            problems = fetch_verified(storage, name, manifest, sizes, tmp, progress=progress)
            if problems:
                raise CheckpointCorruptError(name, name_parts(storage, name, manifest, problems))
        (tmp / MANIFEST_NAME).write_bytes(manifest_bytes)
        fsync_dir(tmp)
        if final.exists():
            remove_checkpoint_dir(final)
        os.rename(tmp, final)
        fsync_dir(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return CheckpointInfo.from_manifest(manifest, str(final))


def restore_latest(
    storage: Storage,
    dest: Path,
    *,
    progress: ProgressCallback | None = None,
    on_skip: Callable[[Skipped], None] | None = None,
) -> CheckpointInfo | None:
    """Stage the newest verified checkpoint into ``dest/ckpt-<step>/``.

    Walks back past checkpoints that are incomplete or fail verification
    (logging each, and reporting it to ``on_skip``). Returns None when storage
    holds no usable checkpoint. Storage failures propagate.
    """
    for name in reversed(list_checkpoint_names(storage)):
        try:
            return restore_checkpoint(storage, name, dest, progress=progress)
        except CheckpointCorruptError as exc:
            skipped = Skipped(name, parse_checkpoint_name(name) or 0, "; ".join(exc.problems))
            log.warning("skipping checkpoint %s: %s", storage.uri_for(name), skipped.reason)
            if on_skip is not None:
                on_skip(skipped)
    return None


def delete_checkpoint(storage: Storage, name: str) -> int:
    """Delete a stored checkpoint: its manifest first (so it is never seen
    complete with files missing), then everything else under its prefix.
    A checkpoint stored incrementally leaves a tombstone (its manifest, below
    ``gc/tombstones/``) before its manifest goes; its chunks are removed by
    the chunk sweep once no retained checkpoint uses them. Returns the number
    of objects deleted."""
    if parse_checkpoint_name(name) is None:
        raise ValueError(f"not a checkpoint name: {name!r}")
    try:
        data = read_manifest_bytes(storage, name)
        chunked = parse_manifest(data, expected_name=name).chunked
    except (NotFoundError, ManifestError):
        chunked = False
    if chunked:
        # A garbage collection that read the manifests before this deletion
        # must still count its chunks as used (an upload may be reusing them);
        # see gc.py.
        storage.write_bytes(tombstone_key(name), data)
    storage.delete([f"{name}/{MANIFEST_NAME}"])
    keys = [o.key for o in storage.list_objects(f"{name}/")]
    storage.delete(keys)
    return len(keys) + 1


def newest_local_or_none(directory: Path) -> Path | None:
    """The newest committed local checkpoint, if any."""
    committed = list_local_committed(directory)
    return committed[-1] if committed else None


__all__ = [
    "CheckpointCorruptError",
    "CheckpointInfo",
    "GlobalCommit",
    "KnownChunks",
    "Skipped",
    "StorageError",
    "UploadResult",
    "checkpoint_name",
    "commit_global",
    "delete_checkpoint",
    "latest_verified",
    "list_checkpoint_names",
    "read_local_manifest",
    "read_manifest",
    "read_parts",
    "restore_checkpoint",
    "restore_latest",
    "update_latest_pointer",
    "upload_checkpoint",
    "verify_checkpoint",
]
