"""Reading a few granted objects through presigned URLs: a read-only storage without credentials.

A trainer resumes from the store without holding its credentials: the
uploader hands it one presigned GET URL per object of the checkpoints it may
load (:mod:`spotguard.contract.grant`), and :class:`GrantedStorage` reads
them with urllib3 (which boto3 already brings): concurrent ranged GETs, each
range read from the socket straight into the caller's memory, as
:class:`~spotguard.storage.s3.S3Storage` reads. It knows only the objects it
was given: its listing is theirs, with the sizes the granted manifests
record; what the bytes are is checked by the reader against the manifest
(:mod:`spotguard.checkpoint.restore.stream`), never trusted from here.

A URL is a credential until it expires: no message, log line or exception
raised here holds one (errors name the object's ``store``-relative URI and
the HTTP status). An expired or refused URL raises :class:`GrantRefused`.
"""

from __future__ import annotations

import http.client
import logging
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from spotguard.storage.base import (
    NotFoundError,
    ObjectInfo,
    PendingUpload,
    ProgressCallback,
    RangedObject,
    StorageError,
    StorageRoot,
    Unchanged,
    byte_ranges,
    dirs_in_listing,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")
MiB = 1 << 20


@runtime_checkable
class SignsReads(Protocol):
    """A backend that can let another process read one object for a while (S3: a presigned GET URL).

    Optional: where a backend lacks it (a ``file://`` store, whose path a trainer reads
    directly; GCS without a signing key), the trainer resumes from a local copy."""

    def presign_read(self, key: str, expires_in: int) -> str:
        """A URL that reads object ``key`` (ranged GETs too) for ``expires_in`` seconds."""
        ...


class _NoQueries(logging.Filter):
    """Takes the query out of every URL urllib3 logs (at DEBUG it logs each request's path: a
    presigned URL's query holds its signature)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "?" in message:
            record.msg, record.args = re.sub(r"\?[^\s\"']*", "?<redacted>", message), ()
        return True


_NO_QUERIES = _NoQueries()


def _quiet_urls() -> None:
    """Install :class:`_NoQueries` on urllib3's loggers (once)."""
    for name in ("urllib3.connectionpool", "urllib3.connection", "urllib3.poolmanager", "urllib3.response"):
        logger = logging.getLogger(name)
        if _NO_QUERIES not in logger.filters:
            logger.addFilter(_NO_QUERIES)


class GrantRefused(StorageError):
    """The store refused a granted URL (HTTP 403): the grant expired, or was never good."""


class _Transient(Exception):
    """A read that may succeed when tried again (a dropped connection, a short body)."""


class GrantedStorage(StorageRoot):
    """The objects ``urls`` (key -> presigned URL) of the store at ``store``, read-only.

    ``sizes``: each object's size as the granted manifests record it (its listing);
    ``held``: objects given whole (a granted manifest), served from memory."""

    def __init__(
        self,
        store: str,
        urls: Mapping[str, str],
        sizes: Mapping[str, int],
        held: Mapping[str, bytes] | None = None,
        *,
        read_chunk_size: int = 16 * MiB,
        max_concurrency: int = 8,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
    ) -> None:
        import urllib3

        _quiet_urls()
        self._store = store.rstrip("/")
        self._urls = dict(urls)
        self._held = dict(held or {})
        self._sizes = {**dict(sizes), **{k: len(v) for k, v in self._held.items()}}
        self._chunk = max(read_chunk_size, MiB)
        self._concurrency = max_concurrency
        self._http = urllib3.PoolManager(
            maxsize=2 * max_concurrency,
            retries=False,
            timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout),
        )

    @property
    def uri(self) -> str:
        return self._store

    @property
    def supports_conditional_writes(self) -> bool:
        return False

    def check(self) -> None:
        pass

    # -- listing ---------------------------------------------------------------------------
    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for key in sorted(self._sizes):
            if key.startswith(prefix):
                yield ObjectInfo(key, self._sizes[key], 0.0)

    def list_dirs(self, prefix: str = "") -> list[str]:
        return dirs_in_listing(self.list_objects, prefix)

    def stat(self, key: str) -> ObjectInfo | None:
        size = self._sizes.get(key)
        return None if size is None else ObjectInfo(key, size, 0.0)

    # -- reading ---------------------------------------------------------------------------
    def _url(self, key: str) -> str:
        url = self._urls.get(key)
        if url is None:
            raise self.missing(key)
        return url

    def _get(self, key: str, start: int | None = None, end: int | None = None) -> Any:
        """The response of one GET of ``key`` (bytes ``[start, end)`` when given), its body unread."""
        import urllib3

        headers = {} if start is None or end is None else {"Range": f"bytes={start}-{end - 1}"}
        try:
            resp = self._http.request(
                "GET", self._url(key), headers=headers, preload_content=False, decode_content=False
            )
        except urllib3.exceptions.HTTPError as exc:  # the message may hold the URL: only its kind is said
            raise _Transient(type(exc).__name__) from None
        status = resp.status
        if status in (200, 206):
            return resp
        resp.release_conn()
        where = self.uri_for(key)
        if status == 403:
            raise GrantRefused(f"{where}: the store refused the restore grant's URL (HTTP 403: expired or refused)")
        if status == 404:
            raise NotFoundError(f"{where} does not exist")
        if status == 416:
            raise StorageError(f"{where}: shorter than the granted manifest says (HTTP 416)")
        if status >= 500:
            raise _Transient(f"HTTP {status}")
        raise StorageError(f"{where}: HTTP {status} through the restore grant")

    def _retrying(self, key: str, fn: Callable[[], _T], attempts: int = 4) -> _T:
        for attempt in range(attempts):
            try:
                return fn()
            except _Transient as exc:
                if attempt == attempts - 1:
                    where = self.uri_for(key)
                    raise StorageError(f"reading {where} through the restore grant kept failing: {exc}") from None
                delay = min(4.0, 0.2 * 2**attempt) * (0.5 + random.random())
                log.warning("reading %s failed (%s); retrying in %.1fs", self.uri_for(key), exc, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        def once() -> bytes:
            resp = self._get(key, start, end)
            _check_range(self.uri_for(key), resp, start, end, self._sizes.get(key))
            try:
                data: bytes = resp.read()
            except Exception as exc:  # noqa: BLE001 - a broken body is retried (its message may hold the URL)
                resp.close()
                raise _Transient(type(exc).__name__) from None
            if len(data) != end - start:
                raise _Transient(f"{len(data)} of {end - start} bytes")
            return data

        return self._retrying(key, once)

    def _read_range_into(self, key: str, start: int, sinks: list[memoryview]) -> None:
        end = start + sum(len(s) for s in sinks)
        where = self.uri_for(key)

        def once() -> None:
            _body_into(_check_range(where, self._get(key, start, end), start, end, None), sinks)

        self._retrying(key, once)

    def read_bytes(self, key: str) -> bytes:
        if key in self._held:
            return self._held[key]
        size = self._sizes.get(key)
        if size is None:
            raise self.missing(key)
        return self._read_range(key, 0, size) if size else b""

    def read_with_etag(self, key: str) -> tuple[bytes, str] | None:
        try:
            return self.read_bytes(key), ""
        except NotFoundError:
            return None

    def read_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | Unchanged | None:
        return self.read_with_etag(key)

    def read_into(self, key: str, sinks: list[memoryview]) -> int:
        """Object ``key`` into ``sinks`` when its size is theirs in all (one GET); its size."""
        want = sum(len(s) for s in sinks)
        size = self._sizes.get(key)
        if size is None:
            raise self.missing(key)
        if size != want:
            return size
        if size:
            self._read_range_into(key, 0, sinks)
        return size

    def iter_chunks(self, key: str, chunk_size: int = 8 << 20) -> Iterator[bytes]:
        if key in self._held:
            yield self._held[key]
            return
        size = self._sizes.get(key)
        if size is None:
            raise self.missing(key)
        for start, end in byte_ranges(size, max(chunk_size, MiB)):
            yield self._read_range(key, start, end)

    def open_ranged(self, key: str, seen: ObjectInfo | None = None) -> RangedObject:
        size = self._sizes.get(key)
        if size is None or key not in self._urls:
            raise self.missing(key)
        return RangedObject(
            key,
            size,
            lambda s, e: self._read_range(key, s, e),
            self._chunk,
            self._concurrency,
            lambda s, sinks: self._read_range_into(key, s, sinks),
        )

    # -- writing: never -----------------------------------------------------------------------
    def _read_only(self) -> StorageError:
        return StorageError(f"{self._store}: the restore grant reads; it writes nothing")

    def write_bytes(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        raise self._read_only()

    def write_checked(self, key: str, data: bytes, crc32c: str | None = None) -> None:
        raise self._read_only()

    def upload_files(self, items: Iterable[tuple[Path, str]], progress: ProgressCallback | None = None) -> None:
        raise self._read_only()

    def download_files(self, items: Iterable[tuple[str, Path]], progress: ProgressCallback | None = None) -> None:
        raise self._read_only()

    def delete(self, keys: Iterable[str]) -> None:
        raise self._read_only()

    def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        return []

    def abort_upload(self, upload: PendingUpload) -> None:
        raise self._read_only()

    def close(self) -> None:
        self._http.clear()


def _check_range(where: str, resp: Any, start: int, end: int, size: int | None) -> Any:
    """``resp`` when it answers bytes ``[start, end)`` (of an object of ``size`` bytes, when known)."""
    if resp.status == 200:
        length = resp.headers.get("content-length")
        if start == 0 and length is not None and int(length) == end:
            return resp
        resp.release_conn()
        raise StorageError(f"{where}: the store answered a ranged read with the whole object")
    found = str(resp.headers.get("content-range", ""))
    want = f"bytes {start}-{end - 1}/"
    total = found[len(want) :] if found.startswith(want) else None
    if total is None or (size is not None and total != str(size)):
        resp.release_conn()
        raise StorageError(f"{where}: the store answered bytes {found or '?'} for {want}{size or '*'}")
    return resp


def _body_into(resp: Any, sinks: list[memoryview]) -> None:
    """Read ``resp``'s body into ``sinks`` from the socket (``readinto`` of the HTTP response
    under urllib3's, no copy in between); a short body or a broken connection is transient."""
    fp: Any = getattr(resp, "_fp", None)
    encoded = str(resp.headers.get("content-encoding", "identity")).lower() not in ("", "identity")
    done = False
    try:
        if fp is None or not hasattr(fp, "readinto") or encoded:
            data = resp.read()
            at = 0
            for sink in sinks:
                if at + len(sink) > len(data):
                    raise _Transient(f"{len(data)} bytes, short")
                sink[:] = data[at : at + len(sink)]
                at += len(sink)
            done = True
            return
        for sink in sinks:
            filled = 0
            while filled < len(sink):
                n = fp.readinto(sink[filled:])
                if not n:
                    raise _Transient("the body ended early")
                filled += n
        done = True
    except (OSError, http.client.HTTPException) as exc:
        raise _Transient(type(exc).__name__) from None
    finally:
        if done and (fp is None or not hasattr(fp, "isclosed") or fp.isclosed()):
            resp.release_conn()  # read through: the connection serves the next request
        else:
            resp.close()  # never hand a half-read connection to the next request


__all__ = ["GrantRefused", "GrantedStorage", "SignsReads"]
