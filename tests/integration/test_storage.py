"""Storage backends against the real thing: a SeaweedFS S3 gateway, a GCS JSON API server
(fake-gcs-server; what it lacks is listed in ``testenv/gcs.py``) and a local directory."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import s3_options

from spotguard.storage import (
    CredentialsError,
    NotFoundError,
    PreconditionFailedError,
    Storage,
    StorageError,
    open_storage,
)
from spotguard.storage.file import TMP_PREFIX, FileStorage
from spotguard.storage.s3 import S3Storage

pytestmark = pytest.mark.integration
MiB = 1 << 20


@pytest.fixture(params=["file", "s3", "gs"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "file":
        return open_storage(f"file://{tmp_path}/store/job")
    if request.param == "gs":
        # Small resumable chunks and read ranges, so resumable uploads and ranged reads really happen.
        return open_storage(
            request.getfixturevalue("gs_uri"),
            **request.getfixturevalue("gcs_store").options(),
            resumable_threshold=5 * MiB,
            chunk_size=1 * MiB,
            read_chunk_size=1 * MiB,
            max_concurrency=4,
        )
    s3_store = request.getfixturevalue("s3_store")
    s3_uri = request.getfixturevalue("s3_uri")
    # Small parts and read ranges, so multipart and ranged reads really happen.
    return open_storage(
        s3_uri,
        **s3_options(s3_store),
        multipart_threshold=5 * MiB,
        multipart_chunksize=5 * MiB,
        read_chunk_size=1 * MiB,
        max_concurrency=4,
    )


def test_open_storage_picks_backend(tmp_path: Path) -> None:
    assert isinstance(open_storage(f"file://{tmp_path}"), FileStorage)
    assert isinstance(open_storage(str(tmp_path)), FileStorage)
    assert isinstance(open_storage("s3://bucket/a/b", region="us-east-1"), S3Storage)
    assert open_storage("s3://bucket/a/b/", region="us-east-1").uri == "s3://bucket/a/b"


@pytest.mark.parametrize(
    "uri, message",
    [
        ("az://bucket/x", "unsupported storage URI scheme 'az'"),
        ("gs:///nobucket", "no bucket"),
        ("gs://Bad_Bucket/x", "invalid bucket name"),
        ("s3:///nobucket", "no bucket"),
        ("s3://bucket/a/../b", "invalid prefix"),
        ("file://host/path", "with a host"),
        ("", "empty storage URI"),
    ],
)
def test_bad_uris_are_one_clear_error(uri: str, message: str) -> None:
    with pytest.raises(StorageError, match=message):
        open_storage(uri)


def test_bytes_roundtrip_stat_and_missing(storage: Storage) -> None:
    etag = storage.write_bytes("a/b.txt", b"hello")
    assert etag
    assert storage.read_bytes("a/b.txt") == b"hello"
    info = storage.stat("a/b.txt")
    assert info is not None and info.size == 5 and info.key == "a/b.txt"
    assert abs(info.modified - time.time()) < 3600
    assert storage.stat("a/none") is None
    assert storage.read_with_etag("a/none") is None
    with pytest.raises(NotFoundError):
        storage.read_bytes("a/none")
    assert storage.uri_for("a/b.txt") == storage.uri + "/a/b.txt"


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/./b", "a\\b"])
def test_keys_cannot_escape_the_root(storage: Storage, key: str) -> None:
    with pytest.raises(ValueError):
        storage.write_bytes(key, b"x")


def test_listing(storage: Storage) -> None:
    for key in ["ckpt-1/a", "ckpt-1/sub/b", "ckpt-2/c", "latest"]:
        storage.write_bytes(key, key.encode())
    keys = sorted(o.key for o in storage.list_objects(""))
    assert keys == ["ckpt-1/a", "ckpt-1/sub/b", "ckpt-2/c", "latest"]
    assert sorted(o.key for o in storage.list_objects("ckpt-1/")) == ["ckpt-1/a", "ckpt-1/sub/b"]
    assert {o.key: o.size for o in storage.list_objects("ckpt-2/")} == {"ckpt-2/c": 8}
    assert storage.list_dirs("") == ["ckpt-1", "ckpt-2"]
    assert storage.list_dirs("ckpt-1/") == ["sub"]
    assert list(storage.list_objects("nothing/")) == []


def test_conditional_writes(storage: Storage) -> None:
    first = storage.write_bytes("latest", b"1", if_none_match=True)
    with pytest.raises(PreconditionFailedError):
        storage.write_bytes("latest", b"2", if_none_match=True)
    current = storage.read_with_etag("latest")
    assert current is not None and current[0] == b"1" and current[1] == first
    second = storage.write_bytes("latest", b"2", if_match=current[1])
    with pytest.raises(PreconditionFailedError):
        storage.write_bytes("latest", b"3", if_match=current[1])  # stale tag
    assert storage.read_bytes("latest") == b"2"
    assert storage.read_with_etag("latest") == (b"2", second)
    assert storage.supports_conditional_writes


def test_upload_download_multipart_and_ranged_reads(storage: Storage, tmp_path: Path) -> None:
    big = os.urandom(12 * MiB + 12345)  # several 5 MiB parts on S3
    small = b"x" * 1000
    empty = b""
    src = tmp_path / "src"
    src.mkdir()
    for name, data in [("big.bin", big), ("small.bin", small), ("empty.bin", empty)]:
        (src / name).write_bytes(data)
    seen: list[int] = []
    storage.upload_files([(src / n, f"up/{n}") for n in ("big.bin", "small.bin", "empty.bin")], seen.append)
    assert sum(seen) == len(big) + len(small)
    assert {o.key: o.size for o in storage.list_objects("up/")} == {
        "up/big.bin": len(big),
        "up/small.bin": len(small),
        "up/empty.bin": 0,
    }
    assert b"".join(storage.iter_chunks("up/big.bin")) == big
    assert b"".join(storage.iter_chunks("up/empty.bin")) == b""
    dst = tmp_path / "dst"
    got: list[int] = []
    storage.download_files([(f"up/{n}", dst / "deep" / n) for n in ("big.bin", "small.bin", "empty.bin")], got.append)
    assert (dst / "deep" / "big.bin").read_bytes() == big
    assert (dst / "deep" / "small.bin").read_bytes() == small
    assert (dst / "deep" / "empty.bin").read_bytes() == b""
    assert sum(got) == len(big) + len(small)
    assert not [p for p in (dst / "deep").iterdir() if p.name not in ("big.bin", "small.bin", "empty.bin")]


def test_download_of_missing_key_is_not_found(storage: Storage, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        storage.download_files([("nope/x", tmp_path / "x")])
    assert not (tmp_path / "x").exists()
    with pytest.raises(NotFoundError):
        b"".join(storage.iter_chunks("nope/x"))


def test_delete(storage: Storage) -> None:
    for key in ["d/1", "d/2", "d/sub/3", "keep/4"]:
        storage.write_bytes(key, b"x")
    storage.delete(["d/1", "d/sub/3", "d/missing"])
    assert sorted(o.key for o in storage.list_objects("")) == ["d/2", "keep/4"]
    storage.delete(["d/2"])
    assert storage.list_dirs("") == ["keep"]
    storage.delete([])


def test_pending_uploads_listed_and_aborted_s3(s3_store: Any, s3_uri: str) -> None:
    storage = open_storage(s3_uri, **s3_options(s3_store))
    assert isinstance(storage, S3Storage)
    key = f"{storage.prefix}/ckpt-000000000001/model.safetensors"
    up = storage.client.create_multipart_upload(Bucket=storage.bucket, Key=key)
    pending = storage.list_pending_uploads("")
    assert [(p.key, p.upload_id) for p in pending] == [("ckpt-000000000001/model.safetensors", up["UploadId"])]
    assert abs(pending[0].started - time.time()) < 3600
    storage.abort_upload(pending[0])
    assert storage.list_pending_uploads("") == []


def test_pending_uploads_listed_and_aborted_file(tmp_path: Path) -> None:
    storage = open_storage(f"file://{tmp_path}")
    storage.write_bytes("ckpt-000000000001/a", b"a")
    leftover = tmp_path / "ckpt-000000000001" / f"{TMP_PREFIX}dead"
    leftover.write_bytes(b"partial")
    assert [o.key for o in storage.list_objects("")] == ["ckpt-000000000001/a"]  # hidden from listings
    pending = storage.list_pending_uploads("")
    assert [p.key for p in pending] == [f"ckpt-000000000001/{TMP_PREFIX}dead"]
    storage.abort_upload(pending[0])
    assert not leftover.exists()


def test_s3_missing_bucket_is_one_clear_error(s3_store: Any) -> None:
    storage = open_storage("s3://no-such-bucket-spotguard/x", **s3_options(s3_store))
    with pytest.raises(NotFoundError, match="bucket 'no-such-bucket-spotguard' does not exist"):
        storage.check()
    with pytest.raises(NotFoundError, match="does not exist"):
        list(storage.list_objects(""))


def test_s3_wrong_credentials_are_one_clear_error(s3_store: Any, s3_uri: str) -> None:
    opts = s3_options(s3_store) | {"secret_key": "wrong-secret"}
    storage = open_storage(s3_uri, **opts)
    with pytest.raises(CredentialsError) as err:
        storage.write_bytes("x", b"x")
    assert "wrong-secret" not in str(err.value)


def test_s3_no_credentials_is_one_clear_error(
    s3_store: Any, s3_uri: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    storage = open_storage(s3_uri, endpoint_url=s3_store.endpoint_url, region=s3_store.region)
    with pytest.raises(CredentialsError, match="no AWS credentials found"):
        storage.check()


def test_s3_reads_settings_from_the_standard_environment(
    s3_store: Any, s3_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in s3_store.env().items():
        monkeypatch.setenv(key, value)
    storage = open_storage(s3_uri)
    storage.check()
    storage.write_bytes("env/x", b"via env")
    assert storage.read_bytes("env/x") == b"via env"


def test_s3_unreachable_endpoint_is_one_clear_error(s3_uri: str) -> None:
    storage = open_storage(
        s3_uri, endpoint_url="http://127.0.0.1:9", access_key="a", secret_key="b", region="us-east-1", max_attempts=1
    )
    with pytest.raises(StorageError, match="cannot reach the S3 endpoint"):
        storage.check()


def test_s3_conditional_write_falls_back_when_not_implemented(s3_store: Any, s3_uri: str) -> None:
    storage = open_storage(s3_uri, **s3_options(s3_store))
    assert isinstance(storage, S3Storage)
    calls: list[dict[str, Any]] = []
    real_put = storage.client.put_object

    def put_object(**kwargs: Any) -> Any:
        from botocore.exceptions import ClientError

        calls.append(kwargs)
        if "IfMatch" in kwargs or "IfNoneMatch" in kwargs:
            raise ClientError(
                {"Error": {"Code": "NotImplemented", "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": 501}},
                "PutObject",
            )
        return real_put(**kwargs)

    storage.client.put_object = put_object
    storage.write_bytes("latest", b"1", if_none_match=True)
    assert storage.read_bytes("latest") == b"1"
    assert not storage.supports_conditional_writes
    storage.write_bytes("latest", b"2", if_match="whatever")
    assert [("IfNoneMatch" in c or "IfMatch" in c) for c in calls] == [True, False, False]


def test_s3_ranged_read_retries_transient_stream_errors(s3_store: Any, s3_uri: str) -> None:
    storage = open_storage(s3_uri, **s3_options(s3_store), read_chunk_size=1 * MiB)
    assert isinstance(storage, S3Storage)
    data = os.urandom(3 * MiB + 7)
    storage.write_bytes("r/x", data)
    real_get = storage.client.get_object
    failures = {"left": 2}

    def flaky_get(**kwargs: Any) -> Any:
        from botocore.exceptions import ResponseStreamingError

        if "Range" in kwargs and failures["left"] > 0:
            failures["left"] -= 1
            raise ResponseStreamingError(error="connection reset")
        return real_get(**kwargs)

    storage.client.get_object = flaky_get
    assert b"".join(storage.iter_chunks("r/x")) == data
    assert failures["left"] == 0


def test_s3_stored_checksums_are_the_whole_object_crc32c(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    """What the store computed on receipt: for single puts and (full-object) multipart uploads
    the CRC32C of the whole object; none for objects uploaded without one, or whose
    composite checksum cannot be turned into a whole-object one (SeaweedFS reports no
    part checksums)."""
    import base64

    from spotguard.storage import StoreChecksums
    from spotguard.storage.checksum import checksum_bytes, checksum_file

    storage = open_storage(s3_uri, **s3_options(s3_store), multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    assert isinstance(storage, S3Storage) and isinstance(storage, StoreChecksums)
    small, big = tmp_path / "small.bin", tmp_path / "big.bin"
    small.write_bytes(os.urandom(1000))
    big.write_bytes(os.urandom(12 * MiB + 7))
    storage.upload_files([(small, "a/small.bin"), (big, "a/big.bin")])
    for path, key, source in ((small, "a/small.bin", "full-object"), (big, "a/big.bin", "full-object")):
        stored = storage.stored_checksum(key)
        assert stored is not None, key
        assert (stored.algorithm, stored.value, stored.size, stored.source) == (
            "crc32c",
            checksum_file(path, "crc32c")[0],
            path.stat().st_size,
            source,
        )
    storage.write_bytes("a/plain.bin", b"no checksum sent")
    assert storage.stored_checksum("a/plain.bin") is None
    with pytest.raises(NotFoundError):
        storage.stored_checksum("a/missing.bin")
    # A composite multipart object, as another client would upload it.
    client, bucket, key = storage.client, storage.bucket, storage._key("a/composite.bin")  # noqa: SLF001
    parts = [os.urandom(5 * MiB), os.urandom(100)]
    up = client.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C")
    done = []
    for number, part in enumerate(parts, 1):
        crc = base64.b64encode(int(checksum_bytes(part, "crc32c"), 16).to_bytes(4, "big")).decode()
        resp = client.upload_part(
            Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=number, Body=part, ChecksumCRC32C=crc
        )
        done.append({"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32C": crc})
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"], MultipartUpload={"Parts": done})
    assert storage.stored_checksum("a/composite.bin") is None


def test_s3_upload_without_checksums_still_works(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    storage = open_storage(s3_uri, **s3_options(s3_store), send_checksums=False)
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(3000))
    storage.upload_files([(src, "f.bin")])
    assert storage.read_bytes("f.bin") == src.read_bytes()
    assert isinstance(storage, S3Storage) and storage.stored_checksum("f.bin") is None
