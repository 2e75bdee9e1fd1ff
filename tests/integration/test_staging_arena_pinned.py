"""GPU trainers' staging arena: page-locked host buffers moved into an arena that is page-locked too.

Where CUDA is available the arena's mapping is registered with
``cudaHostRegister`` (:func:`spotguard.checkpoint.local.arena.cuda_page_lock`).
Here there is no GPU, so the registration is the function ``build`` is given:
one that records what it was asked to lock and unlock. Everything else is the
real path: a snapshot into a pooled host buffer, its plan, the arena in a
memory file system, the buffers moved into it and the preemption's file
linked from it. ``make gpu-check`` (the ``arena`` check) runs it with CUDA.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spotguard.checkpoint.local import arena as ar
from spotguard.checkpoint.local.codec import POOL_PLACES, snapshot_state

FILE = "model.safetensors"


class Locks:
    """A page lock that records each call: ``(address, size)`` locked, addresses unlocked."""

    def __init__(self) -> None:
        self.locked: list[tuple[int, int]] = []
        self.unlocked: list[int] = []

    def __call__(self, address: int, size: int) -> Callable[[], None]:
        self.locked.append((address, size))
        return lambda: self.unlocked.append(address)


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(7, generator=g)}}


def committed_pool() -> tuple[dict[Any, Any], Any, ar.Plan]:
    pool: dict[Any, Any] = {}
    snap = snapshot_state(state(3), pinned=pool)
    (plan,) = ar.plans(snap, min_bytes=0, lockable=False)
    return pool, snap, plan


def test_a_page_locked_plan_gets_an_arena_locked_through_the_page_lock(memory: Path) -> None:
    pool, snap, plan = committed_pool()
    assert not plan.page_locked
    locked_plan = dataclasses.replace(plan, page_locked=True)  # as plans() marks GPU tensors' host buffers
    assert locked_plan == plan  # the same layout: an arena of it is linked like any other
    before = {k: v.clone() for k, v in pool.items() if isinstance(k, tuple)}
    locks = Locks()
    got = ar.build(
        memory, locked_plan, pool, threading.Lock(), places=pool[POOL_PLACES], headroom=None, margin=0, page_lock=locks
    )
    assert got is not None and got.complete
    base = got.base.data_ptr()
    assert locks.locked == [(base, plan.size)]  # the whole mapping, once, before a buffer moved in
    for key, offset, n in plan.tensors:
        (pool_key,) = [k for k, (_, f, kk) in pool[POOL_PLACES].items() if (f, kk) == (FILE, key)]
        assert pool[pool_key].data_ptr() == base + offset and pool[pool_key].nbytes == n
        assert torch.equal(pool[pool_key], before[pool_key])
    # The next snapshot copies into the locked arena, and a preemption's save links its file from it.
    nxt = snapshot_state(state(4), pinned=pool)
    assert ar.linkable(nxt) == {FILE: got}
    assert torch.equal(
        got.base[plan.tensors[0][1] :][: plan.tensors[0][2]],
        nxt.tensors[FILE][plan.tensors[0][0]].owner.reshape(-1).view(torch.uint8),
    )
    got.close()
    assert locks.unlocked == [base]


def test_without_a_page_lock_page_locked_buffers_stay_where_they_are(memory: Path) -> None:
    pool, _, plan = committed_pool()
    keys = {k: v.data_ptr() for k, v in pool.items() if isinstance(k, tuple)}
    locked_plan = dataclasses.replace(plan, page_locked=True)
    # No CUDA here: cuda_page_lock() is None, so no arena is made for page-locked buffers.
    assert ar.cuda_page_lock() is None
    assert (
        ar.build(memory, locked_plan, pool, threading.Lock(), places=pool[POOL_PLACES], headroom=None, margin=0) is None
    )
    assert {k: v.data_ptr() for k, v in pool.items() if isinstance(k, tuple)} == keys


def test_a_failed_page_lock_leaves_the_buffers_and_makes_no_arena(memory: Path) -> None:
    pool, _, plan = committed_pool()
    keys = {k: v.data_ptr() for k, v in pool.items() if isinstance(k, tuple)}

    def refused(address: int, size: int) -> Callable[[], None]:
        raise OSError("cudaHostRegister of the arena failed (CUDA error 2)")

    locked_plan = dataclasses.replace(plan, page_locked=True)
    assert (
        ar.build(
            memory,
            locked_plan,
            pool,
            threading.Lock(),
            places=pool[POOL_PLACES],
            headroom=None,
            margin=0,
            page_lock=refused,
        )
        is None
    )
    assert {k: v.data_ptr() for k, v in pool.items() if isinstance(k, tuple)} == keys


def test_plans_take_page_locked_buffers_only_where_arenas_can_be_locked() -> None:
    _, snap, _ = committed_pool()
    # Plain CPU buffers: planned either way, not page-locked.
    assert [p.page_locked for p in ar.plans(snap, min_bytes=0, lockable=True)] == [False]
    assert [p.page_locked for p in ar.plans(snap, min_bytes=0, lockable=False)] == [False]
