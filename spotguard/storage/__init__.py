"""Object storage for checkpoints: ``s3://bucket/prefix``, ``gs://bucket/prefix`` and ``file:///path``.

>>> from spotguard.storage import open_storage
>>> store = open_storage("file:///tmp/ckpts/my-job")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from spotguard.storage.base import (
    UNCHANGED,
    CredentialsError,
    NotFoundError,
    ObjectInfo,
    ObjectTooLargeError,
    PendingUpload,
    PreconditionFailedError,
    ProgressCallback,
    Storage,
    StorageError,
    StoreChecksums,
    StoredChecksum,
    Unchanged,
    check_key,
    join_key,
)
from spotguard.storage.uri import parse_storage_uri

__all__ = [
    "CredentialsError",
    "NotFoundError",
    "ObjectInfo",
    "ObjectTooLargeError",
    "PendingUpload",
    "PreconditionFailedError",
    "ProgressCallback",
    "Storage",
    "StorageError",
    "StoreChecksums",
    "StoredChecksum",
    "UNCHANGED",
    "Unchanged",
    "check_key",
    "join_key",
    "open_storage",
]


def open_storage(uri: str, **options: Any) -> Storage:
    """Open the storage rooted at ``uri``.

    ``s3://bucket/prefix`` takes the options of
    :class:`spotguard.storage.s3.S3Storage` (``endpoint_url``, ``region``,
    ``access_key``, ``secret_key``, transfer tuning); otherwise the standard
    AWS environment and config apply. ``gs://bucket/prefix`` takes the options
    of :class:`spotguard.storage.gcs.GcsStorage` (``endpoint_url``,
    ``credentials_file``, transfer tuning); otherwise Application Default
    Credentials apply. ``file:///abs/path`` (or a plain path) opens a
    directory. Raises :class:`StorageError` for an unusable URI.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise StorageError("empty storage URI: use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or file:///PATH")
    if uri != uri.strip():
        # The operator's spec check and the CRD refuse it too: one grammar (spotguard.storage.uri).
        raise StorageError(f"white space around the storage URI {uri!r}: remove it")
    try:
        if uri.startswith("s3://"):
            from spotguard.storage.s3 import S3Storage

            return S3Storage(uri, **options)
        if uri.startswith("gs://"):
            try:
                from spotguard.storage.gcs import GcsStorage
            except ImportError as exc:
                raise StorageError(
                    f"gs:// storage needs the Google Cloud Storage client ({exc}): pip install 'spotguard[gcs]'"
                ) from None
            return GcsStorage(uri, **options)
        if uri.startswith("file:"):
            from spotguard.storage.file import FileStorage

            parse_storage_uri(uri)
            return FileStorage(unquote(urlsplit(uri).path), **options)
    except ValueError as exc:  # the URI's grammar (spotguard.storage.uri) said what is wrong
        raise StorageError(str(exc)) from None
    if "://" in uri:
        scheme = uri.split("://", 1)[0]
        raise StorageError(f"unsupported storage URI scheme {scheme!r} in {uri!r}: use s3://, gs:// or file://")
    from spotguard.storage.file import FileStorage

    return FileStorage(uri, **options)
