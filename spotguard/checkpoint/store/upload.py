"""Uploading a committed local checkpoint to storage.

The order is the contract: data files first, then the manifest (its presence
means every file it lists is stored); the advisory ``latest`` pointer moves
only once the checkpoint verifies in storage, as publishing moves it
(:mod:`~spotguard.checkpoint.store.publish`).
A checkpoint goes up whole, or incrementally as content-addressed chunks
shared with the job's other checkpoints (:mod:`~spotguard.checkpoint.store.chunked`),
under an upload intent that keeps the chunk collector off what it reuses
(:mod:`~spotguard.checkpoint.store.intents`). A part of a distributed checkpoint is
checked in storage before its part manifest is stored, then tries the global
commit (:mod:`~spotguard.checkpoint.store.parts`).

A routine upload gives way to a preemption: with ``should_stop`` it stops
at its next request (a part, a chunk, a file) by raising
:class:`UploadCancelled`; nothing it has not written yet is written after
that (never a manifest or the pointer), and what it stored stays for a
later upload of the same checkpoint to skip (``resume``, or the chunks
:attr:`UploadCancelled.stored_chunks` names).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, cast

from spotguard.checkpoint.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    parse_chunk_key,
    parse_manifest,
    part_manifest_path,
    stored_as,
    to_plain,
)
from spotguard.checkpoint.format.verify import check_stored_checksum
from spotguard.checkpoint.store.chunked import ChunkedUpload, KnownChunks, Prestored, upload_chunks, verify_chunks
from spotguard.checkpoint.store.intents import upload_intent
from spotguard.checkpoint.store.parts import commit_global, existing_commit, read_parts
from spotguard.checkpoint.store.publish import UNVERIFIED, Published, UploadResult, verify_and_point
from spotguard.checkpoint.store.stored import CheckpointCorruptError, read_manifest, stored_files
from spotguard.checkpoint.store.verify_stored import verify_uploaded_files
from spotguard.storage.base import NotFoundError, ProgressCallback, Storage, StoreChecksums
from spotguard.storage.checksum import checksum_bytes

log = logging.getLogger(__name__)


class UploadCancelled(Exception):
    """An upload stopped because ``should_stop`` said so (a preemption came first).

    Not a failure: the checkpoint is neither committed nor pointed to by
    this upload. ``stored_chunks`` (digest -> size) are the chunks it stored
    before it stopped: a later upload of the same checkpoint may take them as
    known (they are checked to exist before a manifest names them).
    """

    def __init__(self, name: str, stored_chunks: dict[str, int] | None = None) -> None:
        super().__init__(f"upload of {name} stopped: a preemption came first")
        self.name = name
        self.stored_chunks: dict[str, int] = dict(stored_chunks or {})


#: Storage methods that send a request; a stopped upload sends none of them again.
_REQUESTS = frozenset(
    {
        "write_bytes",
        "write_checked",
        "upload_files",
        "stat",
        "read_bytes",
        "read_with_etag",
        "read_if_changed",
        "iter_chunks",
        "list_objects",
        "list_dirs",
        "delete",
        "stored_checksum",
        "download_files",
    }
)


@dataclass
class _StopGuard:
    """The storage an upload with ``should_stop`` talks to: every request is
    preceded by the question, so a stopped upload ends at its next request
    (a multipart part on the wire asks again every MiB it sends and ends
    there; the storage layer aborts a multipart upload it cannot complete).
    Remembers the chunks it stored."""

    storage: Storage
    should_stop: Callable[[], bool]
    name: str
    stored_chunks: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self) -> None:
        if self.should_stop():
            with self._lock:
                raise UploadCancelled(self.name, self.stored_chunks)

    def progress(self, report: ProgressCallback | None) -> ProgressCallback:
        """A progress callback that stops the transfer once stopped (asked before each part, each MiB of an S3 part)."""

        def call(n: int) -> None:
            self.check()
            if report is not None:
                report(n)

        return call

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.storage, attr)
        if attr not in _REQUESTS or not callable(value):
            return value
        if attr == "write_checked":
            return self._write_checked

        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.check()
            return value(*args, **kwargs)

        return guarded

    def _write_checked(self, key: str, data: bytes, crc32c: str | None = None) -> None:
        self.check()
        self.storage.write_checked(key, data, crc32c)
        digest = parse_chunk_key(key)
        if digest is not None:
            with self._lock:
                self.stored_chunks[digest] = len(data)


def stopping_storage(storage: Storage, should_stop: Callable[[], bool], name: str) -> Storage:
    """``storage`` asking ``should_stop`` before every request and raising :class:`UploadCancelled`
    (for checkpoint ``name``) once it says yes: what a routine verification that a preemption may
    overtake reads through (a store without checksums is read back whole, every chunk of a frozen
    base with it), so that it ends at its next request."""
    return cast("Storage", _StopGuard(storage, should_stop, name))


def upload_checkpoint(
    local_ckpt_dir: Path,
    storage: Storage,
    *,
    progress: ProgressCallback | None = None,
    update_pointer: bool = True,
    incremental: bool | KnownChunks = False,
    should_stop: Callable[[], bool] | None = None,
    resume: bool = False,
    prestored: Prestored | None = None,
) -> UploadResult:
    """Upload a committed local checkpoint: data files (concurrently), then the
    manifest; then, with ``update_pointer``, publish it: verify it in storage
    and only then move the ``latest`` pointer
    (:func:`~spotguard.checkpoint.store.publish.verify_and_point`, as every
    uploader publishes). Uploaders that publish themselves pass
    ``update_pointer=False``.

    ``incremental`` (True, or the :class:`KnownChunks` the caller knows to be
    in storage) stores the files as content-addressed chunks shared with the
    job's other checkpoints (format version 3, see
    :mod:`spotguard.checkpoint.store.chunked`): only chunks not known are uploaded,
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

    ``should_stop`` (a routine upload that a preemption may overtake) is
    asked before each request and between the parts of a transfer: once it
    says yes, :class:`UploadCancelled` is raised at the next one, and nothing
    more is written (no manifest, no pointer); the upload intent is removed.
    ``resume`` (an earlier upload of this checkpoint was stopped) first lists
    what the checkpoint's prefix holds and does not send again a file the
    store holds with the manifest's size and checksum (by the checksum the
    store computed on receipt; stores without one get every file again).
    ``prestored`` (an incremental upload): chunks hashed and stored while the
    checkpoint was written (:class:`~spotguard.checkpoint.store.chunked.Prestored`),
    named by the upload's intent and not read, hashed or stored again.

    Raises :class:`ManifestError` / ``FileNotFoundError`` when the local
    checkpoint is not complete (or, for a part, when storage already holds
    the step committed from other parts), :class:`CheckpointCorruptError`
    when a part's files, or with ``update_pointer`` the checkpoint, do not
    verify after the upload (the pointer stays where it was),
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
    if should_stop is None:
        sending = _Sending(local_ckpt_dir, storage, manifest, manifest_bytes, progress, start)
        result = _upload(storage, sending, incremental, resume, prestored)
        return _publish(storage, result) if update_pointer else result
    # The intent is written and removed through the store itself (a stopped
    # upload removes it); the transfers go through the guard.
    guard = _StopGuard(storage, should_stop, manifest.name)
    guard.check()
    try:
        sending = _Sending(
            local_ckpt_dir, cast("Storage", guard), manifest, manifest_bytes, guard.progress(progress), start
        )
        result = _upload(storage, sending, incremental, resume, prestored)
    except Exception as exc:  # noqa: BLE001 - a store may wrap a stop in any type; the rest raised again
        if not isinstance(exc, UploadCancelled) and not should_stop():
            raise
        # Whatever the transfer made of the stop (the storage layer may wrap it): a
        # stop, with every chunk stored by now (the transfers have returned).
        raise UploadCancelled(manifest.name, guard.stored_chunks) from exc
    return _publish(storage, result) if update_pointer else result


