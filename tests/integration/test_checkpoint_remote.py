"""Upload order, the latest pointer, restore, and garbage collection against real storage."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import assert_state_matches, commit_local, open_test_storage, s3_options

from spotguard.checkpoint import (
    MANIFEST_NAME,
    POINTER_NAME,
    RetentionPolicy,
    apply_retention,
    collect_garbage,
    delete_checkpoint,
    latest_verified,
    list_checkpoint_names,
    load_checkpoint_state,
    read_latest_pointer,
    restore_latest,
    update_latest_pointer,
    upload_checkpoint,
)
from spotguard.checkpoint.format.manifest import pointer_json
from spotguard.storage import PreconditionFailedError, Storage, open_storage
from spotguard.storage.file import FileStorage
from spotguard.storage.s3 import S3Storage

pytestmark = pytest.mark.integration


def name(step: int) -> str:
    return f"ckpt-{step:012d}"


class Recording(FileStorage):
    """A file storage that records the order of mutating operations."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.ops: list[tuple[str, tuple[str, ...]]] = []

    def upload_files(self, items: Any, progress: Any = None) -> None:
        items = list(items)
        self.ops.append(("upload", tuple(sorted(k for _, k in items))))
        super().upload_files(items, progress)

    def write_bytes(self, key: str, data: bytes, **kw: Any) -> str:
        self.ops.append(("write", (key,)))
        return super().write_bytes(key, data, **kw)

    def delete(self, keys: Any) -> None:
        keys = list(keys)
        self.ops.append(("delete", tuple(keys)))
        super().delete(keys)


def test_upload_order_is_data_then_manifest_then_pointer(tmp_path: Path) -> None:
    storage = Recording(tmp_path / "remote")
    ckpt = commit_local(tmp_path / "local", 7, metrics={"loss": 1.5})
    result = upload_checkpoint(ckpt, storage)
    # First the upload's intent (visible to garbage collection), then its removal once the
    # checkpoint is stored; the pointer last, after the stored checkpoint verified.
    (intent_op, (intent,)), *ops, (removal_op, removed), pointer = storage.ops
    assert intent_op == "write" and intent.startswith(f"gc/uploads/{name(7)}.") and intent.endswith(".json")
    assert (removal_op, removed) == ("delete", (intent, intent.removesuffix(".json") + ".alive"))
    assert ops == [
        ("upload", tuple(f"{name(7)}/{f}" for f in ["model.safetensors", "optimizer.safetensors", "state.json"])),
        ("write", (f"{name(7)}/{MANIFEST_NAME}",)),
    ]
    assert pointer == ("write", (POINTER_NAME,))
    assert result.step == 7 and result.name == name(7) and result.pointer_updated
    assert result.bytes == sum(p.stat().st_size for p in ckpt.iterdir())
    assert result.uri == storage.uri_for(name(7))


def test_delete_removes_the_manifest_first(tmp_path: Path) -> None:
    storage = Recording(tmp_path / "remote")
    upload_checkpoint(commit_local(tmp_path / "local", 7), storage)
    storage.ops.clear()
    delete_checkpoint(storage, name(7))
    assert storage.ops[0] == ("delete", (f"{name(7)}/{MANIFEST_NAME}",))
    assert list_checkpoint_names(storage) == []


