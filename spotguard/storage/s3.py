"""``s3://bucket/prefix`` storage through boto3 and s3transfer: the transfers.

Reads of large objects are split into concurrent ranged GETs that are retried
one range at a time. Large files go up and down as concurrent multipart
transfers, carrying CRC32C additional checksums the store checks on receipt.
The client, its settings (endpoint, region, credentials and attempts from the
standard AWS environment unless given) and the mapping of botocore's errors
are :mod:`spotguard.storage.s3_client`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

from spotguard.storage.base import (
    UNCHANGED,
    BucketRoot,
    NotFoundError,
    ObjectInfo,
    PendingUpload,
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
from spotguard.storage.s3_client import (
    NOT_FOUND,
    error_code,
    make_client,
    read_body,
    read_body_into,
    read_whole,
    retrying_read,
    s3_errors,
)
from spotguard.storage.s3_parts import AskingBody, PartStopped, part_buffer, part_ranges

log = logging.getLogger(__name__)

MiB = 1 << 20
_T = TypeVar("_T")


class _ChecksumsUnsupported(Exception):
    """The store refused the additional-checksum fields of a request."""


class _FullObjectUnsupported(Exception):
    """The store refused ``ChecksumType=FULL_OBJECT`` on a multipart upload."""


def _raw(fn: Callable[[bool], _T], full_object: bool) -> _T:
    """Call ``fn(full_object)``; a refusal of the checksum type raises :class:`_FullObjectUnsupported`."""
    from botocore.exceptions import ClientError, ParamValidationError

    try:
        return fn(full_object)
    except ParamValidationError:
        raise _FullObjectUnsupported() from None  # an old botocore without ChecksumType
    except ClientError as exc:
        code, status = error_code(exc)
        if code in ("InvalidArgument", "InvalidRequest", "NotImplemented") or status == 501:
            raise _FullObjectUnsupported() from None
        raise


class _NoSignatures(logging.Filter):
    """Drops botocore's debug lines that show a signature: with the request they sign, a
    presigned URL's is the URL itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Signature:")


_NO_SIGNATURES = _NoSignatures()


def _quiet_signatures() -> None:
    logger = logging.getLogger("botocore.auth")
    if _NO_SIGNATURES not in logger.filters:
        logger.addFilter(_NO_SIGNATURES)


