"""Checkpoints stored incrementally: upload, verify and fetch content-addressed chunks.

Layout below a job's storage root::

    chunks/<aa>/<sha256>          one chunk: the bytes whose SHA-256 is its name
    ckpt-<step>/manifest.json     format version 3: each file as its chunks, in order
    gc/tombstones/<name>.<ms>.json the manifest of a checkpoint being deleted (see gc.py)

A checkpoint's manifest still lists every file with its size and checksum,
and adds the file's chunks (name, size, CRC32C). Chunks are shared: a chunk
already in storage is not uploaded again, so a checkpoint whose frozen
tensors did not change costs only the bytes that did.

What the uploader knows to be in storage (:class:`KnownChunks`) comes from
the previous verified checkpoint's manifest, never from listing the store.
Knowledge read from storage (a restart, or a refresh after half the orphan
grace) is checked before the manifest names a reused chunk: one ``HEAD``
each, and a chunk found missing is uploaded again from the local file.
A routine upload does the same with any knowledge, and its verification
checks every chunk again, so a chunk damaged or removed in the store since
(an overwrite changes the checksum the store computed) is found within one
checkpoint interval and sent again from local bytes. The emergency upload
(against a preemption's deadline) trusts knowledge from a checkpoint this
uploader verified itself: its chunks are reused without a request each, and
the verification of the new checkpoint takes them as checked (``trusted``),
so a fine-tune's emergency checkpoint costs requests in proportion to what
changed. That is as safe as the requests it saves, but for damage done in
the store since the last routine verification: each of those chunks had
its size and the checksum the store computed on receipt checked by that
verification; no collector deletes it meanwhile (the source's manifest marks
it until the upload's intent does, see
:func:`~spotguard.checkpoint.store.gc.sweep_chunks`); and a ``HEAD`` never read
the bytes either (bit rot is what ``deep`` verification and restore's
walk-back are for). The trust lasts :data:`TRUST_SECONDS` from the
verification that last checked the chunks (a chain of checkpoints that each
trust the one before does not extend it); then every chunk is checked again.

Verification checks every chunk a checkpoint references but the trusted
ones: by the CRC32C the store computed on receipt (one ``HEAD`` each), or
by reading it back and checking its size, CRC32C and SHA-256 (``deep``,
stores without checksums, and chunks of files that may be pickles, whose
bytes are inspected). A damaged or missing chunk fails every checkpoint
that uses it, naming the chunk and the files it belongs to; resume walks
back to one that does not use it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path

import google_crc32c

from spotguard.checkpoint.format.chunks import hash_chunk, plan_file, read_range
from spotguard.checkpoint.format.manifest import (
    CHUNKS_DIR,
    POINTER_NAME,
    ChunkRef,
    FileEntry,
    Manifest,
    ManifestError,
    checkpoint_name,
    parse_manifest,
    parse_pointer,
    to_chunked,
)
from spotguard.checkpoint.format.verify import (
    METHOD_MIXED,
    METHOD_READ_BACK,
    METHOD_SIZES,
    METHOD_STORE,
    METHOD_TRUSTED,
    check_one_file,
    needs_content,
)
from spotguard.checkpoint.local.unchanged import Unchanged
from spotguard.storage.base import NotFoundError, ProgressCallback, Storage, StoreChecksums
from spotguard.storage.checksum import crc32c_of_parts

log = logging.getLogger(__name__)

TOMBSTONES_DIR = "gc/tombstones"
#: Chunks uploaded, hashed or fetched at once.
DEFAULT_WORKERS = 8


#: How long chunks a verification checked stay trusted (half the collector's default orphan
#: grace): then a full verification checks every chunk a checkpoint names again.
TRUST_SECONDS = 1800.0


@dataclass
class KnownChunks:
    """Chunks known to be in storage: those of ``source``, a checkpoint this
    uploader verified (or read from storage) at ``since`` (``time.monotonic``)."""

    chunks: dict[str, int] = field(default_factory=dict)
    source: str | None = None
    since: float = 0.0
    #: ``source``'s manifest (which chunk is where in its files), when known: an upload compares
    #: its files with that checkpoint's local copy instead of hashing what did not change.
    manifest: Manifest | None = field(default=None, repr=False, compare=False)
    #: When (``time.monotonic``) this uploader last had every one of these chunks checked in
    #: storage (size and the checksum the store computed) by its own verifications; None for
    #: knowledge read from storage or grown by other means. Within :data:`TRUST_SECONDS` of it
    #: an upload reuses them without a ``HEAD`` each, and the verification of the checkpoint
    #: that reuses them takes them as checked (:attr:`ChunkedUpload.trusted`).
    checked_at: float | None = None

    @classmethod
    def of(cls, manifest: Manifest) -> KnownChunks:
        """The chunks of ``manifest``'s checkpoint, as read (not trusted)."""
        chunks = {c.hash: c.size for c in manifest.chunk_refs().values()}
        return cls(chunks, manifest.name, time.monotonic(), manifest)

    @classmethod
    def verified(cls, manifest: Manifest, trusted: int, previous: KnownChunks | None) -> KnownChunks:
        """The chunks of a checkpoint this uploader just verified, ``trusted`` of them
        taken as checked from ``previous`` (the knowledge its upload used): checked now
        when none were, else as long ago as ``previous``'s were."""
        known = cls.of(manifest)
        checked = previous.checked_at if trusted and previous is not None else known.since
        return replace(known, checked_at=checked)

    def untrusted(self) -> KnownChunks:
        """The same knowledge, checked again before it is reused (a routine upload's)."""
        return replace(self, checked_at=None)

    def trusted(self, now: float | None = None) -> bool:
        """Whether these chunks may be reused and taken as checked without asking the store."""
        now = time.monotonic() if now is None else now
        return self.checked_at is not None and now - self.checked_at < TRUST_SECONDS

    @classmethod
    def from_storage(cls, storage: Storage) -> KnownChunks:
        """The chunks of the checkpoint the ``latest`` pointer names (two small
        reads, no listing); empty when there is none or it is not stored
        incrementally. Reused chunks are checked before a manifest names them,
        so an unverified source costs at most an upload, never a checkpoint."""
        try:
            step = parse_pointer(storage.read_bytes(POINTER_NAME))
            if step is None:
                return cls()
            name = checkpoint_name(step)
            manifest = parse_manifest(storage.read_bytes(f"{name}/manifest.json"), expected_name=name)
        except (NotFoundError, ManifestError):
            return cls()
        return cls.of(manifest) if manifest.chunked else cls()

    def __len__(self) -> int:
        return len(self.chunks)

    def without(self, digests: set[str]) -> KnownChunks:
        """The same knowledge less ``digests`` (chunks a verification found damaged or missing)."""
        if not digests & self.chunks.keys():
            return self
        kept = {d: n for d, n in self.chunks.items() if d not in digests}
        return replace(self, chunks=kept)

    def with_chunks(self, more: dict[str, int]) -> KnownChunks:
        """The same knowledge plus ``more`` (chunks known stored by other means, so not verified)."""
        return KnownChunks({**more, **self.chunks}, self.source, self.since, self.manifest)


