"""Memory set aside for a preemption's save (spotguard.checkpoint.local.reserve), on a real memory file system.

The staging directory is a directory of its own in ``/dev/shm`` (a tmpfs,
as ``spotguard run`` uses), removed after each test.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from ckpt_helpers import save_preempted_in_memory
from sidecar_helpers import PY, Proc, base_env, reaping, s3_storage, spotguard_argv, wait_until

from spotguard.checkpoint import latest_verified, restore_checkpoint, verify_local_checkpoint
from spotguard.checkpoint.local import reserve as rsv
from spotguard.checkpoint.local.commit import LocalWriter, load_checkpoint_state, read_local_manifest
from spotguard.checkpoint.local.staged import remove_staging
from spotguard.contract.control import write_heartbeat
from spotguard.run.supervisor import memory_staging_dir
from spotguard.trainer import Checkpointer

MiB = 1 << 20


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def state(step: int, n: int = 3 * MiB // 4) -> dict[str, object]:
    rng = np.random.default_rng(step)
    return {"model": {"w": rng.standard_normal(n).astype(np.float32), "b": np.full(7, step, dtype=np.int64)}}


def test_prepare_sets_memory_aside_in_files_of_size_zero_and_keeps_what_matches(memory: Path) -> None:
    assert rsv.prepare(memory, [5 * MiB, 3 * MiB + 1], headroom=None, margin=0) == 12 * MiB
    there = rsv.reserves(memory)
    assert sorted(size for _, size in there) == [rsv.reserve_size(3 * MiB + 1), rsv.reserve_size(5 * MiB)]
    for path, size in there:
        assert path.stat().st_size == 0  # nothing in it to read
        assert allocated(path) >= size  # but its pages are there
    # The same sizes again: nothing made or removed.
    assert rsv.prepare(memory, [3 * MiB + 1, 5 * MiB], headroom=None, margin=0) == 12 * MiB
    assert rsv.reserves(memory) == there
    # Other sizes: what no longer matches goes.
    assert rsv.prepare(memory, [3 * MiB + 1], headroom=None, margin=0) == 5 * MiB
    assert [p for p, _ in rsv.reserves(memory)] == [p for p, s in there if s == 5 * MiB]
    assert sorted(os.listdir(memory)) == [p.name for p, s in there if s == 5 * MiB]


def test_nothing_is_set_aside_that_would_leave_less_memory_than_it_takes(memory: Path) -> None:
    assert rsv.prepare(memory, [8 * MiB], headroom=12 * MiB, margin=0) == 0
    assert os.listdir(memory) == []
    assert rsv.prepare(memory, [8 * MiB], headroom=24 * MiB, margin=0) == 10 * MiB


def test_setting_memory_aside_gives_way_to_a_preemption(memory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rsv, "STEP", MiB)
    asked = []

    def stop() -> bool:  # a preemption's save starts after the first step
        asked.append(1)
        return len(asked) > 1

    assert rsv.prepare(memory, [8 * MiB, 8 * MiB], headroom=None, margin=0, stop=stop) == 0
    assert len(asked) == 2  # stopped at once, and the second reserve never started
    assert os.listdir(memory) == []  # what was being allocated is freed for the save


def test_a_file_written_into_a_reserve_grows_as_it_is_written_and_gives_back_the_rest(memory: Path) -> None:
    rsv.prepare(memory, [4 * MiB], headroom=None, margin=0)
    [(reserve, size)] = rsv.reserves(memory)
    inode = reserve.stat().st_ino
    writer = LocalWriter(memory.parent / f"{memory.name}-ck", 3, durable=False, staging=memory)
    target = writer.tmp / "data.bin"
    data = np.random.default_rng(1).integers(0, 255, 3 * MiB + 12345, dtype=np.uint8).tobytes()
    seen: list[tuple[int, int]] = []

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(data), MiB):
            # What an uploader following the file sees: only what was written so far.
            seen.append((os.stat(target).st_size if target.exists() else -1, i))
            yield data[i : i + MiB]

    try:
        entry = writer.add_file("data.bin", chunks(), size_hint=len(data))
        assert target.stat().st_ino == inode  # the reserve's pages, not a new file's
        assert seen and all(size == offset for size, offset in seen), seen
        assert entry.size == len(data) == target.stat().st_size
        assert target.read_bytes() == data
        assert allocated(target) < len(data) + MiB < size  # what it did not use went back
        assert rsv.reserves(memory) == []
    finally:
        writer.abort()
        shutil.rmtree(writer.directory, ignore_errors=True)


def test_small_files_and_writers_outside_staging_take_no_reserve(memory: Path, tmp_path: Path) -> None:
    rsv.prepare(memory, [4 * MiB], headroom=None, margin=0)
    there = rsv.reserves(memory)
    disk = LocalWriter(tmp_path / "ck", 1)
    disk.add_file("big.bin", [b"x" * (2 * MiB)], size_hint=2 * MiB)
    staged = LocalWriter(tmp_path / "ck2", 2, durable=False, staging=memory)
    staged.add_file("small.bin", [b"x" * 100], size_hint=100)
    assert rsv.reserves(memory) == there
    disk.abort()
    staged.abort()


def test_a_routine_save_sets_memory_aside_and_the_preemptions_save_writes_into_it(memory: Path, tmp_path: Path) -> None:
    ckdir, control = tmp_path / "ck", tmp_path / "control"
    ck = Checkpointer(ckdir, control_dir=control, emergency_staging=memory, staging_reserve=True, async_save=False)
    write_heartbeat(control, shipping=True)  # an uploader ships at once: the preemption's save is staged
    routine = ck.save(1, state(1), blocking=True)
    assert routine is not None and not routine.is_symlink()
    wait_until(lambda: rsv.reserves(memory), 30, "memory to be set aside after the routine save")
    [(reserve, size)] = rsv.reserves(memory)
    [tensor_file] = [f for f in read_local_manifest(routine).files if f.path.endswith(".safetensors")]
    assert size == rsv.reserve_size(tensor_file.size)  # the size of the routine save's file
    inode = reserve.stat().st_ino
    path, held = save_preempted_in_memory(ck, 2, state(2))
    assert held.parent == memory
    tensors = [p for p in held.iterdir() if p.suffix == ".safetensors"]
    assert [p.stat().st_ino for p in tensors] == [inode]  # written into the memory set aside
    assert rsv.reserves(memory) == []
    assert verify_local_checkpoint(path).ok
    loaded = load_checkpoint_state(path)
    assert np.array_equal(np.asarray(loaded["model"]["w"]), state(2)["model"]["w"])
    assert np.array_equal(np.asarray(loaded["model"]["b"]), state(2)["model"]["b"])


def test_without_the_switch_nothing_is_set_aside(memory: Path, tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ck", control_dir=tmp_path / "control", emergency_staging=memory, async_save=False)
    ck.save(1, state(1), blocking=True)
    ck.close()
    time.sleep(0.5)
    assert rsv.reserves(memory) == []


@pytest.mark.parametrize("background", [False, True])
def test_the_staging_clean_up_removes_reserves(memory: Path, background: bool) -> None:
    rsv.prepare(memory, [MiB], headroom=None, margin=0)
    (memory / f"{rsv.MAKING_PREFIX}{2 * MiB}-ab12cd34").write_bytes(b"")  # one whose allocation was cut short
    remove_staging(memory, background=background, remove_dir=True)
    wait_until(lambda: not memory.exists(), 30, "the staging directory to be removed")


TRAINER = """
import sys, time
import numpy as np
import spotguard
ck = spotguard.Checkpointer.from_env()
w = np.arange(3 * 2**20 // 4, dtype=np.float32)
ck.save(1, {"model": {"w": w}})
ck.wait()
print("ready", flush=True)
step = 1
while not ck.preempted:
    step += 1
    w[:7] += 1
    if ck.should_save(step):
        ck.save(step, {"model": {"w": w}})
    time.sleep(0.02)
print(f"stopped at step {step}", flush=True)
"""


@pytest.mark.integration
def test_spotguard_run_reserve_staging_end_to_end(s3_store, s3_uri: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    memory = memory_staging_dir(work)
    if memory is None:
        pytest.skip("no memory staging on this machine")
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    argv = spotguard_argv(
        "run", "--workdir", str(work), "--storage", s3_uri, "--reserve-staging", "--", PY, str(script)
    )
    with reaping() as procs:
        proc = Proc(argv, base_env(s3_store.env()), tmp_path / "run.log")
        procs.append(proc)
        proc.wait_for_line(lambda ln: ln.strip() == "ready")
        wait_until(lambda: rsv.reserves(memory), 60, "memory to be set aside in the run's staging")
        proc.signal(signal.SIGTERM)
        assert proc.wait() == 128 + signal.SIGTERM, proc.tail()
    line = next(ln for ln in proc.text().splitlines() if ln.startswith("stopped at step"))
    stopped = int(line.rsplit(" ", 1)[1])
    storage = s3_storage(s3_store, s3_uri)
    info, _ = latest_verified(storage)
    assert info is not None and info.step == stopped
    restored = restore_checkpoint(storage, info.name, tmp_path / "restored")
    expected = np.arange(3 * 2**20 // 4, dtype=np.float32)
    expected[:7] += stopped - 1
    assert np.array_equal(np.asarray(load_checkpoint_state(Path(restored.uri))["model"]["w"]), expected)
    wait_until(lambda: not memory.exists(), 30, "the run's staging memory to be freed")  # reserves included
