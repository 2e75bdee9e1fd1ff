"""``gs://bucket/prefix`` storage through the ``google-cloud-storage`` client: the transfers.

The client, credentials (Application Default Credentials, a key file, or
anonymous against an emulator), the mapping of the client's errors and the
CRC32C-checked retries are :mod:`spotguard.storage.gcs_client`; the pieces of
composite uploads :mod:`~spotguard.storage.gcs_pieces`; deletes
:mod:`~spotguard.storage.gcs_delete`.

What GCS gives natively, and how it is used:

- **CRC32C of every object**, computed by the service on receipt. Uploads
  carry the CRC32C of the bytes sent (computed from the same buffers), so the
  service refuses bytes damaged on the way; :meth:`GcsStorage.stored_checksum`
  reports the service's value, which verification compares with the manifest
  without reading the data back.
- **Generations**: every write of an object gets a new generation number,
  which serves as the entity tag. Create-only writes use
  ``ifGenerationMatch=0``, compare-and-swap uses ``ifGenerationMatch=<tag>``,
  conditional reads ``ifGenerationNotMatch=<tag>`` (304, no body), and ranged
  reads of one object are pinned to one generation.
- **Resumable uploads** for large files (in ``chunk_size`` pieces, each
  retried on its own), many files uploaded concurrently, ranged reads in
  parallel for large objects.
- **Parallel composite uploads** for files of ``composite_threshold`` bytes
  or more: up to 32 pieces at once, joined by one ``compose`` whose CRC32C
  must combine the pieces'; a dead upload's pieces are pending uploads the
  collector removes (:mod:`spotguard.storage.gcs_pieces`).
- **Retries** of 408, 429 and 5xx answers and of dropped connections, with
  exponential backoff until ``retry_deadline`` (the client's ``DEFAULT_RETRY``).
  Writes are retried too, conditional ones included, as the GCS retry
  strategy allows: spotguard writes unconditionally only keys that one writer
  owns (upload intents, part manifests) or that every writer writes with the
  same bytes (a checkpoint's data files, content-addressed chunks), so a
  repeated write cannot undo another's; and a retried conditional create or
  compare-and-swap that had in fact succeeded reports a lost race, which its
  callers already treat as "someone wrote it" (the global manifest) or
  re-read (the pointer).
- **Batch deletes**: up to 100 deletions per HTTP request (one request per
  object against a custom endpoint, whose emulator may have no batches).

Unfinished resumable sessions cannot be listed (they are not objects; GCS
discards them after a week): only composite pieces are pending uploads.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Any, cast

import google_crc32c
from google.api_core import exceptions as gexc
from google.cloud.storage.retry import DEFAULT_RETRY

from spotguard.storage.base import (
    UNCHANGED,
    BucketRoot,
    CappedBuffer,
    NotFoundError,
    ObjectInfo,
    PendingUpload,
    PreconditionFailedError,
    ProgressCallback,
    RangedObject,
    StorageError,
    StoredChecksum,
    Unchanged,
    before_part,
    byte_ranges,
    locked_progress,
    read_in_order,
    wait_all,
)
from spotguard.storage.checksum import crc32c_from_base64, crc32c_of_parts
from spotguard.storage.gcs_client import (
    CHUNK_QUANTUM,
    checked,
    crc32c_hex,
    gcs_errors,
    generation_of,
    make_client,
    stored_checksum_from,
    upload_chunk_size,
)
from spotguard.storage.gcs_delete import BATCH_LIMIT as BATCH_LIMIT
from spotguard.storage.gcs_delete import Deleter
from spotguard.storage.gcs_pieces import (
    COMPOSE_DIR,
    Composite,
    Furthest,
    ProgressReader,
    Window,
    composite_pieces,
    pending_uploads,
    pieces_of,
)

MiB = 1 << 20

log = logging.getLogger(__name__)


# -- the backend ----------------------------------------------------------------------


class GcsStorage(BucketRoot):
    """Storage rooted at ``gs://bucket/prefix``.

    The client is created on first use, so opening a URI costs nothing and a
    missing credential is reported by the first operation (``check()``), as
    one :class:`CredentialsError`.

    Options: ``endpoint_url`` (an emulator, reached with anonymous
    credentials unless ``credentials_file`` or ``anonymous=False`` says
    otherwise), ``credentials_file`` (a service account key; other credential
    files go through ``GOOGLE_APPLICATION_CREDENTIALS``), ``project`` (none is
    needed for objects), ``max_concurrency`` (transfers in flight),
    ``chunk_size`` (resumable upload pieces, rounded up to 256 KiB),
    ``resumable_threshold`` (smaller files go in one request),
    ``composite_threshold`` (larger files go up as parallel pieces joined by
    ``compose``; 0 turns that off) and ``composite_piece`` (their least size),
    ``read_chunk_size`` (ranged reads), ``retry_deadline`` and
    ``retry_initial_delay`` (backoff of the client's retries),
    ``connect_timeout``/``read_timeout`` (per request), ``max_read_bytes`` (whole-object reads), ``batch_deletes``
    (default: on against Google's endpoint, off against a custom one) and
    ``client`` (a ready ``google.cloud.storage.Client``).
    """

    scheme = "gs"

    def __init__(
        self,
        uri: str,
        *,
        endpoint_url: str | None = None,
        credentials_file: str | None = None,
        credentials_info: Mapping[str, Any] | None = None,
        anonymous: bool | None = None,
        project: str | None = None,
        max_concurrency: int = 8,
        chunk_size: int = 32 * MiB,
        resumable_threshold: int = 8 * MiB,
        composite_threshold: int = 128 * MiB,
        composite_piece: int = 32 * MiB,
        read_chunk_size: int = 16 * MiB,
        retry_deadline: float = 120.0,
        retry_initial_delay: float = 1.0,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        batch_deletes: bool | None = None,
        max_read_bytes: int | None = None,
        client: Any = None,
    ) -> None:
        super().__init__(uri)
        self._max_read = max_read_bytes
        self._endpoint_url = endpoint_url.rstrip("/") if endpoint_url else None
        self._concurrency = max(1, max_concurrency)
        # Made on first use: opening a URI costs nothing, a missing credential is the first operation's error.
        self._connect = functools.partial(
            make_client,
            endpoint_url=self._endpoint_url,
            credentials_file=credentials_file,
            credentials_info=dict(credentials_info) if credentials_info else None,
            # A custom endpoint is an emulator unless credentials are asked for.
            anonymous=anonymous
            if anonymous is not None
            else bool(endpoint_url and not credentials_file and not credentials_info),
            project=project,
            concurrency=self._concurrency,
        )
        self._chunk_size = upload_chunk_size(chunk_size)
        self._resumable_threshold = max(0, resumable_threshold)
        self._composite_threshold = max(0, composite_threshold)
        self._composite_piece = upload_chunk_size(composite_piece)
        self._read_chunk = max(read_chunk_size, CHUNK_QUANTUM)
        self._retry = DEFAULT_RETRY.with_deadline(retry_deadline).with_delay(initial=retry_initial_delay)
        self._retry_deadline = retry_deadline
        self._timeout = (connect_timeout, read_timeout)
        custom_endpoint = bool(self._endpoint_url or os.environ.get("STORAGE_EMULATOR_HOST"))
        self._deleter = Deleter(
            bucket=self.bucket,
            uri=self.uri,
            endpoint_url=self._endpoint_url,
            # Google's endpoint takes batches; emulators often do not (fake-gcs-server has none).
            batches=batch_deletes if batch_deletes is not None else not custom_endpoint,
            concurrency=self._concurrency,
            retry=self._retry,
            timeout=self._timeout,
            errors=self._errors,
        )
        self._client_obj = client
        self._client_lock = threading.Lock()

    # -- identity -----------------------------------------------------------
    @property
    def supports_conditional_writes(self) -> bool:
        return True

    # -- client and errors ----------------------------------------------------
    @property
    def client(self) -> Any:
        """The ``google.cloud.storage.Client`` (created on first use)."""
        with self._client_lock:
            if self._client_obj is None:
                with self._errors(self.uri):
                    self._client_obj = self._connect()
            return self._client_obj

    def _bucket(self) -> Any:
        return self.client.bucket(self.bucket)

    def _blob(self, key: str, *, generation: int | None = None, chunk_size: int | None = None) -> Any:
        return self._bucket().blob(self._key(key), generation=generation, chunk_size=chunk_size)

    def _errors(self, what: str, *, listing: bool = False) -> AbstractContextManager[None]:
        """Turn client errors into one-line :class:`StorageError` messages.

        ``listing``: a 404 means the bucket is missing (a listing never misses an object).
        """
        return gcs_errors(
            what,
            bucket=self.bucket,
            endpoint_url=self._endpoint_url,
            retry_deadline=self._retry_deadline,
            listing=listing,
        )

    def check(self) -> None:
        """Raise unless the prefix can be listed (needs only object permissions:
        a principal with an object role on the bucket may lack ``buckets.get``)."""
        with self._errors(f"bucket {self.bucket!r}", listing=True):
            pages = self.client.list_blobs(
                self.bucket,
                prefix=self._full_prefix(""),
                max_results=1,
                fields="items(name),nextPageToken",
                retry=self._retry,
                timeout=self._timeout,
            )
            list(pages)

    # -- reading ------------------------------------------------------------
    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self._errors(self.uri, listing=True):
            blobs = list(
                self.client.list_blobs(
                    self.bucket,
                    prefix=self._full_prefix(prefix),
                    fields="items(name,size,updated),nextPageToken",
                    retry=self._retry,
                    timeout=self._timeout,
                )
            )
        for blob in blobs:
            yield ObjectInfo(
                key=self._rel(blob.name),
                size=int(blob.size or 0),
                modified=blob.updated.timestamp(),
                version=str(blob.generation or ""),
            )

    def _metadata(self, key: str) -> Any:
        """The object's metadata (size, generation, crc32c, updated), or None when absent."""
        with self._errors(self.uri_for(key)):
            return self._bucket().get_blob(self._key(key), retry=self._retry, timeout=self._timeout)

    def stat(self, key: str) -> ObjectInfo | None:
        blob = self._metadata(key)
        if blob is None:
            return None
        return ObjectInfo(
            key=key, size=int(blob.size or 0), modified=blob.updated.timestamp(), version=str(blob.generation or "")
        )

    def stored_checksum(self, key: str) -> StoredChecksum | None:
        """The CRC32C GCS computed for ``key`` on receipt (every object has one), as
        whole-object hex."""
        blob = self._metadata(key)
        if blob is None:
            raise self.missing(key)
        return stored_checksum_from(blob.crc32c, int(blob.size or 0))

    def read_with_etag(self, key: str) -> tuple[bytes, str] | None:
        found = self._read(key, None)
        assert not isinstance(found, Unchanged)  # only a conditional read answers that
        return found

    def read_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | Unchanged | None:
        """A media GET with ``ifGenerationNotMatch=<etag>``: GCS answers 304 (no
        body) while the object keeps that generation. A server that ignores the
        condition sends the object; when its generation is still ``etag`` that is
        :data:`UNCHANGED` too."""
        found = self._read(key, generation_of(etag))
        if found is UNCHANGED or found is None:
            return found
        assert not isinstance(found, Unchanged)
        if etag is not None and found[1] == etag:
            return UNCHANGED
        return found

    def _read(self, key: str, not_generation: int | None) -> tuple[bytes, str] | Unchanged | None:
        """The whole object (checked against the CRC32C GCS sends with it) and its generation."""

        def once() -> tuple[bytes, str] | Unchanged:
            blob, sink = self._blob(key), CappedBuffer(self.uri_for(key), self._max_read)
            try:
                blob.download_to_file(
                    sink,
                    raw_download=True,
                    checksum="crc32c",
                    if_generation_not_match=not_generation,
                    retry=self._retry,
                    timeout=self._timeout,
                )
            except gexc.NotModified:
                return UNCHANGED
            return sink.getvalue(), str(blob.generation or "")

        try:
            with self._errors(self.uri_for(key)):
                return checked(self.uri_for(key), once)
        except NotFoundError:
            return None

    def _get_range(self, key: str, generation: int, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of one generation of ``key`` (gone when it was replaced)."""
        blob = self._blob(key, generation=generation)

        def once() -> bytes:
            data = blob.download_as_bytes(
                start=start, end=end - 1, raw_download=True, checksum=None, retry=self._retry, timeout=self._timeout
            )
            if len(data) != end - start:
                raise StorageError(f"{self.uri_for(key)}: got {len(data)} bytes of range {start}-{end - 1}")
            return bytes(data)

        try:
            with self._errors(self.uri_for(key)):
                return once()
        except NotFoundError:
            raise NotFoundError(f"{self.uri_for(key)} was replaced or deleted while being read") from None

    def open_ranged(self, key: str, seen: ObjectInfo | None = None) -> RangedObject:
        """``key`` for concurrent ranged reads of the generation current now
        (the listing's, ``seen``, where it gave one)."""
        if seen is not None and seen.version.isdigit():
            generation, size = int(seen.version), seen.size
        else:
            blob = self._metadata(key)
            if blob is None:
                raise self.missing(key)
            generation, size = int(blob.generation), int(blob.size or 0)
        return RangedObject(
            key,
            size,
            lambda s, e: self._get_range(key, generation, s, e),
            max(self._read_chunk, MiB),
            self._concurrency,
        )

    def _whole(self, key: str, generation: int) -> bytes:
        blob = self._blob(key, generation=generation)
        with self._errors(self.uri_for(key)):
            return bytes(
                checked(
                    self.uri_for(key),
                    lambda: blob.download_as_bytes(
                        raw_download=True, checksum="crc32c", retry=self._retry, timeout=self._timeout
                    ),
                )
            )

    def iter_chunks(self, key: str, chunk_size: int | None = None) -> Iterator[bytes]:
        """The object in order; a large one in concurrent ranged GETs of one
        generation, whose CRC32Cs combined must equal the one GCS keeps."""
        chunk = max(chunk_size or self._read_chunk, MiB)
        blob = self._metadata(key)
        if blob is None:
            raise self.missing(key)
        size, generation = int(blob.size or 0), int(blob.generation)
        if size == 0:
            return
        if size <= chunk:
            yield self._whole(key, generation)
            return
        expected = crc32c_hex(blob.crc32c)
        parts: list[tuple[int, int]] = []
        chunks = read_in_order(
            lambda s, e: self._get_range(key, generation, s, e),
            byte_ranges(size, chunk),
            self._concurrency,
            thread_name_prefix="gcs-read",
        )
        try:
            for data in chunks:
                parts.append((google_crc32c.value(data), len(data)))
                yield data
        finally:
            chunks.close()
        self._check_parts(key, expected, parts)

    def _check_parts(self, key: str, expected: str | None, parts: list[tuple[int, int]]) -> None:
        """The ranges read must add up to the CRC32C GCS keeps: a range damaged on
        the way is a transfer error (read again), never a damaged checkpoint."""
        got = f"{crc32c_of_parts(parts):08x}"
        if expected is not None and got != expected:
            raise StorageError(
                f"{self.uri_for(key)}: the bytes read have CRC32C {got}, the store keeps {expected} "
                "(damaged on the way: read it again)"
            )

    def download_files(self, items: Iterable[tuple[str, Path]], progress: ProgressCallback | None = None) -> None:
        """Download concurrently: small objects in one GET each, large ones in
        ranged GETs of one generation written at their offsets; each file is
        checked against the CRC32C GCS keeps, then renamed into place."""
        items = [(key, Path(dst)) for key, dst in items]
        report = locked_progress(progress) if progress else None
        with ThreadPoolExecutor(max_workers=self._concurrency, thread_name_prefix="gcs-get") as pool:
            metas = list(pool.map(self._metadata, [key for key, _ in items]))
            for (key, _), meta in zip(items, metas, strict=True):
                if meta is None:
                    raise self.missing(key)
            tmps: list[Path] = []
            try:
                jobs: list[tuple[int, Future[tuple[int, int, int]]]] = []
                for index, ((key, dst), meta) in enumerate(zip(items, metas, strict=True)):
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    tmp = dst.parent / f".{dst.name}.sg-get-{uuid.uuid4().hex[:12]}"
                    tmps.append(tmp)
                    size = int(meta.size or 0)
                    with open(tmp, "wb") as f:
                        f.truncate(size)
                    for s, e in byte_ranges(size, self._read_chunk):
                        jobs.append(
                            (index, pool.submit(self._fetch_into, key, int(meta.generation), tmp, s, e, report))
                        )
                wait_all([f for _, f in jobs])
                per_file: dict[int, list[tuple[int, int, int]]] = {}
                for index, fut in jobs:
                    per_file.setdefault(index, []).append(fut.result())
                for index, ((key, dst), meta) in enumerate(zip(items, metas, strict=True)):
                    parts = [(crc, n) for _, crc, n in sorted(per_file.get(index, []))]
                    self._check_parts(key, crc32c_hex(meta.crc32c), parts)
                    os.replace(tmps[index], dst)
            finally:
                for tmp in tmps:
                    tmp.unlink(missing_ok=True)

    def _fetch_into(
        self, key: str, generation: int, path: Path, start: int, end: int, progress: ProgressCallback | None
    ) -> tuple[int, int, int]:
        data = self._get_range(key, generation, start, end)
        fd = os.open(path, os.O_WRONLY)
        try:
            view = memoryview(data)
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], start + written)
        finally:
            os.close(fd)
        if progress is not None:
            progress(len(data))
        return start, google_crc32c.value(data), len(data)

    # -- writing ------------------------------------------------------------
    def write_bytes(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        """Store ``data`` and return its generation; ``if_none_match`` is
        ``ifGenerationMatch=0``, ``if_match`` is ``ifGenerationMatch=<tag>``."""
        condition: int | None = None
        if if_match is not None:
            condition = generation_of(if_match)
            if condition is None:
                raise PreconditionFailedError(f"{self.uri_for(key)} changed since it was read")
        elif if_none_match:
            condition = 0
        return self._put_bytes(key, data, condition)

    def write_checked(self, key: str, data: bytes, crc32c: str | None = None) -> None:
        """Store ``data`` with the CRC32C of its bytes, which GCS checks on receipt (the client library
        computes it as it sends)."""
        self._put_bytes(key, data, None)

    def _put_bytes(self, key: str, data: bytes, if_generation_match: int | None) -> str:
        """One upload request (a resumable one above the client's single-request limit)
        carrying the CRC32C of ``data``, which the service checks."""

        def once() -> str:
            blob = self._blob(key)
            blob.upload_from_file(
                io.BytesIO(data),
                size=len(data),
                checksum="crc32c",
                if_generation_match=if_generation_match,
                retry=self._retry,
                timeout=self._timeout,
            )
            return str(blob.generation or "")

        with self._errors(self.uri_for(key)):
            return checked(self.uri_for(key), once)

    def upload_files(self, items: Iterable[tuple[Path, str]], progress: ProgressCallback | None = None) -> None:
        """Upload files concurrently, each with the CRC32C of its bytes: files below
        ``resumable_threshold`` in one request, larger ones as resumable uploads in
        ``chunk_size`` pieces (from google-cloud-storage 3 on the last piece
        carries the CRC32C, which the service checks; every version compares the
        one the service reports once the upload completes)."""
        items = [(Path(src), key) for src, key in items]
        if not items:
            return
        report = locked_progress(progress) if progress else None
        composites: list[Composite] = []
        plans = [
            (src, key, composite_pieces(src.stat().st_size, self._composite_threshold, self._composite_piece))
            for src, key in items
        ]
        jobs = sum(len(pieces) for _, _, pieces in plans)
        with ThreadPoolExecutor(max_workers=min(self._concurrency, jobs), thread_name_prefix="gcs-put") as pool:
            futures: list[Future[Any]] = []
            for src, key, pieces in plans:
                if len(pieces) == 1:
                    futures.append(pool.submit(self._upload_file, src, key, report))
                    continue
                composite = Composite(key, uuid.uuid4().hex, pieces)
                composite.futures = [
                    pool.submit(self._upload_piece, src, offset, length, composite.piece(i), report)
                    for i, (offset, length) in enumerate(pieces)
                ]
                composites.append(composite)
                futures.extend(composite.futures)
            try:
                wait_all(futures)
                for composite in composites:  # one request each, while nothing else waits
                    self._compose(composite)
            except BaseException:  # no stored piece left, an interrupt too; raised again
                self._discard_pieces([c.piece(i) for c in composites for i in range(len(c.pieces))])
                raise

    def _upload_piece(self, src: Path, offset: int, length: int, key: str, progress: ProgressCallback | None) -> int:
        """One piece of a composite upload, as a resumable upload checked by its CRC32C;
        returns the CRC32C the service computed."""
        before_part(progress)
        blob = self._resumable(src, key, progress, (offset, length))
        crc = crc32c_from_base64(blob.crc32c or "")
        if crc is None:
            raise StorageError(f"{self.uri_for(key)}: the service reported no CRC32C for a composite piece")
        return crc

    def _compose(self, composite: Composite) -> None:
        """Join a composite upload's pieces into its key, check the CRC32C the service
        computed for the whole object against the pieces', delete the pieces."""
        key = composite.key
        expected = crc32c_of_parts(
            (f.result(), length) for f, (_, length) in zip(composite.futures, composite.pieces, strict=True)
        )
        with self._errors(self.uri_for(key)):
            blob = self._blob(key)
            # Idempotent here (the same pieces give the same object), so retried as any write.
            blob.compose(
                [self._blob(composite.piece(i)) for i in range(len(composite.pieces))],
                retry=self._retry,
                timeout=self._timeout,
            )
        got = crc32c_from_base64(blob.crc32c or "")
        if got != expected:
            raise StorageError(
                f"{self.uri_for(key)}: the composed object's CRC32C ({blob.crc32c}) is not its pieces' "
                f"({expected:08x}); not kept as uploaded"
            )
        self._discard_pieces([composite.piece(i) for i in range(len(composite.pieces))])

    def _discard_pieces(self, keys: list[str]) -> None:
        """Best effort: what is left is listed as a pending upload, which the collector removes."""
        if not keys:
            return
        try:
            self.delete(keys)
        except Exception as exc:  # noqa: BLE001 - best effort: the collector removes what is left
            log.warning("%s: %d composite upload piece(s) left for the collector: %s", self.uri, len(keys), exc)

    def _upload_file(self, src: Path, key: str, progress: ProgressCallback | None) -> None:
        before_part(progress)
        size = src.stat().st_size
        if size < self._resumable_threshold:
            data = src.read_bytes()
            self._put_bytes(key, data, None)
            if progress is not None:
                progress(len(data))
            return

        self._resumable(src, key, progress)

    def _resumable(
        self, src: Path, key: str, progress: ProgressCallback | None, window: tuple[int, int] | None = None
    ) -> Any:
        """A resumable upload of ``src`` (or of its ``window``: offset and length) in ``chunk_size``
        pieces, each retried on its own, checked by its CRC32C; returns the stored blob."""
        reported = Furthest(progress)  # one count for every attempt

        def once() -> Any:
            blob = self._blob(key, chunk_size=self._chunk_size)
            with open(src, "rb") as f:
                stream = f if window is None else cast("IO[bytes]", Window(f, *window))
                # size=None: a resumable upload whatever the size, ended when the file (window) is.
                blob.upload_from_file(
                    ProgressReader(stream, reported),
                    size=None,
                    checksum="crc32c",
                    retry=self._retry,
                    timeout=self._timeout,
                )
            return blob

        with self._errors(self.uri_for(key)):
            return checked(self.uri_for(key), once)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete in batch requests of up to 100 deletions (missing objects ignored);
        one request per object where batches are off (emulators). See
        :mod:`spotguard.storage.gcs_delete`."""
        names = [self._key(k) for k in keys]
        if names:
            self._deleter.delete(self.client, names)

    def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        """The composite uploads whose pieces are still stored (an upload in flight, or
        one that died before its ``compose``), for target keys below ``prefix``; started
        when their first piece was. Unfinished resumable uploads are not listed: GCS
        has no API for them (they are not objects, and the service discards a session
        a week after it started)."""
        return pending_uploads(self.list_objects(f"{COMPOSE_DIR}/"), prefix)

    def abort_upload(self, upload: PendingUpload) -> None:
        """Delete the pieces of a composite upload (see :meth:`list_pending_uploads`)."""
        self.delete(pieces_of(self.list_objects(f"{COMPOSE_DIR}/{upload.upload_id}."), upload))
