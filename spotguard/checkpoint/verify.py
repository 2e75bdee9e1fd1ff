"""Checking a checkpoint's files against its manifest (size, checksum, safety).

The same logic serves local directories and remote prefixes: the caller
supplies the sizes it sees and a way to stream a file's bytes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from spotguard.checkpoint.checksum import Crc32cHasher, new_hasher
from spotguard.checkpoint.manifest import FileEntry, Manifest
from spotguard.checkpoint.pickle_scan import UnsafePickleError, check_pickle_safe, looks_like_pickle
from spotguard.storage.base import NotFoundError

_SPOOL_MAX = 64 << 20


@dataclass
class VerifyResult:
    """Outcome of verifying one checkpoint; ``problems`` name file and reason."""

    name: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    manifest: Manifest | None = None
    checked_bytes: int = 0

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
    wants_bytes = isinstance(hasher, Crc32cHasher)
    size = 0
    spool: tempfile.SpooledTemporaryFile[bytes] | None = None
    try:
        for chunk in read_chunks(path):
            if size == 0 and looks_like_pickle(path, bytes(chunk[:4])):
                spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_MAX)  # noqa: SIM115 (closed below)
            if wants_bytes and not isinstance(chunk, bytes):
                chunk = bytes(chunk)
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