def _publish(storage: Storage, result: UploadResult) -> UploadResult:
    """``update_pointer``: the stored checkpoint verified and pointed to as every uploader
    publishes (:func:`~spotguard.checkpoint.store.publish.verify_and_point`); a part whose
    checkpoint is not committed yet is left to the upload that commits it."""
    if not result.committed:
        return result
    published = verify_and_point(
        storage, result.name, Published(result.name, UNVERIFIED, result), trusted=result.trusted_chunks
    )
    if not published.verified:
        raise CheckpointCorruptError(result.name, published.problems)
    if published.pointer_error is not None:
        raise published.pointer_error
    return replace(result, pointer_updated=bool(published.pointer_moved))


@dataclass(frozen=True)
class _Sending:
    """A local checkpoint on its way to storage: what each way of storing it reads."""

    local_dir: Path
    #: The transfers go through it: the store itself, or the guard of an upload that may be stopped.
    io: Storage
    manifest: Manifest
    manifest_bytes: bytes
    progress: ProgressCallback | None
    #: When the upload started (``time.monotonic``).
    start: float

    def result(self, nbytes: int, **more: Any) -> UploadResult:
        """What was stored: ``nbytes`` sent, and ``more`` of :class:`UploadResult`'s fields."""
        name = self.manifest.name
        return UploadResult(
            step=self.manifest.step,
            name=name,
            bytes=nbytes,
            seconds=time.monotonic() - self.start,
            uri=self.io.uri_for(name),
            pointer_updated=False,
            **more,
        )


