"""Host buffers laid out as the checkpoint's files in the staging memory (spotguard.checkpoint.local.arena),
on a real memory file system.

The staging directory is a directory of its own in ``/dev/shm`` (a tmpfs, as
``spotguard run`` uses), removed after each test.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import save_preempted_in_memory
from sidecar_helpers import PY, Proc, base_env, reaping, s3_storage, spotguard_argv, wait_until

from spotguard.checkpoint import latest_verified, restore_checkpoint, verify_local_checkpoint
from spotguard.checkpoint.local import arena as ar
from spotguard.checkpoint.local.codec import POOL_ARENAS, POOL_PLACES, snapshot_state
from spotguard.checkpoint.local.commit import load_checkpoint_state, write_checkpoint
from spotguard.contract.control import write_heartbeat
from spotguard.run.supervisor import memory_staging_dir
from spotguard.trainer import Checkpointer

MiB = 1 << 20
FILE = "model.safetensors"


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(512, 1024, generator=g),  # 2 MiB
            "h": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "n": torch.tensor(step, dtype=torch.int64),
        },
        "step": step,
    }


def reference_bytes(tmp: Path, st: dict[str, Any], file: str = FILE) -> bytes:
    """The file a plain write of ``st`` makes (no pool, no staging)."""
    path = write_checkpoint(tmp, 1, snapshot_state(st), durable=False)
    return (path / file).read_bytes()


def complete_arena(ck: Checkpointer, file: str = FILE) -> ar.Arena:
    pool = ck._pinned
    assert pool is not None
    wait_until(
        lambda: pool.get(POOL_ARENAS, {}).get(file) is not None and pool[POOL_ARENAS][file].complete,
        30,
        "the host buffers to be moved into their arena",
    )
    return pool[POOL_ARENAS][file]


def staged_checkpointer(tmp_path: Path, memory: Path, **kwargs: Any) -> Checkpointer:
    control = tmp_path / "control"
    ck = Checkpointer(tmp_path / "ck", control_dir=control, emergency_staging=memory, async_save=False, **kwargs)
    write_heartbeat(control, shipping=True)  # an uploader ships at once: the preemption's save is staged
    return ck


def test_a_routine_save_moves_the_host_buffers_and_the_preemptions_save_links_them(
    memory: Path, tmp_path: Path
) -> None:
    ck = staged_checkpointer(tmp_path, memory)
    live = state(1)
    routine = ck.save(1, live, blocking=True)
    assert routine is not None and not routine.is_symlink()
    arena = complete_arena(ck)
    assert os.listdir(memory) == []  # an arena has no name: nothing lists it, a killed trainer leaves nothing
    inode = os.fstat(arena.fd).st_ino
    pool = ck._pinned
    assert pool is not None
    assert {id(pool[k].untyped_storage()) for k in arena.pool_keys} == {id(arena.base.untyped_storage())}
    for t in live["model"].values():  # every tensor changes, as in full training
        t.add_(1)
    path, held = save_preempted_in_memory(ck, 2, live)
    assert held.parent == memory
    linked = held / FILE
    assert linked.stat().st_ino == inode  # the file is the arena: nothing was written
    assert linked.read_bytes() == reference_bytes(tmp_path / "ref", live)  # byte for byte what a write makes
    assert verify_local_checkpoint(path).ok
    loaded = load_checkpoint_state(path)
    for key, t in live["model"].items():
        assert torch.equal(loaded["model"][key], t)
    assert arena.spent and not pool.get(POOL_ARENAS)  # the checkpoint's now


def test_a_linked_arena_is_never_written_again(memory: Path, tmp_path: Path) -> None:
    pool: dict[Any, Any] = {}
    live = state(1)
    first = write_checkpoint(tmp_path / "ck", 1, snapshot_state(live, pinned=pool), pool=pool)
    [plan] = ar.plans(snapshot_state(live))
    built = ar.build(memory, plan, pool, threading.Lock(), places=pool[POOL_PLACES], headroom=None, margin=0)
    assert built is not None and built.complete and first.is_dir()
    inode = os.fstat(built.fd).st_ino
    live["model"]["w"].mul_(2)
    live["model"]["h"].add_(1)
    live["model"]["n"].add_(1)
    snap = snapshot_state(live, pinned=pool)
    assert list(ar.linkable(snap)) == [FILE]
    staged = write_checkpoint(tmp_path / "ck", 2, snap, pool=pool, staging=memory, durable=False)
    del snap
    image = (staged / FILE).read_bytes()
    assert os.stat(staged / FILE).st_ino == inode and built.spent
    # Training goes on (a false alarm): the next snapshots take new buffers, the staged file stays as saved.
    for step in (3, 4):
        live["model"]["w"].add_(step)
        snap = snapshot_state(live, pinned=pool)
        assert not ar.linkable(snap)
        write_checkpoint(tmp_path / "ck", step, snap, pool=pool)
        assert (staged / FILE).read_bytes() == image
    assert verify_local_checkpoint(staged).ok


def test_a_file_whose_layout_changed_is_written(memory: Path, tmp_path: Path) -> None:
    ck = staged_checkpointer(tmp_path, memory)
    live = state(1)
    ck.save(1, live, blocking=True)
    arena = complete_arena(ck)
    inode = os.fstat(arena.fd).st_ino
    for t in live["model"].values():
        t.add_(1)
    live["model"]["extra"] = torch.ones(4)  # another tensor: another header, other offsets
    path, held = save_preempted_in_memory(ck, 2, live)
    assert (held / FILE).stat().st_ino != inode
    assert (held / FILE).read_bytes() == reference_bytes(tmp_path / "ref", live)
    assert verify_local_checkpoint(path).ok


def test_moving_gives_way_to_a_preemption(memory: Path, tmp_path: Path) -> None:
    pool: dict[Any, Any] = {}
    live = {"model": {f"p{i}": torch.full((MiB // 4,), float(i)) for i in range(4)}}
    write_checkpoint(tmp_path / "ck", 1, snapshot_state(live, pinned=pool), pool=pool)
    [plan] = ar.plans(snapshot_state(live))
    asked: list[int] = []

    def stop() -> bool:  # a preemption's save is asked for after the second buffer
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(ar.Stopped):
        ar.build(memory, plan, pool, threading.Lock(), places=pool[POOL_PLACES], headroom=None, margin=0, stop=stop)
    partial = pool[POOL_ARENAS][FILE]
    assert not partial.complete and len(partial.pool_keys) == 2
    for t in live["model"].values():
        t.add_(1)
    snap = snapshot_state(live, pinned=pool)
    assert not ar.linkable(snap)  # half moved: written as before, from the same buffers
    path = write_checkpoint(tmp_path / "ck", 2, snap, pool=pool, staging=memory, durable=False)
    assert (path / FILE).read_bytes() == reference_bytes(tmp_path / "ref", live)


def test_nothing_moves_without_room_or_once_another_snapshot_took_the_pool(memory: Path, tmp_path: Path) -> None:
    pool: dict[Any, Any] = {}
    live = state(1)
    write_checkpoint(tmp_path / "ck", 1, snapshot_state(live, pinned=pool), pool=pool)
    buffers = {k: v for k, v in pool.items() if isinstance(k, tuple)}
    [plan] = ar.plans(snapshot_state(live))
    lock = threading.Lock()
    places = pool[POOL_PLACES]
    assert ar.build(memory, plan, pool, lock, places=places, headroom=MiB, margin=0) is None  # 2 MiB tensor
    assert ar.build(memory, plan, pool, lock, places=places, headroom=None, margin=1 << 50) is None
    snapshot_state(live, pinned=pool)  # the pool now holds another snapshot's places
    assert ar.build(memory, plan, pool, lock, places=places, headroom=None, margin=0) is None
    assert {k: v for k, v in pool.items() if isinstance(k, tuple)} == buffers  # the same buffers, untouched
    assert not pool.get(POOL_ARENAS) and os.listdir(memory) == []


def test_with_the_arena_off_the_preemptions_save_writes(memory: Path, tmp_path: Path) -> None:
    ck = staged_checkpointer(tmp_path, memory, staging_arena=False)
    live = state(1)
    ck.save(1, live, blocking=True)
    ck.wait()
    assert ck._pinned is not None and not ck._pinned.get(POOL_ARENAS)
    for t in live["model"].values():
        t.add_(1)
    path, held = save_preempted_in_memory(ck, 2, live)
    assert (held / FILE).read_bytes() == reference_bytes(tmp_path / "ref", live)


TRAINER = """
import logging, sys, time
import torch
import spotguard
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
for name in ("spotguard.trainer.persist", "spotguard.checkpoint.local.commit"):
    logging.getLogger(name).setLevel(logging.INFO)
