"""The pure parts of the gs:// backend: URIs, checksum notation, entity tags, ranges, progress."""

from __future__ import annotations

import pytest

from testenv.require import require_module

require_module("google.cloud.storage")

from spotguard.storage import Storage, StorageError, StoreChecksums, open_storage  # noqa: E402
from spotguard.storage.base import byte_ranges  # noqa: E402
from spotguard.storage.checksum import crc32c_to_base64  # noqa: E402
from spotguard.storage.gcs import GcsStorage, _Furthest, crc32c_hex, generation_of, stored_checksum_from  # noqa: E402
from spotguard.storage.gcs_client import parse_gs_uri, upload_chunk_size  # noqa: E402


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
    assert storage.list_pending_uploads("") == []
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
    furthest = _Furthest(seen.append)
    for offset in (100, 200, 150, 200, 300):  # a retried piece is read again from 100
        furthest.reached(offset)
    assert seen == [100, 100, 100] and sum(seen) == 300
