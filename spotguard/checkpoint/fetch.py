"""Downloading a checkpoint's files and checking them in the same pass.

A restore used to download every file, fsync it, and then read it back from
disk to compare it with the manifest: three passes over the bytes, two of
them serial after the download (about a third of a restore's time on a busy
machine). Here each file is checked while it streams in: the bytes that are
written are the bytes that are checksummed, so the copy on disk matches the
manifest exactly when the stream did (short of a disk that corrupts what it
was given, which is what the re-verification before any reuse is for).

The files are not fsynced: a restored copy is a cache of storage, and every
reader verifies a local checkpoint before using it (``restore_checkpoint``
before reusing one, ``Checkpointer.restore`` before loading one), so a copy
torn by a crash is detected and fetched again, never loaded.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from spotguard.checkpoint.manifest import FileEntry, Manifest
from spotguard.checkpoint.verify import check_one_file, needs_content
from spotguard.storage.base import (
    NotFoundError,
    ProgressCallback,
    RangedReads,
    Storage,
    byte_ranges,
    read_in_order,
)
from spotguard.storage.checksum import crc32c_combine

DEFAULT_WORKERS = 2  # files at once; each already fetches several ranges concurrently


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(fd, view) :]


def fetch_verified(
    storage: Storage,
    name: str,
    manifest: Manifest,
    sizes: Mapping[str, int],
    dest: Path,
    *,
    workers: int = DEFAULT_WORKERS,
    progress: ProgressCallback | None = None,
) -> list[str]:
    """Download the files of checkpoint ``name`` listed in ``manifest`` into
    ``dest`` (relative paths kept), checking size, checksum and pickle safety
    of each as it streams in; returns the problems ("<file>: <reason>"),
    empty when every file matches.

    ``sizes`` maps each file present in storage to its size (from a listing):
    a missing or wrongly sized file is reported without downloading it. Files
    with problems may be left partly written: ``dest`` is a temporary
    directory the caller removes. Storage errors other than a missing object
    propagate (a network failure must not make a good checkpoint look
    broken).
    """
    dest = Path(dest)
    lock = threading.Lock()  # files stream in on several threads; the callback sees one at a time

    def read_chunks(path: str) -> Iterator[bytes]:
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for chunk in storage.iter_chunks(f"{name}/{path}"):
                _write_all(fd, chunk)
                if progress is not None:
                    with lock:
                        progress(len(chunk))
                yield chunk
        finally:
            os.close(fd)

    def check(entry: FileEntry) -> str | None:
        if _fetchable_into(storage, manifest, entry, sizes):
            return _fetch_into_file(storage, f"{name}/{entry.path}", entry, dest / entry.path, progress, lock)
        return check_one_file(entry, manifest.checksum_algorithm, sizes.get(entry.path), read_chunks)[0]

    files = manifest.files
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(files)))) as pool:
        return [p for p in pool.map(check, files) if p]


def _fetchable_into(storage: Storage, manifest: Manifest, entry: FileEntry, sizes: Mapping[str, int]) -> bool:
    """Whether ``entry`` is fetched by ranges straight into its file
    (:func:`_fetch_into_file`): a whole file (not chunks) of the size the
    manifest says, checked by CRC32C (the ranges' CRCs combine), never a
    possible pickle (those are scanned in order as they stream in)."""
    return (
        isinstance(storage, RangedReads)
        and entry.chunks is None
        and manifest.checksum_algorithm == "crc32c"
        and not needs_content(entry.path)
        and sizes.get(entry.path) == entry.size > 0
    )


def _fetch_into_file(
    storage: Storage,
    key: str,
    entry: FileEntry,
    target: Path,
    progress: ProgressCallback | None,
    lock: threading.Lock,
) -> str | None:
    """Download ``key`` into ``target`` by concurrent ranged reads, each read
    from the socket straight into the file's pages (a shared mapping of the
    file, its blocks allocated first: a full disk is an error here, never a
    fault on a page) where the backend can (``fetch_into``), and checksummed
    there, the ranges' CRC32Cs combined into the file's. The problem with
    the file (as :func:`check_one_file` words it), or None."""
    import google_crc32c
    import numpy as np

    assert isinstance(storage, RangedReads)
    path, size = entry.path, entry.size
    try:
        obj = storage.open_ranged(key)
    except NotFoundError:
        return f"{path}: missing (disappeared while reading)"
    if obj.size != size:
        return f"{path}: size {obj.size} bytes while reading, manifest says {size} (truncated)"
    target.parent.mkdir(parents=True, exist_ok=True)
    crc = 0
    try:
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(fd, 0, size)
            with mmap.mmap(fd, size) as mem:

                def one(start: int, end: int) -> tuple[int, int]:
                    view = memoryview(mem)[start:end]
                    try:
                        if obj.fetch_into is not None:
                            obj.fetch_into(start, [view])
                        else:
                            view[:] = obj.fetch(start, end)
                        piece = np.frombuffer(view, dtype=np.uint8)
                        value = int(google_crc32c.value(piece))
                        del piece
                    finally:
                        view.release()
                    if progress is not None:
                        with lock:
                            progress(end - start)
                    return value, end - start

                for value, n in read_in_order(one, byte_ranges(size, obj.chunk), max(1, obj.concurrency)):
                    crc = crc32c_combine(crc, value, n)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"{path}: unreadable ({exc.strerror or exc})"
    got = f"{crc:08x}"
    if got != entry.checksum:
        return f"{path}: crc32c checksum mismatch (data has {got}, manifest says {entry.checksum})"
    return None


__all__ = ["fetch_verified"]
