"""The pure parts of the gs:// backend: URIs, checksum notation, entity tags, ranges, progress."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testenv.require import require_module

require_module("google.cloud.storage")

from spotguard.storage import Storage, StorageError, StoreChecksums, open_storage  # noqa: E402
from spotguard.storage.base import ObjectInfo, PendingUpload, byte_ranges  # noqa: E402
from spotguard.storage.checksum import crc32c_to_base64  # noqa: E402
from spotguard.storage.gcs import GcsStorage  # noqa: E402
from spotguard.storage.gcs_client import (  # noqa: E402  # noqa: E402
    crc32c_hex,
    gcs_errors,
    generation_of,
    parse_gs_uri,
    stored_checksum_from,
    upload_chunk_size,
)
from spotguard.storage.gcs_pieces import (  # noqa: E402
    COMPOSE_LIMIT,
    Furthest,
    Window,
    composite_pieces,
    parse_piece_key,
    pending_uploads,
    piece_key,
    pieces_of,
)


@pytest.mark.parametrize(
    "uri, bucket, prefix",
    [
        ("gs://bucket", "bucket", ""),
        ("gs://bucket/", "bucket", ""),
        ("gs://my-bucket/team-a/job", "my-bucket", "team-a/job"),
        ("gs://my_bucket.example.com/a/b/", "my_bucket.example.com", "a/b"),
    ],
)
def test_gs_uris_parse(uri: str, bucket: str, prefix: str) -> None:
    assert parse_gs_uri(uri) == (bucket, prefix)


@pytest.mark.parametrize(
    "uri, message",
    [
        ("s3://bucket/x", "not a gs:// URI"),
        ("gs:///x", "no bucket"),
        ("gs://Bucket/x", "invalid bucket name"),
        ("gs://ab/x", "invalid bucket name"),
        ("gs://-bucket/x", "invalid bucket name"),
        ("gs://bu..cket/x", "invalid bucket name"),
        ("gs://bucket/a/../b", "invalid prefix"),
        ("gs://bucket/a//b", "invalid prefix"),
    ],
)
def test_bad_gs_uris_are_refused(uri: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_gs_uri(uri)


def test_open_storage_makes_a_gcs_storage_without_touching_the_network() -> None:
    storage = open_storage("gs://bucket/a/b/", endpoint_url="http://127.0.0.1:9")
    assert isinstance(storage, GcsStorage) and isinstance(storage, Storage) and isinstance(storage, StoreChecksums)
    assert storage.uri == "gs://bucket/a/b" and repr(storage) == "GcsStorage('gs://bucket/a/b')"
    assert storage.uri_for("ckpt-1/manifest.json") == "gs://bucket/a/b/ckpt-1/manifest.json"
    assert storage.supports_conditional_writes
    assert open_storage("gs://bucket").uri == "gs://bucket"
    with pytest.raises(StorageError, match="invalid bucket name"):
        open_storage("gs://UPPER/x")
    with pytest.raises(ValueError, match="invalid storage key"):
        storage.uri_for("../escape")


def test_crc32c_notation_maps_to_the_manifests() -> None:
    # CRC32C("hello world") = c99465aa, which GCS reports as base64 of its 4 big-endian bytes.
    assert crc32c_to_base64(0xC99465AA) == "yZRlqg=="
    assert crc32c_hex("yZRlqg==") == "c99465aa"
    assert crc32c_hex("AAAAAA==") == "00000000"  # the empty object
    for bad in (None, "", "not base64!", "yZRl", "yZRlqg==-2"):
        assert crc32c_hex(bad) is None, bad
    stored = stored_checksum_from("yZRlqg==", 11)
    assert stored is not None
    assert (stored.algorithm, stored.value, stored.size, stored.source) == ("crc32c", "c99465aa", 11, "full-object")
    assert stored_checksum_from(None, 11) is None


def test_generations_are_entity_tags_and_nothing_else_is() -> None:
    assert generation_of("1712345678901234") == 1712345678901234
    assert generation_of("0") == 0
    for other in (None, "", '"d41d8cd98f00b204e9800998ecf8427e"', "-1", "12a", "CJbX8pHk1/cCEAE="):
        assert generation_of(other) is None, other


def test_byte_ranges_cover_the_object_once() -> None:
    assert byte_ranges(0, 4) == []
    assert byte_ranges(4, 4) == [(0, 4)]
    assert byte_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]


def test_resumable_chunks_are_multiples_of_256_kib() -> None:
    quantum = 256 << 10
    assert upload_chunk_size(1) == quantum
    assert upload_chunk_size(quantum) == quantum
    assert upload_chunk_size(quantum + 1) == 2 * quantum
    assert upload_chunk_size(32 << 20) == 32 << 20


def test_progress_counts_each_byte_once_when_pieces_are_read_again() -> None:
    seen: list[int] = []
    furthest = Furthest(seen.append)
    for offset in (100, 200, 150, 200, 300):  # a retried piece is read again from 100
        furthest.reached(offset)
    assert seen == [100, 100, 100] and sum(seen) == 300


MiB = 1 << 20


@pytest.mark.parametrize(
    "size, threshold, least, want",
    [
        (100 * MiB, 128 * MiB, 32 * MiB, [(0, 100 * MiB)]),  # below the threshold: one upload
        (200 * MiB, 0, 32 * MiB, [(0, 200 * MiB)]),  # turned off
        (200 * MiB, 128 * MiB, 32 * MiB, [(i * 32 * MiB, 32 * MiB) for i in range(6)] + [(192 * MiB, 8 * MiB)]),
        (5 * MiB + 3, 2 * MiB, 512 << 10, [(i << 19, 512 << 10) for i in range(10)] + [(10 << 19, 3)]),
    ],
)
def test_composite_pieces(size: int, threshold: int, least: int, want: list[tuple[int, int]]) -> None:
    assert composite_pieces(size, threshold, least) == want


def test_composite_pieces_of_a_large_file_are_at_most_the_compose_limit_and_cover_it() -> None:
    size = 14 * (1 << 30) + 12345
    pieces = composite_pieces(size, 128 * MiB, 32 * MiB)
    assert len(pieces) <= COMPOSE_LIMIT
    assert all(length % (256 << 10) == 0 for _, length in pieces[:-1])
    assert [o for o, _ in pieces] == [sum(n for _, n in pieces[:i]) for i in range(len(pieces))]
    assert sum(n for _, n in pieces) == size


def test_piece_keys_name_their_upload_and_target() -> None:
    key = piece_key("abc123", 7, "ckpt-000000000010/model.safetensors")
    assert key == "gc/compose/abc123.07/ckpt-000000000010/model.safetensors"
    assert parse_piece_key(key) == ("abc123", "ckpt-000000000010/model.safetensors")
    for other in ("gc/compose/abc123/ckpt-1/x", "gc/compose/abc.x/k", "chunks/ab/abc", "x/gc/compose/a.01/k"):
        assert parse_piece_key(other) is None, other


def test_a_window_reads_its_range_as_a_file_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 4)
    with open(path, "rb") as f:
        w = Window(f, 100, 50)
        assert w.tell() == 0 and w.read(10) == bytes(range(100, 110)) and w.tell() == 10
        assert w.read() == bytes(range(110, 150)) and w.read(5) == b""
        assert w.seek(5) == 5 and w.read(3) == bytes(range(105, 108))
        assert w.seek(0, 2) == 50 and w.read(1) == b""


def test_pending_uploads_are_the_composite_uploads_whose_pieces_are_stored() -> None:
    listed = [
        ObjectInfo(piece_key("u1", 1, "ckpt-1/model.bin"), 10, 30.0),
        ObjectInfo(piece_key("u1", 0, "ckpt-1/model.bin"), 10, 20.0),  # the first piece: the upload's start
        ObjectInfo(piece_key("u2", 0, "ckpt-2/model.bin"), 10, 40.0),
        ObjectInfo("gc/compose/not-a-piece", 10, 1.0),
    ]
    assert pending_uploads(listed, "") == [
        PendingUpload("ckpt-1/model.bin", "u1", 20.0),
        PendingUpload("ckpt-2/model.bin", "u2", 40.0),
    ]
    assert pending_uploads(listed, "ckpt-2/") == [PendingUpload("ckpt-2/model.bin", "u2", 40.0)]
    upload = PendingUpload("ckpt-1/model.bin", "u1", 20.0)
    assert pieces_of(listed, upload) == [piece_key("u1", 1, "ckpt-1/model.bin"), piece_key("u1", 0, "ckpt-1/model.bin")]
    # Another upload's pieces, or one of the same id for another key, are not this one's.
    assert pieces_of([ObjectInfo(piece_key("u1", 0, "ckpt-9/x"), 1, 1.0)], upload) == []


def test_an_endpoint_that_cannot_be_reached_is_one_message_with_or_without_retries() -> None:
    from google.api_core import exceptions as gexc

    def errors() -> Any:
        return gcs_errors("gs://b/x", bucket="b", endpoint_url="http://127.0.0.1:9", retry_deadline=5.0)

    with pytest.raises(StorageError) as direct, errors():
        raise ConnectionError("refused")
    assert str(direct.value) == "cannot reach the GCS endpoint (http://127.0.0.1:9) while accessing gs://b/x"
    with pytest.raises(StorageError) as retried, errors():
        raise gexc.RetryError("deadline", ConnectionError("refused"))
    assert str(retried.value) == str(direct.value) + " (retried for 5s)"
