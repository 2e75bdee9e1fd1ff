"""Unchanged bytes are told apart without hashing them (``unchanged.Unchanged``), against the real S3 store.

An incremental upload compares each chunk of the new checkpoint with the
previous checkpoint's local copy at the same place; equal bytes whose
CRC32C is the one the previous manifest records are that stored chunk, and
are not hashed. These tests hold that the shortcut is taken where nothing
changed, that it is never taken where something did (even when the previous
local copy was damaged into the new bytes), and that without the previous
local copy every chunk is hashed as before. Every checkpoint restores byte
for byte.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from sidecar_helpers import s3_storage

from spotguard.checkpoint import KnownChunks, read_manifest, restore_checkpoint, upload_checkpoint, verify_checkpoint
from spotguard.checkpoint.format.manifest import Manifest, checkpoint_name
from spotguard.checkpoint.local.codec import snapshot_state
from spotguard.checkpoint.local.commit import remove_checkpoint_dir, write_checkpoint

pytestmark = pytest.mark.integration


def state(step: int, adapter: int, *, nudge: bool = False) -> dict[str, Any]:
    """A frozen base of 24 MiB in 4 MiB tensors, and a small adapter that changes with ``adapter``;
    ``nudge`` changes one value of one frozen tensor."""
    base = torch.Generator().manual_seed(1)
    frozen = {f"base.{i}": torch.randn(1024, 1024, generator=base) for i in range(6)}
    if nudge:
        frozen["base.2"][0, 0] += 1.0
    gen = torch.Generator().manual_seed(100 + adapter)
    return {"model": frozen, "adapter": {"a": torch.randn(64, 64, generator=gen)}, "step": step}


def commit(directory: Path, step: int, adapter: int, *, nudge: bool = False) -> Path:
    return write_checkpoint(directory, step, snapshot_state(state(step, adapter, nudge=nudge)))


def placed(manifest: Manifest) -> dict[tuple[str, int, int], str]:
    """Every chunk of ``manifest`` by its place: (file, offset, size) -> SHA-256 name."""
    out = {}
    for entry in manifest.files:
        offset = 0
        for ref in entry.chunks or ():
            out[(entry.path, offset, ref.size)] = ref.hash
            offset += ref.size
    return out


def same_place_same_chunk(before: Manifest, after: Manifest) -> int:
    old = placed(before)
    return sum(1 for where, digest in placed(after).items() if old.get(where) == digest)


def restores_byte_for_byte(storage: Any, local: Path, tmp_path: Path) -> None:
    assert verify_checkpoint(storage, local.name).ok
    info = restore_checkpoint(storage, local.name, tmp_path / f"restored-{local.name}")
    for entry in read_manifest(storage, local.name).files:
        assert (Path(info.uri) / entry.path).read_bytes() == (local / entry.path).read_bytes(), entry.path


def test_chunks_unchanged_since_the_previous_checkpoint_are_not_hashed(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    storage = s3_storage(s3_store, s3_uri)
    local = tmp_path / "ckpt"
    first = upload_checkpoint(commit(local, 10, 0), storage, incremental=True)
    assert first.unchanged_chunks == 0  # nothing before it
    known = KnownChunks.of(read_manifest(storage, checkpoint_name(10)))

    second_dir = commit(local, 20, 1)
    second = upload_checkpoint(second_dir, storage, incremental=known)
    expected = same_place_same_chunk(
        read_manifest(storage, checkpoint_name(10)), read_manifest(storage, second_dir.name)
    )
    assert expected >= 2  # the frozen base's chunks
    assert second.unchanged_chunks == expected, (second.unchanged_chunks, expected)
    assert second.new_chunks >= 1 and second.new_bytes < 0.05 * second.reused_bytes
    restores_byte_for_byte(storage, second_dir, tmp_path)


def test_a_previous_copy_damaged_into_the_new_bytes_is_not_trusted(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    """The previous local copy now holds the new checkpoint's bytes (as a damaged disk could
    make it): the comparison says equal everywhere, but where the bytes differ from the stored
    chunk the recorded CRC32C does not match, so that chunk is hashed and stored under its own name."""
    storage = s3_storage(s3_store, s3_uri)
    local = tmp_path / "ckpt"
    previous = commit(local, 10, 0)
    upload_checkpoint(previous, storage, incremental=True)
    before = read_manifest(storage, previous.name)
    known = KnownChunks.of(before)

    changed = commit(local, 20, 0, nudge=True)  # one frozen value differs
    for entry in before.files:
        shutil.copyfile(changed / entry.path, previous / entry.path)  # the previous copy "damaged"
    result = upload_checkpoint(changed, storage, incremental=known)
    after = read_manifest(storage, changed.name)
    differing = [w for w, d in placed(after).items() if placed(before).get(w) != d]
    assert differing, "the nudged tensor's chunk must differ from the stored one"
    assert result.unchanged_chunks == len(placed(after)) - len(differing)
    assert result.new_chunks >= 1
    restores_byte_for_byte(storage, changed, tmp_path)
    nudged = restore_checkpoint(storage, changed.name, tmp_path / "check")
    assert nudged.step == 20


def test_without_the_previous_local_copy_every_chunk_is_hashed(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    storage = s3_storage(s3_store, s3_uri)
    local = tmp_path / "ckpt"
    previous = commit(local, 10, 0)
    upload_checkpoint(previous, storage, incremental=True)
    known = KnownChunks.of(read_manifest(storage, previous.name))
    remove_checkpoint_dir(previous)  # pruned locally

    later = commit(local, 20, 1)
    result = upload_checkpoint(later, storage, incremental=known)
    assert result.unchanged_chunks == 0
    assert result.reused_chunks >= 2  # still deduplicated: by hashing
    restores_byte_for_byte(storage, later, tmp_path)


def test_a_file_the_trainer_linked_is_uploaded_without_reading_it(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    """The Checkpointer links an unchanged frozen base's file from the previous checkpoint; the
    upload of that checkpoint takes every chunk of the linked file from the previous manifest."""
    from spotguard import Checkpointer

    storage = s3_storage(s3_store, s3_uri)
    ck = Checkpointer(tmp_path / "ck", keep_local=10, async_save=False)
    known = None
    results = {}
    for step in (1, 2, 3):
        path = ck.save(step, state(step, step))
        assert path is not None
        results[step] = upload_checkpoint(path, storage, incremental=known if known is not None else True)
        known = KnownChunks.of(read_manifest(storage, path.name))
    ck.close()
    kept = ck.directory / checkpoint_name(3) / "model.kept.safetensors"
    assert kept.stat().st_ino == (ck.directory / checkpoint_name(2) / "model.kept.safetensors").stat().st_ino
    third = read_manifest(storage, checkpoint_name(3))
    kept_chunks = len(next(f for f in third.files if f.path == "model.kept.safetensors").chunks or ())
    assert kept_chunks >= 2 and results[3].unchanged_chunks >= kept_chunks
    assert results[3].new_bytes < 0.05 * results[3].reused_bytes
    for step in (2, 3):
        restores_byte_for_byte(storage, ck.directory / checkpoint_name(step), tmp_path)
    # Export and averaging read a state part from both its files.
    from spotguard.checkpoint.restore.stored_tensors import part_tensors

    model = part_tensors(storage, third, tmp_path / "scratch", "model")
    assert sorted(model) == sorted(state(3, 3)["model"])
    assert all(torch.equal(model[k], v) for k, v in state(3, 3)["model"].items())


def test_tensors_that_moved_to_the_kept_file_are_not_hashed(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    """A part with a large frozen tensor and a trained one: in the second save the frozen tensor
    moves to the part's kept file (new offsets); its chunks are still matched, by the tensor, and
    compared instead of hashed."""
    from spotguard import Checkpointer

    gen = torch.Generator().manual_seed(3)
    frozen = torch.randn(5 << 20, generator=gen)  # 20 MiB: chunks of it alone
    storage = s3_storage(s3_store, s3_uri)
    ck = Checkpointer(tmp_path / "ck", keep_local=10, async_save=False)
    known = None
    results = {}
    for step in (1, 2):
        path = ck.save(step, {"model": {"base": frozen, "lora": torch.full((64,), float(step))}, "step": step})
        assert path is not None
        results[step] = upload_checkpoint(path, storage, incremental=known if known is not None else True)
        known = KnownChunks.of(read_manifest(storage, path.name))
    ck.close()
    second = ck.directory / checkpoint_name(2)
    assert (second / "model.kept.safetensors").exists()
    # The frozen tensor's chunks: the same content (reused), found by comparison.
    assert results[2].unchanged_chunks >= 2, results[2]
    assert results[2].reused_bytes >= frozen.numel() * 4 - (16 << 20)
    restores_byte_for_byte(storage, second, tmp_path)
