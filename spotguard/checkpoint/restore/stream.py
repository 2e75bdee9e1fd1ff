"""Loading a stored checkpoint's state straight into tensors, checked on the way.

A restore to disk writes every byte to a local copy, and loading then reads
it again into tensors: two more passes over the bytes than the download. Here
each safetensors file is read from the store in concurrent ranged reads (the
backend's :class:`~spotguard.storage.base.RangedReads`; the chunks of a
checkpoint stored incrementally). The tensors are allocated from the file's
header before the rest arrives (a whole file's first read is a small one,
:data:`HEADER_PROBE`, so the other ranges wait for no more than the header;
a chunked file's, its first chunk), and each later range is
read from the socket straight into the memory of the tensors it belongs to
(``RangedObject.fetch_into``; where a backend has no such read, or for
chunks, the range's bytes are copied there once, on the thread that fetched
them). The checksums are computed over the same bytes once they are in
place (per range, combined into the file's CRC32C; a SHA-256 in order,
from the range's bytes), and the tensors are handed back
only when every file of the checkpoint matched its manifest: a damaged byte
anywhere fails the checkpoint (:class:`CheckpointCorruptError`), and the
caller walks back to the next older one exactly as a restore to disk does.

Only JSON and safetensors are parsed; nothing is unpickled. Files the state
does not reference are checked (size, checksum, pickle safety) and dropped.
A checkpoint the state loader of a local directory must read another way
(a distributed checkpoint, one without ``state.json``) is not streamable
(:func:`streamable`): restore it to disk.

Given the trainer's live state (:class:`LiveTensors`), each tensor's bytes go
straight into the live tensor at the same place of the state where it fits
(a contiguous CPU tensor of the same dtype and shape: the rule
:func:`~spotguard.checkpoint.local.inplace.load_state_into` applies to local
files), which is memory the trainer already touched; the state handed back
holds those very tensors, so ``load_state_dict`` copies nothing. The live
tensors then receive bytes before the checksums are known: a checkpoint that
fails leaves them holding part of it (:attr:`LiveTensors.landed` names them),
and only a later load that fills every one of them again makes them usable.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import google_crc32c

from spotguard.checkpoint.format.manifest import FileEntry, Manifest
from spotguard.checkpoint.format.verify import check_one_file
from spotguard.checkpoint.local.codec import (
    ST_TO_TORCH,
    STATE_FILE,
    StateError,
    TensorSpan,
    decode_state,
    parse_safetensors_header,
    safetensors_header_end,
    tensor_files_of,
)
from spotguard.checkpoint.local.inplace import fits_in_place, live_places
from spotguard.checkpoint.store.chunked import _chunk_of, _ChunkDamaged, check_chunk_landed, stream_file
from spotguard.checkpoint.store.parts import name_parts
from spotguard.checkpoint.store.stored import CheckpointCorruptError, stored_files
from spotguard.checkpoint.store.verify_stored import stored_manifest
from spotguard.storage.base import (
    NotFoundError,
    ObjectInfo,
    ProgressCallback,
    RangedReads,
    ReadsInto,
    Storage,
    byte_ranges,
    read_as_listed,
    read_in_order,
)
from spotguard.storage.checksum import crc32c_combine, new_hasher

if TYPE_CHECKING:
    import torch

DEFAULT_FILE_WORKERS = 2  # files at once; each already reads several ranges concurrently
CHUNK_WINDOW = 8  # chunks of one file fetched at once (a checkpoint stored incrementally)
#: The first read of a whole file: its header (safetensors headers are ~100 bytes a tensor), while
#: the ranges after it wait. More is read at once when the header turns out longer.
HEADER_PROBE = 256 * 1024


class NotStreamable(ValueError):
    """The checkpoint is not one process's state (:func:`streamable`): restore it to disk."""


class _Damaged(Exception):
    """A file's bytes do not match its manifest (the message names file and reason)."""


def streamable(manifest: Manifest) -> bool:
    """Whether :func:`load_stored_state` can load ``manifest``'s checkpoint: one
    process's state (``state.json`` and its safetensors files)."""
    return manifest.sharding is None and manifest.locally_complete and any(f.path == STATE_FILE for f in manifest.files)


