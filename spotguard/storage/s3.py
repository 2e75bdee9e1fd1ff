"""``s3://bucket/prefix`` storage through boto3 and s3transfer.

Endpoint, region and credentials come from the standard AWS environment and
config files (``AWS_ENDPOINT_URL_S3``, ``AWS_DEFAULT_REGION``,
``AWS_ACCESS_KEY_ID`` ...) unless given explicitly. Transient errors are
retried by botocore (standard mode, exponential backoff with jitter); reads of
large objects are split into concurrent ranged GETs that are retried one range
at a time. Large files go up and down as concurrent multipart transfers.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from spotguard.storage.base import (
    CredentialsError,
    NotFoundError,
    ObjectInfo,
    PendingUpload,
    PreconditionFailedError,
    ProgressCallback,
    StorageError,
    check_key,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
_T = TypeVar("_T")

_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_PRECONDITION = {"412", "PreconditionFailed", "409", "ConditionalRequestConflict"}
_DENIED = {
    "403",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
}


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/prefix`` into bucket and prefix (no slashes around)."""
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    rest = uri[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}: use s3://BUCKET/PREFIX")
    prefix = prefix.strip("/")
    if prefix and any(p in ("", ".", "..") for p in prefix.split("/")):
        raise ValueError(f"invalid prefix in {uri!r}")
    return bucket, prefix


def _error_code(exc: BaseException) -> tuple[str, int]:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