_CHUNK_KEY_RE = re.compile(rf"\b{CHUNKS_DIR}/[0-9a-f]{{2}}/([0-9a-f]{{64}})\b")


def chunks_named(problems: Iterable[str]) -> set[str]:
    """Pure: the digests of the chunks a verification's problems name (by their keys)."""
    return {m.group(1) for problem in problems for m in _CHUNK_KEY_RE.finditer(problem)}


@dataclass(frozen=True, kw_only=True)
class ChunkCounts:
    """What an upload stored anew and found stored already: bytes (all new for whole files)
    and, stored as chunks, how many chunks."""

    #: Data stored by this upload, and data already in storage that the checkpoint shares.
    new_chunks: int = 0
    new_bytes: int = 0
    reused_chunks: int = 0
    reused_bytes: int = 0
    #: Chunks (of the new and the reused) recognized by comparison with the previous
    #: checkpoint's local copy, without hashing (see :class:`~spotguard.checkpoint.local.unchanged.Unchanged`).
    unchanged_chunks: int = 0

    def counts(self) -> dict[str, int]:
        """The counters by name (keywords for another :class:`ChunkCounts`)."""
        return {f.name: getattr(self, f.name) for f in fields(ChunkCounts)}


@dataclass(frozen=True)
class ChunkedUpload(ChunkCounts):
    """What :func:`upload_chunks` stored: the version 3 manifest and how many
    chunks and bytes were new or reused."""

    manifest: Manifest
    manifest_bytes: bytes
    #: The reused chunks taken from knowledge this uploader verified (digest -> size): not
    #: checked again, here or by the verification that follows (see :func:`verify_chunks`).
    trusted: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Prestored:
    """Chunks of a checkpoint hashed, and stored where new, while it was being written
    (:mod:`spotguard.sidecar.follow`), for its upload once committed."""

    #: ``(path, offset, length)`` -> the chunk read there from the file being written.
    located: Mapping[tuple[str, int, int], ChunkRef]
    #: The chunks stored (digest -> size), each with its CRC32C checked by the store on receipt.
    stored: Mapping[str, int]
    #: When (``time.monotonic``) they were stored.
    at: float

    def fresh(self, now: float, grace: float) -> bool:
        """Whether the stored chunks are young enough to name without a request: well within the
        ``grace`` of a collector that keeps unreferenced chunks that young (half of it, as for a
        stopped upload's chunks)."""
        return now - self.at < grace / 2