@dataclass
class _Placer:
    """Puts a file's bytes where they belong: into the tensors the header
    declares (``spans``, in file order, each with its flat byte view)."""

    spans: list[TensorSpan]
    views: list[Any]  # numpy uint8 views of the tensors' memory, one per span

    def __post_init__(self) -> None:
        self._starts = [s.start for s in self.spans]

    def put(self, offset: int, data: bytes) -> None:
        import numpy as np

        end = offset + len(data)
        src = np.frombuffer(data, dtype=np.uint8)
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        while i < len(self.spans) and self.spans[i].start < end:
            span = self.spans[i]
            a, b = max(span.start, offset), min(span.end, end)
            if a < b:
                self.views[i][a - span.start : b - span.start] = src[a - offset : b - offset]
            i += 1

    def sinks(self, offset: int, end: int) -> list[Any]:
        """Where bytes ``[offset, end)`` of the file go, in order: slices of
        the tensors' memory, and new buffers for bytes no tensor holds."""
        import numpy as np

        out: list[Any] = []
        at = offset
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        while at < end:
            while i < len(self.spans) and self.spans[i].end <= at:
                i += 1
            span = self.spans[i] if i < len(self.spans) else None
            if span is None or span.start > at:
                stop = end if span is None else min(end, span.start)
                out.append(np.empty(stop - at, dtype=np.uint8))
                at = stop
                continue
            stop = min(span.end, end)
            out.append(self.views[i][at - span.start : stop - span.start])
            at = stop
        return out


class LiveTensors:
    """The trainer's live state (``{"model": model.state_dict(), "optimizer": ...}``), whose
    tensors a streamed restore fills in place where they fit (see the module's docstring).

    After a load: :attr:`landed`, the live tensors that received bytes (also of a load that
    failed), and :attr:`in_place_bytes`, how many bytes went there."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        self.landed: list[Any] = []
        self.in_place_bytes = 0
        self._places: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def begin(self, doc: Any) -> None:
        """Where ``state.json`` (``doc``) puts each tensor in the live state."""
        self._places = live_places(doc.get("state") if isinstance(doc, dict) else None, self.tree)
        self.landed = []
        self.in_place_bytes = 0

    def targets(self, file: str) -> dict[str, Any]:
        """The live tensors of ``file``'s keys."""
        return {key: t for (f, key), t in self._places.items() if f == file}

    def took(self, target: Any, nbytes: int) -> None:
        with self._lock:
            self.landed.append(target)
            self.in_place_bytes += nbytes


