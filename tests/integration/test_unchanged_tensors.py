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

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from spotguard import Checkpointer
from spotguard.checkpoint.codec import StateError
from spotguard.checkpoint.local import load_checkpoint_state, verify_local_checkpoint
from spotguard.checkpoint.manifest import checkpoint_name

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