def _upload(
    storage: Storage,
    sending: _Sending,
    incremental: bool | KnownChunks,
    resume: bool,
    prestored: Prestored | None = None,
) -> UploadResult:
    """The upload proper: intents through ``storage``, everything else through ``sending.io``."""
    manifest = sending.manifest
    name = manifest.name
    if manifest.is_part:
        incremental = _as_stored_parts(sending.io, manifest, incremental)
        part = partial(_upload_part, sending)
        if incremental is False:
            with upload_intent(storage, manifest.name):
                return part(None)
        send: Callable[[KnownChunks], UploadResult] = part
    else:
        send = partial(_upload_incremental, sending, prestored=prestored)
    stored_before = dict(prestored.stored) if prestored is not None else {}
    if incremental is not False:
        known = incremental if isinstance(incremental, KnownChunks) else KnownChunks.from_storage(storage)
        with upload_intent(storage, name, {**stored_before, **known.chunks}):
            if _known_source_stored(storage, known):
                return send(known)
        # What it knew came from a checkpoint deleted since (retention): a collector
        # that did not see this upload yet may sweep those chunks. Learn again.
        log.info(
            "%s: %s, whose chunks this upload would reuse, is gone; using the latest pointer's",
            storage.uri_for(name),
            known.source,
        )
        known = KnownChunks.from_storage(storage)
        with upload_intent(storage, name, {**stored_before, **known.chunks}):
            if not _known_source_stored(storage, known):
                known = KnownChunks()
            return send(known)
    with upload_intent(storage, name):
        return _upload_plain(sending, resume=resume)


def _as_stored_parts(storage: Storage, manifest: Manifest, incremental: bool | KnownChunks) -> bool | KnownChunks:
    """How to store a part: as the parts of its step already stored are (as chunks or whole),
    whatever this uploader was told, so that nodes configured differently still make one
    checkpoint (the global commit refuses parts stored both ways); else as told."""
    stored = [m.chunked for _, m in read_parts(storage, manifest.name)[0].values()]
    if not stored or stored[0] == (incremental is not False):
        return incremental
    log.info(
        "%s: the parts of this step already stored are %s; storing part %s the same way",
        storage.uri_for(manifest.name),
        "chunks" if stored[0] else "whole files",
        manifest.sharding.part if manifest.sharding is not None else "?",
    )
    return stored[0]


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


def _upload_incremental(sending: _Sending, known: KnownChunks, *, prestored: Prestored | None = None) -> UploadResult:
    storage, manifest = sending.io, sending.manifest
    name = manifest.name
    chunked = upload_chunks(sending.local_dir, storage, manifest, known, progress=sending.progress, prestored=prestored)
    # The manifest goes last: every chunk it names was stored by now, or is one the uploader
    # knows stored (checked, or from a checkpoint it verified: see the chunked module).
    storage.write_bytes(f"{name}/{MANIFEST_NAME}", chunked.manifest_bytes)
    log.info(
        "uploaded %s incrementally: %d new chunk(s) (%d bytes), %d reused (%d bytes); %d unchanged since %s "
        "(compared, not hashed)",
        storage.uri_for(name),
        chunked.new_chunks,
        chunked.new_bytes,
        chunked.reused_chunks,
        chunked.reused_bytes,
        chunked.unchanged_chunks,
        known.source or "-",
    )
    return sending.result(chunked.new_bytes + len(chunked.manifest_bytes), **_chunk_counts(chunked))


def files_to_send(manifest: Manifest, stored: Iterable[tuple[str, Any]]) -> list[str]:
    """Pure: the paths of ``manifest``'s files still to upload, given
    ``stored``: (path, what the store says of it) for files already in the
    checkpoint's prefix, each a :class:`~spotguard.storage.base.StoredChecksum`
    or None (the store computed none). A file is skipped only when the store
    holds it with the manifest's size and checksum, in the manifest's algorithm."""
    held = dict(stored)
    send: list[str] = []
    for entry in manifest.files:
        info = held.get(entry.path)
        if (
            info is None
            or info.algorithm != manifest.checksum_algorithm
            or check_stored_checksum(entry, manifest.checksum_algorithm, info) is not None
        ):
            send.append(entry.path)
    return send


def _stored_checksums(storage: Storage, manifest: Manifest) -> list[tuple[str, Any]]:
    """What the store says of the files of ``manifest`` already below its prefix
    (an interrupted upload's): one listing, then one request per file found."""
    if not isinstance(storage, StoreChecksums):
        return []
    present = stored_files(storage, manifest.name)
    wanted = {e.path: e.size for e in manifest.files}
    return [
        (path, storage.stored_checksum(f"{manifest.name}/{path}"))
        for path, info in present.items()
        if wanted.get(path) == info.size
    ]


