"""Background deletes of local checkpoints: step by step, never through another hard link, held during a preemption.

Real files in a temporary directory (sparse where large: no disk is spent).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from spotguard.checkpoint import deletes, local


def sparse(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


def wait_until(cond: object, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_a_large_file_is_freed_from_its_end_a_step_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = 3 * deletes.STEP_BYTES + 12345
    path = sparse(tmp_path / "data.safetensors", size)
    sizes: list[int] = []
    real = os.ftruncate

    def seen(fd: int, length: int) -> None:
        sizes.append(length)
        real(fd, length)

    monkeypatch.setattr(deletes.os, "ftruncate", seen)
    assert deletes.shrink_file(path) == size
    assert sizes == [size - deletes.STEP_BYTES, size - 2 * deletes.STEP_BYTES, 12345, 0]
    assert path.stat().st_size == 0


def test_a_file_with_another_hard_link_is_never_shrunk(tmp_path: Path) -> None:
    # A newer checkpoint links the unchanged files of the one being deleted: they must keep every byte.
    old = tmp_path / "old" / "frozen.bin"
    old.parent.mkdir()
    old.write_bytes(b"x" * 100_000)
    newer = tmp_path / "newer" / "frozen.bin"
    newer.parent.mkdir()
    os.link(old, newer)
    assert deletes.shrink_file(old) == 0
    local.remove_checkpoint_dir(tmp_path / "old", background=True)
    assert wait_until(lambda: not any(p.name.startswith(local.TMP_PREFIX) for p in tmp_path.iterdir()))
    assert newer.read_bytes() == b"x" * 100_000


def test_background_deletes_stand_still_while_a_preemption_holds_them(tmp_path: Path) -> None:
    directory = tmp_path / "ck"
    ckpt = directory / "ckpt-000000000001"
    sparse(ckpt / "model.safetensors", 2 * deletes.STEP_BYTES)

    def doomed() -> list[Path]:
        return [p for p in directory.iterdir() if p.name.startswith(local.TMP_PREFIX)]

    with deletes.hold_deletes():
        assert deletes.deletes_held()
        local.remove_checkpoint_dir(ckpt, background=True)
        assert not ckpt.exists()  # renamed away at once
        time.sleep(0.3)
        (left,) = doomed()
        assert (left / "model.safetensors").stat().st_size == 2 * deletes.STEP_BYTES  # not a step taken
        assert any(t.name == "spotguard-prune" for t in threading.enumerate())
    assert not deletes.deletes_held()
    assert wait_until(lambda: not doomed())


def test_the_emergency_path_runs_with_deletes_held() -> None:
    from spotguard.sidecar.service import CheckpointAgent

    class Probe:
        def _emergency(self, source: str, received_at: float, forward: object) -> bool:
            return deletes.deletes_held()

    assert CheckpointAgent.emergency(Probe(), "sigterm", time.time()) is True  # type: ignore[arg-type]
    assert not deletes.deletes_held()
