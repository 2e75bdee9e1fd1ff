"""A preemption's checkpoint staged in memory (spotguard.checkpoint.local.staged), on real files.

The staging directories here are plain directories (the mechanism is the
same on any file system); the full-memory case uses a real tmpfs in a mount
namespace of its own (``emergency_staging_child.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from ckpt_helpers import save_preempted_in_memory

from spotguard.checkpoint import snapshot_state, verify_local_checkpoint, write_checkpoint
from spotguard.checkpoint.local.commit import (
    STAGED_PREFIX,
    list_local_committed,
    load_checkpoint_state,
    read_local_manifest,
    remove_checkpoint_dir,
)
from spotguard.checkpoint.local.staged import remove_staging, settle_staged, staged_links
from spotguard.contract.control import write_heartbeat
from spotguard.trainer import Checkpointer
from testenv.require import require_root, require_tool

CHILD = Path(__file__).with_name("emergency_staging_child.py")
ROOT = Path(__file__).resolve().parents[2]


def state(step: int, n: int = 4096) -> dict[str, object]:
    rng = np.random.default_rng(step)
    return {"model": {"w": rng.standard_normal(n).astype(np.float32), "b": np.full(7, step, dtype=np.int64)}}


def staged(directory: Path) -> list[str]:
    return sorted(e for e in os.listdir(directory) if e.startswith(STAGED_PREFIX)) if directory.exists() else []


def test_a_preemptions_save_is_written_in_memory_and_committed_by_a_link(tmp_path: Path) -> None:
    ckdir, control, memory = tmp_path / "ck", tmp_path / "control", tmp_path / "memory"
    ck = Checkpointer(ckdir, control_dir=control, emergency_staging=memory, async_save=False)
    write_heartbeat(control, shipping=True)  # an uploader ships at once: the save is not fsynced
    routine = ck.save(1, state(1), blocking=True)
    assert routine is not None and not routine.is_symlink()  # a routine save is durable, on the disk
    path, held = save_preempted_in_memory(ck, 2, state(2))
    assert held.parent == memory and held.name.startswith(STAGED_PREFIX)
    # Everything that reads local checkpoints sees it as any other.
    assert [p.name for p in list_local_committed(ckdir)] == ["ckpt-000000000001", "ckpt-000000000002"]
    assert verify_local_checkpoint(path).ok
    assert read_local_manifest(path).reason == "sigterm"
    loaded = load_checkpoint_state(path)
    assert np.array_equal(np.asarray(loaded["model"]["w"]), state(2)["model"]["w"])
    # Deleting it removes the link, then its files.
    remove_checkpoint_dir(path)
    assert not os.path.lexists(path) and not held.exists() and staged(memory) == []
    assert [p.name for p in list_local_committed(ckdir)] == ["ckpt-000000000001"]


def test_without_a_shipping_uploader_the_preemptions_save_stays_on_the_disk(tmp_path: Path) -> None:
    ckdir, control, memory = tmp_path / "ck", tmp_path / "control", tmp_path / "memory"
    ck = Checkpointer(ckdir, control_dir=control, emergency_staging=memory, async_save=False)
    write_heartbeat(control, shipping=False)  # the uploader cannot ship: the local copy is all there is
    ck.request_checkpoint("sigterm", preempt=True, deadline=time.time() + 30)
    assert ck.should_save(3)
    path = ck.save(3, state(3))
    ck.close()
    assert path is not None and path.is_dir() and not path.is_symlink()
    assert staged(memory) == []


def test_a_staged_save_of_an_existing_step_keeps_the_existing_checkpoint(tmp_path: Path) -> None:
    ckdir, memory = tmp_path / "ck", tmp_path / "memory"
    first = write_checkpoint(ckdir, 4, snapshot_state(state(4)))
    again = write_checkpoint(ckdir, 4, snapshot_state(state(5)), durable=False, staging=memory)
    assert again == first and not first.is_symlink() and verify_local_checkpoint(first).ok
    assert np.array_equal(np.asarray(load_checkpoint_state(first)["model"]["w"]), state(4)["model"]["w"])
    # Nothing of the staged copy is left: neither its files nor its link.
    assert staged(memory) == [] and [e for e in os.listdir(ckdir) if e.startswith(".")] == []


def test_settling_removes_what_storage_holds_and_copies_the_rest_to_the_disk(tmp_path: Path) -> None:
    ckdir, memory = tmp_path / "ck", tmp_path / "memory"
    verified = write_checkpoint(ckdir, 6, snapshot_state(state(6)), durable=False, staging=memory)
    newer = write_checkpoint(ckdir, 7, snapshot_state(state(7)), durable=False, staging=memory)
    before = read_local_manifest(newer).to_json()
    gone = write_checkpoint(ckdir, 8, snapshot_state(state(8)), durable=False, staging=memory)
    remove_staging(memory, keep=[Path(os.readlink(verified)), Path(os.readlink(newer))])  # step 8's files went
    assert len(staged_links(ckdir)) == 3

    removed, copied = settle_staged(ckdir, verified_step=6)

    assert sorted(removed) == [verified.name, gone.name] and copied == [newer.name]
    assert not os.path.lexists(verified) and not os.path.lexists(gone)
    # The checkpoint storage does not hold is now a directory of the disk, byte for byte the same.
    assert newer.is_dir() and not newer.is_symlink()
    assert read_local_manifest(newer).to_json() == before and verify_local_checkpoint(newer).ok
    assert staged_links(ckdir) == [] and [e for e in os.listdir(ckdir) if e.startswith(".")] == []
    # The verified one's files go with the staging directory, here after this process would have exited.
    assert len(staged(memory)) == 1
    remove_staging(memory, background=True, remove_dir=True)
    deadline = time.time() + 30
    while memory.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert not memory.exists()


def test_a_link_this_package_did_not_make_is_never_followed_to_delete(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    elsewhere = write_checkpoint(tmp_path / "users", 9, snapshot_state(state(9)))
    ckdir.mkdir()
    link = ckdir / elsewhere.name
    link.symlink_to(elsewhere)
    remove_checkpoint_dir(link)
    assert not os.path.lexists(link)
    assert verify_local_checkpoint(elsewhere).ok  # the user's checkpoint is untouched
    assert settle_staged(ckdir, verified_step=100) == ([], [])


def test_a_full_memory_staging_falls_back_to_the_disk(tmp_path: Path) -> None:
    """A real 1 MiB tmpfs, mounted in the child's own mount namespace."""
    unshare = require_tool("unshare", "install util-linux (unshare makes the test's private mount namespace)")
    require_root("mounting a tmpfs")
    mount = tmp_path / "memory"
    mount.mkdir()
    done = subprocess.run(
        [unshare, "-m", "--propagation", "private", sys.executable, str(CHILD), str(mount), str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # Too big for the staging: not chosen at all.
    assert out["chosen"] is None
    # Chosen anyway (it filled up while written): written again on the disk, nothing left in memory.
    assert out["written"] == str(tmp_path / "ck" / "ckpt-000000000002")
    assert out["is_link"] is False and out["verifies"] is True
    assert out["memory_after"] == []
    assert "filled up" in done.stderr
    # A small one fits and is staged.
    assert out["small_is_link"] is True
    assert os.listdir(mount) == []  # the tmpfs went with the child's namespace


@pytest.mark.parametrize("same_workdir", [True, False])
def test_memory_staging_of_a_run_is_per_work_directory(tmp_path: Path, same_workdir: bool) -> None:
    from spotguard.run.supervisor import SHM, memory_staging_dir

    a, b = memory_staging_dir(tmp_path / "a"), memory_staging_dir(tmp_path / ("a" if same_workdir else "b"))
    if a is None:
        pytest.skip(f"{SHM} is not a memory file system here")
    assert a.parent == SHM and (a == b) is same_workdir
