"""Uploading a committed local checkpoint to storage.

The order is the contract: data files first, then the manifest (its presence
means every file it lists is stored), then the advisory ``latest`` pointer.
A checkpoint goes up whole, or incrementally as content-addressed chunks
shared with the job's other checkpoints (:mod:`~spotguard.checkpoint.chunked`),
under an upload intent that keeps the chunk collector off what it reuses
(:mod:`~spotguard.checkpoint.intents`). A part of a distributed checkpoint is
checked in storage before its part manifest is stored, then tries the global
commit (:mod:`~spotguard.checkpoint.parts`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from spotguard.checkpoint.chunked import KnownChunks, upload_chunks
from spotguard.checkpoint.intents import upload_intent
from spotguard.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    parse_manifest,
    part_manifest_path,
    to_plain,
)
from spotguard.checkpoint.parts import commit_global, existing_commit
from spotguard.checkpoint.stored import CheckpointCorruptError, read_manifest, update_latest_pointer
from spotguard.checkpoint.verify_stored import verify_uploaded_files
from spotguard.storage.base import NotFoundError, ProgressCallback, Storage
from spotguard.storage.checksum import checksum_bytes

log = logging.getLogger(__name__)


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
        commit = existing_commit(storage, name)
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


__all__ = ["UploadResult", "upload_checkpoint"]
