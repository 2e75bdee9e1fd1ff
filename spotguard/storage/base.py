"""The Storage protocol shared by every backend, its errors and helpers.

Keys are relative to the storage root, use ``/`` as separator and never
contain ``..`` segments. A backend guarantees that an object appears under its
final key only when it is complete (S3 PUT/multipart completion is atomic; the
file backend writes a temporary file and renames it).
"""

from __future__ import annotations

import enum
import io
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final, Protocol, TypeVar, runtime_checkable

from spotguard.storage.uri import parse_bucket_uri

_R = TypeVar("_R")

#: Called with the number of bytes transferred since the previous call.
ProgressCallback = Callable[[int], None]


class StorageError(Exception):
    """A storage operation failed; ``str(error)`` is one line a user can act on."""


class NotFoundError(StorageError):
    """The object (or the storage root) does not exist."""


class PreconditionFailedError(StorageError):
    """A conditional write lost a race (the object changed since it was read)."""


class CredentialsError(StorageError):
    """No usable credentials, or the store refused them."""


class ObjectTooLargeError(StorageError):
    """A whole-object read found more bytes than its reader takes (``max_read_bytes``)."""


def too_large(what: str, size: int | None, limit: int) -> ObjectTooLargeError:
    """Pure: the error of a whole-object read of ``what`` that found ``size`` bytes (None: more than ``limit``)."""
    found = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return ObjectTooLargeError(
        f"{what} holds {found}; reads of it take at most {limit} bytes (a latest pointer or a manifest"
        " is far smaller: is this the store and prefix meant?)"
    )


class CappedBuffer(io.BytesIO):
    """An in-memory sink that refuses (:class:`ObjectTooLargeError`) a write past ``limit`` bytes (None: any).

    For clients that write a download into a file-like object: the bytes stop
    at the limit whatever size the store announced."""

    def __init__(self, what: str, limit: int | None) -> None:
        super().__init__()
        self.what = what
        self.limit = limit

    def write(self, data: Any, /) -> int:
        if self.limit is not None and self.tell() + memoryview(data).nbytes > self.limit:
            raise too_large(self.what, None, self.limit)
        return super().write(data)


class Unchanged(enum.Enum):
    """The type of :data:`UNCHANGED`."""

    UNCHANGED = "unchanged"


