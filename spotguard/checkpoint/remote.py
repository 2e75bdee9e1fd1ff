"""Checkpoints in storage: upload, verify, find the newest verified, restore.

Layout below the storage root: ``ckpt-<step:012d>/<data files>``,
``ckpt-<step:012d>/manifest.json`` (uploaded after every data file), and the
advisory ``latest`` pointer (uploaded last). Which checkpoint is usable is
decided from the listing and the manifests alone; the pointer is never
trusted.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from spotguard.checkpoint.fetch import fetch_verified
from spotguard.checkpoint.local import (
    TMP_PREFIX,
    list_local_committed,
    read_local_manifest,
    remove_checkpoint_dir,
    verify_local_checkpoint,
)
from spotguard.checkpoint.manifest import (
    MANIFEST_NAME,
    POINTER_NAME,
    Manifest,
    ManifestError,
    checkpoint_name,
    parse_checkpoint_name,
    parse_manifest,
    parse_pointer,
    pointer_json,
)
from spotguard.checkpoint.verify import (
    METHOD_READ_BACK,
    METHOD_SIZES,
    VerifyResult,
    verify_files,
    verify_files_by_store,
)
from spotguard.storage.base import (
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


def verify_checkpoint(
    storage: Storage, name: str, *, checksums: bool = True, deep: bool = False, workers: int = 4
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
    ``VerifyResult.method`` says which way was taken.
    """
    if parse_checkpoint_name(name) is None:
        return VerifyResult(name, False, [f"{name!r} is not a checkpoint name (ckpt-<12 digits>)"])
    try:
        manifest = read_manifest(storage, name)
    except NotFoundError:
        return VerifyResult(name, False, [f"{MANIFEST_NAME}: missing (upload incomplete or interrupted)"])
    except ManifestError as exc:
        return VerifyResult(name, False, [f"{MANIFEST_NAME}: {exc}"])
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
    log.info(
        "verify %s: %s by %s (%d files by store checksum, %d read back, %d bytes read)",
        storage.uri_for(name), "ok" if result.ok else "FAILED", result.method,
        result.store_checked, result.read_back, result.checked_bytes,
    )  # fmt: skip
    return result


def latest_verified(
    storage: Storage, *, checksums: bool = True, deep: bool = False
) -> tuple[CheckpointInfo | None, list[Skipped]]:
    """The newest checkpoint that passes verification, and every newer one that
    was passed over with the reason. ``(None, skipped)`` when none passes.
    ``checksums`` and ``deep`` as for :func:`verify_checkpoint`."""
    skipped: list[Skipped] = []
    for name in reversed(list_checkpoint_names(storage)):
        result = verify_checkpoint(storage, name, checksums=checksums, deep=deep)
        if result.ok and result.manifest is not None:
            return CheckpointInfo.from_manifest(result.manifest, storage.uri_for(name)), skipped
        skipped.append(Skipped(name, parse_checkpoint_name(name) or 0, result.reason))
        log.warning("skipping checkpoint %s: %s", storage.uri_for(name), result.reason)
    return None, skipped


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
) -> UploadResult:
    """Upload a committed local checkpoint: data files (concurrently), then the
    manifest, then the ``latest`` pointer.

    Raises :class:`ManifestError` / ``FileNotFoundError`` when the local
    checkpoint is not complete, :class:`StorageError` on storage failures.
    """
    start = time.monotonic()
    local_ckpt_dir = Path(local_ckpt_dir)
    manifest_bytes = (local_ckpt_dir / MANIFEST_NAME).read_bytes()
    manifest = parse_manifest(manifest_bytes, expected_name=local_ckpt_dir.name)
    for entry in manifest.files:
        size = (local_ckpt_dir / entry.path).stat().st_size
        if size != entry.size:
            raise ManifestError(f"{local_ckpt_dir / entry.path}: size {size}, manifest says {entry.size}")
    name = manifest.name
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
    )


def restore_checkpoint(
    storage: Storage,
    name: str,
    dest: Path,
    *,
    progress: ProgressCallback | None = None,
) -> CheckpointInfo:
    """Download one checkpoint into ``dest/<name>`` and verify it there.

    The directory appears only when every file is downloaded and matches the
    manifest. A matching local copy that already verifies is reused. Raises
    :class:`CheckpointCorruptError` (with the problems) or
    :class:`StorageError`.
    """
    dest = Path(dest)
    try:
        manifest_bytes = read_manifest_bytes(storage, name)
    except NotFoundError:
        raise CheckpointCorruptError(name, [f"{MANIFEST_NAME}: missing (upload incomplete or interrupted)"]) from None
    try:
        manifest = parse_manifest(manifest_bytes, expected_name=name)
    except ManifestError as exc:
        raise CheckpointCorruptError(name, [f"{MANIFEST_NAME}: {exc}"]) from None
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
        listing = _listing(storage, name)
        missing = [e.path for e in manifest.files if e.path not in listing]
        if missing:
            raise CheckpointCorruptError(name, [f"{p}: missing" for p in missing])
        # One pass: each file is checked as it streams in; not fsynced, as
        # every reader verifies a local copy before using it.
        sizes = {path: info.size for path, info in listing.items()}
        problems = fetch_verified(storage, name, manifest, sizes, tmp, progress=progress)
        if problems:
            raise CheckpointCorruptError(name, problems)
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
    Returns the number of objects deleted."""
    if parse_checkpoint_name(name) is None:
        raise ValueError(f"not a checkpoint name: {name!r}")
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
    "Skipped",
    "StorageError",
    "UploadResult",
    "checkpoint_name",
    "delete_checkpoint",
    "latest_verified",
    "list_checkpoint_names",
    "read_local_manifest",
    "read_manifest",
    "restore_checkpoint",
    "restore_latest",
    "update_latest_pointer",
    "upload_checkpoint",
    "verify_checkpoint",
]
