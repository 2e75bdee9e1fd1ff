"""Applying retention in storage, and removing what crashed uploads leave behind.

Deleting a checkpoint removes its manifest first, so at no instant is a
checkpoint listed as complete while its files are going away. Nothing
deletes a distributed checkpoint's prefix that waits for its other parts
while it is newer than the newest verified checkpoint (see
:func:`find_orphans`); retention plans over complete (global) manifests as
for a single process.

Chunks of checkpoints stored incrementally are shared, so deleting a
checkpoint deletes only its manifest (after writing a tombstone), and
:func:`sweep_chunks` later removes the chunks nothing references any more
(mark and sweep; see there why a crash or a concurrent upload never loses a
chunk a verified checkpoint needs).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from spotguard.checkpoint.format.manifest import (
    CHUNKS_DIR,
    FORMAT_VERSION,
    MANIFEST_NAME,
    PARTS_DIR,
    ManifestError,
    parse_checkpoint_name,
    parse_chunk_key,
    parse_manifest,
)
from spotguard.checkpoint.store.chunked import TOMBSTONES_DIR
from spotguard.checkpoint.store.intents import check_grace, read_intents
from spotguard.checkpoint.store.latest import latest_verified
from spotguard.checkpoint.store.parts import read_parts
from spotguard.checkpoint.store.retention import (
    RetentionCandidate,
    RetentionPlan,
    RetentionPolicy,
    plan_retention,
)
from spotguard.checkpoint.store.stored import (
    delete_checkpoint,
    list_checkpoint_names,
    read_manifest,
    read_manifest_bytes,
)
from spotguard.storage.base import NotFoundError, ObjectInfo, PendingUpload, Storage

log = logging.getLogger(__name__)

DEFAULT_ORPHAN_GRACE = 3600.0
#: :attr:`ChunkSweep.aborted` of a sweep that gave way to a preemption.
SWEEP_STOPPED = "stopped: a preemption came first"
DEFAULT_STALE_UPLOAD_AGE = 6 * 3600.0


@dataclass
class GcReport:
    """What a garbage collection did (or, with ``dry_run``, would do)."""

    plan: RetentionPlan
    deleted: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    aborted_uploads: list[PendingUpload] = field(default_factory=list)
    newest_verified: str | None = None
    #: Distributed checkpoints newer than the newest verified one whose parts
    #: are not all stored yet: kept, whatever their age.
    waiting: list[str] = field(default_factory=list)
    #: Keys of the chunks the sweep deleted (would delete), and their bytes.
    chunks_deleted: list[str] = field(default_factory=list)
    chunk_bytes_freed: int = 0
    #: Why the chunk sweep deleted nothing (a manifest newer than this
    #: spotguard), or None.
    chunk_sweep_aborted: str | None = None


class Stopped(Exception):
    """Housekeeping gave way to a preemption before it deleted anything more."""


def plan_storage_retention(
    storage: Storage,
    policy: RetentionPolicy,
    newest_verified: str | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[RetentionPlan, str | None]:
    """Build the retention plan for a storage root: candidates are checkpoints
    with a readable manifest; the newest verified one is found by verification
    unless the caller knows it (an uploader that just verified it).
    ``should_stop`` is asked before each manifest read (:class:`Stopped`)."""
    if newest_verified is None:
        info, _ = latest_verified(storage)
        newest_verified = info.name if info else None
    candidates: list[RetentionCandidate] = []
    for name in list_checkpoint_names(storage):
        if should_stop is not None and should_stop():
            raise Stopped()
        try:
            manifest = read_manifest(storage, name)
        except (NotFoundError, ManifestError):
            continue  # incomplete or broken: the orphan sweep's business
        candidates.append(RetentionCandidate(name, manifest.step, dict(manifest.metrics)))
    return plan_retention(candidates, policy, newest_verified), newest_verified


def apply_retention(
    storage: Storage,
    policy: RetentionPolicy,
    dry_run: bool = False,
    *,
    newest_verified: str | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[str]:
    """Delete the checkpoints the policy does not keep; returns their names
    (the names that would be deleted, with ``dry_run``). ``newest_verified``
    spares a verification the caller has just done; ``should_stop`` is asked
    before each manifest read and each deletion (a preemption stops
    housekeeping at once; nothing is deleted after it)."""
    try:
        plan, _ = plan_storage_retention(storage, policy, newest_verified, should_stop)
    except Stopped:
        return []
    if dry_run:
        return list(plan.delete)
    deleted: list[str] = []
    for name in plan.delete:
        if should_stop is not None and should_stop():
            break
        log.info("retention: deleting %s", storage.uri_for(name))
        delete_checkpoint(storage, name)
        deleted.append(name)
    return deleted


def _holds_parts(objects: list[ObjectInfo], name: str) -> bool:
    prefix = f"{name}/{PARTS_DIR}/"
    return any(o.key.startswith(prefix) for o in objects)


def find_orphans(
    storage: Storage,
    *,
    grace: float = DEFAULT_ORPHAN_GRACE,
    newest_verified: str | None = None,
    now: float | None = None,
    waiting: list[str] | None = None,
) -> list[str]:
    """Checkpoint prefixes without a usable manifest whose newest object is
    older than ``grace`` seconds (interrupted uploads), never the newest verified.

    A prefix holding part manifests of a distributed checkpoint but no global
    manifest is waiting for its other parts (another node's uploader may be
    slow, or down for a while): it is never an orphan while its step is newer
    than the newest verified checkpoint (``newest_verified``; None: there is
    none, so every such prefix waits), whatever its age; such prefixes are
    appended to ``waiting`` when given. Older ones can no longer become the
    checkpoint to resume from and are orphans as before.

    A manifest of a format newer than this spotguard reads is never an
    orphan: it is most likely complete, and its chunks depend on it.
    A ``grace`` that is not a finite number of seconds, 0 or more, is
    refused (ValueError) before anything is read.
    """
    grace = check_grace(grace)
    now = time.time() if now is None else now
    newest_step = parse_checkpoint_name(newest_verified) if newest_verified else None
    orphans: list[str] = []
    uploading = read_intents(storage, now).checkpoints
    for name in list_checkpoint_names(storage):
        if name == newest_verified or name in uploading:
            continue  # the newest verified, or being uploaded now (whatever its age)
        try:
            data = read_manifest_bytes(storage, name)
        except NotFoundError:
            pass
        else:
            if newer_format_version(data) is not None:
                continue  # written by a newer spotguard: not for this one to judge
            try:
                parse_manifest(data, expected_name=name)
                continue
            except ManifestError:
                pass
        objects = list(storage.list_objects(f"{name}/"))
        step = parse_checkpoint_name(name) or 0
        if _holds_parts(objects, name) and (newest_step is None or step > newest_step):
            if waiting is not None:
                waiting.append(name)
            continue  # a distributed checkpoint waiting for its other parts
        if objects and now - max(o.modified for o in objects) < grace:
            continue  # possibly still being uploaded
        orphans.append(name)
    return orphans


def stale_uploads(
    storage: Storage, *, max_age: float = DEFAULT_STALE_UPLOAD_AGE, now: float | None = None
) -> list[PendingUpload]:
    """Unfinished (multipart) uploads started more than ``max_age`` seconds ago."""
    now = time.time() if now is None else now
    return [u for u in storage.list_pending_uploads("") if now - u.started >= max_age]


def newer_format_version(data: bytes) -> int | None:
    """The ``format_version`` of a manifest newer than this spotguard reads, or
    None (it is one this spotguard reads, or not a manifest at all)."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return None
    version = doc.get("format_version") if isinstance(doc, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        return version
    return None


@dataclass
class ChunkSweep:
    """What a chunk sweep did (or, with ``dry_run``, would do).

    ``deleted`` are chunk keys (``chunks/<aa>/<sha256>``), ``freed_bytes``
    their total size, ``kept`` the number of listed chunks this sweep left,
    ``tombstones_deleted`` the keys of expired tombstones. ``aborted`` says
    why nothing was deleted (a manifest newer than this spotguard), or why the
    sweep stopped early (:data:`SWEEP_STOPPED`: a preemption), or is None.
    """

    deleted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    kept: int = 0
    tombstones_deleted: list[str] = field(default_factory=list)
    aborted: str | None = None


def plan_sweep(
    chunks: Mapping[str, ObjectInfo], referenced: Collection[str], grace: float, now: float, floor: float | None = None
) -> list[str]:
    """The chunks to delete, as sorted digests: those of ``chunks`` (digest ->
    stored object) that are not ``referenced``, whose object is at least
    ``grace`` seconds old at ``now``, and, when an upload is in progress,
    older than ``floor`` (when the oldest live intent was written, by the
    store's clock: a chunk stored since may be that upload's). A younger
    chunk may also have just been uploaded again for a checkpoint the mark
    did not see."""
    return sorted(
        d
        for d, info in chunks.items()
        if d not in referenced and now - info.modified >= grace and (floor is None or info.modified < floor - 1.0)
    )


@dataclass
class _Marks:
    referenced: set[str] = field(default_factory=set)
    expired_tombstones: list[ObjectInfo] = field(default_factory=list)
    aborted: str | None = None
    #: The checkpoints whose manifests were read.
    seen: set[str] = field(default_factory=set)


def _chunks_of(data: bytes, expected_name: str | None = None) -> set[str]:
    manifest = parse_manifest(data, expected_name=expected_name)
    return set(manifest.chunk_refs()) if manifest.chunked else set()


def _mark_manifests(storage: Storage, marks: _Marks, should_stop: Callable[[], bool] | None = None) -> None:
    """Add the chunks of every stored manifest not read yet to ``marks``
    (:class:`Stopped` when ``should_stop`` says so before a read)."""
    for name in list_checkpoint_names(storage):
        if name in marks.seen:
            continue
        if should_stop is not None and should_stop():
            raise Stopped()
        key = f"{name}/{MANIFEST_NAME}"
        try:
            data = read_manifest_bytes(storage, name)
        except NotFoundError:
            # No manifest (yet, or any more). A distributed checkpoint's parts stored so far
            # name chunks their uploaders verified, which its global commit will name.
            for _, part in read_parts(storage, name)[0].values():
                marks.referenced |= set(part.chunk_refs())
            continue
        marks.seen.add(name)
        if (version := newer_format_version(data)) is not None:
            marks.aborted = f"{storage.uri_for(key)} has format_version {version}, newer than this spotguard reads"
            return
        try:
            marks.referenced |= _chunks_of(data, expected_name=name)
        except ManifestError as exc:
            # It can never verify, so no resume needs its chunks.
            log.warning("chunk sweep: %s is unreadable (%s); its chunks are not kept for it", storage.uri_for(key), exc)


def _mark(storage: Storage, grace: float, now: float, should_stop: Callable[[], bool] | None = None) -> _Marks:
    """Every chunk a stored manifest or a tombstone younger than ``grace``
    references. Manifests are read before tombstones are listed: a checkpoint
    deleted meanwhile had its tombstone written before its manifest went, so
    its chunks are marked either way."""
    marks = _Marks()
    _mark_manifests(storage, marks, should_stop)
    if marks.aborted is not None:
        return marks
    for info in storage.list_objects(f"{TOMBSTONES_DIR}/"):
        if should_stop is not None and should_stop():
            raise Stopped()
        if now - info.modified >= grace:
            marks.expired_tombstones.append(info)
            continue
        try:
            data = storage.read_bytes(info.key)
        except NotFoundError:
            continue  # expired for another collector meanwhile
        if (version := newer_format_version(data)) is not None:
            marks.aborted = f"{storage.uri_for(info.key)} has format_version {version}, newer than this spotguard reads"
            return marks
        try:
            marks.referenced |= _chunks_of(data)
        except ManifestError as exc:
            log.warning("chunk sweep: tombstone %s is unreadable (%s)", storage.uri_for(info.key), exc)
    return marks


def sweep_chunks(
    storage: Storage,
    *,
    grace: float = DEFAULT_ORPHAN_GRACE,
    now: float | None = None,
    dry_run: bool = False,
    should_stop: Callable[[], bool] | None = None,
    workers: int = 8,
) -> ChunkSweep:
    """Delete the chunks no checkpoint references (mark and sweep).

    1. List every chunk with its modified time.
    2. Mark: the chunks of every readable version 3 ``ckpt-*/manifest.json``
       (for a distributed checkpoint not committed yet, of its stored part
       manifests, each written after its uploader verified its chunks and
       before its intent went), and of every tombstone (the manifest of a deleted checkpoint, written
       before its manifest went) younger than ``grace``. An unreadable or
       malformed manifest marks nothing: its checkpoint can never verify. A
       manifest (or tombstone) of a format newer than this spotguard reads
       aborts the sweep before anything is deleted (``aborted`` says which):
       it may reference chunks in a way this spotguard does not know.
    3. Between the mark and the sweep: read the live upload intents
       (:mod:`spotguard.checkpoint.store.intents`) and the manifests written since
       the mark. A chunk a live intent names, or stored since the oldest live
       intent was written, or named by a new manifest, is kept.
    4. Sweep: the unmarked chunks at least ``grace`` seconds old
       (:func:`plan_sweep`), each stat'ed again right before its deletion and
       kept if it is gone or was written again since the listing (an upload
       that did not know it was stored stores it again, and its manifest may
       come after the mark).
    5. Delete the tombstones older than ``grace``, and the intents of
       uploads that died (not live for a lease).

    Why no chunk a checkpoint needs is lost, for an upload of any length: a
    doomed chunk was listed in step 1 and referenced by nothing in steps 2
    and 3. Take an upload U whose manifest would name it. If U's intent was
    written before step 3, U either was live then (its intent names the
    chunks it reuses, and the chunks it stores are younger than the intent)
    or had finished (its manifest was read in step 2 or 3). If U's intent
    was written after step 3, U stores its new chunks after step 1 (not
    listed, or written again: the second stat keeps them), and U found the
    checkpoint S it reuses chunks from still stored *after* writing its
    intent (:func:`~spotguard.checkpoint.store.upload.upload_checkpoint` checks),
    so S's manifest existed at step 2 or appeared before step 3 (read
    there), or S's upload is itself such a U, and so on back to one that was
    read. This holds for any crash of the collector or the uploader. One
    race remains that an object store without conditional deletes cannot
    close: an upload storing again, between the second stat and the delete
    (milliseconds), a chunk it did not know was stored; that checkpoint then
    fails verification, naming the chunk, and its uploader sends the chunk
    again. An uploader stopped longer than the lease (its heartbeat stale)
    is protected only by ``grace``, which is why a grace shorter than the
    lease is refused by the CLI and the sidecar
    (:func:`~spotguard.checkpoint.store.intents.check_orphan_grace`). Storage
    errors abort the sweep (a manifest that could not be read must not be
    taken for one that is not there); deletions already done stay done and
    are safe.

    ``now`` (unix seconds) is for tests; ``dry_run`` deletes nothing and
    returns what the sweep would delete, without the second stat.
    ``should_stop`` is asked once the chunks are listed, before each manifest
    read, each tombstone and each deletion: a preemption stops the sweep at its next object
    (``aborted`` then says so, ``kept`` counts every listed chunk), deleting
    nothing more. A ``grace`` that is not a finite number of seconds, 0 or
    more, is refused (ValueError) before anything is read.
    """
    grace = check_grace(grace)
    now = time.time() if now is None else now
    listed: dict[str, ObjectInfo] = {}
    for info in storage.list_objects(f"{CHUNKS_DIR}/"):
        digest = parse_chunk_key(info.key)
        if digest is not None:
            listed[digest] = info
    try:
        if should_stop is not None and should_stop():
            raise Stopped()
        marks = _mark(storage, grace, now, should_stop)
        if marks.aborted is None:
            # Uploads in progress, and checkpoints whose manifests appeared since
            # the mark (their uploads may have ended before the intents were read).
            intents = read_intents(storage, now)
            _mark_manifests(storage, marks, should_stop)
    except Stopped:
        log.info("chunk sweep of %s stopped before deleting anything: a preemption came first", storage.uri)
        return ChunkSweep(kept=len(listed), aborted=SWEEP_STOPPED)
    if marks.aborted is not None:
        log.warning("chunk sweep of %s aborted, nothing deleted: %s; upgrade spotguard", storage.uri, marks.aborted)
        return ChunkSweep(kept=len(listed), aborted=marks.aborted)
    doomed = plan_sweep(listed, marks.referenced | intents.known, grace, now, intents.floor)
    expired = [t.key for t in marks.expired_tombstones] + intents.dead
    if dry_run:
        return ChunkSweep(
            deleted=[listed[d].key for d in doomed],
            freed_bytes=sum(listed[d].size for d in doomed),
            kept=len(listed) - len(doomed),
            tombstones_deleted=expired,
        )

    def delete_one(digest: str) -> int | None:
        """Bytes freed, or None when the chunk is kept after all."""
        if should_stop is not None and should_stop():
            return None
        seen = listed[digest]
        current = storage.stat(seen.key)
        if current is None:
            return None  # deleted by another collector
        if current.modified > seen.modified or current.size != seen.size or now - current.modified < grace:
            log.info("chunk sweep: %s was written again since it was listed; kept", storage.uri_for(seen.key))
            return None
        log.debug("chunk sweep: deleting %s", storage.uri_for(seen.key))
        storage.delete([seen.key])
        return current.size

    sweep = ChunkSweep()
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="chunk-sweep") as pool:
        for digest, freed in zip(doomed, pool.map(delete_one, doomed), strict=True):
            if freed is not None:
                sweep.deleted.append(listed[digest].key)
                sweep.freed_bytes += freed
    sweep.kept = len(listed) - len(sweep.deleted)
    if should_stop is not None and should_stop():
        sweep.aborted = SWEEP_STOPPED
        return sweep
    if expired:
        storage.delete(expired)
        sweep.tombstones_deleted = expired
    if sweep.deleted:
        log.info(
            "chunk sweep: deleted %d chunks (%d bytes) from %s", len(sweep.deleted), sweep.freed_bytes, storage.uri
        )
    return sweep


