"""A pruned checkpoint's large files are freed a step at a time, never a byte another name holds.

On a real file system (the test's temporary directory, and /dev/shm for a
memory one): see :mod:`spotguard.checkpoint.local.release`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from spotguard.checkpoint.local import commit as local
from spotguard.checkpoint.local import release
from spotguard.checkpoint.local.release import MEMORY_FILE_SYSTEMS, fs_type, release_file, release_tree

MiB = 1 << 20


def _file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def _truncations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes release truncates files to, recorded as the real calls go through."""
    seen: list[int] = []
    real = os.ftruncate

    def spy(fd: int, size: int) -> None:
        seen.append(size)
        real(fd, size)

    monkeypatch.setattr(release.os, "ftruncate", spy)
    return seen


def test_fs_type_tells_a_disk_from_memory(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        assert fs_type(fd) not in (None, *MEMORY_FILE_SYSTEMS)
    finally:
        os.close(fd)
    shm = Path("/dev/shm")
    if shm.is_dir():
        fd = os.open(shm, os.O_RDONLY)
        try:
            assert fs_type(fd) in MEMORY_FILE_SYSTEMS
        finally:
            os.close(fd)


def test_a_large_file_is_shrunk_a_step_at_a_time_then_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _truncations(monkeypatch)
    path = tmp_path / "model.safetensors"
    _file(path, 5 * MiB + 3)
    release_file(path, step=MiB)
    assert not path.exists()
    assert seen == [4 * MiB + 3, 3 * MiB + 3, 2 * MiB + 3, MiB + 3, 3, 0]


def test_a_file_another_name_holds_keeps_every_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kept file of an incremental checkpoint is hard-linked into the next one: pruning the older
    # checkpoint must leave the newer one's file whole.
    seen = _truncations(monkeypatch)
    old, new = tmp_path / "ckpt-1", tmp_path / "ckpt-2"
    old.mkdir()
    new.mkdir()
    data = _file(old / "model.kept.safetensors", 3 * MiB)
    os.link(old / "model.kept.safetensors", new / "model.kept.safetensors")
    release_tree(old, step=MiB)
    assert not old.exists()
    assert seen == []
    assert (new / "model.kept.safetensors").read_bytes() == data


def test_links_are_removed_never_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _truncations(monkeypatch)
    outside = tmp_path / "outside"
    outside.mkdir()
    data = _file(outside / "weights", 3 * MiB)
    doomed = tmp_path / "doomed"
    (doomed / "sub").mkdir(parents=True)
    (doomed / "weights").symlink_to(outside / "weights")
    (doomed / "dir").symlink_to(outside)
    _file(doomed / "sub" / "small", 100)
    _file(doomed / "sub" / "large", 2 * MiB + 1)
    release_tree(doomed, step=MiB)
    assert not doomed.exists()
    assert (outside / "weights").read_bytes() == data
    assert seen == [MiB + 1, 1, 0]  # the large regular file only


def test_a_file_in_memory_is_only_unlinked(monkeypatch: pytest.MonkeyPatch) -> None:
    # A staged checkpoint's file in a memory file system may be a trainer's mapped host buffers.
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    seen = _truncations(monkeypatch)
    path = shm / f"spotguard-release-{os.getpid()}"
    _file(path, 3 * MiB)
    release_file(path, step=MiB)
    assert not path.exists()
    assert seen == []


def test_the_background_prune_shrinks_a_checkpoint_but_not_a_staged_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(local, "release_tree", lambda p: calls.append(("release", p)))
    monkeypatch.setattr(local.shutil, "rmtree", lambda p, ignore_errors=False: calls.append(("rmtree", p)))
    directory = tmp_path / "ck"
    plain = directory / "ckpt-000000000001"
    plain.mkdir(parents=True)
    staging = tmp_path / "shm" / f"{local.STAGED_PREFIX}000000000002"
    staging.mkdir(parents=True)
    (directory / "ckpt-000000000002").symlink_to(staging)
    local.remove_checkpoint_dir(plain, background=True)
    local.remove_checkpoint_dir(directory / "ckpt-000000000002", background=True)
    deadline = time.monotonic() + 30
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    kinds = dict((Path(p).name.startswith(local.STAGED_PREFIX), kind) for kind, p in calls)
    assert kinds == {False: "release", True: "rmtree"}


def test_a_release_waits_while_a_preemption_holds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The uploader's emergency path holds this process's releases: a background prune takes no
    # step (no commit the emergency's fsyncs would wait for) until the emergency is over.
    import threading

    seen = _truncations(monkeypatch)
    path = tmp_path / "model.safetensors"
    _file(path, 3 * MiB)
    with release.held():
        worker = threading.Thread(target=release_file, args=(path, MiB))
        worker.start()
        worker.join(0.5)
        assert worker.is_alive() and seen == [] and path.stat().st_size == 3 * MiB
    worker.join(30)
    assert not worker.is_alive() and not path.exists()
    assert seen == [2 * MiB, MiB, 0]
