"""Deleting gs:// objects for :mod:`spotguard.storage.gcs`: batch requests of up to
:data:`BATCH_LIMIT` deletions, each deletion a batch could not do sent again on its
own with the client's retries; one request per object where batches are off (a custom
endpoint: an emulator may have none). A missing object is already deleted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from google.api_core import exceptions as gexc

from spotguard.storage.base import CredentialsError, StorageError, wait_all
from spotguard.storage.gcs_client import endpoint_of

#: The most calls one batch request may carry (a GCS limit).
BATCH_LIMIT = 100


@dataclass(frozen=True)
class Deleter:
    """How one :class:`~spotguard.storage.gcs.GcsStorage` deletes: its bucket's
    name, whether batches are on, and the retries, timeouts and error mapping of
    its other requests."""

    bucket: str
    uri: str
    endpoint_url: str | None
    batches: bool
    concurrency: int
    retry: Any  # google.api_core Retry
    timeout: tuple[float, float]
    errors: Callable[[str], AbstractContextManager[None]]

    def delete(self, client: Any, names: list[str]) -> None:
        """Delete the objects of these full names (missing ones ignored)."""
        for i in range(0, len(names), BATCH_LIMIT):
            chunk = names[i : i + BATCH_LIMIT]
            if self.batches:
                self._delete_batch(client, chunk)
            else:
                self._delete_each(client, chunk)

    def _delete_batch(self, client: Any, names: list[str]) -> None:
        bucket = client.bucket(self.bucket)

        def send() -> list[Any]:
            with client.batch(raise_exception=False) as batch:
                for name in names:
                    bucket.delete_blob(name)
            return list(batch._responses)  # noqa: SLF001 - the per-call answers of the batch

        with self.errors(self.uri):
            try:
                responses = self.retry(send)()
            except ValueError:  # the answer was not a batch answer
                raise StorageError(
                    f"{endpoint_of(self.endpoint_url)} does not take batch requests: "
                    f"open {self.uri} with batch_deletes=False"
                ) from None
        again: list[str] = []
        for name, resp in zip(names, responses, strict=True):
            status = int(getattr(resp, "status_code", 0))
            if 200 <= status < 300 or status == 404:
                continue
            if status in (403, 401):
                raise CredentialsError(
                    f"deleting gs://{self.bucket}/{name} denied ({status}): check the Google Cloud credentials"
                )
            again.append(name)  # throttled or failed within the batch: once more on its own, with retries
        if again:
            self._delete_each(client, again)

    def _delete_each(self, client: Any, names: list[str]) -> None:
        bucket = client.bucket(self.bucket)

        def one(name: str) -> None:
            with self.errors(f"gs://{self.bucket}/{name}"), contextlib.suppress(gexc.NotFound):
                bucket.delete_blob(name, retry=self.retry, timeout=self.timeout)

        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="gcs-del") as pool:
            wait_all([pool.submit(one, name) for name in names])