#: What :meth:`Storage.read_if_changed` returns when the object still has the
#: entity tag the caller gave (HTTP 304 Not Modified): nothing was transferred.
UNCHANGED: Final = Unchanged.UNCHANGED


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: key relative to the storage root, size in bytes,
    last-modified time (unix seconds), and the version the store named when
    it said so (S3: the entity tag; GCS: the generation; empty where the
    backend does not say)."""

    key: str
    size: int
    modified: float
    version: str = ""


@dataclass(frozen=True)
class StoredChecksum:
    """A checksum the store computed over an object's bytes when it received them.

    ``value`` is the checksum of the whole object, as lowercase hex in the
    manifest's notation (8 digits for CRC32C), so it compares directly with a
    manifest entry; ``source`` says how the store gave it (``full-object``, or
    ``parts`` when it was combined from the store's per-part checksums).
    """

    algorithm: str
    value: str
    size: int
    source: str


@dataclass(frozen=True)
class PendingUpload:
    """An unfinished upload that holds storage (an S3 multipart upload, or a
    temporary file of the file backend)."""

    key: str
    upload_id: str
    started: float


@runtime_checkable
class Storage(Protocol):
    """A flat object store rooted at :attr:`uri`.

    Backends: :class:`spotguard.storage.s3.S3Storage` (``s3://bucket/prefix``),
    :class:`spotguard.storage.gcs.GcsStorage` (``gs://bucket/prefix``) and
    :class:`spotguard.storage.file.FileStorage` (``file:///path``).
    """

    @property
    def uri(self) -> str:
        """The root URI, without a trailing slash."""
        ...

    @property
    def supports_conditional_writes(self) -> bool:
        """Whether :meth:`write_bytes` honours ``if_match``/``if_none_match``."""
        ...

    def uri_for(self, key: str) -> str:
        """The absolute URI of ``key``."""
        ...

    def check(self) -> None:
        """Raise :class:`StorageError` if the root cannot be used (missing bucket
        or directory, no credentials, unreachable endpoint)."""
        ...

    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (recursive)."""
        ...

    def list_dirs(self, prefix: str = "") -> list[str]:
        """Names of the "directories" directly below ``prefix`` (which is empty
        or ends with ``/``), without trailing slash."""
        ...

    def stat(self, key: str) -> ObjectInfo | None:
        """Size and time of ``key``, or None when it does not exist."""
        ...

    def read_bytes(self, key: str) -> bytes:
        """The whole object; raises :class:`NotFoundError`. A backend opened with
        ``max_read_bytes`` refuses a larger object here and in the two reads below
        (:class:`ObjectTooLargeError`), having read no more than that."""
        ...

    def read_with_etag(self, key: str) -> tuple[bytes, str] | None:
        """The object and its entity tag, or None when it does not exist."""
        ...

    def read_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | Unchanged | None:
        """A conditional read (``If-None-Match``): :data:`UNCHANGED` when the
        object's entity tag is still ``etag`` (one request, no body), else the
        object and its entity tag as :meth:`read_with_etag` gives them, or None
        when it does not exist. ``etag=None`` reads unconditionally."""
        ...

    def iter_chunks(self, key: str, chunk_size: int = 8 << 20) -> Iterator[bytes]:
        """The object's bytes, in order, in chunks (streamed, possibly fetched
        concurrently)."""
        ...

    def write_bytes(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        """Store ``data`` atomically and return its entity tag.

        ``if_match`` writes only if the current entity tag equals it;
        ``if_none_match`` only if the object does not exist. A lost race raises
        :class:`PreconditionFailedError`.
        """
        ...

    def upload_files(self, items: Iterable[tuple[Path, str]], progress: ProgressCallback | None = None) -> None:
        """Upload local files to keys, concurrently; returns when all are stored."""
        ...

    def write_checked(self, key: str, data: bytes, crc32c: str | None = None) -> None:
        """Store ``data`` as one object, with the checksum the store checks on
        receipt and keeps where it does (S3 additional checksums). ``crc32c``:
        the CRC32C of ``data`` (hex) where the caller has it, not computed again
        (a wrong one is refused by the store that checks it)."""
        ...

    def download_files(self, items: Iterable[tuple[str, Path]], progress: ProgressCallback | None = None) -> None:
        """Download keys to local paths, concurrently. A path appears only once
        its file is complete."""
        ...

    def delete(self, keys: Iterable[str]) -> None:
        """Delete objects; missing ones are ignored."""
        ...

    def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        """Unfinished uploads below ``prefix``."""
        ...

    def abort_upload(self, upload: PendingUpload) -> None:
        """Abort an unfinished upload and free its storage."""
        ...


@dataclass(frozen=True)
class RangedObject:
    """One version of a stored object, read by byte ranges.

    ``fetch(start, end)`` returns bytes ``[start, end)`` of the version that
    was current when the object was opened (a replaced object fails the read
    rather than mixing versions); ranges may be fetched concurrently, up to
    ``concurrency`` at once, ``chunk`` bytes each being what the backend is
    tuned for.
    """

    key: str
    size: int
    fetch: Callable[[int, int], bytes]
    chunk: int
    concurrency: int
    #: ``fetch_into(start, sinks)`` puts bytes ``[start, start + sum of the sinks' lengths)`` into the
    #: writable buffers ``sinks``, in order, with no copy in between (None: the backend has no such read).
    fetch_into: Callable[[int, list[memoryview]], None] | None = None


@runtime_checkable
class ReadsInto(Protocol):
    """A backend that reads a whole object into the caller's memory (S3).

    Optional: a reader that knows where an object's bytes go (a chunk of a
    file being restored, the tensors it holds) has them put there from the
    socket, with no ``bytes`` object in between.
    """

    def read_into(self, key: str, sinks: list[memoryview]) -> int:
        """Read object ``key`` into ``sinks`` (filled in order) when its size is
        theirs in all; returns its size (nothing is read when that differs).
        Raises :class:`NotFoundError`."""
        ...


@runtime_checkable
class RangedReads(Protocol):
    """A backend that reads an object's byte ranges on request (S3, GCS).

    Optional: it lets a reader fetch the ranges of a large object concurrently
    and put each straight where it belongs (a restore into tensors); readers
    use :meth:`Storage.iter_chunks` where a backend lacks it.
    """

    def open_ranged(self, key: str, seen: ObjectInfo | None = None) -> RangedObject:
        """Open ``key`` for ranged reads; raises :class:`NotFoundError`.

        ``seen``: the object as a listing just gave it. With its version the
        backend reads that version without asking the store about the
        object first (one round trip less); a version replaced since then
        fails the reads, as one replaced after opening does."""
        ...


@runtime_checkable
class StoreChecksums(Protocol):
    """A backend whose store computes checksums on receipt (S3 additional checksums).

    Optional: verification uses it where a backend offers it and reads the
    bytes back otherwise.
    """

    def stored_checksum(self, key: str) -> StoredChecksum | None:
        """The checksum the store computed for ``key`` when it received it, or None
        when the store has none for it (it was uploaded without one, or the store
        does not keep them). Raises :class:`NotFoundError` when ``key`` is absent."""
        ...


def check_key(key: str) -> str:
    """Validate an object key relative to a storage root; returns it unchanged."""
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"invalid storage key {key!r}")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"invalid storage key {key!r}")
    return key


def join_key(*parts: str) -> str:
    """Join key parts with ``/``, ignoring empty ones."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


# --- shared by the backends --------------------------------------------------------------


class StorageRoot:
    """What every backend's identity shares: the URIs of keys under its root :attr:`uri`."""

    @property
    def uri(self) -> str:
        """The root URI, without a trailing slash."""
        raise NotImplementedError

    def uri_for(self, key: str) -> str:
        """The absolute URI of ``key``."""
        return f"{self.uri}/{check_key(key)}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def missing(self, key: str) -> NotFoundError:
        """The error of a read of ``key`` that found nothing."""
        return NotFoundError(f"{self.uri_for(key)} does not exist")


class BucketRoot(StorageRoot):
    """The root ``<scheme>://bucket/prefix`` of an object-store backend (S3, GCS): where its keys
    lie in the bucket, and what such backends derive alike from their listings and reads."""

    #: The URI scheme (``s3``, ``gs``).
    scheme: ClassVar[str]

    def __init__(self, uri: str) -> None:
        self.bucket, self.prefix = parse_bucket_uri(uri, self.scheme)

    @property
    def uri(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")

    def _key(self, key: str) -> str:
        """The store's key of ``key`` (under the prefix)."""
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full_key: str) -> str:
        """``key`` of the store's key (below the prefix)."""
        return full_key[len(self.prefix) + 1 :] if self.prefix else full_key

    def _full_prefix(self, prefix: str) -> str:
        return f"{self.prefix}/{prefix}" if self.prefix else prefix

    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        raise NotImplementedError

    def list_dirs(self, prefix: str = "") -> list[str]:
        return dirs_in_listing(self.list_objects, prefix)

    def read_with_etag(self, key: str) -> tuple[bytes, str] | None:
        raise NotImplementedError

    def read_bytes(self, key: str) -> bytes:
        found = self.read_with_etag(key)
        if found is None:
            raise self.missing(key)
        return found[0]


# --- shared by the object-store backends -------------------------------------------------


def dirs_in_listing(list_objects: Callable[[str], Iterable[ObjectInfo]], prefix: str = "") -> list[str]:
    """The "directories" directly below ``prefix``, derived from the recursive listing.

    Rather than from a delimiter listing: some stores keep reporting a
    "directory" after its last object is deleted (SeaweedFS; an empty folder
    of a GCS bucket with hierarchical namespace), and a deleted checkpoint
    must not look like a broken one.
    """
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    rests = (o.key[len(prefix) :] for o in list_objects(prefix))
    return sorted({rest.split("/", 1)[0] for rest in rests if "/" in rest} - {""})


def read_as_listed(read: Callable[[ObjectInfo | None], _R], seen: ObjectInfo | None) -> _R:
    """``read(seen)``: an object read as a listing saw it (``open_ranged(key, seen)``).

    When the listing's version no longer reads (replaced since, or a store
    that takes its entity tag another way), ``read(None)``: the version
    current now, as asking the store first would have read it. Never two
    versions mixed; the caller's checksums decide whether it is the one it
    wants."""
    try:
        return read(seen)
    except PreconditionFailedError:
        if seen is None:
            raise
        return read(None)


def byte_ranges(size: int, chunk: int) -> list[tuple[int, int]]:
    """Pure: ``[start, end)`` ranges of at most ``chunk`` bytes covering ``size`` bytes."""
    return [(start, min(start + chunk, size)) for start in range(0, size, chunk)]


def read_in_order(
    fetch: Callable[[int, int], _R], ranges: Iterable[tuple[int, int]], window: int, *, thread_name_prefix: str = ""
) -> Generator[_R, None, None]:
    """The ``[start, end)`` ranges of one object, fetched concurrently and handed out in order.

    A bounded look-ahead keeps memory at about ``window`` ranges; when the
    reader stops early, the fetches not started are cancelled. ``fetch`` may
    return what it made of the bytes rather than the bytes (a restore puts
    them in place on the fetching thread and hands out only their checksum).
    """
    pool = ThreadPoolExecutor(max_workers=window, thread_name_prefix=thread_name_prefix)
    pending: deque[Future[_R]] = deque()
    try:
        it = iter(ranges)
        for start, end in it:
            pending.append(pool.submit(fetch, start, end))
            if len(pending) >= window:
                break
        while pending:
            data = pending.popleft().result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(fetch, nxt[0], nxt[1]))
            yield data
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


# --- shared by the backends' parallel transfers ------------------------------------------


def locked_progress(progress: ProgressCallback) -> ProgressCallback:
    """Serialize progress callbacks coming from transfer threads."""
    lock = threading.Lock()

    def call(n: int) -> None:
        with lock:
            progress(n)

    return call


def before_part(progress: ProgressCallback | None) -> None:
    """Ask a transfer's progress callback, with 0 bytes, before a part or file
    is read and sent. A callback that stops its transfer (a routine upload a
    preemption overtakes, see :mod:`spotguard.checkpoint.store.upload`) raises here,
    so no new request starts once it has said stop (S3 parts on the wire ask
    again as they are sent, see ``spotguard.storage.s3``)."""
    if progress is not None:
        progress(0)


def wait_all(futures: list[Any]) -> None:
    """Wait for every transfer; at the first failure (whichever transfer it is,
    not the first in the list) cancel the rest and raise it."""
    pooled = [f for f in futures if isinstance(f, Future)]
    if len(pooled) == len(futures):
        done, _ = wait(pooled, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f in done and not f.cancelled() and f.exception() is not None), None)
        if failed is not None:
            for fut in futures:
                fut.cancel()
            failed.result()  # raises
    try:
        for fut in futures:
            fut.result()
    except BaseException:  # the other transfers cancelled on any exit, an interrupt too; raised again
        for fut in futures:
            fut.cancel()
        raise
