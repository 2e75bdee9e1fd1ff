"""Ranged reads from the real S3 store straight into the caller's memory (``RangedObject.fetch_into``)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from ckpt_helpers import s3_options

from spotguard.storage import StorageError, open_storage
from spotguard.storage.s3 import S3Storage

MiB = 1 << 20


def _storage(s3_store: Any, s3_uri: str) -> S3Storage:
    storage = open_storage(s3_uri, **s3_options(s3_store), read_chunk_size=MiB)
    assert isinstance(storage, S3Storage)
    return storage


def _split(total: int, cuts: list[int]) -> list[bytearray]:
    edges = [0, *cuts, total]
    return [bytearray(b - a) for a, b in zip(edges, edges[1:], strict=False)]


def test_ranges_land_in_the_callers_buffers_and_the_connection_is_reused(
    s3_store: Any, s3_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import urllib3.connection
    from botocore.response import StreamingBody

    storage = _storage(s3_store, s3_uri)
    data = os.urandom(3 * MiB + 7)
    storage.write_bytes("into/x", data)
    obj = storage.open_ranged("into/x")
    assert obj.fetch_into is not None

    def no_copy(self: Any, amt: int | None = None) -> bytes:
        raise AssertionError("the body was read into a bytes object of its own")

    connects: list[int] = []
    real_connect = urllib3.connection.HTTPConnection.connect

    def connect(self: Any) -> None:
        connects.append(1)
        real_connect(self)

    monkeypatch.setattr(StreamingBody, "read", no_copy)
    monkeypatch.setattr(urllib3.connection.HTTPConnection, "connect", connect)
    for start, cuts, end in [
        (0, [], MiB),
        (5, [1, 70_000, 70_001], MiB + 5),
        (2 * MiB, [MiB // 2], 3 * MiB + 7),
        (3 * MiB, [3, 4], 3 * MiB + 7),
    ]:
        sinks = _split(end - start, [c for c in cuts if c < end - start])
        obj.fetch_into(start, [memoryview(s) for s in sinks])
        assert b"".join(sinks) == data[start:end]
    for _ in range(10):
        sink = bytearray(1000)
        obj.fetch_into(123, [memoryview(sink)])
        assert bytes(sink) == data[123:1123]
    # Each body read through hands its connection back: the HEAD's connection served every GET.
    assert connects == []


def test_a_body_shorter_than_asked_is_retried_then_one_clear_error(s3_store: Any, s3_uri: str) -> None:
    storage = _storage(s3_store, s3_uri)
    storage.write_bytes("into/short", b"y" * 1000)
    obj = storage.open_ranged("into/short")
    assert obj.fetch_into is not None
    sink = bytearray(200)
    with pytest.raises(StorageError, match="kept failing"):
        obj.fetch_into(900, [memoryview(sink)])  # the store has 100 of these bytes


def test_a_connection_broken_mid_body_is_closed_and_the_range_read_again(
    s3_store: Any, s3_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = _storage(s3_store, s3_uri)
    data = os.urandom(2 * MiB)
    storage.write_bytes("into/broken", data)
    obj = storage.open_ranged("into/broken")
    assert obj.fetch_into is not None
    real_get = storage.client.get_object
    closed: list[bool] = []

    def get_object(**kwargs: Any) -> Any:
        response = real_get(**kwargs)
        if closed:
            return response
        raw = response["Body"]._raw_stream
        fp = raw._fp
        real_readinto, real_close = fp.readinto, raw.close
        reads = {"n": 0}

        def readinto(b: Any) -> int:
            reads["n"] += 1
            if reads["n"] == 3:
                raise ConnectionResetError("reset by peer")
            return int(real_readinto(memoryview(b)[: 64 * 1024]))

        def close() -> None:
            closed.append(True)
            real_close()

        fp.readinto = readinto
        raw.close = close
        return response

    monkeypatch.setattr(storage.client, "get_object", get_object)
    sink = bytearray(MiB)
    obj.fetch_into(MiB, [memoryview(sink)])
    assert bytes(sink) == data[MiB:]
    assert closed == [True]  # the half-read connection was not handed to the next request


def test_ranges_read_as_a_listing_saw_the_object_fail_once_it_was_replaced(s3_store: Any, s3_uri: str) -> None:
    """``open_ranged(key, seen)`` asks the store nothing first: the listing's
    entity tag pins the reads, so a version replaced since the listing is
    never read as if it were the listed one."""
    storage = _storage(s3_store, s3_uri)
    storage.write_bytes("into/listed", b"a" * (2 * MiB))
    seen = next(o for o in storage.list_objects("into/") if o.key == "into/listed")
    assert seen.version and seen.size == 2 * MiB
    assert storage.open_ranged("into/listed", seen).fetch(0, 4) == b"aaaa"
    storage.write_bytes("into/listed", b"b" * (2 * MiB))
    stale = storage.open_ranged("into/listed", seen)
    assert stale.fetch_into is not None
    with pytest.raises(StorageError):
        stale.fetch(0, MiB)
    with pytest.raises(StorageError):
        stale.fetch_into(MiB, [memoryview(bytearray(MiB))])
    assert storage.open_ranged("into/listed").fetch(0, 4) == b"bbbb"