ck = spotguard.Checkpointer.from_env()
w = torch.arange(3 * 2**20 // 4, dtype=torch.float32)
b = torch.zeros(5, dtype=torch.int64)
ck.save(1, {"model": {"w": w, "b": b}})
ck.wait()
print("ready", flush=True)
step = 1
while not ck.preempted:
    step += 1
    w.add_(1)
    b.add_(1)
    if ck.should_save(step):
        ck.save(step, {"model": {"w": w, "b": b}})
    time.sleep(0.02)
print(f"stopped at step {step}", flush=True)
"""


@pytest.mark.integration
def test_spotguard_run_links_the_preemptions_file_end_to_end(s3_store, s3_uri: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    if memory_staging_dir(work) is None:
        pytest.skip("no memory staging on this machine")
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    argv = spotguard_argv("run", "--workdir", str(work), "--storage", s3_uri, "--", PY, str(script))
    with reaping() as procs:
        proc = Proc(argv, base_env(s3_store.env()), tmp_path / "run.log")
        procs.append(proc)
        proc.wait_for_line(lambda ln: ln.strip() == "ready")
        proc.wait_for_line(lambda ln: "staging arena: model.safetensors" in ln)
        proc.signal(signal.SIGTERM)
        assert proc.wait() == 128 + signal.SIGTERM, proc.tail()
    assert "model.safetensors linked from its host buffers" in proc.text(), proc.tail()
    line = next(ln for ln in proc.text().splitlines() if ln.startswith("stopped at step"))
    stopped = int(line.rsplit(" ", 1)[1])
    storage = s3_storage(s3_store, s3_uri)
    info, _ = latest_verified(storage)
    assert info is not None and info.step == stopped
    restored = load_checkpoint_state(Path(restore_checkpoint(storage, info.name, tmp_path / "restored").uri))
    assert torch.equal(restored["model"]["w"], torch.arange(3 * 2**20 // 4, dtype=torch.float32) + (stopped - 1))
    assert torch.equal(restored["model"]["b"], torch.full((5,), stopped - 1, dtype=torch.int64))
