"""The staging arena's layout and choices (spotguard.checkpoint.local.arena), without I/O."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spotguard.checkpoint.local import arena
from spotguard.checkpoint.local.codec import (
    _ST_ITEMSIZE,
    KEPT_SUFFIX,
    Snapshot,
    TensorBlob,
    iter_safetensors,
    safetensors_header,
    written_size,
)
from spotguard.contract.env import STAGING_ARENA, from_env
from spotguard.trainer.config import CheckpointerConfig

MiB = 1 << 20


def blob(t: torch.Tensor, unchanged: bool = False) -> TensorBlob:
    dtype = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64", torch.uint8: "U8", torch.bool: "BOOL"}
    flat = t.reshape(-1).view(torch.uint8)
    return TensorBlob(dtype[t.dtype], tuple(t.shape), memoryview(flat.numpy()), owner=t, unchanged=unchanged)


def test_a_plan_lays_out_the_file_the_writer_writes() -> None:
    blobs = {
        "b": blob(torch.ones(3, dtype=torch.bfloat16)),  # 6 bytes: would misalign what follows
        "w": blob(torch.arange(5, dtype=torch.float32)),
        "step": blob(torch.tensor(7, dtype=torch.int64)),
        "mask": blob(torch.tensor([True, False])),
        "empty": blob(torch.zeros(0, 4)),
    }
    plan = arena.plan_file("model.safetensors", blobs)
    header, order = safetensors_header(blobs)
    assert plan.header == header
    assert [k for k, _, _ in plan.tensors] == order
    assert plan.size == written_size(blobs)
    image = b"".join(bytes(c) for c in iter_safetensors(blobs))
    for key, offset, n in plan.tensors:
        assert image[offset : offset + n] == bytes(blobs[key].data)  # each tensor's bytes where the plan says
        assert offset % _ST_ITEMSIZE[blobs[key].dtype] == 0  # and aligned for a view of its dtype


def test_arenas_are_planned_for_files_of_plain_cpu_host_buffers_only() -> None:
    big = torch.zeros(MiB // 4)
    snap = Snapshot(
        doc={},
        tensors={
            "model.safetensors": {"w": blob(big), "b": blob(torch.zeros(3))},
            "model" + KEPT_SUFFIX: {"frozen": blob(torch.zeros(MiB // 4), unchanged=True)},  # linked, not written
            "optimizer.safetensors": {"m": blob(torch.zeros(16))},  # too small to be worth it
        },
    )
    a = np.zeros(MiB, dtype=np.uint8)
    snap.tensors["numpy.safetensors"] = {"a": TensorBlob("U8", a.shape, memoryview(a), owner=a)}  # not a pool buffer
    assert [p.file for p in arena.plans(snap)] == ["model.safetensors"]
    assert [p.file for p in arena.plans(snap, min_bytes=0)] == ["model.safetensors", "optimizer.safetensors"]


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("false", False), ("true", True)])
def test_the_arena_is_on_unless_turned_off(value: str | None, expected: bool) -> None:
    env = {} if value is None else {STAGING_ARENA.name: value}
    assert from_env(STAGING_ARENA, env) is expected
    assert CheckpointerConfig.from_env(env).staging_arena is expected
    with pytest.raises(ValueError, match=STAGING_ARENA.name):
        CheckpointerConfig.from_env({STAGING_ARENA.name: "maybe"})
