"""The ``gs://`` backend's connection: URIs, credentials, the client, errors and retried checks.

Credentials are Application Default Credentials: Workload Identity on GKE (no
key at all), a key file named by ``GOOGLE_APPLICATION_CREDENTIALS`` (say,
mounted from a Secret), or ``gcloud auth application-default login`` on a
workstation; ``credentials_file=`` names a key file explicitly. An emulator
is reached through ``STORAGE_EMULATOR_HOST`` (the client's own convention) or
``endpoint_url=``, with anonymous credentials. Nothing here logs credentials,
and no error message quotes a key.

What the client raises becomes one
:class:`~spotguard.storage.base.StorageError` a user can act on
(:func:`gcs_errors`); a transfer whose bytes fail their CRC32C check on the
way is sent or read again (:func:`checked`). The transfers themselves are
:class:`spotguard.storage.gcs.GcsStorage`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import requests
from google.api_core import exceptions as gexc
from google.auth import exceptions as authexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage as gcs
from google.oauth2 import service_account
from requests.adapters import HTTPAdapter

from spotguard.storage.base import (
    CredentialsError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
    StoredChecksum,
)
from spotguard.storage.checksum import crc32c_from_base64
from spotguard.storage.uri import parse_bucket_uri

log = logging.getLogger(__name__)

#: Resumable upload chunks must be multiples of this (a GCS rule).
CHUNK_QUANTUM = 256 << 10
_T = TypeVar("_T")

_NO_CREDENTIALS = (
    "no Google Cloud credentials found: on GKE bind the pod's service account with Workload Identity, "
    "elsewhere set GOOGLE_APPLICATION_CREDENTIALS to a service account key file "
    "(or run `gcloud auth application-default login`)"
)


def _data_corruption_types() -> tuple[type[BaseException], ...]:
    """The client's checksum-mismatch exception (its module moved in google-cloud-storage 3)."""
    found: list[type[BaseException]] = []
    with contextlib.suppress(ImportError, AttributeError):
        from google.cloud.storage import exceptions as storage_exceptions

        found.append(storage_exceptions.DataCorruption)
    with contextlib.suppress(ImportError, AttributeError):
        from google.resumable_media import common as media_common

        found.append(media_common.DataCorruption)
    return tuple(found)


_DATA_CORRUPTION = _data_corruption_types()


def parse_gs_uri(uri: str) -> tuple[str, str]:
    """Pure: split ``gs://bucket/prefix`` into bucket and prefix (no slashes around)."""
    return parse_bucket_uri(uri, "gs")