class _Claims:
    """Chunks already handled in this upload (a chunk repeated in a file, or in two files, is stored once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[str] = set()

    def first(self, digest: str) -> bool:
        with self._lock:
            if digest in self._seen:
                return False
            self._seen.add(digest)
            return True


def upload_chunks(
    local_dir: Path,
    storage: Storage,
    manifest: Manifest,
    known: KnownChunks | None = None,
    *,
    progress: ProgressCallback | None = None,
    workers: int = DEFAULT_WORKERS,
    prestored: Prestored | None = None,
) -> ChunkedUpload:
    """Store the files of a committed local checkpoint as chunks and return the
    version 3 manifest to write after them (the caller writes it).

    Each file is split (:func:`~spotguard.checkpoint.format.chunks.plan_file`),
    every chunk hashed (or recognized unchanged); a chunk in ``known`` is not
    uploaded (checked to exist with its size first unless ``known.trusted()``),
    any other is uploaded with its CRC32C. The chunks'
    CRC32Cs must combine to the file checksum the local manifest recorded (a
    file changed on disk since its checkpoint was committed is refused:
    :class:`ManifestError`). Storage errors propagate.

    ``prestored`` (chunks found while the checkpoint was written) stands for
    reading and hashing a chunk at the same place of the same file, and a
    chunk it stored is not stored again. Used only where the manifest's
    checksums are CRC32C: a file whose chunks so found do not combine to the
    checksum the writer recorded (changed after it was read) is read and
    hashed again.
    """
    known = known or KnownChunks()
    found = prestored if manifest.checksum_algorithm == "crc32c" else None
    located = found.located if found is not None else {}
    stored_before = found.stored if found is not None else {}
    claims = _Claims()
    lock = threading.Lock()
    totals = ChunkCounts().counts()
    trusted: dict[str, int] = {}
    trust = known.trusted()
    unchanged = Unchanged(Path(local_dir), known.manifest, known.chunks)

    def count(kind: str, nbytes: int) -> None:
        with lock:
            totals[f"{kind}_chunks"] += 1
            totals[f"{kind}_bytes"] += nbytes

    def read(rel: str, offset: int, length: int) -> bytes:
        fd = os.open(Path(local_dir) / rel, os.O_RDONLY)
        try:
            return read_range(fd, offset, length)
        finally:
            os.close(fd)

    def one(rel: str, offset: int, length: int, found: bool = True) -> ChunkRef:
        data: bytes | None = None
        ref = located.get((rel, offset, length)) if found else None
        if ref is None:
            ref = unchanged.linked(Path(local_dir), rel, offset, length)
            if ref is None:
                data = read(rel, offset, length)
                ref = unchanged.match(rel, offset, data)
            if ref is None:
                assert data is not None
                ref = hash_chunk(data)
            else:
                with lock:
                    totals["unchanged_chunks"] += 1
        if claims.first(ref.hash):
            if known.chunks.get(ref.hash) == ref.size and trust:
                with lock:
                    trusted[ref.hash] = ref.size
                count("reused", ref.size)
                return ref
            if stored_before.get(ref.hash) == ref.size:
                count("new", ref.size)  # stored by this checkpoint's upload, while it was written
                return ref
            if known.chunks.get(ref.hash) == ref.size:
                info = storage.stat(ref.key)
                if info is not None and info.size == ref.size:
                    count("reused", ref.size)
                    return ref
                log.warning(
                    "%s: known chunk %s is missing from storage; uploading it again",
                    storage.uri_for(ref.key),
                    ref.hash[:12],
                )
            if data is None:  # a linked file's chunk, not read so far: its bytes must be the chunk's
                data = read(rel, offset, length)
                if hash_chunk(data) != ref:
                    raise ManifestError(f"{rel}: bytes at {offset} are not chunk {ref.hash[:12]} any more")
            storage.write_checked(ref.key, data, ref.checksum)
            count("new", ref.size)
            if progress is not None:
                with lock:
                    progress(ref.size)
        return ref

    def whole(entry: FileEntry) -> list[ChunkRef] | None:
        # A linked file whose chunks are all trusted: its chunk list in one step, none asked of the
        # store, none read, not planned (a task per chunk, then reading every DCP item's bounds to
        # plan the chunks, grew a sharded save's upload with its frozen items).
        refs = unchanged.linked_file(Path(local_dir), entry) if trust else None
        if refs is None or any(known.chunks.get(ref.hash) != ref.size for ref in refs):
            return None
        for ref in refs:
            if claims.first(ref.hash):
                trusted[ref.hash] = ref.size
                count("reused", ref.size)
        with lock:
            totals["unchanged_chunks"] += len(refs)
        return list(refs)

    tables: dict[str, list[ChunkRef]] = {}
    for entry in manifest.files:
        taken = whole(entry)
        if taken is not None:
            tables[entry.path] = taken
    plans = [(e, plan_file(Path(local_dir) / e.path)) for e in manifest.files if e.path not in tables]
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="chunk-upload") as pool:
        futures = {
            entry.path: [pool.submit(one, entry.path, offset, length) for offset, length in plan]
            for entry, plan in plans
        }
        tables.update({path: [f.result() for f in fs] for path, fs in futures.items()})
        for entry, plan in plans:
            if located and not _combines(tables[entry.path], entry.checksum):
                log.warning("%s changed after it was read while written; reading it again", entry.path)
                redo = [pool.submit(one, entry.path, offset, length, False) for offset, length in plan]
                tables[entry.path] = [f.result() for f in redo]
    chunked = to_chunked(manifest, tables)
    return ChunkedUpload(chunked, chunked.to_json(), **totals, trusted=trusted)


def _combines(refs: list[ChunkRef], checksum: str) -> bool:
    """Pure: whether the CRC32Cs of a file's chunks combine to its CRC32C ``checksum``."""
    if not refs:
        return True
    return f"{crc32c_of_parts((int(r.checksum, 16), r.size) for r in refs):08x}" == checksum