def _allocate(
    spans: list[TensorSpan], targets: Mapping[str, Any] | None = None, live: LiveTensors | None = None
) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """A tensor for each of ``spans`` and a flat byte view of each (what the bytes are copied
    into): the live one of ``targets`` where it fits, else a new, empty one."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    views = []
    for span in spans:
        name = ST_TO_TORCH.get(span.dtype)
        dtype = getattr(torch, name) if name else None
        if dtype is None:
            raise StateError(f"tensor {span.key!r}: dtype {span.dtype} is not available in this torch")
        target = targets.get(span.key) if targets else None
        if target is not None and fits_in_place(torch, target, dtype, span.shape):
            tensors[span.key] = target  # the live tensor itself: load_state_dict finds it
            t = target.detach()
            if live is not None:
                live.took(target, span.end - span.start)
        else:
            t = torch.empty(span.shape, dtype=dtype)
            tensors[span.key] = t
        views.append(t.reshape(-1).view(torch.uint8).numpy())
    return tensors, views


class _FileRead:
    """One file read from storage in pieces, checked and placed as they arrive."""

    def __init__(
        self,
        storage: Storage,
        name: str,
        entry: FileEntry,
        algorithm: str,
        progress: ProgressCallback | None,
        seen: ObjectInfo | None = None,
        live: LiveTensors | None = None,
    ) -> None:
        self.storage = storage
        self.live = live
        self.seen = seen
        self.key = f"{name}/{entry.path}"
        self.entry = entry
        self.algorithm = algorithm
        self.progress = progress
        self.ordered = new_hasher(algorithm) if algorithm != "crc32c" else None
        self.crc = 0
        self.total = 0
        self.placer: _Placer | None = None

    # -- where the pieces come from ------------------------------------------------------
    def _pieces(
        self,
    ) -> tuple[list[tuple[int, int]], Callable[[int, int], bytes], int, Callable[[int, list[Any]], int] | None] | None:
        """(ranges, fetch, window, fetch_into or None), or None when the backend reads only in order."""
        entry = self.entry
        if entry.chunks is not None:
            offsets: dict[int, Any] = {}
            at = 0
            for ref in entry.chunks:
                offsets[at] = ref
                at += ref.size
            users = _users_of(entry)

            def fetch_chunk(start: int, end: int) -> bytes:
                ref = offsets[start]
                try:
                    data = self.storage.read_bytes(ref.key)
                except NotFoundError:
                    raise _Damaged(f"{ref.key}: missing ({users})") from None
                problem = check_chunk_landed(ref, len(data), google_crc32c.value(data))
                if problem:
                    raise _Damaged(f"{ref.key}: {problem} ({users})")
                return data

            def chunk_into(start: int, sinks: list[Any]) -> int:
                ref = offsets[start]
                assert isinstance(self.storage, ReadsInto)
                try:
                    size = self.storage.read_into(ref.key, [memoryview(s) for s in sinks])
                except NotFoundError:
                    raise _Damaged(f"{ref.key}: missing ({users})") from None
                crc = _crc_of(sinks) if size == ref.size else 0
                problem = check_chunk_landed(ref, size, crc)
                if problem:
                    raise _Damaged(f"{ref.key}: {problem} ({users})")
                return crc

            ranges = [(start, start + ref.size) for start, ref in offsets.items()]
            into = chunk_into if isinstance(self.storage, ReadsInto) else None
            return ranges, fetch_chunk, CHUNK_WINDOW, into
        if not isinstance(self.storage, RangedReads):
            return None
        try:
            obj = self.storage.open_ranged(self.key, self.seen)
        except NotFoundError:
            raise _Damaged(f"{entry.path}: missing (disappeared while reading)") from None
        if obj.size != entry.size:
            raise _Damaged(f"{entry.path}: size {obj.size} bytes, manifest says {entry.size}")
        ranges = byte_ranges(obj.size, obj.chunk)
        if ranges and ranges[0][1] > HEADER_PROBE:  # the header alone first: the other ranges start sooner
            ranges[:1] = [(0, HEADER_PROBE), (HEADER_PROBE, ranges[0][1])]
        fetch_into = obj.fetch_into
        if fetch_into is None:
            return ranges, obj.fetch, obj.concurrency, None

        def range_into(start: int, sinks: list[Any]) -> int:
            fetch_into(start, [memoryview(s) for s in sinks])
            return _crc_of(sinks)

        return ranges, obj.fetch, obj.concurrency, range_into

    def _in_order(self) -> Iterator[tuple[int, bytes]]:
        """The file's bytes through :meth:`Storage.iter_chunks`, with their offsets."""
        at = 0
        try:
            for chunk in self.storage.iter_chunks(self.key):
                yield at, chunk
                at += len(chunk)
        except NotFoundError:
            raise _Damaged(f"{self.entry.path}: missing (disappeared while reading)") from None

    # -- what happens to each piece -------------------------------------------------------
    def _take(self, offset: int, data: bytes) -> tuple[int, int, bytes | None]:
        """Checksum and place one piece (on the thread that fetched it)."""
        crc = google_crc32c.value(data) if self.ordered is None else 0
        if self.placer is not None:
            self.placer.put(offset, data)
        if self.progress is not None:
            with _progress_lock:
                self.progress(len(data))
        return crc, len(data), data if self.ordered is not None else None

    def _take_into(self, start: int, end: int, into: Callable[[int, list[Any]], int]) -> tuple[int, int, None]:
        """Read one piece straight into the tensors it belongs to; its CRC32C, computed there."""
        assert self.placer is not None
        crc = into(start, self.placer.sinks(start, end))
        if self.progress is not None:
            with _progress_lock:
                self.progress(end - start)
        return crc, end - start, None

    def _account(self, crc: int, n: int, data: bytes | None) -> None:
        """Fold one piece, in file order, into the file's checksum."""
        self.total += n
        if self.ordered is not None:
            assert data is not None
            self.ordered.update(data)
        else:
            self.crc = crc32c_combine(self.crc, crc, n)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The file's tensors, read from storage; raises :class:`_Damaged` when
        its bytes do not match the manifest, :class:`StateError` when they do
        but are not a safetensors file."""
        entry = self.entry
        size = entry.size
        pieces = self._pieces()
        head: list[tuple[int, bytes]] = []
        rest: Iterator[tuple[int, int, bytes | None]]
        if pieces is not None:
            ranges, fetch, window, into = pieces
            # The header comes first: it says where every tensor goes.
            i, got = 0, 0
            while i < len(ranges) and (got < 8 or got < _header_end_or(head, size)):
                start, end = ranges[i]
                head.append((start, fetch(start, end)))
                got, i = end, i + 1

            def fetch_take(start: int, end: int) -> tuple[int, int, bytes | None]:
                if into is not None and self.placer is not None and self.ordered is None:
                    return self._take_into(start, end, into)
                return self._take(start, fetch(start, end))

            rest = read_in_order(fetch_take, ranges[i:], max(1, window), thread_name_prefix="restore-read")
        else:
            stream = self._in_order()
            got = 0
            for offset, chunk in stream:
                head.append((offset, chunk))
                got = offset + len(chunk)
                if got >= 8 and got >= _header_end_or(head, size):
                    break
            rest = (self._take(offset, chunk) for offset, chunk in stream)
        header_problem: StateError | None = None
        tensors: dict[str, torch.Tensor] = {}
        try:
            raw = head[0][1] if len(head) == 1 else b"".join(d for _, d in head)
            end = safetensors_header_end(raw[:8], size)
            spans = parse_safetensors_header(raw[8:end], size)
            targets = self.live.targets(entry.path) if self.live is not None else None
            tensors, views = _allocate(spans, targets, self.live)
            self.placer = _Placer(spans, views)
        except StateError as exc:
            header_problem = exc  # reported only if the bytes are what the manifest says
        for offset, data in head:
            self._account(*self._take(offset, data))
        for piece in rest:
            self._account(*piece)
        self._check()
        if header_problem is not None:
            raise StateError(f"{entry.path}: not a valid safetensors file ({header_problem})")
        return tensors

    def _check(self) -> None:
        """Raise :class:`_Damaged` unless the bytes read are the manifest's."""
        entry = self.entry
        if self.total != entry.size:
            raise _Damaged(
                f"{entry.path}: size {self.total} bytes while reading, manifest says {entry.size} (truncated)"
            )
        value = self.ordered.hexdigest() if self.ordered is not None else f"{self.crc:08x}"
        if value != entry.checksum:
            raise _Damaged(
                f"{entry.path}: {self.algorithm} checksum mismatch (data has {value}, manifest says {entry.checksum})"
            )


