"""``max_read_bytes``: whole-object reads that stop at a size, against real stores and a flooding proxy.

The operator opens each job's store with it: a ``latest`` pointer or a
manifest is small, and a store that answers gigabytes must cost a refusal,
not the operator's memory.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import s3_options

from spotguard.storage import UNCHANGED, ObjectTooLargeError, open_storage
from testenv.faultproxy import FaultProxy, flood

LIMIT = 64 << 10


def test_s3_reads_up_to_the_limit_and_refuses_past_it(s3_store: Any, s3_uri: str) -> None:
    storage = open_storage(s3_uri, **s3_options(s3_store), max_read_bytes=LIMIT)
    storage.write_bytes("small", b"x" * LIMIT)
    storage.write_bytes("big", b"y" * (LIMIT + 1))
    assert storage.read_bytes("small") == b"x" * LIMIT
    found = storage.read_with_etag("small")
    assert found is not None and storage.read_if_changed("small", found[1]) is UNCHANGED
    for read in (storage.read_bytes, storage.read_with_etag, lambda key: storage.read_if_changed(key, '"other"')):
        with pytest.raises(ObjectTooLargeError, match=f"big holds {LIMIT + 1} bytes; reads of it take at most {LIMIT}"):
            read("big")
    # Without a limit (every reader but the operator), as before.
    assert open_storage(s3_uri, **s3_options(s3_store)).read_bytes("big") == b"y" * (LIMIT + 1)


@pytest.mark.parametrize("announce", [True, False], ids=["announced", "chunked"])
def test_s3_stops_a_store_that_floods_the_answer(s3_store: Any, s3_uri: str, announce: bool) -> None:
    """The store sends 1 GiB where a pointer was asked for: told by its header, or only by its bytes."""
    with FaultProxy(s3_store.endpoint_url) as proxy:
        proxy.add(flood(1 << 30, announce=announce), method="GET", path=r"/latest$")
        storage = open_storage(
            s3_uri, **{**s3_options(s3_store), "endpoint_url": proxy.url}, max_read_bytes=LIMIT, max_attempts=1
        )
        with pytest.raises(ObjectTooLargeError, match="holds (1073741824 bytes|more than 65536 bytes)"):
            storage.read_with_etag("latest")
        assert len(proxy.requests("GET")) == 1  # refused, not retried


def test_file_storage_reads_at_most_the_limit(tmp_path: Path) -> None:
    storage = open_storage(f"file://{tmp_path}", max_read_bytes=LIMIT)
    storage.write_bytes("small", b"x" * LIMIT)
    storage.write_bytes("big", b"y" * (LIMIT + 1))
    assert storage.read_bytes("small") == b"x" * LIMIT
    with pytest.raises(ObjectTooLargeError, match="more than 65536 bytes"):
        storage.read_with_etag("big")
    # A key that is an endless device on disk reads no further than the limit either.
    (tmp_path / "endless").symlink_to("/dev/zero")
    with pytest.raises(ObjectTooLargeError):
        storage.read_bytes("endless")


def test_gcs_reads_up_to_the_limit_and_refuses_past_it(gcs_store: Any) -> None:
    uri = f"gs://{gcs_store.bucket}/t-{uuid.uuid4().hex[:10]}"
    storage = open_storage(uri, **gcs_store.options(), max_read_bytes=LIMIT)
    storage.write_bytes("small", b"x" * LIMIT)
    storage.write_bytes("big", b"y" * (LIMIT + 1))
    assert storage.read_bytes("small") == b"x" * LIMIT
    with pytest.raises(ObjectTooLargeError, match="more than 65536 bytes"):
        storage.read_with_etag("big")
    with FaultProxy(gcs_store.endpoint_url) as proxy:
        proxy.add(flood(1 << 30, announce=False), method="GET", path=r"alt=media")
        flooded = open_storage(uri, endpoint_url=proxy.url, max_read_bytes=LIMIT, retry_deadline=2.0)
        with pytest.raises(ObjectTooLargeError):
            flooded.read_bytes("small")