def _users(manifest: Manifest) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {}
    for entry in manifest.files:
        for ref in entry.chunks or ():
            paths = users.setdefault(ref.hash, [])
            if entry.path not in paths:
                paths.append(entry.path)
    return users


def _chunk_of(paths: list[str]) -> str:
    if len(paths) == 1:
        return f"chunk of {paths[0]}"
    return f"chunk of {paths[0]} and {len(paths) - 1} other file{'s' if len(paths) > 2 else ''}"


def check_chunk_landed(ref: ChunkRef, size: int, crc: int) -> str | None:
    """Pure: why bytes of ``size`` with CRC32C ``crc`` are not the bytes recorded
    for chunk ``ref`` (size, CRC32C), or None.

    What a restore asks of each chunk it reads: the same test the
    verification of a stored chunk makes (the CRC32C the store computed on
    receipt against the manifest's, :func:`verify_chunks`), on the bytes
    themselves. The chunk's SHA-256 names it for the uploader (two different
    chunks never share a key); the manifest's CRC32C was computed from the
    same bytes the uploader read, so bytes under that key that are not those
    fail it as surely as a damaged whole file fails its own (see
    docs/checkpoint-format.md, "Restore")."""
    if size != ref.size:
        kind = "truncated" if size < ref.size else "longer than recorded"
        return f"size {size} bytes, manifest says {ref.size} ({kind})"
    if f"{crc:08x}" != ref.checksum:
        return f"crc32c checksum mismatch (data has {crc:08x}, manifest says {ref.checksum})"
    return None


def check_chunk_bytes(ref: ChunkRef, data: bytes) -> str | None:
    """Why ``data`` is not chunk ``ref`` (size, CRC32C, SHA-256), or None."""
    if len(data) != ref.size:
        kind = "truncated" if len(data) < ref.size else "longer than recorded"
        return f"size {len(data)} bytes, manifest says {ref.size} ({kind})"
    crc = f"{google_crc32c.value(data):08x}"
    if crc != ref.checksum:
        return f"crc32c checksum mismatch (data has {crc}, manifest says {ref.checksum})"
    digest = hashlib.sha256(data).hexdigest()
    if digest != ref.hash:
        return f"sha256 mismatch (data has {digest[:12]}...)"
    return None