class S3Storage:
    """Storage rooted at ``s3://bucket/prefix``."""

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
        max_attempts: int = 8,
        max_pool_connections: int = 32,
        multipart_threshold: int = 32 * MiB,
        multipart_chunksize: int = 32 * MiB,
        max_concurrency: int = 8,
        read_chunk_size: int = 16 * MiB,
        addressing_style: str | None = None,
        client: Any = None,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket, self.prefix = parse_s3_uri(uri)
        self._read_chunk = read_chunk_size
        self._concurrency = max_concurrency
        self._conditional = True
        if client is None:
            session = boto3.session.Session(
                aws_access_key_id=access_key,
                aws_secret_access_key=secret_key,
                aws_session_token=session_token,
                region_name=region,
                profile_name=profile,
            )
            has_endpoint = bool(
                endpoint_url
                or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL")
            )
            config = Config(
                retries={"mode": "standard", "max_attempts": max_attempts},
                max_pool_connections=max_pool_connections,
                connect_timeout=10,
                read_timeout=120,
                # spotguard checks every byte end to end with the manifest's
                # checksums; skip botocore's second checksum pass.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                # Custom endpoints (MinIO, SeaweedFS, ...) rarely have
                # wildcard DNS for virtual-hosted buckets.
                s3={"addressing_style": addressing_style or ("path" if has_endpoint else "auto")},  # type: ignore[arg-type]
            )
            client = session.client("s3", endpoint_url=endpoint_url, config=config)
        self.client = client
        self._transfer_config = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            use_threads=True,
        )

    # -- identity -----------------------------------------------------------
    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    @property
    def supports_conditional_writes(self) -> bool:
        return self._conditional

    def uri_for(self, key: str) -> str:
        return f"{self.uri}/{check_key(key)}"

    def __repr__(self) -> str:
        return f"S3Storage({self.uri!r})"

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1 :] if self.prefix else full_key

    def _full_prefix(self, prefix: str) -> str:
        if not self.prefix:
            return prefix
        return f"{self.prefix}/{prefix}"

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Turn botocore errors into one-line :class:`StorageError` messages."""
        from botocore import exceptions as bx

        try:
            yield
        except StorageError:
            raise
        except bx.NoCredentialsError:
            raise CredentialsError(
                "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE / an instance role)"
            ) from None
        except bx.PartialCredentialsError as exc:
            raise CredentialsError(f"incomplete AWS credentials: {exc}") from None
        except (bx.EndpointConnectionError, bx.ConnectTimeoutError) as exc:
            raise StorageError(
                f"cannot reach the S3 endpoint ({exc.kwargs.get('endpoint_url', '?')}) "
                f"while accessing {what}"
            ) from None
        except bx.ClientError as exc:
            code, status = _error_code(exc)
            if code == "NoSuchBucket":
                raise NotFoundError(f"bucket {self.bucket!r} does not exist") from None
            if code in _NOT_FOUND or status == 404:
                raise NotFoundError(f"{what} does not exist") from None
            if code in _PRECONDITION or status in (409, 412):
                raise PreconditionFailedError(f"{what} changed since it was read") from None
            if code in _DENIED or status == 403:
                raise CredentialsError(
                    f"access to {what} denied ({code or status}): check the AWS credentials"
                ) from None
            raise StorageError(f"S3 error on {what}: {code or status}") from None
        except bx.BotoCoreError as exc:
            raise StorageError(f"S3 error on {what}: {exc}") from None

    def check(self) -> None:
        with self._errors(f"bucket {self.bucket!r}"):
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except Exception as exc:
                code, status = _error_code(exc)
                if code in _NOT_FOUND or status == 404:
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
                )

    def list_dirs(self, prefix: str = "") -> list[str]:
        # Derived from the recursive listing rather than Delimiter="/": some
        # stores (SeaweedFS) keep reporting a "directory" after its last object
        # is deleted, and a deleted checkpoint must not look like a broken one.
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        rests = (o.key[len(prefix) :] for o in self.list_objects(prefix))
        return sorted({rest.split("/", 1)[0] for rest in rests if "/" in rest} - {""})

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            with self._errors(self.uri_for(key)):
                head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except NotFoundError:
            return None
        return ObjectInfo(
            key=key, size=int(head["ContentLength"]), modified=head["LastModified"].timestamp()
        )

    def read_with_etag(self, key: str) -> tuple[bytes, str] | None:
        def once() -> tuple[bytes, str]:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            return obj["Body"].read(), str(obj["ETag"])

        try:
            with self._errors(self.uri_for(key)):
                return self._retrying(once, self.uri_for(key))
        except NotFoundError:
            return None

    def read_bytes(self, key: str) -> bytes:
        found = self.read_with_etag(key)
        if found is None:
            raise NotFoundError(f"{self.uri_for(key)} does not exist")
        return found[0]

    def _retrying(self, fn: Callable[[], _T], what: str, attempts: int = 4) -> _T:
        """Retry a streaming read that botocore cannot retry by itself."""
        from botocore import exceptions as bx
        from urllib3 import exceptions as ux

        transient = (
            bx.ResponseStreamingError,
            bx.IncompleteReadError,
            bx.ReadTimeoutError,
            bx.ConnectionClosedError,
            ux.ProtocolError,
            ux.ReadTimeoutError,
            ConnectionError,
        )
        for attempt in range(attempts):
            try:
                return fn()
            except transient as exc:
                if attempt == attempts - 1:
                    raise StorageError(f"reading {what} kept failing: {exc}") from None
                delay = min(8.0, 0.2 * 2**attempt) * (0.5 + random.random())
                log.warning("reading %s failed (%s); retrying in %.1fs", what, exc, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _get_range(self, key: str, start: int, end: int, etag: str) -> bytes:
        def once() -> bytes:
            obj = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end - 1}", IfMatch=etag
            )
            data: bytes = obj["Body"].read()
            if len(data) != end - start:
                from botocore.exceptions import IncompleteReadError

                raise IncompleteReadError(actual_bytes=len(data), expected_bytes=end - start)
            return data

        # Retry transient stream failures first; translate what remains.
        with self._errors(self.uri_for(key)):
            return self._retrying(once, self.uri_for(key))

    def iter_chunks(self, key: str, chunk_size: int | None = None) -> Iterator[bytes]:
        chunk = max(chunk_size or self._read_chunk, MiB)
        with self._errors(self.uri_for(key)):
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        size = int(head["ContentLength"])
        etag = str(head["ETag"])
        if size == 0:
            return
        ranges = [(s, min(s + chunk, size)) for s in range(0, size, chunk)]
        if len(ranges) == 1:
            yield self._get_range(key, 0, size, etag)
            return
        # Fetch ranges concurrently, hand them out in order; bounded look-ahead
        # keeps memory at about `window` chunks.
        window = self._concurrency
        pool = ThreadPoolExecutor(max_workers=window)
        pending: deque[Future[bytes]] = deque()
        try:
            it = iter(ranges)
            for s, e in it:
                pending.append(pool.submit(self._get_range, key, s, e, etag))
                if len(pending) >= window:
                    break
            while pending:
                data = pending.popleft().result()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append(pool.submit(self._get_range, key, nxt[0], nxt[1], etag))
                yield data
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    # -- writing ------------------------------------------------------------
    def write_bytes(
        self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False
    ) -> str:
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
                code, status = _error_code(exc)
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

    def upload_files(
        self, items: Iterable[tuple[Path, str]], progress: ProgressCallback | None = None
    ) -> None:
        from boto3.s3.transfer import ProgressCallbackInvoker, create_transfer_manager

        items = list(items)
        subscribers = [ProgressCallbackInvoker(_locked(progress))] if progress else None
        with self._errors(self.uri), create_transfer_manager(self.client, self._transfer_config) as tm:
            futures = [
                tm.upload(str(src), self.bucket, self._key(key), subscribers=subscribers) for src, key in items
            ]
            _wait_all(futures)

    def download_files(
        self, items: Iterable[tuple[str, Path]], progress: ProgressCallback | None = None
    ) -> None:
        from boto3.s3.transfer import ProgressCallbackInvoker, create_transfer_manager

        items = list(items)
        subscribers = [ProgressCallbackInvoker(_locked(progress))] if progress else None
        for _, dst in items:
            Path(dst).parent.mkdir(parents=True, exist_ok=True)
        # s3transfer writes to a temporary name and renames when complete.
        with self._errors(self.uri), create_transfer_manager(self.client, self._transfer_config) as tm:
            futures = [
                tm.download(self.bucket, self._key(key), str(dst), subscribers=subscribers) for key, dst in items
            ]
            _wait_all(futures)

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


def _locked(progress: ProgressCallback) -> ProgressCallback:
    """Serialize progress callbacks coming from transfer threads."""
    lock = threading.Lock()

    def call(n: int) -> None:
        with lock:
            progress(n)

    return call


def _wait_all(futures: list[Any]) -> None:
    """Wait for every transfer; on the first failure cancel the rest and raise it."""
    try:
        for fut in futures:
            fut.result()
    except BaseException:
        for fut in futures:
            fut.cancel()
        raise