def _upload_plain(sending: _Sending, resume: bool = False) -> UploadResult:
    storage, manifest, manifest_bytes = sending.io, sending.manifest, sending.manifest_bytes
    name = manifest.name
    if manifest.chunked:
        # A copy restored from an incremental store, uploaded whole.
        manifest = to_plain(manifest)
        manifest_bytes = manifest.to_json()
    paths = [e.path for e in manifest.files]
    if resume:
        paths = files_to_send(manifest, _stored_checksums(storage, manifest))
        if len(paths) < len(manifest.files):
            log.info(
                "%s: %d of %d file(s) already stored by an interrupted upload; not sent again",
                storage.uri_for(name),
                len(manifest.files) - len(paths),
                len(manifest.files),
            )
    storage.upload_files([(sending.local_dir / p, f"{name}/{p}") for p in paths], sending.progress)
    # The manifest goes last: its presence means every data file is stored.
    storage.write_bytes(f"{name}/{MANIFEST_NAME}", manifest_bytes)
    return sending.result(manifest.total_size + len(manifest_bytes), new_bytes=manifest.total_size)


def _upload_part(sending: _Sending, known: KnownChunks | None) -> UploadResult:
    """One node's part: its files (whole, or as chunks with ``known``), checked in
    storage, then its part manifest, then the global commit."""
    storage, manifest, manifest_bytes = sending.io, sending.manifest, sending.manifest_bytes
    sharding = manifest.sharding
    assert sharding is not None and sharding.part is not None
    name = manifest.name
    index = sharding.part
    part_key = f"{name}/{part_manifest_path(index)}"
    uploaded = 0
    chunked: ChunkedUpload | None = None
    try:
        stored_global: Manifest | None = read_manifest(storage, name)
    except NotFoundError:
        stored_global = None
    if stored_global is not None:
        # Committed already (this part shipped before a restart, or an
        # earlier attempt committed the step): never overwrite the files of
        # a committed checkpoint with other bytes.
        if not _committed_with(storage, stored_global, index, manifest_bytes):
            raise ManifestError(
                f"{name} is already committed in storage with a different part {index}; "
                "not overwriting the files of a committed checkpoint"
            )
        commit = existing_commit(storage, name)
    else:
        if known is None:
            storage.upload_files(
                [(sending.local_dir / e.path, f"{name}/{e.path}") for e in manifest.files], sending.progress
            )
            # The part manifest says its files are stored and verified: check them first.
            problems = verify_uploaded_files(storage, name, manifest)
            stored_bytes = manifest_bytes
            uploaded = manifest.total_size + len(manifest_bytes)
        else:
            chunked = upload_chunks(sending.local_dir, storage, manifest, known, progress=sending.progress)
            stored_bytes = chunked.manifest_bytes
            problems = verify_chunks(storage, parse_manifest(stored_bytes), trusted=chunked.trusted).problems
            uploaded = chunked.new_bytes + len(stored_bytes)
        if problems:
            raise CheckpointCorruptError(name, [f"{p} (part {index})" for p in problems])
        storage.write_bytes(part_key, stored_bytes)
        commit = commit_global(storage, name)
    total = commit.total or sharding.parts
    log.info(
        "uploaded part %d of %s: %s (%d of %d parts present)%s",
        index,
        storage.uri_for(name),
        commit.status,
        len(commit.present),
        total,
        ""
        if chunked is None
        else f"; {chunked.new_chunks} new chunk(s) ({chunked.new_bytes} bytes), {chunked.reused_chunks} reused "
        f"({chunked.reused_bytes} bytes)",
    )
    return sending.result(
        uploaded,
        committed=commit.committed,
        parts_present=len(commit.present),
        parts_total=total,
        **({} if chunked is None else _chunk_counts(chunked)),
    )


def _chunk_counts(chunked: ChunkedUpload) -> dict[str, Any]:
    return {**chunked.counts(), "trusted_chunks": chunked.trusted}


def _committed_with(storage: Storage, stored_global: Manifest, index: int, local: bytes) -> bool:
    """Whether the committed checkpoint's part ``index`` is the local part manifest ``local``
    (the same bytes, or the same manifest stored incrementally)."""
    listed = next((f for f in stored_global.files if f.path == part_manifest_path(index)), None)
    if listed is None:
        return False
    if listed.size == len(local) and listed.checksum == checksum_bytes(local, stored_global.checksum_algorithm):
        return True
    try:
        stored = storage.read_bytes(f"{stored_global.name}/{listed.path}")
    except NotFoundError:
        return False
    same_bytes = listed.checksum == checksum_bytes(stored, stored_global.checksum_algorithm)
    return same_bytes and stored_as(stored, local)


__all__ = ["UploadCancelled", "UploadResult", "files_to_send", "stopping_storage", "upload_checkpoint"]