def collect_garbage(
    storage: Storage,
    policy: RetentionPolicy,
    *,
    orphan_grace: float = DEFAULT_ORPHAN_GRACE,
    stale_upload_age: float = DEFAULT_STALE_UPLOAD_AGE,
    dry_run: bool = False,
    now: float | None = None,
) -> GcReport:
    """Apply retention, delete orphaned prefixes, abort stale multipart uploads,
    then sweep the chunks nothing references any more (:func:`sweep_chunks`,
    with ``orphan_grace`` as its grace).

    A checkpoint stored incrementally that retention deletes leaves a
    tombstone that keeps its chunks for ``orphan_grace`` seconds, so its
    unique chunks go in a later collection; a dry run counts the chunks a
    real run would delete now. ``now`` (unix seconds) is for tests. An
    ``orphan_grace`` that is not a finite number of seconds, 0 or more, is
    refused (ValueError) before anything is read or deleted.
    """
    orphan_grace = check_grace(orphan_grace)
    plan, newest = plan_storage_retention(storage, policy)
    report = GcReport(plan=plan, newest_verified=newest)
    report.orphans = find_orphans(storage, grace=orphan_grace, newest_verified=newest, now=now, waiting=report.waiting)
    report.aborted_uploads = stale_uploads(storage, max_age=stale_upload_age, now=now)
    report.deleted = list(plan.delete)
    if not dry_run:
        for name in plan.delete:
            log.info("gc: deleting %s (retention)", storage.uri_for(name))
            delete_checkpoint(storage, name)
        for name in report.orphans:
            if parse_checkpoint_name(name) is None:
                continue
            log.info("gc: deleting %s (orphaned: no manifest)", storage.uri_for(name))
            storage.delete([o.key for o in storage.list_objects(f"{name}/")])
        for upload in report.aborted_uploads:
            log.info("gc: aborting stale upload of %s", storage.uri_for(upload.key))
            storage.abort_upload(upload)
    sweep = sweep_chunks(storage, grace=orphan_grace, now=now, dry_run=dry_run)
    report.chunks_deleted = sweep.deleted
    report.chunk_bytes_freed = sweep.freed_bytes
    report.chunk_sweep_aborted = sweep.aborted
    return report
