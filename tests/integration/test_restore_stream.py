"""Restoring a stored checkpoint's state straight into tensors (``restore_latest_state``).

Real stores: the S3 store of the test environment (ranged reads of 1 MiB, so that
one tensor spans several ranges and a range holds several tensors), the same
checkpoint stored incrementally (chunks), and a directory (read in order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import open_test_storage, spy_whole_reads

from spotguard.checkpoint import snapshot_state, upload_checkpoint, write_checkpoint
from spotguard.checkpoint.local.commit import load_checkpoint_state
from spotguard.checkpoint.restore.load import restore_latest, restore_latest_state
from spotguard.checkpoint.restore.stream import HEADER_PROBE, streamable
from spotguard.checkpoint.store.stored import Skipped
from spotguard.storage import Storage

MiB = 1 << 20


def make_state(step: int) -> dict[str, Any]:
    """Tensors of many dtypes and shapes (a 3 MiB one among them), NaNs and
    signed zeros included (compared bit for bit), and a numpy array."""
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(step)
    big = torch.randn(768, 1024, generator=g)  # 3 MiB of float32
    big[0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    return {
        "model": {
            "big": big,
            "bf16": torch.randn(333, 7, generator=g).to(torch.bfloat16),
            "half": torch.randn(5, generator=g).half(),
            "ids": torch.randint(-(1 << 40), 1 << 40, (1001,), generator=g),
            "mask": torch.rand(17, generator=g) > 0.5,
            "bytes": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
            "scalar": torch.tensor(float(step)),
            "empty": torch.empty(0, 4),
        },
        "optimizer": {"state": {0: {"exp_avg": torch.randn(300_001, generator=g, dtype=torch.float64)}}},
        "arr": np.arange(step, step + 10, dtype=np.int32),
        "step": step,
    }


def assert_bitwise_equal(got: Any, want: Any, where: str = "state") -> None:
    import numpy as np
    import torch

    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), where
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.tobytes() == want.tobytes(), where
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            assert_bitwise_equal(got[k], want[k], f"{where}[{k!r}]")
    else:
        assert got == want, where


def upload_steps(storage: Storage, tmp_path: Path, steps: tuple[int, ...], incremental: bool) -> None:
    for step in steps:
        ckpt = write_checkpoint(tmp_path / "local", step, snapshot_state(make_state(step)))
        upload_checkpoint(ckpt, storage, incremental=incremental)


@pytest.mark.parametrize("kind", ["s3", "s3-incremental", "file"])
def test_streamed_restore_is_bitwise_equal_to_the_saved_state(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    options = {"read_chunk_size": MiB, "max_concurrency": 4} if kind.startswith("s3") else {}
    storage: Storage = open_test_storage(kind.split("-")[0], request, tmp_path, **options)
    assert restore_latest_state(storage) is None
    upload_steps(storage, tmp_path, (3,), incremental=kind.endswith("incremental"))
    seen: list[int] = []
    found = restore_latest_state(storage, progress=seen.append)
    assert found is not None
    info, state = found
    assert info.step == 3 and info.uri == storage.uri_for(info.name)
    assert streamable(info.manifest)  # read into memory, not restored to disk and loaded from there
    assert_bitwise_equal(state, make_state(3))
    assert sum(seen) >= 3 * MiB  # the tensor files came through the progress callback
    # The same as loading a local copy.
    assert_bitwise_equal(state, load_checkpoint_state(next((tmp_path / "local").glob("ckpt-*"))))
    # Each tensor owns its memory (as safetensors' loader gives them), and can be trained on.
    big = state["model"]["big"]
    assert big.untyped_storage().nbytes() == big.nbytes
    big.add_(1.0)


@pytest.mark.parametrize("kind", ["s3", "s3-incremental"])
def test_a_damaged_byte_mid_tensor_falls_back_to_the_older_checkpoint(
    s3_store: Any, request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    storage: Storage = open_test_storage("s3", request, tmp_path, read_chunk_size=MiB, max_concurrency=4)
    incremental = kind == "s3-incremental"
    upload_steps(storage, tmp_path, (1, 2), incremental=incremental)
    newest = "ckpt-000000000002"
    from spotguard.checkpoint.store.stored import read_manifest

    manifest = read_manifest(storage, newest)
    entry = next(f for f in manifest.files if f.path == "model.safetensors")
    if incremental:
        assert entry.chunks
        ref = max(entry.chunks, key=lambda r: r.size)
        key, what = ref.key, ref.key
    else:
        key, what = f"{newest}/model.safetensors", "model.safetensors"
    data = bytearray(storage.read_bytes(key))
    data[len(data) // 2] ^= 0x01  # one bit, inside the 3 MiB tensor, same size
    storage.write_bytes(key, bytes(data))

    skipped: list[Skipped] = []
    found = restore_latest_state(storage, on_skip=skipped.append)
    assert found is not None
    info, state = found
    assert info.step == 1
    assert_bitwise_equal(state, make_state(1))
    assert [s.name for s in skipped] == [newest]
    assert what in skipped[0].reason and "mismatch" in skipped[0].reason


def test_tensor_bytes_go_from_the_socket_into_the_tensors(
    s3_store: Any, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the header, every range is read into the tensors' memory
    (``fetch_into``), never first into a ``bytes`` of its own."""
    from spotguard.storage.s3 import S3Storage

    storage = open_test_storage("s3", request, tmp_path, read_chunk_size=MiB, max_concurrency=4)
    assert isinstance(storage, S3Storage)
    upload_steps(storage, tmp_path, (4,), incremental=False)
    calls: dict[str, list[int]] = {"bytes": [], "into": []}
    real_bytes, real_into = storage._get_range, storage._get_range_into

    def get_range(key: str, start: int, end: int, etag: str) -> bytes:
        if key.endswith(".safetensors"):
            calls["bytes"].append(start)
        return real_bytes(key, start, end, etag)

    def get_range_into(key: str, start: int, sinks: list[memoryview], etag: str) -> None:
        calls["into"].append(start)
        real_into(key, start, sinks, etag)

    monkeypatch.setattr(storage, "_get_range", get_range)
    monkeypatch.setattr(storage, "_get_range_into", get_range_into)
    found = restore_latest_state(storage)
    assert found is not None
    assert_bitwise_equal(found[1], make_state(4))
    # Only the first range of each tensor file is read as bytes: its header says where the rest goes.
    assert calls["bytes"] and set(calls["bytes"]) == {0}
    assert len(calls["into"]) >= 3  # the 3 MiB tensor and the 2.3 MiB one, in 1 MiB ranges
    # That first read is the header alone, not a whole range: the rest of the range is read into the tensors.
    assert HEADER_PROBE in calls["into"]


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_tensor_files_are_read_as_the_listing_saw_them(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A plain checkpoint's listing names each file's version (S3: entity
    tag, GCS: generation): its ranges are read pinned to that version with no
    request about the file first, into memory and into a local copy alike."""
    storage = open_test_storage(kind, request, tmp_path, read_chunk_size=MiB, max_concurrency=4)
    upload_steps(storage, tmp_path, (6,), incremental=False)
    asked: list[str] = []
    if kind == "s3":
        real_head = storage.client.head_object

        def head_object(**kwargs: Any) -> Any:
            asked.append(kwargs["Key"])
            return real_head(**kwargs)

        monkeypatch.setattr(storage.client, "head_object", head_object)
    else:
        real_metadata = storage._metadata

        def metadata(key: str) -> Any:
            asked.append(key)
            return real_metadata(key)

        monkeypatch.setattr(storage, "_metadata", metadata)
    found = restore_latest_state(storage)
    assert found is not None
    assert_bitwise_equal(found[1], make_state(6))
    info = restore_latest(storage, tmp_path / "restored")
    assert info is not None
    assert_bitwise_equal(load_checkpoint_state(Path(info.uri)), make_state(6))
    assert [k for k in asked if k.endswith(".safetensors")] == []


@pytest.mark.parametrize("into", ["tensors", "disk"])
@pytest.mark.parametrize("change", ["deleted", "replaced"])
def test_a_file_changed_after_the_listing_fails_its_checkpoint_and_the_restore_walks_back(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, into: str, change: str
) -> None:
    """Read as the listing saw it, a file deleted right after the listing is
    a missing file of that checkpoint, and one replaced (the listing's entity
    tag no longer reads) is read as it is now and fails its checksum: either
    way the restore walks back past that checkpoint; it neither stops on the
    store's refusal nor loads the replacement."""
    storage = open_test_storage("s3", request, tmp_path, read_chunk_size=MiB, max_concurrency=4)
    upload_steps(storage, tmp_path, (1, 2), incremental=False)
    newest = "ckpt-000000000002"
    real_list = storage.list_objects

    def list_objects(prefix: str = "") -> Any:
        listed = list(real_list(prefix))
        if prefix == f"{newest}/":
            key = f"{newest}/model.safetensors"
            if change == "deleted":
                storage.delete([key])
            else:  # the same size, one bit flipped
                data = bytearray(storage.read_bytes(key))
                data[len(data) // 2] ^= 0x01
                storage.write_bytes(key, bytes(data))
        return iter(listed)

    monkeypatch.setattr(storage, "list_objects", list_objects)
    skipped: list[Skipped] = []
    if into == "tensors":
        found = restore_latest_state(storage, on_skip=skipped.append)
        assert found is not None
        info, state = found
    else:
        restored = restore_latest(storage, tmp_path / "restored", on_skip=skipped.append)
        assert restored is not None
        info, state = restored, load_checkpoint_state(Path(restored.uri))
    assert info.step == 1
    assert_bitwise_equal(state, make_state(1))
    assert [s.name for s in skipped] == [newest]
    assert (
        "model.safetensors: " + ("missing" if change == "deleted" else "crc32c checksum mismatch") in skipped[0].reason
    )


def test_a_header_longer_than_the_first_read_is_read_on(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Thousands of tensors with long names: the header runs past the first
    read (:data:`HEADER_PROBE`), and the restore reads on until it has it."""
    import torch

    storage = open_test_storage("s3", request, tmp_path, read_chunk_size=MiB, max_concurrency=4)
    g = torch.Generator().manual_seed(7)
    state = {
        "model": {
            f"layers.{i:05d}.{'attention_projection_' * 4}weight": torch.randn(97, generator=g) for i in range(3000)
        },
        "step": 7,
    }
    ckpt = write_checkpoint(tmp_path / "local", 7, snapshot_state(state))
    header = int.from_bytes((ckpt / "model.safetensors").read_bytes()[:8], "little")
    assert header > HEADER_PROBE
    upload_checkpoint(ckpt, storage, incremental=False)
    found = restore_latest_state(storage)
    assert found is not None
    assert_bitwise_equal(found[1], state)


def test_chunks_go_from_the_socket_into_the_tensors(
    s3_store: Any, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint stored incrementally: past each file's header chunk, every
    chunk is read into the tensors' memory (``read_into``)."""
    from spotguard.storage.s3 import S3Storage

    storage = open_test_storage("s3", request, tmp_path, read_chunk_size=MiB, max_concurrency=4)
    assert isinstance(storage, S3Storage)
    upload_steps(storage, tmp_path, (5,), incremental=True)
    into, as_bytes = spy_whole_reads(storage, monkeypatch)
    found = restore_latest_state(storage)
    assert found is not None
    assert_bitwise_equal(found[1], make_state(5))
    from spotguard.checkpoint.store.stored import read_manifest

    manifest = read_manifest(storage, found[0].name)
    chunked = [e for e in manifest.files if e.chunks]
    chunk_reads_as_bytes = [k for k in as_bytes if k.startswith("chunks/")]
    # As bytes: only the first chunk of each file (a tensor file's holds its header; state.json is read whole).
    assert len(chunk_reads_as_bytes) <= len(chunked)
    assert len(into) + len(chunk_reads_as_bytes) == sum(len(e.chunks or ()) for e in chunked)
    assert len(into) >= 2
