"""Downloading a checkpoint's files and checking them in the same pass.

A restore used to download every file, fsync it, and then read it back from
disk to compare it with the manifest: three passes over the bytes, two of
them serial after the download (about a third of a restore's time on a busy
machine). Here each file is checked while it streams in: the bytes that are
written are the bytes that are checksummed, so the copy on disk matches the
manifest exactly when the stream did (short of a disk that corrupts what it
was given, which is what the re-verification before any reuse is for).

From a backend that reads into memory (S3), each range of a file the
manifest checks by CRC32C and that cannot be a pickle (safetensors, JSON,
DCP data), and each chunk of a checkpoint stored incrementally, is read
from the socket into a buffer the process reuses, checksummed there and
written at its offset (:class:`_Targets`): no ``bytes`` object per range.
Reading the socket straight into the file's mapped pages instead faulted
on every new page, which cost more than the write that copies a range
from memory already touched (the resume section of docs/benchmarks.md).
Other files stream in order, as above.

The files are not fsynced: a restored copy is a cache of storage, and every
reader verifies a local checkpoint before using it (``restore_checkpoint``
before reusing one, ``Checkpointer.restore`` before loading one), so a copy
torn by a crash is detected and fetched again, never loaded.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import google_crc32c

from spotguard.checkpoint.format.manifest import ChunkRef, FileEntry, Manifest
from spotguard.checkpoint.format.verify import check_one_file, needs_content
from spotguard.checkpoint.store.chunked import DEFAULT_WORKERS as CHUNK_WORKERS
from spotguard.checkpoint.store.chunked import _chunk_of, _read_whole, _reader, _users, check_chunk_landed
from spotguard.storage.base import (
    NotFoundError,
    ObjectInfo,
    ProgressCallback,
    RangedReads,
    ReadsInto,
    Storage,
    byte_ranges,
    read_as_listed,
)
from spotguard.storage.checksum import crc32c_combine, crc32c_value

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
    seen: Mapping[str, ObjectInfo] | None = None,
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
    broken). ``seen``: the listing's objects by path, when the caller has
    them: a file read by ranges is then read as that listing saw it,
    without asking the store about it again.
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
            key, target = f"{name}/{entry.path}", dest / entry.path
            return read_as_listed(
                lambda listed: _fetch_into_file(storage, key, entry, target, progress, lock, listed),
                seen.get(entry.path) if seen is not None else None,
            )
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
    seen: ObjectInfo | None = None,
) -> str | None:
    """Download ``key`` into ``target`` by concurrent ranged reads, each read
    from the socket into a reused buffer where the backend can
    (``fetch_into``; see :class:`_Targets`), checksummed there and written,
    the ranges' CRC32Cs combined into the file's. The problem with the file (as
    :func:`check_one_file` words it), or None."""
    assert isinstance(storage, RangedReads)
    path, size = entry.path, entry.size
    try:
        obj = storage.open_ranged(key, seen)
    except NotFoundError:
        return f"{path}: missing (disappeared while reading)"
    if obj.size != size:
        return f"{path}: size {obj.size} bytes while reading, manifest says {size} (truncated)"
    fetch_into = obj.fetch_into
    files = _Targets(target.parent, mapped=True)
    crc = 0
    try:
        try:
            files.open(target.name, size)

            def one(start: int, end: int) -> tuple[int, int]:
                if fetch_into is not None:
                    value = files.land(target.name, start, end - start, lambda views: fetch_into(start, views))
                else:
                    data = obj.fetch(start, end)
                    files.put(target.name, start, data)
                    value = google_crc32c.value(data)
                if progress is not None:
                    with lock:
                        progress(end - start)
                return value, end - start

            # Every range lands where it belongs, so they need no order; the mapping is closed
            # only once no thread writes into it, also when one of them failed.
            pool = ThreadPoolExecutor(max_workers=max(1, obj.concurrency), thread_name_prefix="restore-read")
            try:
                pieces = [pool.submit(one, start, end) for start, end in byte_ranges(size, obj.chunk)]
                for piece in pieces:
                    value, n = piece.result()
                    crc = crc32c_combine(crc, value, n)
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
        finally:
            files.close()
    except OSError as exc:
        return f"{path}: unreadable ({exc.strerror or exc})"
    except NotFoundError:  # deleted since the listing (read as the listing saw it, without a HEAD first)
        return f"{path}: missing (disappeared while reading)"
    got = f"{crc:08x}"
    if got != entry.checksum:
        return f"{path}: crc32c checksum mismatch (data has {got}, manifest says {entry.checksum})"
    return None


#: Buffers ranges are read into before they are written (:meth:`_Targets.land`), kept for the next
#: restore: memory the process has already touched. At most this many are kept.
_SCRATCH_KEPT = 16
_scratch: list[bytearray] = []
_scratch_lock = threading.Lock()


def _take_scratch(n: int) -> bytearray:
    with _scratch_lock:
        for i, buf in enumerate(_scratch):
            if len(buf) >= n:
                return _scratch.pop(i)
    return bytearray(n)


def _give_scratch(buf: bytearray) -> None:
    with _scratch_lock:
        if len(_scratch) < _SCRATCH_KEPT:
            _scratch.append(buf)


class _Targets:
    """Files a restore writes by putting byte ranges where they belong, in any
    order and from several threads. ``mapped`` (a backend that reads into
    memory) allocates each file's blocks first (a full disk is an error before
    anything is downloaded), and a range is read from the socket into a
    reused buffer, checksummed there and written at its offset (:meth:`land`);
    otherwise a range's bytes are written at their offset (:meth:`put`)."""

    def __init__(self, dest: Path, *, mapped: bool) -> None:
        self.dest = dest
        self.mapped = mapped
        self.fds: dict[str, int] = {}

    def open(self, path: str, size: int) -> None:
        target = self.dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.fds[path] = fd
        if self.mapped and size > 0:
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)

    def land(self, path: str, offset: int, length: int, read: Callable[[list[memoryview]], object]) -> int:
        """``read`` puts bytes ``[offset, offset + length)`` of ``path`` into the
        memory it is given; their CRC32C, computed there, once they are written."""
        buf = _take_scratch(length)
        view = memoryview(buf)[:length]
        try:
            read([view])
            crc = crc32c_value(view)
            self.put(path, offset, view)
            return crc
        finally:
            view.release()
            _give_scratch(buf)

    def put(self, path: str, offset: int, data: bytes | memoryview) -> None:
        """Write ``data`` at ``offset`` of ``path``."""
        out, at = memoryview(data), offset
        while out.nbytes:
            written = os.pwrite(self.fds[path], out, at)
            out, at = out[written:], at + written

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _fetch_chunk(files: _Targets, storage: Storage, path: str, offset: int, ref: ChunkRef) -> str | None:
    """Put chunk ``ref`` at ``offset`` of ``path``: the problem with it (size,
    CRC32C: :func:`check_chunk_landed`), or None."""
    if files.mapped:
        assert isinstance(storage, ReadsInto)
        sizes: list[int] = []
        crc = files.land(path, offset, ref.size, lambda views: sizes.append(storage.read_into(ref.key, views)))
        return check_chunk_landed(ref, sizes[0], crc if sizes[0] == ref.size else 0)
    data = storage.read_bytes(ref.key)
    problem = check_chunk_landed(ref, len(data), google_crc32c.value(data))
    if problem is None:
        files.put(path, offset, data)
    return problem


