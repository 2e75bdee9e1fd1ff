"""A preemption's incremental checkpoint hashed and stored as chunks while the trainer writes it
(spotguard.sidecar.follow, chunks), against a real S3 store.

The writer is a thread that writes a safetensors file in steps into the
temporary directory of a :class:`~spotguard.checkpoint.local.commit.LocalWriter`
(renamed at commit), as the Checkpointer's writer does. The upload after the
commit takes what the follower found (:class:`~spotguard.checkpoint.store.chunked.Prestored`).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sidecar_helpers import s3_storage, sigterm_trainer_run

from spotguard.checkpoint import (
    load_checkpoint_state,
    restore_checkpoint,
    upload_checkpoint,
    verify_checkpoint,
)
from spotguard.checkpoint.format.chunks import hash_chunk, plan_file, plan_safetensors
from spotguard.checkpoint.format.manifest import CHUNKS_DIR
from spotguard.checkpoint.local.commit import LocalWriter
from spotguard.checkpoint.store.chunked import KnownChunks
from spotguard.contract.control import WRITING_FILE, WritePlan, atomic_write_json
from spotguard.sidecar.follow import WriteFollower
from spotguard.storage import StorageError

pytestmark = pytest.mark.integration

MiB = 1024 * 1024


def safetensors_bytes(tensors: dict[str, bytes]) -> bytes:
    """A safetensors file of byte tensors, in order."""
    header: dict[str, Any] = {}
    at = 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [at, at + len(data)]}
        at += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values())


def model_file(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    sizes = {"big": 20 * MiB, "mid": 3 * MiB, "small": 64 * 1024}  # cut at 16 MiB, alone, grouped with the header
    return safetensors_bytes({k: rng.integers(0, 256, n, dtype=np.uint8).tobytes() for k, n in sizes.items()})


class Puts:
    """A store that records each chunk it is asked to store, and when."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.chunks: list[tuple[str, float]] = []

    def write_checked(self, key: str, data: bytes, crc32c: str | None = None) -> None:
        if key.startswith(CHUNKS_DIR + "/"):
            self.chunks.append((key, time.monotonic()))
        self.inner.write_checked(key, data, crc32c)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def slowly(data: bytes, step: int = 1 * MiB, pause: float = 0.02) -> Iterator[bytes]:
    for i in range(0, len(data), step):
        time.sleep(pause)
        yield data[i : i + step]


def follow(storage: Any, tmp_path: Path, step: int, files: tuple[tuple[str, int], ...]) -> tuple[Path, WriteFollower]:
    ckdir, control = tmp_path / "ck", tmp_path / "control"
    atomic_write_json(control / WRITING_FILE, WritePlan(step, time.time(), (str(ckdir),), files).to_json())
    return ckdir, WriteFollower(storage, control, time.time(), time.time() + 60, known={}).start()


