"""Unchanged tensors are not written again: the local save links their file from the previous checkpoint.

The Checkpointer's snapshot compares each tensor byte for byte with its host
buffer, which holds what the last committed checkpoint holds at the same
leaf; unchanged tensors go to ``<part>.kept.safetensors``, which the writer
hard-links from that checkpoint when it is the same file there. These tests
hold that a frozen base stops costing writes from the third save on, that
any changed byte is seen (a write through ``.data``, ``0.0`` becoming
``-0.0``), that a snapshot that was never committed is never compared
against, and that every checkpoint loads exactly what was saved.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from spotguard import Checkpointer
from spotguard.checkpoint.format.manifest import checkpoint_name
from spotguard.checkpoint.local.codec import POOL_TRACKED, Snapshot, StateError, pool_committed, snapshot_state
from spotguard.checkpoint.local.commit import load_checkpoint_state, verify_local_checkpoint
from spotguard.checkpoint.local.written import WriteTracker
from testenv.require import require

KEPT = "model.kept.safetensors"


def frozen_base() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {f"base.{i}": torch.randn(256, 256, generator=gen) for i in range(4)}


def state(base: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
    adapter = torch.full((16, 16), float(step))
    return {"model": {**base, "lora": adapter}, "step": step}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def assert_loads(directory: Path, step: int, expected: dict[str, Any]) -> None:
    path = directory / checkpoint_name(step)
    assert verify_local_checkpoint(path).ok
    loaded = load_checkpoint_state(path)
    assert loaded["step"] == expected["step"]
    for name, tensor in expected["model"].items():
        assert torch.equal(bits(loaded["model"][name]), bits(tensor)), (step, name)


def inode(directory: Path, step: int, file: str = KEPT) -> int | None:
    path = directory / checkpoint_name(step) / file
    return os.stat(path).st_ino if path.exists() else None


@pytest.fixture
def ck(tmp_path: Path) -> Any:
    checkpointer = Checkpointer(tmp_path / "ck", keep_local=10, async_save=False)
    yield checkpointer
    checkpointer.close()


def test_a_frozen_base_is_linked_from_the_previous_checkpoint(ck: Any) -> None:
    base = frozen_base()
    saved = {}
    for step in (1, 2, 3, 4):
        saved[step] = state(base, step)
        ck.save(step, saved[step])
    directory = ck.directory
    assert inode(directory, 1) is None  # nothing to compare with: everything written once
    assert inode(directory, 2) is not None  # unchanged since 1: its own file, written
    assert inode(directory, 3) == inode(directory, 2) == inode(directory, 4)  # then linked
    # The adapter changed every time: never linked.
    assert inode(directory, 3, "model.safetensors") != inode(directory, 2, "model.safetensors")
    for step, expected in saved.items():
        assert_loads(directory, step, expected)


def test_any_changed_byte_is_seen(ck: Any) -> None:
    base = frozen_base()
    base["zeros"] = torch.zeros(64, 64)
    for step in (1, 2):
        ck.save(step, state(base, step))
    before = (ck.directory / checkpoint_name(2) / KEPT).read_bytes()
    # A write through .data (no version counter sees it), and 0.0 -> -0.0 (equal as floats, not as bytes).
    base["base.1"].data[3, 3] += 1.0
    base["zeros"].data.neg_()
    third = state(base, 3)
    ck.save(3, third)
    assert inode(ck.directory, 3) != inode(ck.directory, 2)
    assert_loads(ck.directory, 3, third)
    # The previous checkpoint's file was never written through (a link shares it).
    assert (ck.directory / checkpoint_name(2) / KEPT).read_bytes() == before
    loaded = load_checkpoint_state(ck.directory / checkpoint_name(3))
    assert torch.equal(bits(loaded["model"]["zeros"]), bits(torch.zeros(64, 64).neg()))


def test_a_snapshot_never_committed_is_never_compared_against(ck: Any) -> None:
    base = frozen_base()
    for step in (1, 2):
        ck.save(step, state(base, step))
    base["base.0"].data.mul_(2.0)  # the host buffer takes these bytes in the failed save below
    broken = {**state(base, 3), "zzz": object()}
    with pytest.raises(StateError):
        ck.save(3, broken)
    fourth = state(base, 4)
    ck.save(4, fourth)
    assert inode(ck.directory, 4) != inode(ck.directory, 2)
    assert_loads(ck.directory, 4, fourth)


# -- tensors told unchanged without being read (write tracking) ------------------------------


def big_base() -> dict[str, torch.Tensor]:
    """Tensors large enough to be tracked (spotguard.checkpoint.local.written.MIN_TRACKED_BYTES)."""
    gen = torch.Generator().manual_seed(2)
    return {f"base.{i}": torch.randn(512, 1024, generator=gen) for i in range(4)}  # 2 MiB each


def snap(pool: dict[Any, Any], base: dict[str, torch.Tensor], step: int, commit: bool = True) -> Snapshot:
    snapshot = snapshot_state(state(base, step), pinned=pool)
    if commit:
        pool_committed(pool, checkpoint_name(step), (step, step))
    return snapshot


def kept(snapshot: Snapshot) -> dict[str, bytes]:
    """The kept tensors' bytes as the snapshot holds them."""
    return {k: bytes(b.data) for k, b in snapshot.tensors.get(KEPT, {}).items()}


