"""A preemption's checkpoint sent while the trainer writes it (spotguard.sidecar.follow), against a real S3 store.

The writer here is a thread that writes the file in steps, as the
Checkpointer's writer does (a temporary directory renamed at commit); the
store is SeaweedFS with 5 MiB parts, so a file of a few MiB goes in parts.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sidecar_helpers import sigterm_trainer_run, small_parts

from spotguard.checkpoint import (
    load_checkpoint_state,
    upload_checkpoint,
    verify_checkpoint,
)
from spotguard.checkpoint.local.commit import LocalWriter
from spotguard.contract.control import WRITING_FILE, WritePlan, atomic_write_json
from spotguard.sidecar.follow import FollowStopped, WriteFollower

pytestmark = pytest.mark.integration

MiB = 1024 * 1024


def grow(path: Path, data: bytes, step: int, pause: float, done: threading.Event | None = None) -> threading.Thread:
    """Write ``data`` into ``path`` ``step`` bytes at a time, ``pause`` s apart, in a thread."""

    def run() -> None:
        with open(path, "wb") as f:
            for i in range(0, len(data), step):
                f.write(data[i : i + step])
                f.flush()
                time.sleep(pause)
        if done is not None:
            done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_growing_file_is_sent_part_by_part_as_written(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    storage = small_parts(s3_store, s3_uri)
    data = np.random.default_rng(1).integers(0, 256, 23 * MiB, dtype=np.uint8).tobytes()
    path = tmp_path / "growing.bin"
    path.touch()
    asked: list[tuple[int, int]] = []  # (end asked for, size written when it was)
    done = threading.Event()

    def written(end: int) -> None:
        while path.stat().st_size < end:
            time.sleep(0.005)
        asked.append((end, path.stat().st_size))

    writer = grow(path, data, 1 * MiB, 0.02, done)
    assert storage.upload_growing(path, "grown/file.bin", len(data), written)
    writer.join()
    assert storage.read_bytes("grown/file.bin") == data
    # Every part waited for its own bytes only: the first went while most of the file was not written yet.
    assert sorted(e for e, _ in asked) == [5 * MiB, 10 * MiB, 15 * MiB, 20 * MiB, 23 * MiB]
    assert min(size for _, size in asked) < len(data) // 2
    # The store computed the checksum of what it received, as for any upload.
    stored = storage.stored_checksum("grown/file.bin")
    from spotguard.storage.checksum import checksum_bytes

    assert stored is not None and stored.value == checksum_bytes(data, "crc32c")


def test_a_stopped_follow_leaves_no_multipart_upload(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    storage = small_parts(s3_store, s3_uri)
    path = tmp_path / "stalled.bin"
    path.write_bytes(b"x" * (7 * MiB))  # the writer stalls after 7 of 20 MiB

    def written(end: int) -> None:
        if path.stat().st_size < end:
            raise FollowStopped()

    with pytest.raises(FollowStopped):
        storage.upload_growing(path, "stalled/file.bin", 20 * MiB, written)
    assert storage.stat("stalled/file.bin") is None
    assert storage.list_pending_uploads("") == []


def slowly(data: bytes, step: int = 1 * MiB, pause: float = 0.02) -> Any:
    for i in range(0, len(data), step):
        time.sleep(pause)
        yield data[i : i + step]


@pytest.mark.parametrize("rewritten", [False, True], ids=["as-sent", "rewritten-after-sent"])
def test_a_follower_sends_the_save_and_the_upload_resumes_checking_every_file(
    s3_store: Any, s3_uri: str, tmp_path: Path, rewritten: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The follower stores the data file while it is written; the upload after the commit sends
    only what the store does not hold with the manifest's checksum, so bytes that changed after
    they were sent (a library that writes a file out of order) are sent again, and the
    checkpoint verifies either way."""
    storage = small_parts(s3_store, s3_uri)
    ckdir, control = tmp_path / "ck", tmp_path / "control"
    data = np.random.default_rng(3).integers(0, 256, 12 * MiB, dtype=np.uint8).tobytes()
    plan = WritePlan(7, time.time(), (str(ckdir),), (("model.dat", len(data)),))
    atomic_write_json(control / WRITING_FILE, plan.to_json())
    follower = WriteFollower(storage, control, time.time(), time.time() + 60).start()
    writer = LocalWriter(ckdir, 7, durable=False)
    if rewritten:
        # Zeros first, which the follower sends; then the real bytes, in place.
        with open(writer.tmp / "model.dat", "wb") as f:
            for chunk in slowly(bytes(len(data))):
                f.write(chunk)
                f.flush()
        deadline = time.time() + 60
        while not follower.sent and time.time() < deadline:
            time.sleep(0.02)
        (writer.tmp / "model.dat").write_bytes(data)
        writer.add_written("model.dat")
    else:
        writer.add_file("model.dat", slowly(data))
    committed = writer.commit()
    assert follower.finish(committed.name, 60) == ["model.dat"] and follower.error is None
    with caplog.at_level(logging.INFO, logger="spotguard.checkpoint.store.upload"):
        upload_checkpoint(committed, storage, resume=True)
    assert verify_checkpoint(storage, committed.name).ok
    assert storage.read_bytes(f"{committed.name}/model.dat") == data
    # As sent: the upload after the commit did not send the data file again; rewritten: it did.
    kept = "1 of 1 file(s) already stored by an interrupted upload; not sent again" in caplog.text
    assert kept is not rewritten, caplog.text