def fetch_chunks(
    storage: Storage,
    manifest: Manifest,
    dest: Path,
    *,
    workers: int = CHUNK_WORKERS,
    progress: ProgressCallback | None = None,
) -> list[str]:
    """Assemble every file of a chunked checkpoint in ``dest`` from its chunks,
    downloaded concurrently, each put at its offset and checked (size,
    CRC32C: :func:`check_chunk_landed`; see :class:`_Targets`); then the files that may be pickles are
    inspected, and a SHA-256 file checksum is checked. Returns the problems
    (empty when the copy matches the manifest). Storage errors other than a
    missing object propagate; ``dest`` is a temporary directory the caller
    removes on failure."""
    dest = Path(dest)
    users = _users(manifest)
    lock = threading.Lock()
    files = _Targets(dest, mapped=isinstance(storage, ReadsInto))
    jobs: list[tuple[str, int, ChunkRef]] = []
    whole: list[FileEntry] = []

    def one(job: tuple[str, int, ChunkRef]) -> str | None:
        path, offset, ref = job
        try:
            problem = _fetch_chunk(files, storage, path, offset, ref)
        except NotFoundError:
            return f"{ref.key}: missing ({_chunk_of(users[ref.hash])})"
        if problem:
            return f"{ref.key}: {problem} ({_chunk_of(users[ref.hash])})"
        if progress is not None:
            with lock:
                progress(ref.size)
        return None

    try:
        for entry in manifest.files:
            if entry.chunks is None:
                whole.append(entry)  # a part manifest of a distributed checkpoint: stored whole
                continue
            files.open(entry.path, entry.size)
            offset = 0
            for ref in entry.chunks or ():
                jobs.append((entry.path, offset, ref))
                offset += ref.size
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="chunk-fetch") as pool:
            results = list(pool.map(one, jobs))
    finally:
        files.close()
    problems = sorted({p for p in results if p})
    for entry in whole:
        data, problem = _read_whole(storage, manifest, entry)
        if problem is not None or data is None:
            problems.append(problem or f"{entry.path}: missing")
            continue
        target = dest / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    if problems:
        return problems
    for entry in manifest.files:
        if entry.chunks is not None and (needs_content(entry.path) or manifest.checksum_algorithm != "crc32c"):
            problem, _ = check_one_file(
                entry, manifest.checksum_algorithm, entry.size, _reader(partial(_read_local, dest / entry.path))
            )
            if problem:
                problems.append(problem)
    return problems


def _read_local(path: Path) -> Iterable[bytes]:
    with open(path, "rb") as f:
        while data := f.read(8 << 20):
            yield data


__all__ = ["fetch_chunks", "fetch_verified"]