@dataclass
class ChunkChecks:
    """The outcome of checking a checkpoint's chunks (and the files whose
    bytes must be inspected) in storage."""

    problems: list[str]
    read_bytes: int = 0
    store_checked: int = 0
    read_back: int = 0
    #: Chunks taken as checked (``trusted``), not asked for.
    trusted: int = 0

    @property
    def method(self) -> str:
        if self.store_checked and self.read_back:
            return METHOD_MIXED
        if self.read_back:
            return METHOD_READ_BACK
        if self.store_checked:
            return METHOD_STORE
        return METHOD_TRUSTED if self.trusted else ""


def verify_chunks(
    storage: Storage,
    manifest: Manifest,
    *,
    checksums: bool = True,
    deep: bool = False,
    workers: int = DEFAULT_WORKERS,
    trusted: Mapping[str, int] | None = None,
) -> ChunkChecks:
    """Check that every chunk ``manifest`` references exists in storage with
    its recorded size and checksum, and that no file that may be a pickle
    would run code. Never raises for a broken checkpoint; storage failures
    other than a missing object propagate.

    ``trusted`` (digest -> size: the chunks an upload reused from a checkpoint
    its uploader verified, :attr:`ChunkedUpload.trusted`) are taken as checked
    unless ``deep``; the files whose bytes are inspected are read whole still."""
    refs = manifest.chunk_refs()
    trust = {} if deep or trusted is None else trusted
    users = _users(manifest)
    by_store = checksums and not deep and isinstance(storage, StoreChecksums)

    def check(ref: ChunkRef) -> tuple[str | None, int, str]:
        where = f"{ref.key}: {{}} ({_chunk_of(users[ref.hash])})"
        if not checksums:
            info = storage.stat(ref.key)
            if info is None:
                return where.format("missing"), 0, METHOD_SIZES
            if info.size != ref.size:
                return where.format(f"size {info.size} bytes, manifest says {ref.size}"), 0, METHOD_SIZES
            return None, 0, METHOD_SIZES
        if by_store:
            try:
                stored = storage.stored_checksum(ref.key)  # type: ignore[attr-defined]
            except NotFoundError:
                return where.format("missing"), 0, METHOD_STORE
            if stored is not None and stored.algorithm == "crc32c":
                if stored.size != ref.size:
                    return where.format(f"size {stored.size} bytes, manifest says {ref.size}"), 0, METHOD_STORE
                if stored.value != ref.checksum:
                    return (
                        where.format(
                            f"crc32c checksum mismatch (the store computed {stored.value} on "
                            f"receipt, manifest says {ref.checksum})"
                        ),
                        0,
                        METHOD_STORE,
                    )
                return None, 0, METHOD_STORE
        try:
            data = storage.read_bytes(ref.key)
        except NotFoundError:
            return where.format("missing"), 0, METHOD_READ_BACK
        problem = check_chunk_bytes(ref, data)
        return (where.format(problem) if problem else None), len(data), METHOD_READ_BACK

    ordered = [ref for ref in refs.values() if trust.get(ref.hash) != ref.size]
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(ordered) or 1))) as pool:
        results = list(pool.map(check, ordered))
    # Chunks whose bytes this verification read back and found to be their SHA-256 names.
    read_ok = {ref.hash for ref, (p, _, m) in zip(ordered, results, strict=True) if p is None and m == METHOD_READ_BACK}
    # A distributed checkpoint's part manifests are stored whole (small): read back.
    whole = [check_whole_file(storage, manifest, e, checksums=checksums) for e in manifest.files if e.chunks is None]
    results += [(p, n, METHOD_READ_BACK) for p, n in whole]
    problems = [p for p, _, _ in results if p]
    checks = ChunkChecks(
        problems,
        read_bytes=sum(n for _, n, _ in results),
        store_checked=sum(1 for _, _, m in results if m == METHOD_STORE),
        read_back=sum(1 for _, _, m in results if m == METHOD_READ_BACK),
        trusted=len(refs) - len(ordered),
    )
    if problems or not checksums:
        return checks
    # Whole-file checks the chunks cannot stand for: pickles are inspected
    # opcode by opcode, and a SHA-256 file checksum is not made of the chunks'.
    for entry in manifest.files:
        if entry.chunks is not None and (needs_content(entry.path) or manifest.checksum_algorithm != "crc32c"):
            seen = _inspected_key(entry) if manifest.checksum_algorithm == "crc32c" and not deep else None
            if seen is not None and not all(c.hash in read_ok for c in entry.chunks):
                seen = None  # a chunk trusted or vouched for by a store's CRC32C: its bytes are inspected
            if seen is not None and _INSPECTED.has(seen):
                continue
            try:
                problem, nbytes = check_one_file(
                    entry, manifest.checksum_algorithm, entry.size, _reader(partial(stream_file, storage, entry))
                )
            except (_ChunkDamaged, NotFoundError) as exc:
                problem, nbytes = str(exc), 0
            checks.read_bytes += nbytes
            if problem:
                checks.problems.append(problem)
            elif seen is not None:
                _INSPECTED.add(seen)
    return checks


