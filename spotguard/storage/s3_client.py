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

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from spotguard.storage.base import CredentialsError, NotFoundError, PreconditionFailedError, StorageError

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