def as_bytes(base: dict[str, torch.Tensor], *names: str) -> dict[str, bytes]:
    return {n: base[n].numpy().tobytes() for n in names}


@pytest.fixture
def tracking() -> None:
    require(
        WriteTracker.shared() is not None, "write tracking (userfaultfd, asynchronous write-protection: Linux 6.7+)"
    )


NBYTES = 512 * 1024 * 4


def unread(snapshot: Snapshot, tensors: int) -> bool:
    """Whether the snapshot read nothing of ``tensors`` whole tensors but their first and last page
    at most (which they may share with memory written since: those pages are compared)."""
    return tensors * NBYTES - tensors * 2 * mmap.PAGESIZE <= snapshot.unread_bytes <= tensors * NBYTES


@pytest.mark.usefixtures("tracking")
def test_a_tracked_frozen_base_is_told_unchanged_without_being_read() -> None:
    base, pool = big_base(), {}
    assert snap(pool, base, 1).unread_bytes == 0  # nothing to compare with
    second = snap(pool, base, 2)
    assert unread(second, 4)  # tracked since the first snapshot copied it
    assert kept(second) == as_bytes(base, *base)
    # A write through .data (no version counter sees it), and one through numpy.
    base["base.1"].data[7, 7] += 1.0
    base["base.3"].numpy()[511, 1023] = -0.0
    third = snap(pool, base, 3)
    assert unread(third, 2)
    assert set(kept(third)) == {"base.0", "base.2"}
    assert {k: bytes(b.data) for k, b in third.tensors["model.safetensors"].items() if k != "lora"} == as_bytes(
        base, "base.1", "base.3"
    )
    fourth = snap(pool, base, 4)  # written before the third, copied then, untouched since
    assert unread(fourth, 4)
    assert kept(fourth) == as_bytes(base, *base)


@pytest.mark.usefixtures("tracking")
def test_a_new_storage_at_a_leaf_is_compared_until_it_is_tracked() -> None:
    base, pool = big_base(), {}
    snap(pool, base, 1)
    snap(pool, base, 2)
    old = base["base.0"]
    base["base.0"] = old.clone()  # the same bytes in new memory: compared, found equal
    third = snap(pool, base, 3)
    assert unread(third, 3)
    assert "base.0" in kept(third)
    del old
    base["base.0"].data.mul_(2.0)
    fourth = snap(pool, base, 4)
    assert unread(fourth, 3)
    assert kept(fourth) == as_bytes(base, "base.1", "base.2", "base.3")


@pytest.mark.usefixtures("tracking")
def test_nothing_is_told_unchanged_against_a_snapshot_never_committed() -> None:
    base, pool = big_base(), {}
    snap(pool, base, 1)
    snap(pool, base, 2, commit=False)
    third = snap(pool, base, 3)
    assert third.unread_bytes == 0
    assert kept(third) == {}
    assert unread(snap(pool, base, 4), 4)


def test_with_tracking_off_every_tensor_is_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTGUARD_TRACK_WRITES", "0")
    base, pool = big_base(), {}
    for step in (1, 2, 3):
        snapshot = snap(pool, base, step)
        assert snapshot.unread_bytes == 0
    assert kept(snapshot) == as_bytes(base, *base)  # still told unchanged, by comparison


@pytest.mark.usefixtures("tracking")
def test_checkpoints_of_a_tracked_base_load_what_was_saved(ck: Any) -> None:
    base = big_base()
    saved = {}
    for step in (1, 2, 3, 4, 5):
        if step == 4:
            base["base.2"].numpy()[0, 0] += 1.0
        saved[step] = state({k: v.clone() for k, v in base.items()}, step)
        ck.save(step, state(base, step))
    for step, expected in saved.items():
        assert_loads(ck.directory, step, expected)
    assert inode(ck.directory, 3) == inode(ck.directory, 2)
    assert inode(ck.directory, 4) != inode(ck.directory, 3)


@pytest.mark.usefixtures("tracking")
def test_a_tensor_written_all_over_is_compared_until_it_stops_changing() -> None:
    # Tracking a tensor that changes at every step would cost a fault per page per checkpoint for
    # nothing: found mostly written, it is compared instead; found unchanged, it is tracked again.
    base, pool = big_base(), {}
    snap(pool, base, 1)
    base["base.0"].data.add_(1.0)
    second = snap(pool, base, 2)
    assert unread(second, 3)
    assert len(pool[POOL_TRACKED]) == 3
    third = snap(pool, base, 3)  # unchanged since, found so by comparison
    assert unread(third, 3)
    assert "base.0" in kept(third)
    assert unread(snap(pool, base, 4), 3)  # tracked again from here
    assert unread(snap(pool, base, 5), 4)
    assert kept(snap(pool, base, 6)) == as_bytes(base, *base)