class _Inspected:
    """Files whose stored bytes this process inspected (a pickle's opcodes) and found safe, by
    their path and chunks (SHA-256 names, in order): a verification that read back every chunk
    of such a file and found each to be its SHA-256 name has the very bytes inspected before,
    and does not inspect them again (a chunk only trusted, or vouched for by the CRC32C a store
    computed, is no proof against crafted bytes: such a file is inspected as before).
    A distributed part is verified before its part manifest is stored, then the whole
    checkpoint: DCP's ``.metadata`` (a pickle growing with the items saved) was inspected twice."""

    def __init__(self, size: int = 64) -> None:
        self._lock = threading.Lock()
        self._keys: dict[tuple[str, int, str, tuple[str, ...]], None] = {}
        self._size = size

    def has(self, key: tuple[str, int, str, tuple[str, ...]]) -> bool:
        with self._lock:
            return key in self._keys

    def add(self, key: tuple[str, int, str, tuple[str, ...]]) -> None:
        with self._lock:
            self._keys[key] = None
            while len(self._keys) > self._size:
                del self._keys[next(iter(self._keys))]  # the oldest


_INSPECTED = _Inspected()


def _inspected_key(entry: FileEntry) -> tuple[str, int, str, tuple[str, ...]]:
    return (entry.path, entry.size, entry.checksum, tuple(c.hash for c in entry.chunks or ()))


def check_whole_file(
    storage: Storage, manifest: Manifest, entry: FileEntry, *, checksums: bool = True
) -> tuple[str | None, int]:
    """The problem (or None) with a file of a chunked manifest stored whole below the checkpoint's
    prefix (a part manifest of a distributed checkpoint), and the bytes read to check it."""
    data, problem = _read_whole(storage, manifest, entry, checksums=checksums)
    return problem, len(data or b"")


def _read_whole(
    storage: Storage, manifest: Manifest, entry: FileEntry, *, checksums: bool = True
) -> tuple[bytes | None, str | None]:
    try:
        data = storage.read_bytes(f"{manifest.name}/{entry.path}")
    except NotFoundError:
        return None, f"{entry.path}: missing"
    problem, _ = check_one_file(entry, manifest.checksum_algorithm, len(data), lambda _p: [data], checksums=checksums)
    return data, problem


def stream_file(storage: Storage, entry: FileEntry) -> Iterator[bytes]:
    """A chunked file's bytes, chunk by chunk, each checked against its reference."""
    for ref in entry.chunks or ():
        data = storage.read_bytes(ref.key)
        problem = check_chunk_bytes(ref, data)
        if problem:
            raise _ChunkDamaged(f"{ref.key}: {problem} (chunk of {entry.path})")
        yield data


class _ChunkDamaged(Exception):
    pass


def _reader(stream: Callable[[], Iterable[bytes]]) -> Callable[[str], Iterable[bytes]]:
    """A ``read_chunks(path)`` for :func:`check_one_file` that streams one given file."""
    return lambda _path: stream()


def tombstone_key(name: str, now: float | None = None) -> str:
    """Where the tombstone of checkpoint ``name`` deleted at ``now`` goes."""
    return f"{TOMBSTONES_DIR}/{name}.{int((time.time() if now is None else now) * 1000)}.json"


__all__ = [
    "DEFAULT_WORKERS",
    "TOMBSTONES_DIR",
    "ChunkChecks",
    "ChunkedUpload",
    "KnownChunks",
    "check_chunk_bytes",
    "check_chunk_landed",
    "stream_file",
    "tombstone_key",
    "upload_chunks",
    "verify_chunks",
]
