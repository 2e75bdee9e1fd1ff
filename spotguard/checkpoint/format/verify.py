"""Checking a checkpoint's files against its manifest (size, checksum, safety).

The same logic serves local directories and remote prefixes: the caller
supplies the sizes it sees and a way to stream a file's bytes, and, for a
store that computes checksums on receipt, a way to ask for them (then the
bytes are read back only for files the store has no checksum for).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from spotguard.checkpoint.format.manifest import FileEntry, Manifest
from spotguard.checkpoint.format.pickle_scan import (
    NOT_PICKLE_SUFFIXES,
    UnsafePickleError,
    check_pickle_safe,
    looks_like_pickle,
)
from spotguard.storage.base import NotFoundError, StoredChecksum
from spotguard.storage.checksum import new_hasher

_SPOOL_MAX = 64 << 20

#: How a checkpoint's file contents were checked (``VerifyResult.method``).
METHOD_STORE = "store-checksum"
METHOD_READ_BACK = "read-back"
METHOD_MIXED = "mixed"
METHOD_SIZES = "sizes-only"
#: Every chunk was reused from a checkpoint its uploader had just verified (``VerifyResult.trusted``).
METHOD_TRUSTED = "trusted"


@dataclass
class VerifyResult:
    """Outcome of verifying one checkpoint; ``problems`` name file and reason."""

    name: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    manifest: Manifest | None = None
    checked_bytes: int = 0
    #: How file contents were checked: ``store-checksum`` (checksums the store
    #: computed on receipt), ``read-back`` (every byte read and checksummed),
    #: ``mixed`` (some of each), ``sizes-only``; ``""`` when no file was reached.
    method: str = ""
    store_checked: int = 0
    read_back: int = 0
    #: Chunks taken as checked: an incremental upload reused them from a checkpoint its
    #: uploader verified (see :mod:`spotguard.checkpoint.store.chunked`).
    trusted: int = 0
    #: For a distributed checkpoint: the part indices found in storage and how
    #: many it has (None for a single-process checkpoint, or when unknown).
    parts_present: list[int] | None = None
    parts_total: int | None = None

    @property
    def reason(self) -> str:
        """All problems on one line ("" when ok)."""
        return "; ".join(self.problems)


def check_one_file(
    entry: FileEntry,
    algorithm: str,
    actual_size: int | None,
    read_chunks: Callable[[str], Iterable[bytes]],
    *,
    checksums: bool = True,
) -> tuple[str | None, int]:
    """The problem with one file (or None) and the bytes read to check it."""
    path = entry.path
    if actual_size is None:
        return f"{path}: missing", 0
    if actual_size != entry.size:
        kind = "truncated" if actual_size < entry.size else "longer than recorded"
        return f"{path}: size {actual_size} bytes, manifest says {entry.size} ({kind})", 0
    if not checksums:
        return None, 0
    hasher = new_hasher(algorithm)
    size = 0
    spool: tempfile.SpooledTemporaryFile[bytes] | None = None
    try:
        for chunk in read_chunks(path):
            if size == 0 and looks_like_pickle(path, bytes(chunk[:4])):
                spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_MAX)  # noqa: SIM115 (closed below)
            hasher.update(chunk)
            size += len(chunk)
            if spool is not None:
                spool.write(chunk)
        if size != entry.size:
            return f"{path}: size {size} bytes while reading, manifest says {entry.size} (truncated)", size
        got = hasher.hexdigest()
        if got != entry.checksum:
            return (
                f"{path}: {algorithm} checksum mismatch (data has {got}, manifest says {entry.checksum})",
                size,
            )
        if spool is not None:
            try:
                check_pickle_safe(spool)  # type: ignore[arg-type]
            except UnsafePickleError as exc:
                return f"{path}: {exc} (refused: loading it could run code)", size
        return None, size
    except NotFoundError:
        return f"{path}: missing (disappeared while reading)", size
    except OSError as exc:
        return f"{path}: unreadable ({exc.strerror or exc})", size
    finally:
        if spool is not None:
            spool.close()


def verify_files(
    manifest: Manifest,
    sizes: Mapping[str, int],
    read_chunks: Callable[[str], Iterable[bytes]],
    *,
    checksums: bool = True,
    workers: int = 1,
) -> tuple[list[str], int]:
    """Problems found in the manifest's files (in manifest order) and bytes read.

    ``sizes`` maps every present file path to its size; ``read_chunks(path)``
    streams a file. Storage errors other than a missing object propagate: a
    network failure must not make a good checkpoint look broken.
    """

    def check(entry: FileEntry) -> tuple[str | None, int]:
        return check_one_file(
            entry, manifest.checksum_algorithm, sizes.get(entry.path), read_chunks, checksums=checksums
        )

    if workers > 1 and len(manifest.files) > 1:
        with ThreadPoolExecutor(max_workers=min(workers, len(manifest.files))) as pool:
            results = list(pool.map(check, manifest.files))
    else:
        results = [check(e) for e in manifest.files]
    problems = [p for p, _ in results if p]
    return problems, sum(n for _, n in results)


@dataclass
class FileChecks:
    """What :func:`verify_files_by_store` found: problems (manifest order), bytes
    read back, and how many files were checked each way."""

    problems: list[str]
    read_bytes: int
    store_checked: int
    read_back: int

    @property
    def method(self) -> str:
        """``store-checksum``, ``read-back`` or ``mixed``."""
        if self.store_checked and self.read_back:
            return METHOD_MIXED
        return METHOD_STORE if self.store_checked else METHOD_READ_BACK


def needs_content(path: str) -> bool:
    """Whether a file must be read even when the store vouches for its checksum:
    anything that may be a pickle is inspected byte by byte (spotguard's own
    ``.safetensors`` and ``.json`` files and DCP's ``.distcp`` data files never
    are, see ``looks_like_pickle``)."""
    return not path.endswith(NOT_PICKLE_SUFFIXES)


def check_stored_checksum(entry: FileEntry, algorithm: str, stored: StoredChecksum) -> str | None:
    """The problem with one file judged by the checksum the store computed on
    receipt (None when it matches the manifest)."""
    if stored.size != entry.size:
        kind = "truncated" if stored.size < entry.size else "longer than recorded"
        return f"{entry.path}: size {stored.size} bytes, manifest says {entry.size} ({kind})"
    if stored.value != entry.checksum:
        return (
            f"{entry.path}: {algorithm} checksum mismatch (the store computed {stored.value} on receipt, "
            f"manifest says {entry.checksum})"
        )
    return None


def verify_files_by_store(
    manifest: Manifest,
    sizes: Mapping[str, int],
    stored_checksum: Callable[[str], StoredChecksum | None],
    read_chunks: Callable[[str], Iterable[bytes]],
    *,
    workers: int = 1,
) -> FileChecks:
    """Like :func:`verify_files`, but a file's checksum is taken from the store
    (``stored_checksum(path)``: what it computed on receipt, or None) where it
    has one of the manifest's algorithm; the other files are read back.

    A store checksum is as strong as a read-back for what the store received:
    the client sent the checksum with the bytes, the store checked the bytes
    against it before storing the object, and the value it returns is compared
    with the manifest's, which the writer computed. Storage errors other than a
    missing object propagate.
    """
    algorithm = manifest.checksum_algorithm

    def check(entry: FileEntry) -> tuple[str | None, int, str]:
        actual = sizes.get(entry.path)
        if actual is None or actual != entry.size:
            problem, _ = check_one_file(entry, algorithm, actual, read_chunks)
            return problem, 0, ""
        if needs_content(entry.path):
            problem, nbytes = check_one_file(entry, algorithm, actual, read_chunks)
            return problem, nbytes, METHOD_READ_BACK
        try:
            stored = stored_checksum(entry.path)
        except NotFoundError:
            return f"{entry.path}: missing (disappeared while checking)", 0, METHOD_STORE
        if stored is None or stored.algorithm != algorithm:
            problem, nbytes = check_one_file(entry, algorithm, actual, read_chunks)
            return problem, nbytes, METHOD_READ_BACK
        return check_stored_checksum(entry, algorithm, stored), 0, METHOD_STORE

    if workers > 1 and len(manifest.files) > 1:
        with ThreadPoolExecutor(max_workers=min(workers, len(manifest.files))) as pool:
            results = list(pool.map(check, manifest.files))
    else:
        results = [check(e) for e in manifest.files]
    return FileChecks(
        problems=[p for p, _, _ in results if p],
        read_bytes=sum(n for _, n, _ in results),
        store_checked=sum(1 for _, _, m in results if m == METHOD_STORE),
        read_back=sum(1 for _, _, m in results if m == METHOD_READ_BACK),
    )
