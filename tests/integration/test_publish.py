"""The one publish pipeline (upload, global commit, verify, pointer) against the real S3 store.

Both uploaders go through it: the sidecar's shipper and the Checkpointer's
in-process upload. These tests hold its outcomes: a whole checkpoint is
verified and pointed to; one that fails verification never moves the
pointer; a part waits for the others and a later global commit publishes
it; a pointer that cannot move leaves a verified checkpoint verified. The
last test runs the in-process ``Shipping`` through a race that leaves two
parts stored and no global manifest, which it used not to retry.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import s3_options, write_part

from spotguard.checkpoint import (
    MANIFEST_NAME,
    CheckpointCorruptError,
    checkpoint_name,
    read_latest_pointer,
    update_latest_pointer,
    upload_checkpoint,
    verify_checkpoint,
)
from spotguard.checkpoint.local.codec import snapshot_state
from spotguard.checkpoint.local.commit import write_checkpoint
from spotguard.checkpoint.store.publish import AWAITING, UNVERIFIED, VERIFIED, publish, publish_commit
from spotguard.storage import Storage, open_storage

pytestmark = pytest.mark.integration


@pytest.fixture
def storage(s3_store: Any, s3_uri: str) -> Storage:
    return open_storage(s3_uri, **s3_options(s3_store))


def whole(directory: Path, step: int) -> Path:
    gen = torch.Generator().manual_seed(step)
    return write_checkpoint(directory, step, snapshot_state({"model": {"w": torch.randn(64, generator=gen)}}))


def test_a_whole_checkpoint_is_verified_then_pointed_to(tmp_path: Path, storage: Storage) -> None:
    path = whole(tmp_path, 10)
    pointer_during_upload: list[int | None] = []

    def upload() -> Any:
        result = upload_checkpoint(path, storage, update_pointer=False)
        pointer_during_upload.append(read_latest_pointer(storage))
        return result

    published = publish(path.name, storage, upload)
    assert published.state == VERIFIED and published.verified, published
    assert published.verdict is not None and published.verdict.ok
    assert pointer_during_upload == [None]  # the pointer waits for the verification
    assert published.pointer_moved is True and published.pointer_error is None
    assert read_latest_pointer(storage) == 10 and published.step == 10


def test_a_checkpoint_that_fails_verification_never_moves_the_pointer(tmp_path: Path, storage: Storage) -> None:
    older = whole(tmp_path, 10)
    assert publish(older.name, storage, lambda: upload_checkpoint(older, storage, update_pointer=False)).verified
    path = whole(tmp_path, 20)

    def upload_then_damage() -> Any:
        result = upload_checkpoint(path, storage, update_pointer=False)
        data = next(o.key for o in storage.list_objects(f"{path.name}/") if not o.key.endswith(MANIFEST_NAME))
        storage.write_bytes(data, b"not the bytes the manifest names")
        return result

    published = publish(path.name, storage, upload_then_damage)
    assert published.state == UNVERIFIED and not published.verified
    assert published.problems and published.pointer_moved is None
    assert read_latest_pointer(storage) == 10


class DamagesOnUpload:
    """The store, except that the data files an upload sends arrive damaged (a byte flipped)."""

    def __init__(self, inner: Storage) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def upload_files(self, items: Iterable[tuple[Path, str]], progress: Any = None) -> None:
        items = list(items)
        self._inner.upload_files(items, progress)
        for src, key in items:
            data = bytearray(src.read_bytes())
            data[len(data) // 2] ^= 0xFF
            self._inner.write_bytes(key, bytes(data))


def test_update_pointer_never_points_to_a_checkpoint_that_does_not_verify(tmp_path: Path, storage: Storage) -> None:
    """``upload_checkpoint(update_pointer=True)`` publishes as the uploaders do: it used to move
    the pointer to what it had stored without verifying it."""
    upload_checkpoint(whole(tmp_path, 10), storage)
    assert read_latest_pointer(storage) == 10
    path = whole(tmp_path, 20)
    damaging: Any = DamagesOnUpload(storage)
    with pytest.raises(CheckpointCorruptError):
        upload_checkpoint(path, damaging, update_pointer=True)
    assert not verify_checkpoint(storage, path.name).ok
    assert read_latest_pointer(storage) == 10  # still the newest verified
    # Stored intact, it verifies and the pointer moves to it.
    result = upload_checkpoint(path, storage, update_pointer=True)
    assert result.pointer_updated and read_latest_pointer(storage) == 20


def test_a_part_awaits_the_others_and_a_later_commit_publishes_it(tmp_path: Path, storage: Storage) -> None:
    name = checkpoint_name(30)
    first = write_part(tmp_path / "node0", 30, 0)
    waiting = publish(name, storage, lambda: upload_checkpoint(first, storage, update_pointer=False))
    assert waiting.state == AWAITING and (waiting.parts_present, waiting.parts_total) == (1, 2)
    assert waiting.pointer_moved is None and read_latest_pointer(storage) is None
    assert publish_commit(storage, name).state == AWAITING  # still one part of two

    # The second part arrives and is committed, but its uploader dies before it verifies
    # (here: the global manifest is taken back, as if two uploaders had each seen the other's part missing).
    second = write_part(tmp_path / "node1", 30, 1)
    upload_checkpoint(second, storage, update_pointer=False)
    storage.delete([f"{name}/{MANIFEST_NAME}"])
    assert not verify_checkpoint(storage, name).ok

    published = publish_commit(storage, name)
    assert published.state == VERIFIED and published.commit_status == "written", published
    assert published.upload is None and (published.parts_present, published.parts_total) == (2, 2)
    assert read_latest_pointer(storage) == 30


class PointerDown:
    """The store, except that the ``latest`` pointer cannot be read or written."""

    def __init__(self, inner: Storage) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def read_with_etag(self, key: str) -> Any:
        raise ConnectionError("the pointer's request failed")


def test_a_pointer_that_cannot_move_leaves_the_checkpoint_verified(tmp_path: Path, storage: Storage) -> None:
    path = whole(tmp_path, 40)
    flaky: Any = PointerDown(storage)
    published = publish(path.name, flaky, lambda: upload_checkpoint(path, storage, update_pointer=False))
    assert published.state == VERIFIED
    assert isinstance(published.pointer_error, ConnectionError) and published.pointer_moved is None
    assert read_latest_pointer(storage) is None
    assert update_latest_pointer(storage, 40)  # the next writer moves it


def test_in_process_shipping_commits_a_part_left_waiting(tmp_path: Path, storage: Storage) -> None:
    """``upload=True`` on a node whose part was stored while another's was not yet: the
    Checkpointer's next upload commits the global manifest first (it used never to)."""
    from spotguard.trainer.config import PRUNE_SELF, CheckpointerConfig
    from spotguard.trainer.policy import SaveRecord
    from spotguard.trainer.shipping import Shipping

    settings = CheckpointerConfig(
        directory=tmp_path / "ckpt",
        storage_uri=storage.uri,
        checksum="crc32c",
        control_dir=tmp_path / "control",
        keep_local=10,
        upload=True,
        async_save=False,
    )
    assert settings.local_pruner == PRUNE_SELF
    shipping = Shipping(settings, SaveRecord(), lambda: storage)
    name = checkpoint_name(50)
    shipping.upload(write_part(tmp_path / "node0", 50, 0))
    assert shipping.awaiting == {name} and name not in shipping.verified
    # The other node's part lands, and its uploader's global commit is lost with it.
    upload_checkpoint(write_part(tmp_path / "node1", 50, 1), storage, update_pointer=False)
    storage.delete([f"{name}/{MANIFEST_NAME}"])

    shipping.upload(whole(tmp_path / "own", 60))
    assert name in shipping.verified and not shipping.awaiting
    assert verify_checkpoint(storage, name).ok
    assert read_latest_pointer(storage) == 60
