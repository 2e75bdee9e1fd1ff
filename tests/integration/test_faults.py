"""Faults between spotguard and the real store (SeaweedFS), injected by the project's
own proxy (``testenv/faultproxy.py``): 503 SlowDown, connection resets, truncated
response bodies, added latency, bytes corrupted in transit; and verification from
checksums the store computed on receipt instead of reading every byte back.

What must hold: storage calls and upload/verify retry what is transient, report
what is not (an exception naming the error), never report verified what is not,
and lose nothing that was verified before.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import assert_state_matches, commit_local, s3_options

from spotguard.checkpoint import (
    MANIFEST_NAME,
    CheckpointCorruptError,
    latest_verified,
    load_checkpoint_state,
    restore_checkpoint,
    upload_checkpoint,
    verify_checkpoint,
)
from spotguard.storage import StorageError, open_storage
from spotguard.storage.s3 import S3Storage
from testenv.faultproxy import FaultProxy, corrupt, latency, reset, status, truncate

pytestmark = pytest.mark.integration

MiB = 1 << 20
#: Big enough for multipart uploads with the small part size below (model ~12 MiB, optimizer ~8 MiB).
NUMEL = 2_000_000
#: Small parts, so that a few MiB make a multipart upload of several parts.
SMALL_PARTS = {"multipart_threshold": 5 * MiB, "multipart_chunksize": 5 * MiB, "read_chunk_size": 4 * MiB}


@pytest.fixture
def proxy(s3_store: Any) -> Iterator[FaultProxy]:
    with FaultProxy(s3_store.endpoint_url) as p:
        yield p


def via(proxy: FaultProxy, s3_store: Any, uri: str, **options: Any) -> S3Storage:
    """``uri`` opened through the proxy (fast retries: the faults are short)."""
    opts = {**s3_options(s3_store), "endpoint_url": proxy.url, **SMALL_PARTS, **options}
    storage = open_storage(uri, **opts)
    assert isinstance(storage, S3Storage)
    return storage


def direct(s3_store: Any, uri: str, **options: Any) -> S3Storage:
    storage = open_storage(uri, **s3_options(s3_store), **SMALL_PARTS, **options)
    assert isinstance(storage, S3Storage)
    return storage


def data_gets(proxy: FaultProxy, name: str) -> list[str]:
    """GETs of a checkpoint's data files (reading bytes back), by target."""
    return [r.target for r in proxy.requests("GET", rf"/{name}/(?!{MANIFEST_NAME})[^?]+$")]


def ckpt(step: int) -> str:
    return f"ckpt-{step:012d}"


# -- verification from store-computed checksums (issue #9, point 4) --------------------------


