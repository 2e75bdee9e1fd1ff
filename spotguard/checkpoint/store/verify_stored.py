"""Verifying a checkpoint in storage against its manifest.

A checkpoint is usable when every file its manifest lists is in storage with
the recorded size and checksum, and no pickle in it would run code. The file
checks themselves are :mod:`~spotguard.checkpoint.format.verify` (shared with local
directories) and, for a checkpoint stored incrementally,
:mod:`~spotguard.checkpoint.store.chunked`; this module feeds them what storage
holds, compares with the checksums the store computed on receipt where it
has them, and for a distributed checkpoint names the part a problem belongs
to (:mod:`~spotguard.checkpoint.store.parts`). Choosing the newest checkpoint that
verifies is :mod:`~spotguard.checkpoint.store.latest`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from spotguard.checkpoint.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    parse_checkpoint_name,
    parse_manifest,
)
from spotguard.checkpoint.format.verify import (
    METHOD_READ_BACK,
    METHOD_SIZES,
    VerifyResult,
    verify_files,
    verify_files_by_store,
)
from spotguard.checkpoint.store.chunked import verify_chunks
from spotguard.checkpoint.store.parts import check_against_parts, missing_manifest_problems, name_parts
from spotguard.checkpoint.store.stored import CheckpointCorruptError, read_manifest, read_manifest_bytes, stored_files
from spotguard.storage.base import NotFoundError, Storage, StoreChecksums, StoredChecksum

log = logging.getLogger(__name__)


def stored_manifest(storage: Storage, name: str) -> tuple[bytes, Manifest]:
    """The stored manifest of checkpoint ``name``, as stored and parsed; raises
    :class:`CheckpointCorruptError` saying why there is none to go by (missing,
    for a distributed checkpoint with the parts that are; malformed)."""
    try:
        manifest_bytes = read_manifest_bytes(storage, name)
    except NotFoundError:
        raise CheckpointCorruptError(name, missing_manifest_problems(storage, name)[0]) from None
    try:
        return manifest_bytes, parse_manifest(manifest_bytes, expected_name=name)
    except ManifestError as exc:
        raise CheckpointCorruptError(name, [f"{MANIFEST_NAME}: {exc}"]) from None


def verify_checkpoint(
    storage: Storage,
    name: str,
    *,
    checksums: bool = True,
    deep: bool = False,
    workers: int = 4,
    quiet: bool = False,
    trusted: Mapping[str, int] | None = None,
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

    ``trusted``: chunks its upload reused from a checkpoint the uploader had
    verified (:attr:`~spotguard.checkpoint.store.chunked.ChunkedUpload.trusted`),
    taken as checked unless ``deep``.
    """
    if parse_checkpoint_name(name) is None:
        return VerifyResult(name, False, [f"{name!r} is not a checkpoint name (ckpt-<12 digits>)"])
    try:
        manifest = read_manifest(storage, name)
    except NotFoundError:
        problems, present, total = missing_manifest_problems(storage, name)
        return VerifyResult(name, False, problems, parts_present=present, parts_total=total)
    except ManifestError as exc:
        return VerifyResult(name, False, [f"{MANIFEST_NAME}: {exc}"])
    if manifest.is_part:
        assert manifest.sharding is not None
        return VerifyResult(
            name,
            False,
            [
                f"{MANIFEST_NAME}: the manifest of part {manifest.sharding.part} of {manifest.sharding.parts}, "
                "not of the whole checkpoint"
            ],
        )
    if manifest.chunked:
        chunk_checks = verify_chunks(
            storage, manifest, checksums=checksums, deep=deep, workers=max(workers, 8), trusted=trusted
        )
        result = VerifyResult(
            name,
            not chunk_checks.problems,
            chunk_checks.problems,
            manifest,
            chunk_checks.read_bytes,
            method=chunk_checks.method if checksums else METHOD_SIZES,
            store_checked=chunk_checks.store_checked,
            read_back=chunk_checks.read_back,
            trusted=chunk_checks.trusted,
        )
        return _global_checked(storage, name, manifest, result, "chunks", quiet)
    listing = stored_files(storage, name)
    sizes = {path: info.size for path, info in listing.items()}

    def read_chunks(path: str) -> Iterable[bytes]:
        return storage.iter_chunks(f"{name}/{path}")

    if checksums and not deep and isinstance(storage, StoreChecksums):
        checker = storage

        def stored(path: str) -> StoredChecksum | None:
            return checker.stored_checksum(f"{name}/{path}")

        checks = verify_files_by_store(manifest, sizes, stored, read_chunks, workers=workers)
        result = VerifyResult(
            name,
            not checks.problems,
            checks.problems,
            manifest,
            checks.read_bytes,
            method=checks.method,
            store_checked=checks.store_checked,
            read_back=checks.read_back,
        )
    else:
        problems, nbytes = verify_files(manifest, sizes, read_chunks, checksums=checksums, workers=workers)
        method = METHOD_READ_BACK if checksums else METHOD_SIZES
        result = VerifyResult(
            name,
            not problems,
            problems,
            manifest,
            nbytes,
            method=method,
            read_back=len(manifest.files) if checksums else 0,
        )
    return _global_checked(storage, name, manifest, result, "files", quiet)


def _global_checked(
    storage: Storage, name: str, manifest: Manifest, result: VerifyResult, unit: str, quiet: bool
) -> VerifyResult:
    """``result``, for a distributed checkpoint with each problem's part named and the
    global manifest checked against its parts; logged."""
    if manifest.sharding is not None:
        result.problems = name_parts(storage, name, manifest, result.problems)
        if not result.problems:
            result.problems = check_against_parts(storage, name, manifest)
            result.ok = not result.problems
        result.parts_total = manifest.sharding.parts
        result.parts_present = list(range(manifest.sharding.parts))
    _log_verify(storage, name, result, unit, quiet)
    return result


def _log_verify(storage: Storage, name: str, result: VerifyResult, unit: str, quiet: bool = False) -> None:
    log.log(
        logging.DEBUG if quiet else logging.INFO,
        "verify %s: %s by %s (%d %s by store checksum, %d read back, %d bytes read%s)",
        storage.uri_for(name),
        "ok" if result.ok else "FAILED",
        result.method,
        result.store_checked,
        unit,
        result.read_back,
        result.checked_bytes,
        f", {result.trusted} trusted" if result.trusted else "",
    )


def verify_uploaded_files(storage: Storage, name: str, manifest: Manifest, *, workers: int = 4) -> list[str]:
    """Problems of ``manifest``'s files in storage below ``name`` (by store
    checksum where the store has one, else read back); [] when all match."""
    sizes = {path: info.size for path, info in stored_files(storage, name).items()}

    def read_chunks(path: str) -> Iterable[bytes]:
        return storage.iter_chunks(f"{name}/{path}")

    if isinstance(storage, StoreChecksums):
        checker = storage

        def stored(path: str) -> StoredChecksum | None:
            return checker.stored_checksum(f"{name}/{path}")

        return verify_files_by_store(manifest, sizes, stored, read_chunks, workers=workers).problems
    problems, _ = verify_files(manifest, sizes, read_chunks, workers=workers)
    return problems


__all__ = ["verify_checkpoint", "verify_uploaded_files"]
