"""The ``s3://`` backend's connection: URIs, the boto3 client and its settings, errors.

Endpoint, region, credentials and the number of attempts per request come
from the standard AWS environment and config files (``AWS_ENDPOINT_URL_S3``,
``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``, ``AWS_MAX_ATTEMPTS`` ...)
unless given explicitly. Transient errors are retried by botocore (standard
mode, exponential backoff with jitter). What botocore raises becomes one
:class:`~spotguard.storage.base.StorageError` a user can act on
(:func:`s3_errors`). The transfers themselves are
:class:`spotguard.storage.s3.S3Storage`.
"""

from __future__ import annotations

import http.client
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from spotguard.storage.base import CredentialsError, NotFoundError, PreconditionFailedError, StorageError, too_large
from spotguard.storage.uri import parse_bucket_uri

log = logging.getLogger(__name__)
_T = TypeVar("_T")

NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
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
    return parse_bucket_uri(uri, "s3")


def error_code(exc: BaseException) -> tuple[str, int]:
    """The S3 error code and HTTP status of a botocore error (``""`` and 0 when it has none)."""
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def make_client(
    *,
    endpoint_url: str | None,
    region: str | None,
    access_key: str | None,
    secret_key: str | None,
    session_token: str | None,
    profile: str | None,
    max_attempts: int | None,
    max_pool_connections: int,
    addressing_style: str | None,
    connect_timeout: float = 10.0,
    read_timeout: float = 120.0,
) -> Any:
    """A boto3 S3 client with spotguard's settings (see :class:`~spotguard.storage.s3.S3Storage`)."""
    import boto3
    from botocore.config import Config

    if max_attempts is None:
        # The standard AWS setting, else 8 attempts per request.
        env_attempts = os.environ.get("AWS_MAX_ATTEMPTS", "")
        max_attempts = int(env_attempts) if env_attempts.isdigit() and int(env_attempts) > 0 else 8
    session = boto3.session.Session(
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        aws_session_token=session_token,
        region_name=region,
        profile_name=profile,
    )
    has_endpoint = bool(endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
    config = Config(
        retries={"mode": "standard", "max_attempts": max_attempts},
        max_pool_connections=max_pool_connections,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        # spotguard checks every byte end to end with the manifest's
        # checksums; skip botocore's second checksum pass.
        request_checksum_calculation="when_required",
        # Presigned URLs (the trainer's restore grant) by SigV4 too, not botocore's legacy default.
        signature_version="s3v4",
        response_checksum_validation="when_required",
        # Custom endpoints (MinIO, SeaweedFS, ...) rarely have
        # wildcard DNS for virtual-hosted buckets.
        s3={"addressing_style": addressing_style or ("path" if has_endpoint else "auto")},  # type: ignore[arg-type]
    )
    return session.client("s3", endpoint_url=endpoint_url, config=config)


@contextmanager
def s3_errors(what: str, bucket: str) -> Iterator[None]:
    """Turn botocore errors into one-line :class:`StorageError` messages about ``what`` (in ``bucket``)."""
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
            f"cannot reach the S3 endpoint ({exc.kwargs.get('endpoint_url', '?')}) while accessing {what}"
        ) from None
    except bx.ClientError as exc:
        code, status = error_code(exc)
        if code == "NoSuchBucket":
            raise NotFoundError(f"bucket {bucket!r} does not exist") from None
        if code in NOT_FOUND or status == 404:
            raise NotFoundError(f"{what} does not exist") from None
        if code in _PRECONDITION or status in (409, 412):
            raise PreconditionFailedError(f"{what} changed since it was read") from None
        if code in _DENIED or status == 403:
            raise CredentialsError(f"access to {what} denied ({code or status}): check the AWS credentials") from None
        if code == "BadDigest":
            raise StorageError(
                f"S3 error on {what}: BadDigest (the store received other bytes than were sent, "
                "repeatedly: a faulty network path or proxy?)"
            ) from None
        raise StorageError(f"S3 error on {what}: {code or status}") from None
    except bx.BotoCoreError as exc:
        raise StorageError(f"S3 error on {what}: {exc}") from None


__all__ = ["error_code", "make_client", "parse_s3_uri", "s3_errors"]


def read_body(body: Any, want: int) -> bytes:
    """A response body's bytes, all ``want`` of them (botocore's ``IncompleteReadError`` otherwise)."""
    from botocore.exceptions import IncompleteReadError

    data: bytes = body.read()
    if len(data) != want:
        raise IncompleteReadError(actual_bytes=len(data), expected_bytes=want)
    return data


def read_whole(obj: Any, limit: int | None, what: str) -> bytes:
    """The body of a ``GetObject`` answer, whole; with ``limit``, at most that many bytes.

    A body the store announces larger is refused before a byte of it is read;
    one that runs on past what it announced stops at ``limit + 1`` bytes
    (:class:`~spotguard.storage.base.ObjectTooLargeError` either way). One
    shorter than announced raises botocore's ``IncompleteReadError`` (retried).
    """
    from botocore.exceptions import IncompleteReadError

    body = obj["Body"]
    if limit is None:
        data: bytes = body.read()
        return data
    announced = obj.get("ContentLength")
    if announced is not None and int(announced) > limit:
        body.close()
        raise too_large(what, int(announced), limit)
    data = body.read(limit + 1)
    if len(data) > limit:
        body.close()
        raise too_large(what, None, limit)
    if announced is not None and len(data) != int(announced):
        raise IncompleteReadError(actual_bytes=len(data), expected_bytes=int(announced))
    return data


def read_body_into(body: Any, sinks: list[memoryview]) -> None:
    """Read a response body's bytes into ``sinks``, in order, filling each.

    botocore's ``StreamingBody.read`` returns a new ``bytes`` per call, which
    a reader then copies where it wants them: every byte is written twice and
    the buffer in between is fresh memory each time. Here the bytes go from
    the socket straight into the caller's memory (``readinto`` of the HTTP
    response under urllib3's, as ``http.client`` reads a body of known
    length), and the connection goes back to urllib3's pool once the body
    is read through. Where the body is not a plain one (urllib3 decoding a
    ``Content-Encoding``, another transport), it falls back to reading and
    copying. A body shorter than the sinks raises botocore's
    ``IncompleteReadError``, a failure of the connection its
    ``ResponseStreamingError``: both are what a reader retries.
    """
    from botocore.exceptions import IncompleteReadError, ResponseStreamingError

    want = sum(len(s) for s in sinks)
    raw: Any = getattr(body, "_raw_stream", None)
    fp: Any = getattr(raw, "_fp", None)
    encoded = raw is not None and str(raw.headers.get("content-encoding", "identity")).lower() not in ("", "identity")
    if fp is None or not hasattr(fp, "readinto") or encoded:
        data = read_body(body, want)
        at = 0
        for sink in sinks:
            sink[:] = data[at : at + len(sink)]
            at += len(sink)
        return
    got = 0
    done = False
    try:
        for sink in sinks:
            filled = 0
            while filled < len(sink):
                n = fp.readinto(sink[filled:])
                if not n:
                    raise IncompleteReadError(actual_bytes=got, expected_bytes=want)
                filled += n
                got += n
        done = True
    except (OSError, http.client.HTTPException) as exc:
        raise ResponseStreamingError(error=exc) from exc
    finally:
        if done and fp.isclosed():
            raw.release_conn()  # read through: the connection serves the next request
        else:
            raw.close()  # never hand a half-read connection to the next request


def retrying_read(fn: Callable[[], _T], what: str, attempts: int = 4) -> _T:
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