_progress_lock = threading.Lock()


def _crc_of(sinks: list[Any]) -> int:
    """The CRC32C of the bytes in ``sinks`` (numpy views), in order."""
    crc = 0
    for sink in sinks:
        crc = google_crc32c.extend(crc, sink)
    return int(crc)


def _header_end_or(head: list[tuple[int, bytes]], size: int) -> int:
    """Where the header ends according to the bytes read so far (0 when it cannot tell)."""
    first = head[0][1][:8] if head and len(head[0][1]) >= 8 else b"".join(d for _, d in head)[:8]
    try:
        return safetensors_header_end(first, size)
    except StateError:
        return 0


def _no_bytes(path: str) -> Iterator[bytes]:
    """A reader for size checks, which read nothing."""
    return iter(())


def _users_of(entry: FileEntry) -> str:
    return _chunk_of([entry.path])


def _check_whole(
    storage: Storage, name: str, entry: FileEntry, algorithm: str, size: int | None, keep: bool
) -> tuple[str | None, bytes | None]:
    """Check one file the state does not load into tensors (size, checksum,
    pickle safety), streamed; its bytes when ``keep``."""
    kept: list[bytes] = []

    def reader(path: str) -> Iterator[bytes]:
        source = stream_file(storage, entry) if entry.chunks is not None else storage.iter_chunks(f"{name}/{path}")
        for chunk in source:
            if keep:
                kept.append(chunk)
            yield chunk

    try:
        problem, _ = check_one_file(entry, algorithm, size, reader)
    except _ChunkDamaged as exc:
        problem = str(exc)
    return problem, (b"".join(kept) if keep and problem is None else None)