def upload_chunk_size(requested: int) -> int:
    """Pure: ``requested`` rounded up to a multiple of 256 KiB (what resumable uploads require)."""
    return max(CHUNK_QUANTUM, -(-requested // CHUNK_QUANTUM) * CHUNK_QUANTUM)


def endpoint_of(endpoint_url: str | None) -> str:
    """The endpoint requests go to: ``endpoint_url``, the emulator's, or Google's."""
    return endpoint_url or os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"


def make_client(
    *,
    endpoint_url: str | None,
    credentials_file: str | None,
    credentials_info: Mapping[str, Any] | None,
    anonymous: bool,
    project: str | None,
    concurrency: int,
) -> Any:
    """A ``google.cloud.storage.Client`` with a connection pool for ``concurrency`` transfers."""
    credentials: Any = None
    if credentials_file:
        credentials = key_file_credentials(credentials_file)
    elif credentials_info:
        credentials = key_info_credentials(credentials_info)
    elif anonymous:
        credentials = AnonymousCredentials()  # type: ignore[no-untyped-call]
    options = {"api_endpoint": endpoint_url} if endpoint_url else None
    # project=None: object operations need no project, and none may be configured.
    client = gcs.Client(project=project, credentials=credentials, client_options=options)
    # Room in the connection pool for every concurrent transfer (the default keeps 10).
    adapter = HTTPAdapter(pool_connections=4, pool_maxsize=2 * concurrency + 4)
    session = client._http  # noqa: SLF001 - the client has no public way to size its pool
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    return client


def key_file_credentials(path: str) -> Any:
    """A service account key file's credentials. Other kinds of credential files
    (workload identity federation, user credentials) go through
    ``GOOGLE_APPLICATION_CREDENTIALS``. Errors name the file, never its content."""
    try:
        return service_account.Credentials.from_service_account_file(path)  # type: ignore[no-untyped-call]
    except FileNotFoundError:
        raise CredentialsError(f"the service account key file {path} does not exist") from None
    except (OSError, ValueError, KeyError) as exc:
        raise CredentialsError(
            f"cannot use {path} as a service account key ({type(exc).__name__}): it must be the JSON key "
            "of a service account (type, client_email, private_key, token_uri)"
        ) from None


def key_info_credentials(info: Mapping[str, Any]) -> Any:
    """A service account key given as its parsed JSON (say, read from a Secret); errors never quote it."""
    try:
        return service_account.Credentials.from_service_account_info(info)  # type: ignore[no-untyped-call]
    except (ValueError, KeyError) as exc:
        raise CredentialsError(
            f"the service account key given is not usable ({type(exc).__name__}): it must be the JSON key "
            "of a service account (type, client_email, private_key, token_uri)"
        ) from None


@contextmanager
def gcs_errors(
    what: str, *, bucket: str, endpoint_url: str | None, retry_deadline: float, listing: bool = False
) -> Iterator[None]:
    """Turn client errors into one-line :class:`StorageError` messages about ``what`` (in ``bucket``).

    ``listing``: a 404 means the bucket is missing (a listing never misses an object).
    """
    try:
        yield
    except StorageError:
        raise
    except gexc.RetryError as exc:
        cause = exc.cause
        if isinstance(cause, (requests.exceptions.ConnectionError, ConnectionError)):
            raise _unreachable(what, endpoint_url, retry_deadline) from None
        raise StorageError(f"GCS kept failing on {what} for {retry_deadline:.0f}s: {short(cause or exc)}") from None
    except authexc.DefaultCredentialsError as exc:
        # Its messages name files and what is missing, never a key's content.
        named = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
        if named:
            raise CredentialsError(
                f"the Google Cloud credentials in GOOGLE_APPLICATION_CREDENTIALS={named} cannot be used "
                f"({short(exc)}): it must name a service account key or a credential configuration file"
            ) from None
        raise CredentialsError(f"{_NO_CREDENTIALS} ({short(exc)})") from None
    except authexc.RefreshError as exc:
        raise CredentialsError(
            f"the Google Cloud credentials could not be refreshed while accessing {what}: {short(exc)} "
            "(check the Workload Identity binding or the key file)"
        ) from None
    except authexc.TransportError as exc:
        raise StorageError(f"cannot reach Google's credential service while accessing {what}: {short(exc)}") from None
    except gexc.NotFound as exc:
        # GCS says "The specified bucket does not exist." (the URL in the message names the bucket too).
        if listing or "specified bucket does not exist" in str(exc.message).lower():
            raise NotFoundError(f"bucket {bucket!r} does not exist") from None
        raise NotFoundError(f"{what} does not exist") from None
    except gexc.PreconditionFailed:
        raise PreconditionFailedError(f"{what} changed since it was read") from None
    except (gexc.Forbidden, gexc.Unauthorized) as exc:
        raise CredentialsError(
            f"access to {what} denied ({exc.code}): check the Google Cloud credentials and that the "
            f"principal may read and write objects in bucket {bucket!r} (roles/storage.objectUser)"
        ) from None
    except gexc.GoogleAPICallError as exc:
        raise StorageError(f"GCS error on {what}: {exc.code} {short(exc.message)}") from None
    except (requests.exceptions.ConnectionError, ConnectionError):
        raise _unreachable(what, endpoint_url) from None
    except _DATA_CORRUPTION as exc:
        raise StorageError(
            f"GCS transfer of {what} failed its CRC32C check repeatedly (a faulty network path or proxy?): {short(exc)}"
        ) from None


def _unreachable(what: str, endpoint_url: str | None, retried: float | None = None) -> StorageError:
    """An endpoint that cannot be reached while accessing ``what``, also after ``retried`` seconds of retries."""
    after = "" if retried is None else f" (retried for {retried:.0f}s)"
    return StorageError(f"cannot reach the GCS endpoint ({endpoint_of(endpoint_url)}) while accessing {what}{after}")


def checked(what: str, fn: Callable[[], _T], attempts: int = 3) -> _T:
    """Run a transfer whose bytes are checked by CRC32C, sending or reading them
    again when the check fails (bytes damaged on the way), ``attempts`` times."""
    for attempt in range(attempts):
        try:
            return fn()
        except _DATA_CORRUPTION:
            if attempt == attempts - 1:
                raise
            log.warning("%s: the bytes failed their CRC32C check on the way; transferring them again", what)
        except gexc.BadRequest as exc:
            # GCS refuses an upload whose bytes do not have the CRC32C sent with them.
            if "crc32c" not in str(exc).lower() or attempt == attempts - 1:
                raise
            log.warning("%s: the store refused the bytes it received (CRC32C mismatch); sending them again", what)
    raise AssertionError("unreachable")


def short(exc: object, limit: int = 300) -> str:
    """The first line of an error, cut to ``limit`` characters (client errors can be long)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = [
    "CHUNK_QUANTUM",
    "checked",
    "endpoint_of",
    "gcs_errors",
    "key_file_credentials",
    "key_info_credentials",
    "make_client",
    "parse_gs_uri",
    "short",
    "upload_chunk_size",
]


# -- what the service reports, in spotguard's notation ---------------------------------


def crc32c_hex(value: str | None) -> str | None:
    """Pure: an object's ``crc32c`` as GCS reports it (base64 of 4 big-endian bytes)
    in the manifest's notation (8 lowercase hex digits), or None when absent or malformed."""
    if not value:
        return None
    crc = crc32c_from_base64(value)
    if crc is None or "-" in value:
        return None
    return f"{crc:08x}"


def stored_checksum_from(crc32c: str | None, size: int) -> StoredChecksum | None:
    """Pure: the :class:`StoredChecksum` for an object's ``crc32c`` metadata.

    GCS computes the CRC32C of every object over all its bytes (composed
    objects included), so it is always a whole-object value."""
    value = crc32c_hex(crc32c)
    if value is None:
        return None
    return StoredChecksum("crc32c", value, size, "full-object")


def generation_of(etag: str | None) -> int | None:
    """Pure: the generation an entity tag of this backend names, or None when it
    is not one (a tag from another store can never match)."""
    if etag is None or not etag.isdigit():
        return None
    return int(etag)