def test_verify_uses_the_checksums_the_store_computed_and_reads_nothing_back(
    s3_store: Any, s3_uri: str, proxy: FaultProxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = via(proxy, s3_store, s3_uri)
    path = commit_local(tmp_path / "local", 7, NUMEL)
    upload_checkpoint(path, storage)
    # Multipart uploads happened (several parts), so the whole-object checksum path is exercised.
    assert proxy.requests("PUT", r"partNumber=3"), [r.target for r in proxy.log]

    proxy.log.clear()
    caplog.set_level(logging.INFO, logger="spotguard.checkpoint.store.verify_stored")
    result = verify_checkpoint(storage, ckpt(7))
    assert result.ok, result.problems
    assert result.method == "store-checksum", result
    assert result.store_checked == len(result.manifest.files) and result.read_back == 0  # type: ignore[union-attr]
    assert result.checked_bytes == 0
    assert data_gets(proxy, ckpt(7)) == [], "the fast path read data back"
    assert len(proxy.requests("HEAD")) >= len(result.manifest.files)  # type: ignore[union-attr]
    assert any("by store-checksum" in r.getMessage() for r in caplog.records), caplog.text

    # --deep still reads every byte back.
    proxy.log.clear()
    deep = verify_checkpoint(storage, ckpt(7), deep=True)
    assert deep.ok and deep.method == "read-back"
    assert deep.checked_bytes == deep.manifest.total_size  # type: ignore[union-attr]
    assert len(data_gets(proxy, ckpt(7))) >= len(deep.manifest.files)  # type: ignore[union-attr]


def test_objects_without_a_store_checksum_are_read_back(
    s3_store: Any, s3_uri: str, proxy: FaultProxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plain = via(proxy, s3_store, s3_uri, send_checksums=False)
    upload_checkpoint(commit_local(tmp_path / "local", 3, NUMEL), plain)
    proxy.log.clear()
    caplog.set_level(logging.INFO, logger="spotguard.checkpoint.store.verify_stored")
    result = verify_checkpoint(via(proxy, s3_store, s3_uri), ckpt(3))
    assert result.ok, result.problems
    assert result.method == "read-back" and result.store_checked == 0
    assert result.checked_bytes == result.manifest.total_size  # type: ignore[union-attr]
    assert data_gets(proxy, ckpt(3)), "no read-back happened"
    assert any("by read-back" in r.getMessage() for r in caplog.records), caplog.text


def test_a_local_file_damaged_before_upload_is_not_verified_by_store_checksums(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    """The store checks what it received against what the client sent; the comparison
    with the manifest is what catches bytes that changed before they were sent."""
    storage = direct(s3_store, s3_uri)
    path = commit_local(tmp_path / "local", 5, NUMEL)
    victim = path / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    # Stored, but never published: the pointer moves only to what verifies.
    with pytest.raises(CheckpointCorruptError, match=r"model\.safetensors: crc32c checksum mismatch"):
        upload_checkpoint(path, storage)
    result = verify_checkpoint(storage, ckpt(5))
    assert not result.ok
    assert result.method == "store-checksum"
    assert any("model.safetensors: crc32c checksum mismatch" in p for p in result.problems), result.problems
    info, skipped = latest_verified(storage)
    assert info is None and skipped[0].name == ckpt(5)


@pytest.mark.parametrize("target", [r"/model\.safetensors\?.*partNumber=2", r"/state\.json$"])
def test_bytes_corrupted_in_transit_are_refused_sent_again_and_verified(
    s3_store: Any, s3_uri: str, proxy: FaultProxy, tmp_path: Path, target: str
) -> None:
    storage = via(proxy, s3_store, s3_uri)
    path = commit_local(tmp_path / "local", 9, NUMEL)
    proxy.add(corrupt(), method="PUT", path=target, times=1)
    upload_checkpoint(path, storage)
    hit = proxy.faults()
    assert [r.status for r in hit] == [400], [(r.target, r.status) for r in hit]
    resent = [r for r in proxy.log if (r.method, r.target) == (hit[0].method, hit[0].target) and r.fault is None]
    assert [r.status for r in resent] == [200]
    result = verify_checkpoint(storage, ckpt(9))
    assert result.ok and result.method == "store-checksum", result


def test_bytes_always_corrupted_in_transit_are_never_stored_or_verified(
    s3_store: Any, s3_uri: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    storage = via(proxy, s3_store, s3_uri)
    path = commit_local(tmp_path / "local", 10, NUMEL)
    proxy.add(corrupt(), method="PUT", path=r"/optimizer\.safetensors\?")
    with pytest.raises(StorageError, match="BadDigest"):
        upload_checkpoint(path, storage)
    assert proxy.faults() and all(r.status == 400 for r in proxy.faults())
    result = verify_checkpoint(storage, ckpt(10))
    assert not result.ok and "manifest.json: missing" in result.reason
    assert latest_verified(storage)[0] is None
    # Once the path is clean again, the next attempt goes through.
    proxy.clear()
    upload_checkpoint(path, storage)
    assert verify_checkpoint(storage, ckpt(10)).ok


def test_the_file_backend_reads_back(tmp_path: Path) -> None:
    storage = open_storage(f"file://{tmp_path}/remote/job")
    upload_checkpoint(commit_local(tmp_path / "local", 1), storage)
    result = verify_checkpoint(storage, ckpt(1))
    assert result.ok and result.method == "read-back"
    assert result.checked_bytes == result.manifest.total_size  # type: ignore[union-attr]


# -- transient faults: retried, nothing lost (issue #9, point 3) -----------------------------


def test_503_slowdown_on_uploads_is_retried(s3_store: Any, s3_uri: str, proxy: FaultProxy, tmp_path: Path) -> None:
    storage = via(proxy, s3_store, s3_uri)
    # Every kind of write fails a few times first: parts, single puts, the manifest, the pointer.
    proxy.add(status(503, "SlowDown"), method="PUT", path=r"partNumber=1\b", times=2)
    proxy.add(status(503, "SlowDown"), method="PUT", path=r"/state\.json$", times=2)
    proxy.add(status(503, "SlowDown"), method="PUT", path=r"/manifest\.json$", times=2)
    proxy.add(status(503, "SlowDown"), method="POST", path=r"uploads", times=1)
    proxy.add(status(503, "SlowDown"), method="HEAD", times=2)
    path = commit_local(tmp_path / "local", 11, NUMEL)
    result = upload_checkpoint(path, storage)
    assert result.pointer_updated
    verdict = verify_checkpoint(storage, ckpt(11))
    assert verdict.ok and verdict.method == "store-checksum", verdict
    injected = proxy.faults()
    assert len(injected) == 9, [(r.method, r.target) for r in injected]
    # Each refused request was sent again and then succeeded.
    for rec in injected:
        later = [r for r in proxy.log if r.method == rec.method and r.target == rec.target and r.fault is None]
        assert any(r.status in (200, 204) for r in later), rec.target


def test_connection_resets_are_retried(s3_store: Any, s3_uri: str, proxy: FaultProxy, tmp_path: Path) -> None:
    storage = via(proxy, s3_store, s3_uri)
    proxy.add(reset(), method="PUT", times=3)
    proxy.add(reset(), method="HEAD", times=2)
    proxy.add(reset(), method="GET", times=3)
    path = commit_local(tmp_path / "local", 13, NUMEL)
    upload_checkpoint(path, storage)
    info, skipped = latest_verified(storage)
    assert info is not None and info.step == 13 and not skipped
    restored = restore_checkpoint(storage, ckpt(13), tmp_path / "restore")
    assert_state_matches(load_checkpoint_state(Path(restored.uri)), 13, NUMEL)
    assert len(proxy.faults()) == 8


def test_truncated_response_bodies_are_retried(s3_store: Any, s3_uri: str, proxy: FaultProxy, tmp_path: Path) -> None:
    storage = via(proxy, s3_store, s3_uri)
    upload_checkpoint(commit_local(tmp_path / "local", 15, NUMEL), storage)
    # Ranged reads of the data, the manifest read and a listing come back cut short.
    proxy.add(truncate(1000), method="GET", path=r"/model\.safetensors$", times=3)
    proxy.add(truncate(10), method="GET", path=r"/manifest\.json$", times=1)
    proxy.add(truncate(50), method="GET", path=r"list-type=2", times=1)
    deep = verify_checkpoint(storage, ckpt(15), deep=True)
    assert deep.ok, deep.problems
    restored = restore_checkpoint(storage, ckpt(15), tmp_path / "restore")
    assert_state_matches(load_checkpoint_state(Path(restored.uri)), 15, NUMEL)
    cut = proxy.faults()
    assert len(cut) == 5, [(r.method, r.target) for r in cut]


def test_added_latency_changes_nothing(s3_store: Any, s3_uri: str, proxy: FaultProxy, tmp_path: Path) -> None:
    storage = via(proxy, s3_store, s3_uri)
    proxy.add(latency(0.05), seconds=30)
    upload_checkpoint(commit_local(tmp_path / "local", 17, NUMEL), storage)
    assert verify_checkpoint(storage, ckpt(17)).ok
    assert proxy.faults(), "no request was delayed"


def test_a_store_that_keeps_failing_is_reported_and_nothing_verified_is_lost(
    s3_store: Any, s3_uri: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    storage = via(proxy, s3_store, s3_uri, max_attempts=3)
    local = tmp_path / "local"
    upload_checkpoint(commit_local(local, 20, NUMEL), storage)
    proxy.add(status(503, "SlowDown"), method="PUT")
    proxy.add(status(503, "SlowDown"), method="POST")
    with pytest.raises(StorageError, match="SlowDown"):
        upload_checkpoint(commit_local(local, 21, NUMEL), storage)
    proxy.clear()
    info, skipped = latest_verified(direct(s3_store, s3_uri))
    assert info is not None and info.step == 20
    assert all(s.step > 20 for s in skipped)
    # What the store answered with is what a failed request reports, nothing more (no credentials).
    failing = [r for r in proxy.log if r.status == 503]
    assert failing and all(r.fault == "status" for r in failing)


def test_the_proxy_passes_requests_unchanged(s3_store: Any, s3_uri: str, proxy: FaultProxy) -> None:
    storage = via(proxy, s3_store, s3_uri)
    key = f"probe-{uuid.uuid4().hex[:6]}"
    storage.write_bytes(key, b"x" * 1000)
    assert storage.read_bytes(key) == b"x" * 1000
    assert [r.method for r in proxy.log if re.search(key, r.target)] == ["PUT", "GET"]
    assert all(r.fault is None for r in proxy.log)
