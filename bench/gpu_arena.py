"""GPU check ``arena``: a GPU trainer's staging arena, page-locked, and the preemption's save it makes.

A CUDA tensor's host copy lives in a page-locked buffer (for asynchronous
copies). After a routine save the Checkpointer moves those buffers into an
arena in the emergency staging (a memory file system), whose mapping is
page-locked whole (``cudaHostRegister``, as DCP's stager pins its memory:
``spotguard.checkpoint.local.arena.cuda_page_lock``). A preemption's save then
copies the tensor into pinned pages that exist and links the arena as its file,
writing nothing. Checked: the arena is made and complete, the tensor's host
buffer is a view of it and page-locked, the preemption's file is the arena
(same inode) and holds the tensor's bytes. Measured: the preemption's save
(request to committed) with the arena, beside the same save with the arena
turned off (``staging_arena=False``: the file written from the pinned buffers),
median of ``ctx.rounds`` each, alternating.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu_common import Check, CheckFailed, Ctx, MiB, median

FILE = "model.safetensors"


def _wait(pred: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after {seconds:.0f}s waiting for {what}")
        time.sleep(0.05)


def _preempted_save(ctx: Ctx, staging: Path, arena_on: bool, state: dict[str, Any], t: Any) -> tuple[float, Any]:
    """One Checkpointer's routine save, then (its arena built, when on) a preemption's save of a
    changed tensor: that save's seconds, and the arena (None when off)."""
    import torch

    from spotguard.checkpoint.local.codec import POOL_ARENAS
    from spotguard.contract.control import write_heartbeat
    from spotguard.trainer import Checkpointer

    root = Path(tempfile.mkdtemp(dir=ctx.root, prefix="arena-"))
    control = root / "control"
    ck = Checkpointer(
        root / "ck",
        control_dir=control,
        emergency_staging=staging,
        staging_arena=arena_on,
        async_save=False,
        distributed=False,
    )
    write_heartbeat(control, shipping=True)  # an uploader ships at once: the preemption's save is staged
    try:
        ck.save(1, state, blocking=True)
        arena = None
        if arena_on:
            pool = ck._pinned
            assert pool is not None
            _wait(
                lambda: (a := pool.get(POOL_ARENAS, {}).get(FILE)) is not None and a.complete,
                120,
                "the host buffers to move into their arena",
            )
            arena = pool[POOL_ARENAS][FILE]
            inode = os.fstat(arena.fd).st_ino
            base, size = arena.base.data_ptr(), arena.size
            host = [b for k, b in pool.items() if isinstance(k, tuple) and base <= b.data_ptr() < base + size]
            if not host:
                raise CheckFailed("no host buffer of the tensor is a view of its arena")
            if ctx.cuda and not all(b.is_pinned() for b in host):
                raise CheckFailed("the arena's host buffers are not page-locked")
        with torch.no_grad():
            t.add_(1.0)
        if ctx.cuda:
            torch.cuda.synchronize()
        ck.request_checkpoint("sigterm", preempt=True, deadline=time.time() + 60)
        if not ck.should_save(2):
            raise CheckFailed("the preemption's request did not reach should_save")
        t0 = time.perf_counter()
        path = ck.save(2, state)
        seconds = time.perf_counter() - t0
        if path is None:
            raise CheckFailed("the preemption's save committed nothing")
        if arena is not None:
            staged = Path(os.path.realpath(path)) / FILE
            if os.stat(staged).st_ino != inode:
                raise CheckFailed("the preemption's file is not the arena (written instead of linked)")
            data = staged.read_bytes()
            raw = t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
            if raw not in data:
                raise CheckFailed("the linked arena does not hold the tensor's bytes")
        return seconds, arena
    finally:
        ck.close()
        shutil.rmtree(root, ignore_errors=True)


def check_arena(ctx: Ctx, c: Check) -> None:
    import torch

    from spotguard.checkpoint.local.arena import cuda_page_lock

    device = torch.device("cuda", 0) if ctx.cuda else torch.device("cpu")
    n = ctx.size_mib * MiB // 4
    torch.manual_seed(0)
    t = torch.randn(n, device=device)
    state = {"model": {"weight": t}}
    if ctx.cuda and cuda_page_lock() is None:
        raise CheckFailed("CUDA is available but cuda_page_lock() found no cudaHostRegister")
    with_arena: list[float] = []
    without: list[float] = []
    pinned = inside = True
    for r in range(ctx.rounds):
        for arena_on in (True, False) if r % 2 == 0 else (False, True):
            staging = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="spotguard-gpu-arena-"))
            try:
                seconds, arena = _preempted_save(ctx, staging, arena_on, state, t)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            (with_arena if arena_on else without).append(seconds)
            if arena is not None:
                pinned = pinned and (arena.plan.page_locked == ctx.cuda)
                inside = inside and arena.complete
    c.say(
        f"{ctx.size_mib} MiB {'CUDA' if ctx.cuda else 'CPU'} tensor: arena made and complete: "
        f"{'yes' if inside else 'no'}; page-locked: {'yes' if pinned and ctx.cuda else 'no'}"
        f"{'' if ctx.cuda else ' (CPU tensor: plain buffers, no lock needed)'}"
    )
    c.say(
        f"preemption's save (median of {ctx.rounds}): with the arena {median(with_arena):.3f}s (the file linked), "
        f"without {median(without):.3f}s (written from the pinned buffers), "
        f"{median(without) / max(median(with_arena), 1e-9):.2f}x"
    )
    c.fig("arena_page_locked", pinned and ctx.cuda)
    c.fig("emergency_save_s_arena", round(median(with_arena), 4))
    c.fig("emergency_save_s_written", round(median(without), 4))
    if not inside:
        raise CheckFailed("the arena was not completed")
    if ctx.cuda and not pinned:
        raise CheckFailed("the arena of a CUDA tensor's host buffers was not page-locked")