@pytest.mark.parametrize("rewritten", [False, True], ids=["as-written", "rewritten-after-read"])
def test_chunks_are_hashed_and_stored_while_written_and_not_read_again(
    s3_store: Any, s3_uri: str, tmp_path: Path, rewritten: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The follower stores every chunk of the file being written, the first long before the last
    byte is written; the upload after the commit stores none again and reads none, and the
    checkpoint verifies and restores the bytes written. Bytes changed after the follower read
    them make the chunks' checksums disagree with the file's: that file is read and hashed again,
    and the checkpoint holds the new bytes."""
    storage = s3_storage(s3_store, s3_uri)
    puts = Puts(storage)
    data = model_file(5)
    ckdir, follower = follow(puts, tmp_path, 7, (("model.safetensors", len(data)),))
    writer = LocalWriter(ckdir, 7, durable=False)
    if rewritten:
        with open(writer.tmp / "model.safetensors", "wb") as f:
            f.write(data[:4096])  # the header as written, then other tensor bytes
            for piece in slowly(bytes(len(data) - 4096)):
                f.write(piece)
                f.flush()
        deadline = time.time() + 60
        places = plan_safetensors(data[:4096], len(data))
        while len(follower.prestored().located) < len(places) and time.time() < deadline:  # type: ignore[union-attr]
            time.sleep(0.02)
        (writer.tmp / "model.safetensors").write_bytes(data)
        writer.add_written("model.safetensors")
    else:
        writer.add_file("model.safetensors", slowly(data))
    written_at = time.monotonic()
    committed = writer.commit()
    assert follower.finish(committed.name, 60) == ["model.safetensors"] and follower.error is None
    found = follower.prestored()
    assert found is not None
    places = plan_file(committed / "model.safetensors")
    assert len(places) >= 3 and set(found.located) == {("model.safetensors", o, n) for o, n in places}
    if not rewritten:
        assert puts.chunks[0][1] < written_at - 0.2  # while the file was being written
    follower_puts = len(puts.chunks)
    assert follower_puts == len(found.stored) == len(places)
    upload = Puts(storage)
    with caplog.at_level(logging.WARNING, logger="spotguard.checkpoint.store.chunked"):
        result = upload_checkpoint(committed, upload, incremental=KnownChunks(), prestored=found)
    again = "changed after it was read while written; reading it again" in caplog.text
    assert again is rewritten, caplog.text
    # As written: nothing stored again. Rewritten: the chunks of the new bytes (the header's group is the same).
    assert len(upload.chunks) == (len(places) - 1 if rewritten else 0)
    assert result.new_chunks == len(places) + (len(places) - 1 if rewritten else 0)
    assert verify_checkpoint(storage, committed.name).ok
    out = restore_checkpoint(storage, committed.name, tmp_path / "restored")
    assert (Path(out.uri) / "model.safetensors").read_bytes() == data


def test_a_linked_file_is_not_read_and_known_chunks_are_not_stored_again(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    """A file linked from a kept checkpoint (a frozen base) is left to the upload, which knows it
    without reading it; chunks the store already holds are not stored again."""
    storage = s3_storage(s3_store, s3_uri)
    base, adapter = model_file(8), model_file(9)
    kept = tmp_path / "kept.safetensors"
    kept.write_bytes(base)
    ckdir, follower = follow(
        storage, tmp_path, 3, (("base.safetensors", len(base)), ("adapter.safetensors", len(adapter)))
    )
    writer = LocalWriter(ckdir, 3, durable=False)
    os.link(kept, writer.tmp / "base.safetensors")
    writer.add_written("base.safetensors")
    writer.add_file("adapter.safetensors", slowly(adapter))
    committed = writer.commit()
    assert follower.finish(committed.name, 60) == ["adapter.safetensors"] and follower.error is None
    found = follower.prestored()
    assert found is not None
    assert {path for path, _, _ in found.located} == {"adapter.safetensors"}
    upload_checkpoint(committed, storage, incremental=KnownChunks(), prestored=found)
    assert verify_checkpoint(storage, committed.name).ok
    # A second follower that knows the stored chunks stores none of the same bytes again.
    again = Puts(storage)
    ckdir2 = tmp_path / "ck2"
    control2 = tmp_path / "control2"
    atomic_write_json(
        control2 / WRITING_FILE,
        WritePlan(4, time.time(), (str(ckdir2),), (("adapter.safetensors", len(adapter)),)).to_json(),
    )
    follower2 = WriteFollower(again, control2, time.time(), time.time() + 60, known=dict(found.stored)).start()
    writer2 = LocalWriter(ckdir2, 4, durable=False)
    writer2.add_file("adapter.safetensors", slowly(adapter))
    committed2 = writer2.commit()
    assert follower2.finish(committed2.name, 60) == ["adapter.safetensors"]
    assert again.chunks == []
    assert len(follower2.prestored().located) == len(plan_file(committed2 / "adapter.safetensors"))  # type: ignore[union-attr]


def test_spotguard_run_hashes_an_incremental_checkpoint_while_it_is_written(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    """End to end, incremental (the default): the supervisor follows the trainer's save, the upload
    after the commit finds every chunk of the data file found, and the checkpoint restores exactly."""
    nbytes = 40 * MiB
    text, restored = sigterm_trainer_run(s3_store, s3_uri, tmp_path, nbytes)

    def fields(stage: str) -> dict[str, str]:
        line = next(ln for ln in text.splitlines() if f"stage={stage} " in ln)
        return dict(f.split("=", 1) for f in line.split() if "=" in f)

    followed, uploaded = fields("follow"), fields("upload")
    assert followed["files"] == "1" and int(followed["chunks"]) >= 3, text
    # Every chunk the upload counts as new was stored while the data file was written, but the one of
    # state.json (not a safetensors file: chunked once committed).
    assert int(uploaded["new_chunks"]) == int(followed["stored"]) + 1, text
    state = load_checkpoint_state(restored)
    assert sum(np.asarray(t).nbytes for t in state["model"].values()) == nbytes


def test_a_follower_stopped_by_a_failed_save_ends_at_once(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    storage = s3_storage(s3_store, s3_uri)
    data = model_file(11)
    ckdir, follower = follow(storage, tmp_path, 9, (("model.safetensors", len(data)),))
    writer = LocalWriter(ckdir, 9, durable=False)
    with open(writer.tmp / "model.safetensors", "wb") as f:
        f.write(data[: 6 * MiB])  # and the writer stops there
    time.sleep(0.5)
    t0 = time.monotonic()
    assert follower.finish(None, 60) == []
    assert time.monotonic() - t0 < 5
    assert follower.error is None


def test_a_chunk_given_with_a_wrong_checksum_is_refused_by_the_store(s3_store: Any, s3_uri: str) -> None:
    """A CRC32C handed to the store with a chunk (not computed again) is checked there: a wrong one
    stores nothing."""
    storage = s3_storage(s3_store, s3_uri)
    data = b"chunk bytes" * 1000
    with pytest.raises(Exception):  # noqa: B017,PT011 - the store's refusal, in whatever error it maps to
        storage.write_checked("chunks/aa/wrong", data, "00000000")
    assert storage.stat("chunks/aa/wrong") is None
    ref = hash_chunk(data)
    storage.write_checked(ref.key, data, ref.checksum)
    assert storage.read_bytes(ref.key) == data


class Failing(Puts):
    """A store whose chunk writes fail after the first (a store that starts failing mid-save)."""

    def write_checked(self, key: str, data: bytes, crc32c: str | None = None) -> None:
        if key.startswith(CHUNKS_DIR + "/") and self.chunks:
            raise StorageError(f"{key}: 503 Slow Down")
        super().write_checked(key, data, crc32c)


def test_a_store_failing_while_the_follower_stores_leaves_the_rest_to_the_upload(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    """What the follower could not store is not taken as stored: the upload after the commit reads,
    hashes and stores it, and the checkpoint verifies and restores the bytes written."""
    storage = s3_storage(s3_store, s3_uri)
    data = model_file(13)
    failing = Failing(storage)
    ckdir, follower = follow(failing, tmp_path, 5, (("model.safetensors", len(data)),))
    writer = LocalWriter(ckdir, 5, durable=False)
    writer.add_file("model.safetensors", slowly(data))
    committed = writer.commit()
    follower.finish(committed.name, 60)
    found = follower.prestored()
    assert found is not None and isinstance(follower.error, StorageError)
    assert len(found.stored) == 1 < len(plan_file(committed / "model.safetensors"))
    upload = Puts(storage)
    upload_checkpoint(committed, upload, incremental=KnownChunks(), prestored=found)
    assert len(upload.chunks) == len(plan_file(committed / "model.safetensors")) - 1
    assert verify_checkpoint(storage, committed.name).ok
    out = restore_checkpoint(storage, committed.name, tmp_path / "restored")
    assert (Path(out.uri) / "model.safetensors").read_bytes() == data


def test_the_shipper_forgets_what_was_found_for_checkpoints_too_old_to_ship(tmp_path: Path) -> None:
    """A follower's finds for a checkpoint that was never shipped (superseded) do not stay for the
    uploader's whole life: once too old to be named by an upload, the next find drops them."""
    from spotguard.checkpoint.store.chunked import Prestored
    from spotguard.sidecar.deadline import ThroughputTracker
    from spotguard.sidecar.metrics import SidecarMetrics
    from spotguard.sidecar.shipper import CheckpointShipper
    from spotguard.storage import open_storage

    storage = open_storage(f"file://{tmp_path / 'store'}")
    shipper = CheckpointShipper(
        tmp_path / "ckpt", storage, SidecarMetrics(), ThroughputTracker(30.0, 5.0), incremental=True
    )
    now = time.monotonic()
    shipper.note_prestored("ckpt-000000000001", Prestored({}, {}, now - 10**6))  # long ago
    shipper.note_prestored("ckpt-000000000002", Prestored({}, {}, now))
    shipper.note_prestored("ckpt-000000000003", Prestored({}, {}, now))
    assert sorted(shipper._prestored) == ["ckpt-000000000002", "ckpt-000000000003"]