def test_a_follower_stops_when_the_save_commits_nothing(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    storage = small_parts(s3_store, s3_uri)
    ckdir, control = tmp_path / "ck", tmp_path / "control"
    tmp = ckdir / ".tmp-ckpt-000000000009-abcdef12"
    tmp.mkdir(parents=True)
    atomic_write_json(
        control / WRITING_FILE, WritePlan(9, time.time(), (str(ckdir),), (("m.bin", 20 * MiB),)).to_json()
    )
    (tmp / "m.bin").write_bytes(b"y" * (6 * MiB))  # and the writer stops there
    follower = WriteFollower(storage, control, time.time(), time.time() + 60).start()
    time.sleep(0.5)
    t0 = time.monotonic()
    assert follower.finish(None, 60) == []
    assert time.monotonic() - t0 < 10  # told at once, not at the deadline
    assert storage.stat("ckpt-000000000009/m.bin") is None
    assert storage.list_pending_uploads("") == []


def test_spotguard_run_sends_the_preemptions_checkpoint_while_it_is_written(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    """End to end, whole files (``--no-incremental``): the supervisor follows the trainer's save,
    the upload after the commit finds the data file stored, and the checkpoint restores exactly.

    The trainer writes 48 MiB into memory in tens of milliseconds; on a loaded machine the
    follower may find the save only once it is committed (it then leaves everything to the
    ordinary upload: the next test). A run that shows following is asked for in three."""
    nbytes = 48 * MiB  # more than one multipart part (32 MiB)
    runs: list[str] = []
    for attempt in range(3):
        where = tmp_path / f"run{attempt}"
        where.mkdir()
        text, restored = sigterm_trainer_run(s3_store, f"{s3_uri}/run{attempt}", where, nbytes, "--no-incremental")
        runs.append(text)
        if "stage=follow" in text and "files=1" in text:
            break
    assert "stage=follow" in text and "files=1" in text, "\n\n".join(runs)
    assert "1 of 2 file(s) already stored by an interrupted upload; not sent again" in text, text
    state = load_checkpoint_state(restored)
    total = sum(np.asarray(t).nbytes for t in state["model"].values())
    assert total == nbytes


def test_a_save_committed_before_the_follower_saw_it_does_not_hold_the_upload(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    """A small or linked save may be committed before the follower finds its temporary directory:
    the follower then ends at once (the ordinary upload sends everything), not at the deadline."""
    storage = small_parts(s3_store, s3_uri)
    ckdir, control = tmp_path / "ck", tmp_path / "control"
    plan = WritePlan(11, time.time(), (str(ckdir),), (("model.dat", 12 * MiB),))
    atomic_write_json(control / WRITING_FILE, plan.to_json())
    writer = LocalWriter(ckdir, 11, durable=False)
    writer.add_bytes("model.dat", bytes(12 * MiB))
    committed = writer.commit()  # before the follower starts: it never sees the temporary directory
    follower = WriteFollower(storage, control, time.time(), time.time() + 60).start()
    time.sleep(0.2)
    t0 = time.monotonic()
    assert follower.finish(committed.name, 60) == []
    assert time.monotonic() - t0 < 5
    assert storage.list_pending_uploads("") == []