class S3Storage(BucketRoot):
    """Storage rooted at ``s3://bucket/prefix``.

    Uploads carry CRC32C additional checksums (``send_checksums``), which the
    store checks on receipt and returns from :meth:`stored_checksum`; stores that
    refuse them get plain uploads. ``connect_timeout``/``read_timeout`` bound
    each request's connection and each wait for bytes; ``max_read_bytes`` the
    whole-object reads (:meth:`read_bytes` and the like; none by default).
    """

    scheme = "s3"

    def __init__(
        self,
        uri: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        profile: str | None = None,
        max_attempts: int | None = None,
        max_pool_connections: int = 32,
        multipart_threshold: int = 32 * MiB,
        multipart_chunksize: int = 32 * MiB,
        max_concurrency: int = 8,
        read_chunk_size: int = 16 * MiB,
        addressing_style: str | None = None,
        send_checksums: bool = True,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        max_read_bytes: int | None = None,
        client: Any = None,
    ) -> None:
        from boto3.s3.transfer import TransferConfig

        super().__init__(uri)
        self._max_read = max_read_bytes
        self._read_chunk = read_chunk_size
        self._concurrency = max_concurrency
        self._conditional = True
        self._checksums = send_checksums
        self._full_object = True
        self._multipart_threshold = multipart_threshold
        self._part_size = multipart_chunksize
        if client is None:
            client = make_client(
                endpoint_url=endpoint_url,
                region=region,
                access_key=access_key,
                secret_key=secret_key,
                session_token=session_token,
                profile=profile,
                max_attempts=max_attempts,
                max_pool_connections=max_pool_connections,
                addressing_style=addressing_style,
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
            )
        self.client = client
        self._transfer_config = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            use_threads=True,
        )

    # -- identity -----------------------------------------------------------
    @property
    def supports_conditional_writes(self) -> bool:
        return self._conditional

    def _errors(self, what: str) -> AbstractContextManager[None]:
        """Turn botocore errors into one-line :class:`StorageError` messages."""
        return s3_errors(what, self.bucket)

    def check(self) -> None:
        with self._errors(f"bucket {self.bucket!r}"):
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except Exception as exc:  # noqa: BLE001 - botocore raises many types; a missing bucket is known by its code
                code, status = error_code(exc)
                if code in NOT_FOUND or status == 404:
                    raise NotFoundError(f"bucket {self.bucket!r} does not exist") from None
                raise

    # -- reading ------------------------------------------------------------
    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        paginator = self.client.get_paginator("list_objects_v2")
        full = self._full_prefix(prefix)
        with self._errors(self.uri):
            pages = list(paginator.paginate(Bucket=self.bucket, Prefix=full))
        for page in pages:
            for obj in page.get("Contents", []):
                yield ObjectInfo(
                    key=self._rel(obj["Key"]),
                    size=int(obj["Size"]),
                    modified=obj["LastModified"].timestamp(),
                    version=str(obj.get("ETag", "")),
                )

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            with self._errors(self.uri_for(key)):
                head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except NotFoundError:
            return None
        return ObjectInfo(
            key=key,
            size=int(head["ContentLength"]),
            modified=head["LastModified"].timestamp(),
            version=str(head.get("ETag", "")),
        )

    def read_with_etag(self, key: str) -> tuple[bytes, str] | None:
        def once() -> tuple[bytes, str]:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            return read_whole(obj, self._max_read, self.uri_for(key)), str(obj["ETag"])

        try:
            with self._errors(self.uri_for(key)):
                return retrying_read(once, self.uri_for(key))
        except NotFoundError:
            return None

    def read_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | Unchanged | None:
        """``GetObject`` with ``IfNoneMatch=etag``: the store answers 304 Not
        Modified (no body) while the object keeps that entity tag. A store that
        ignores the condition sends the object; when its tag is still ``etag``
        that is :data:`UNCHANGED` too."""
        from botocore.exceptions import ClientError

        def once() -> tuple[bytes, str] | Unchanged:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(key)}
            if etag is not None:
                kwargs["IfNoneMatch"] = etag
            try:
                obj = self.client.get_object(**kwargs)
            except ClientError as exc:
                # botocore raises for a 304; it is the answer, not an error
                # (and must not reach the generic mapping below).
                code, status = error_code(exc)
                if status == 304 or code in ("304", "NotModified"):
                    return UNCHANGED
                raise
            tag = str(obj["ETag"])
            if etag is not None and tag == etag:
                obj["Body"].close()
                return UNCHANGED
            return read_whole(obj, self._max_read, self.uri_for(key)), tag

        try:
            with self._errors(self.uri_for(key)):
                return retrying_read(once, self.uri_for(key))
        except NotFoundError:
            return None

    def _get_range(self, key: str, start: int, end: int, etag: str) -> bytes:
        def once() -> bytes:
            obj = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end - 1}", IfMatch=etag
            )
            return read_body(obj["Body"], end - start)

        # Retry transient stream failures first; translate what remains.
        with self._errors(self.uri_for(key)):
            return retrying_read(once, self.uri_for(key))

    def _get_range_into(self, key: str, start: int, sinks: list[memoryview], etag: str) -> None:
        last = start + sum(len(s) for s in sinks) - 1

        def once() -> None:
            obj = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{last}", IfMatch=etag
            )
            read_body_into(obj["Body"], sinks)

        with self._errors(self.uri_for(key)):
            retrying_read(once, self.uri_for(key))

    def read_into(self, key: str, sinks: list[memoryview]) -> int:
        want = sum(len(s) for s in sinks)

        def once() -> int:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            size = int(obj["ContentLength"])
            if size != want:
                obj["Body"].close()
                return size
            read_body_into(obj["Body"], sinks)
            return size

        with self._errors(self.uri_for(key)):
            return retrying_read(once, self.uri_for(key))

    def iter_chunks(self, key: str, chunk_size: int | None = None) -> Iterator[bytes]:
        chunk = max(chunk_size or self._read_chunk, MiB)
        with self._errors(self.uri_for(key)):
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        size = int(head["ContentLength"])
        etag = str(head["ETag"])
        if size == 0:
            return
        ranges = byte_ranges(size, chunk)
        if len(ranges) == 1:
            yield self._get_range(key, 0, size, etag)
            return
        yield from read_in_order(lambda s, e: self._get_range(key, s, e, etag), ranges, self._concurrency)

    def open_ranged(self, key: str, seen: ObjectInfo | None = None) -> RangedObject:
        """``key`` for concurrent ranged GETs, each retried on its own and
        pinned to the entity tag seen now (``If-Match``): the listing's
        (``seen``) where it gave one, else a HEAD's."""
        if seen is not None and seen.version:
            etag, size = seen.version, seen.size
        else:
            with self._errors(self.uri_for(key)):
                head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            etag, size = str(head["ETag"]), int(head["ContentLength"])
        return RangedObject(
            key,
            size,
            lambda s, e: self._get_range(key, s, e, etag),
            max(self._read_chunk, MiB),
            self._concurrency,
            lambda s, sinks: self._get_range_into(key, s, sinks, etag),
        )

    def presign_read(self, key: str, expires_in: int) -> str:
        """A presigned GET URL of ``key`` for ``expires_in`` seconds (SigV4, signed here without a
        request: :class:`~spotguard.storage.presigned.SignsReads`). A credential: never log it."""
        _quiet_signatures()
        url: str = self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(key)}, ExpiresIn=int(expires_in)
        )
        return url

    # -- writing ------------------------------------------------------------
    def write_bytes(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        from botocore.exceptions import ClientError

        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(key), "Body": data}
        if self._conditional:
            if if_match is not None:
                kwargs["IfMatch"] = if_match
            elif if_none_match:
                kwargs["IfNoneMatch"] = "*"
        with self._errors(self.uri_for(key)):
            try:
                resp = self.client.put_object(**kwargs)
            except ClientError as exc:
                code, status = error_code(exc)
                if code != "NotImplemented" and status != 501:
                    raise
                # The store cannot do conditional writes: fall back to a plain
                # put (callers treat what they write this way as advisory).
                log.info("%s does not support conditional writes; using plain puts", self.uri)
                self._conditional = False
                kwargs.pop("IfMatch", None)
                kwargs.pop("IfNoneMatch", None)
                resp = self.client.put_object(**kwargs)
        return str(resp.get("ETag", ""))

    def upload_files(self, items: Iterable[tuple[Path, str]], progress: ProgressCallback | None = None) -> None:
        """Upload files concurrently, each with the CRC32C of its bytes (per part
        for multipart uploads) so that the store checks what it receives and
        keeps the checksum (:meth:`stored_checksum`)."""
        items = list(items)
        if not self._checksums:
            self._upload_files_plain(items, progress)
            return
        try:
            self._upload_files_checksummed(items, progress)
        except _ChecksumsUnsupported:
            log.info("%s does not take additional checksums; uploading without them", self.uri)
            self._checksums = False
            self._upload_files_plain(items, progress)

    def _upload_files_plain(self, items: list[tuple[Path, str]], progress: ProgressCallback | None) -> None:
        from boto3.s3.transfer import ProgressCallbackInvoker, create_transfer_manager

        subscribers = [ProgressCallbackInvoker(locked_progress(progress))] if progress else None
        with self._errors(self.uri), create_transfer_manager(self.client, self._transfer_config) as tm:
            futures = [tm.upload(str(src), self.bucket, self._key(key), subscribers=subscribers) for src, key in items]
            wait_all(futures)

    def upload_growing(self, src: Path, key: str, size: int, written: Callable[[int], None]) -> bool:
        """Upload a file still being written, ``size`` bytes once done: each
        part goes as soon as ``written(end)`` returns (it waits until the
        file holds that many bytes, and raises to stop). Parts as
        :meth:`upload_files` cuts them, with their CRC32C, so that the object
        is the one an upload of the finished file makes. False (nothing
        sent) where this store takes no checksums or the file is not cut in parts."""
        if not self._checksums or size < self._multipart_threshold:
            return False
        self._upload_files_checksummed([(src, key)], None, final_size=size, written=written)
        return True

    def _upload_files_checksummed(
        self,
        items: list[tuple[Path, str]],
        progress: ProgressCallback | None,
        *,
        final_size: int | None = None,
        written: Callable[[int], None] | None = None,
    ) -> None:
        report = locked_progress(progress) if progress else None
        sized = [(Path(src), key, Path(src).stat().st_size if final_size is None else final_size) for src, key in items]
        pending: list[tuple[str, str, list[Future[dict[str, Any]]]]] = []
        pool = ThreadPoolExecutor(max_workers=self._concurrency, thread_name_prefix="s3-upload")
        created: list[tuple[str, str]] = []
        try:
            small: list[Future[None]] = []
            for src, key, size in sized:
                if size < self._multipart_threshold:
                    small.append(pool.submit(self._put_file, src, key, report))
                    continue
                upload_id = self._create_multipart(key)
                created.append((key, upload_id))
                parts = [
                    pool.submit(self._upload_part, src, key, upload_id, number, offset, length, report, written)
                    for number, offset, length in part_ranges(size, self._part_size)
                ]
                pending.append((key, upload_id, parts))
            wait_all(small)
            for key, upload_id, parts in pending:
                wait_all(parts)
                self._complete_multipart(key, upload_id, [f.result() for f in parts])
                created.remove((key, upload_id))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for key, upload_id in created:
                # Free the parts of an upload that cannot complete now.
                with contextlib.suppress(Exception):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key), UploadId=upload_id)

    def _checksum_call(self, what: str, fn: Callable[[], _T], attempts: int = 3) -> _T:
        """Run a request that carries an additional checksum.

        ``BadDigest`` means the store received other bytes than were sent (damaged
        on the way): they are sent again, up to ``attempts`` times, then the error
        is raised. A store that refuses the checksum fields themselves raises
        :class:`_ChecksumsUnsupported`.
        """
        from botocore.exceptions import ClientError

        for attempt in range(attempts):
            with self._errors(what):
                try:
                    return fn()
                except ClientError as exc:
                    code, status = error_code(exc)
                    if code == "NotImplemented" or status == 501:
                        raise _ChecksumsUnsupported() from None
                    if code != "BadDigest" or attempt == attempts - 1:
                        raise
                    log.warning("%s: the store refused the bytes it received (BadDigest); sending them again", what)
        raise AssertionError("unreachable")

    def _put_file(self, src: Path, key: str, progress: ProgressCallback | None) -> None:
        before_part(progress)
        data = src.read_bytes()
        self._put_bytes(key, data)
        if progress is not None:
            progress(len(data))

    def write_checked(self, key: str, data: bytes, crc32c: str | None = None) -> None:
        """Store ``data`` with the CRC32C of its bytes, which the store checks
        on receipt and keeps (a plain put where the store takes no checksums)."""
        if self._checksums:
            try:
                self._put_bytes(key, data, crc32c)
                return
            except _ChecksumsUnsupported:
                log.info("%s does not take additional checksums; uploading without them", self.uri)
                self._checksums = False
        with self._errors(self.uri_for(key)):
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def _put_bytes(self, key: str, data: bytes, crc32c: str | None = None) -> None:
        from spotguard.storage.checksum import checksum_bytes, crc32c_to_base64

        crc = crc32c_to_base64(int(crc32c if crc32c is not None else checksum_bytes(data, "crc32c"), 16))
        self._checksum_call(
            self.uri_for(key),
            lambda: self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, ChecksumCRC32C=crc),
        )

    def _create_multipart(self, key: str) -> str:
        # FULL_OBJECT: the store keeps the CRC32C of the whole object (as a
        # manifest records it), not only a checksum of the part checksums.
        def create(full_object: bool) -> Any:
            extra = {"ChecksumType": "FULL_OBJECT"} if full_object else {}
            return self.client.create_multipart_upload(
                Bucket=self.bucket, Key=self._key(key), ChecksumAlgorithm="CRC32C", **extra
            )

        resp: Any = None
        if self._full_object:
            try:
                resp = self._checksum_call(self.uri_for(key), lambda: _raw(create, True))
            except _FullObjectUnsupported:
                log.info("%s does not take full-object checksums; using composite ones", self.uri)
                self._full_object = False
        if resp is None:
            resp = self._checksum_call(self.uri_for(key), lambda: create(False))
        return str(resp["UploadId"])

    def _upload_part(
        self,
        src: Path,
        key: str,
        upload_id: str,
        number: int,
        offset: int,
        length: int,
        progress: ProgressCallback | None,
        written: Callable[[int], None] | None = None,
    ) -> dict[str, Any]:
        from spotguard.storage.checksum import checksum_bytes, crc32c_to_base64

        before_part(progress)
        if written is not None:
            written(offset + length)
        data = part_buffer(length)
        got = 0
        with open(src, "rb", buffering=0) as f:
            f.seek(offset)
            while got < length and (n := f.readinto(memoryview(data)[got:])):
                got += n
        if got != length:
            raise StorageError(f"{src} changed while uploading (part {number} is short)")
        crc = crc32c_to_base64(int(checksum_bytes(data, "crc32c"), 16))
        try:
            resp = self._checksum_call(
                self.uri_for(key),
                lambda: self.client.upload_part(
                    Bucket=self.bucket,
                    Key=self._key(key),
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=data if progress is None else AskingBody(data, progress),
                    ChecksumCRC32C=crc,
                ),
            )
        except PartStopped as exc:
            raise exc.cause from None
        if progress is not None:
            progress(len(data))
        return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32C": crc, "_size": length}

    def _complete_multipart(self, key: str, upload_id: str, parts: list[dict[str, Any]]) -> None:
        from spotguard.storage.checksum import crc32c_from_base64, crc32c_of_parts, crc32c_to_base64

        extra: dict[str, str] = {}
        if self._full_object:
            # The whole file's CRC32C, combined from the parts as sent; the store
            # refuses the upload (BadDigest) unless it computes the same.
            whole = crc32c_of_parts((crc32c_from_base64(p["ChecksumCRC32C"]) or 0, p["_size"]) for p in parts)
            extra = {"ChecksumType": "FULL_OBJECT", "ChecksumCRC32C": crc32c_to_base64(whole)}
        listed = [{k: v for k, v in p.items() if k != "_size"} for p in parts]
        self._checksum_call(
            self.uri_for(key),
            lambda: self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=self._key(key),
                UploadId=upload_id,
                MultipartUpload={"Parts": listed},
                **extra,
            ),
        )

    def stored_checksum(self, key: str) -> StoredChecksum | None:
        """The CRC32C SeaweedFS/S3 computed for ``key`` on receipt, as whole-object
        hex; None when it keeps none. A multipart object's composite checksum is
        turned into the whole-object CRC32C from its per-part checksums."""
        from spotguard.storage.checksum import crc32c_from_base64

        with self._errors(self.uri_for(key)):
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key), ChecksumMode="ENABLED")
        size = int(head["ContentLength"])
        value = head.get("ChecksumCRC32C")
        if not value:
            return None
        crc = crc32c_from_base64(str(value))
        if crc is None:
            return None
        composite = "-" in str(value) or head.get("ChecksumType") == "COMPOSITE"
        if not composite:
            return StoredChecksum("crc32c", f"{crc:08x}", size, "full-object")
        whole = self._crc32c_from_parts(key, str(value), size)
        if whole is None:
            return None
        return StoredChecksum("crc32c", f"{whole:08x}", size, "parts")

    def _crc32c_from_parts(self, key: str, composite: str, size: int) -> int | None:
        """The whole-object CRC32C of a multipart object, combined from the part
        checksums the store reports, or None when it does not report them or
        they do not add up to the object (its composite checksum and size)."""
        from spotguard.storage.checksum import crc32c_composite, crc32c_from_base64, crc32c_of_parts

        count = int(composite.rsplit("-", 1)[1]) if "-" in composite else 0
        parts: list[tuple[int, int]] = []
        for number in range(1, count + 1):
            with self._errors(self.uri_for(key)):
                head = self.client.head_object(
                    Bucket=self.bucket, Key=self._key(key), PartNumber=number, ChecksumMode="ENABLED"
                )
            crc = crc32c_from_base64(str(head.get("ChecksumCRC32C") or ""))
            if crc is None or "-" in str(head.get("ChecksumCRC32C")):
                return None
            parts.append((crc, int(head["ContentLength"])))
        if not parts or sum(n for _, n in parts) != size:
            return None
        if crc32c_composite(c for c, _ in parts) != composite:
            return None
        return crc32c_of_parts(parts)

    def download_files(self, items: Iterable[tuple[str, Path]], progress: ProgressCallback | None = None) -> None:
        from boto3.s3.transfer import ProgressCallbackInvoker, create_transfer_manager

        items = list(items)
        subscribers = [ProgressCallbackInvoker(locked_progress(progress))] if progress else None
        for _, dst in items:
            Path(dst).parent.mkdir(parents=True, exist_ok=True)
        # s3transfer writes to a temporary name and renames when complete.
        with self._errors(self.uri), create_transfer_manager(self.client, self._transfer_config) as tm:
            futures = [
                tm.download(self.bucket, self._key(key), str(dst), subscribers=subscribers) for key, dst in items
            ]
            wait_all(futures)

    def delete(self, keys: Iterable[str]) -> None:
        full = [self._key(k) for k in keys]
        for i in range(0, len(full), 1000):
            batch = full[i : i + 1000]
            with self._errors(self.uri):
                resp = self.client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )
            errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise StorageError(
                    f"could not delete {len(errors)} object(s), e.g. "
                    f"s3://{self.bucket}/{first.get('Key')}: {first.get('Code')}"
                )

    def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        paginator = self.client.get_paginator("list_multipart_uploads")
        found: list[PendingUpload] = []
        with self._errors(self.uri):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._full_prefix(prefix)):
                for up in page.get("Uploads", []):
                    found.append(
                        PendingUpload(
                            key=self._rel(up["Key"]),
                            upload_id=up["UploadId"],
                            started=up["Initiated"].timestamp(),
                        )
                    )
        return found

    def abort_upload(self, upload: PendingUpload) -> None:
        try:
            with self._errors(self.uri_for(upload.key)):
                self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=self._key(upload.key), UploadId=upload.upload_id
                )
        except NotFoundError:
            pass