@pytest.mark.parametrize("kind", ["file", "s3", "gs"])
def test_pointer_only_moves_forward(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> None:
    storage: Storage = open_test_storage(kind, request, tmp_path)
    local = tmp_path / "local"
    upload_checkpoint(commit_local(local, 20), storage)
    assert read_latest_pointer(storage) == 20
    late = upload_checkpoint(commit_local(local, 10), storage)  # a slow uploader finishing late
    assert not late.pointer_updated
    assert read_latest_pointer(storage) == 20
    assert update_latest_pointer(storage, 30)
    assert not update_latest_pointer(storage, 30)
    assert read_latest_pointer(storage) == 30


def test_pointer_update_retries_after_losing_a_race(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path)
    storage.write_bytes(POINTER_NAME, pointer_json(1))
    real = storage.write_bytes
    raced = {"done": False}

    def racing_write(key: str, data: bytes, **kw: Any) -> str:
        if key == POINTER_NAME and not raced["done"]:
            raced["done"] = True
            real(POINTER_NAME, pointer_json(5))  # another writer gets in between read and write
            raise PreconditionFailedError("changed")
        return real(key, data, **kw)

    storage.write_bytes = racing_write  # type: ignore[method-assign]
    assert update_latest_pointer(storage, 3) is False  # the other writer's 5 is newer: keep it
    assert read_latest_pointer(storage) == 5
    assert update_latest_pointer(storage, 9)
    assert read_latest_pointer(storage) == 9


@pytest.mark.parametrize("kind", ["file", "s3", "gs"])
@pytest.mark.parametrize("pointer", ["missing", "stale", "ahead", "garbage"])
def test_latest_verified_does_not_trust_the_pointer(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, pointer: str
) -> None:
    storage: Storage = open_test_storage(kind, request, tmp_path)
    local = tmp_path / "local"
    for step in (1, 2, 3):
        upload_checkpoint(commit_local(local, step), storage)
    if pointer == "missing":
        storage.delete([POINTER_NAME])
    elif pointer == "stale":
        storage.write_bytes(POINTER_NAME, pointer_json(1))
    elif pointer == "ahead":
        storage.write_bytes(POINTER_NAME, pointer_json(99))
    else:
        storage.write_bytes(POINTER_NAME, b"\x00garbage")
    info, skipped = latest_verified(storage)
    assert info is not None and info.step == 3 and skipped == []


@pytest.mark.parametrize("kind", ["file", "s3", "gs"])
def test_an_upload_interrupted_before_its_manifest_is_skipped(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    storage: Storage = open_test_storage(kind, request, tmp_path)
    local = tmp_path / "local"
    upload_checkpoint(commit_local(local, 1), storage)
    partial = commit_local(local, 2)
    storage.upload_files([(partial / "model.safetensors", f"{name(2)}/model.safetensors")])
    info, skipped = latest_verified(storage)
    assert info is not None and info.step == 1
    assert [(s.name, s.reason) for s in skipped] == [
        (name(2), "manifest.json: missing (upload incomplete or interrupted)")
    ]


@pytest.mark.parametrize("kind", ["file", "s3", "gs"])
def test_restore_latest(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> None:
    storage: Storage = open_test_storage(kind, request, tmp_path)
    assert restore_latest(storage, tmp_path / "dest") is None
    local = tmp_path / "local"
    for step in (4, 8):
        upload_checkpoint(commit_local(local, step, numel=300_000), storage)
    info = restore_latest(storage, tmp_path / "dest")
    assert info is not None and info.step == 8 and Path(info.uri) == tmp_path / "dest" / name(8)
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == [name(8)]
    assert_state_matches(load_checkpoint_state(tmp_path / "dest" / name(8)), 8, numel=300_000)

    # Already there and intact: reused without downloading again.
    def no_download(*a: Any, **k: Any) -> None:
        raise AssertionError("downloaded again")

    storage.download_files = no_download  # type: ignore[method-assign]
    again = restore_latest(storage, tmp_path / "dest")
    assert again is not None and again.step == 8


def test_gc_against_s3_deletes_exactly_the_planned_prefixes(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    storage = open_storage(s3_uri, **s3_options(s3_store))
    assert isinstance(storage, S3Storage)
    local = tmp_path / "local"
    losses = {10: 0.9, 20: 0.2, 30: 0.5, 40: 0.6, 50: 0.7, 60: 0.8}
    for step, loss in losses.items():
        upload_checkpoint(commit_local(local, step, metrics={"loss": loss}), storage)
    # An interrupted upload (data, no manifest), an unrelated file, a stale multipart
    # upload, and an object outside the root that must never be touched.
    partial = commit_local(local, 70)
    storage.upload_files([(partial / "model.safetensors", f"{name(70)}/model.safetensors")])
    storage.write_bytes("notes/README.txt", b"not a checkpoint")
    client = storage.client
    client.put_object(Bucket=storage.bucket, Key=f"{storage.prefix}-sibling/{name(10)}/x", Body=b"outside")
    mpu = client.create_multipart_upload(Bucket=storage.bucket, Key=f"{storage.prefix}/{name(80)}/model.safetensors")

    def keys() -> set[str]:
        return {o.key for o in storage.list_objects("")}

    before = keys()
    policy = RetentionPolicy(keep_last=2, keep_best=1, metric="loss", mode="min")

    dry = collect_garbage(storage, policy, orphan_grace=0, stale_upload_age=0, dry_run=True)
    assert dry.deleted == [name(10), name(30), name(40)]
    assert dry.orphans == [name(70)]
    assert [u.upload_id for u in dry.aborted_uploads] == [mpu["UploadId"]]
    assert keys() == before  # a dry run changes nothing

    report = collect_garbage(storage, policy, orphan_grace=0, stale_upload_age=0)
    assert report.newest_verified == name(60)
    assert report.deleted == [name(10), name(30), name(40)]
    assert set(report.plan.keep) == {name(20), name(50), name(60)}
    expected = {k for k in before if k.split("/")[0] not in {name(10), name(30), name(40), name(70)}}
    assert keys() == expected
    assert "notes/README.txt" in expected and POINTER_NAME in expected
    assert client.get_object(Bucket=storage.bucket, Key=f"{storage.prefix}-sibling/{name(10)}/x")["Body"].read()
    assert storage.list_pending_uploads("") == []
    info, _ = latest_verified(storage)
    assert info is not None and info.step == 60


def test_orphans_within_the_grace_period_are_kept(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "remote")
    local = tmp_path / "local"
    upload_checkpoint(commit_local(local, 1), storage)
    partial = commit_local(local, 2)
    storage.upload_files([(partial / "model.safetensors", f"{name(2)}/model.safetensors")])
    report = collect_garbage(storage, RetentionPolicy(keep_last=1), orphan_grace=3600)
    assert report.orphans == []
    assert list_checkpoint_names(storage) == [name(1), name(2)]
    report = collect_garbage(storage, RetentionPolicy(keep_last=1), orphan_grace=0)
    assert report.orphans == [name(2)]
    assert list_checkpoint_names(storage) == [name(1)]


def test_apply_retention_never_deletes_the_newest_verified(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "remote")
    local = tmp_path / "local"
    for step in (1, 2, 3):
        upload_checkpoint(commit_local(local, step), storage)
    # The newest is broken: the newest *verified* is 2, and it must survive keep-last 0.
    storage.delete([f"{name(3)}/state.json"])
    deleted = apply_retention(storage, RetentionPolicy(keep_last=0), dry_run=True)
    assert deleted == [name(1)]
    assert apply_retention(storage, RetentionPolicy(keep_last=0)) == [name(1)]
    assert list_checkpoint_names(storage) == [name(2), name(3)]


def test_stale_file_uploads_are_aborted(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "remote")
    upload_checkpoint(commit_local(tmp_path / "local", 1), storage)
    leftover = tmp_path / "remote" / name(1) / ".sg-tmp-dead"
    leftover.write_bytes(b"partial")
    report = collect_garbage(storage, RetentionPolicy(), stale_upload_age=3600)
    assert report.aborted_uploads == [] and leftover.exists()
    old = time.time() - 7200
    import os

    os.utime(leftover, (old, old))
    report = collect_garbage(storage, RetentionPolicy(), stale_upload_age=3600)
    assert [u.key for u in report.aborted_uploads] == [f"{name(1)}/.sg-tmp-dead"]
    assert not leftover.exists()