def load_stored_state(
    storage: Storage,
    name: str,
    *,
    progress: ProgressCallback | None = None,
    workers: int = DEFAULT_FILE_WORKERS,
    into: LiveTensors | None = None,
) -> tuple[Manifest, dict[str, Any]]:
    """The state of stored checkpoint ``name``, read into memory and checked
    against its manifest on the way (see the module's docstring); ``into``: the
    trainer's live tensors, filled in place where they fit.

    Raises :class:`CheckpointCorruptError` naming the problems when any file
    is missing, damaged or not what the state needs (nothing is returned
    then), :class:`NotStreamable` when the checkpoint is not :func:`streamable`,
    and :class:`StorageError` for failures of the store itself (a network
    failure must not make a good checkpoint look broken).
    """
    manifest_bytes, manifest = stored_manifest(storage, name)
    if not streamable(manifest):
        raise NotStreamable(f"{name} is not one process's state (restore it to disk instead)")
    algorithm = manifest.checksum_algorithm
    seen: Mapping[str, ObjectInfo] = {}  # the listing's objects: a file is read as it saw them
    if manifest.chunked:
        sizes: Mapping[str, int] = {e.path: e.size for e in manifest.files}
    else:
        listing = stored_files(storage, name)
        missing = [e.path for e in manifest.files if e.path not in listing]
        if missing:
            raise CheckpointCorruptError(name, name_parts(storage, name, manifest, [f"{p}: missing" for p in missing]))
        sizes, seen = {path: info.size for path, info in listing.items()}, listing
    entries = {e.path: e for e in manifest.files}

    def fail(problems: list[str]) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            name, problems if manifest.chunked else name_parts(storage, name, manifest, problems)
        )

    # state.json first, checked before it is parsed: it names the tensor files.
    problem, doc_bytes = _check_whole(storage, name, entries[STATE_FILE], algorithm, sizes.get(STATE_FILE), True)
    if problem is not None or doc_bytes is None:
        raise fail([problem or f"{STATE_FILE}: unreadable"])
    try:
        doc = json.loads(doc_bytes)
    except ValueError as exc:
        raise CheckpointCorruptError(name, [f"{STATE_FILE}: unreadable ({exc})"]) from None
    wanted = {f for f in tensor_files_of(doc) if f in entries and f.endswith(".safetensors")}
    if into is not None:
        into.begin(doc)
    loaded: dict[str, dict[str, torch.Tensor]] = {}

    def one(entry: FileEntry) -> str | None:
        size_problem, _ = check_one_file(entry, algorithm, sizes.get(entry.path), _no_bytes, checksums=False)
        if size_problem is not None:
            return size_problem
        if entry.path not in wanted:
            return _check_whole(storage, name, entry, algorithm, sizes.get(entry.path), False)[0]
        try:
            loaded[entry.path] = read_as_listed(
                lambda listed: _FileRead(storage, name, entry, algorithm, progress, listed, into).tensors(),
                seen.get(entry.path),
            )
        except _Damaged as exc:
            return str(exc)
        except StateError as exc:
            return str(exc)
        except NotFoundError:  # deleted since the listing (read as the listing saw it, without a HEAD first)
            return f"{entry.path}: missing (disappeared while reading)"
        return None

    others = [e for e in manifest.files if e.path != STATE_FILE]
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(others) or 1)), thread_name_prefix="restore") as pool:
        results = list(pool.map(one, others))
    problems = [p for p in results if p]
    if problems:
        loaded.clear()  # never hand out bytes of a checkpoint that did not verify
        raise fail(problems)

    def load_file(file: str, as_torch: bool) -> Mapping[str, Any]:
        if file not in loaded:
            raise StateError(f"state.json references {file!r}, which is not a safetensors file of this checkpoint")
        tensors = loaded[file]
        return tensors if as_torch else {k: t.numpy() for k, t in tensors.items()}

    try:
        state = decode_state(doc, load_file)
    except StateError as exc:
        raise CheckpointCorruptError(name, [str(exc)]) from None
    return manifest, state


__all__ = ["LiveTensors", "NotStreamable", "load_stored_state", "streamable"]
