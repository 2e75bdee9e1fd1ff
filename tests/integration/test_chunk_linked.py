"""What an incremental upload and its verification do once per file instead of once per chunk:
a file linked from the previous verified checkpoint takes that checkpoint's chunk list whole, and
a pickle whose chunks were inspected in this process is not inspected again (the part of a
distributed checkpoint, then the whole checkpoint)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
from sidecar_helpers import s3_storage

from spotguard.checkpoint import upload_checkpoint, verify_checkpoint
from spotguard.checkpoint.format.chunks import plan_file
from spotguard.checkpoint.local.commit import LocalWriter
from spotguard.checkpoint.local.unchanged import Unchanged
from spotguard.checkpoint.store import chunked
from spotguard.checkpoint.store.chunked import KnownChunks
from spotguard.storage import open_storage

MiB = 1 << 20


def _checkpoint(root: Path, step: int, head: bytes, *, base: bytes | None = None, link: Path | None = None) -> Path:
    writer = LocalWriter(root, step, durable=False)
    if link is not None:
        os.link(link, writer.tmp / "base.distcp")  # the frozen base, not written again
        writer.add_written("base.distcp")
    else:
        assert base is not None
        writer.add_file("base.distcp", [base])
    writer.add_file("head.distcp", [head])
    return writer.commit()


@pytest.mark.integration
def test_a_linked_files_chunks_are_taken_whole_from_the_verified_manifest(
    s3_store: Any, s3_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upload of a file linked from the checkpoint it verified before takes that file's chunk
    list in one step: no lookup per chunk, none read, none asked of the store, all trusted, and its
    chunks not even planned (a DCP file's plan reads every item's bounds); a file written again (the
    head) is still planned and taken chunk by chunk."""
    storage = s3_storage(s3_store, s3_uri)
    root = tmp_path / "ckpt"
    first = _checkpoint(root, 10, os.urandom(MiB), base=os.urandom(40 * MiB))
    upload_checkpoint(first, storage, incremental=True, update_pointer=False)
    verdict = verify_checkpoint(storage, first.name)
    assert verdict.ok and verdict.manifest is not None
    known = KnownChunks.verified(verdict.manifest, verdict.trusted, None)
    base_chunks = next(f.chunks for f in verdict.manifest.files if f.path == "base.distcp")
    assert base_chunks is not None and len(base_chunks) == len(plan_file(first / "base.distcp")) > 1

    per_chunk: list[str] = []
    real = Unchanged.linked

    def counted(self: Unchanged, local_dir: Path, path: str, offset: int, length: int) -> Any:
        per_chunk.append(path)
        return real(self, local_dir, path, offset, length)

    planned: list[str] = []

    def planning(path: Path, **kw: Any) -> Any:
        planned.append(path.name)
        return plan_file(path, **kw)

    monkeypatch.setattr(Unchanged, "linked", counted)
    monkeypatch.setattr(chunked, "plan_file", planning)
    second = _checkpoint(root, 20, os.urandom(MiB), link=first / "base.distcp")
    result = upload_checkpoint(second, storage, incremental=known, update_pointer=False)
    assert "base.distcp" not in per_chunk and "head.distcp" in per_chunk, per_chunk
    assert "base.distcp" not in planned and "head.distcp" in planned, planned
    assert result.unchanged_chunks == len(base_chunks)
    assert {c.hash for c in base_chunks} <= set(result.trusted_chunks)
    again = verify_checkpoint(storage, second.name, trusted=result.trusted_chunks)
    assert again.ok and again.manifest is not None
    assert next(f.chunks for f in again.manifest.files if f.path == "base.distcp") == base_chunks

    # Knowledge not verified by this uploader (read from storage): asked of the store chunk by chunk.
    per_chunk.clear()
    third = _checkpoint(root, 30, os.urandom(MiB), link=second / "base.distcp")
    upload_checkpoint(third, storage, incremental=KnownChunks.of(again.manifest), update_pointer=False)
    assert per_chunk.count("base.distcp") == len(base_chunks)


@pytest.mark.integration
@pytest.mark.parametrize("store", ["file", "s3"])
def test_a_pickle_read_back_and_inspected_in_this_process_is_not_inspected_again(
    store: str, s3_store: Any, s3_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that may be a pickle, every chunk of it read back and found to be its SHA-256 name
    (the file store), is inspected once per process for the same chunks; a deep verification
    inspects it again, and so does one of other bytes. Where the store's CRC32C vouches for the
    chunks instead (S3), or they are trusted, it is inspected at every verification."""
    storage = open_storage(f"file://{tmp_path}/remote") if store == "file" else s3_storage(s3_store, s3_uri)
    inspected: list[str] = []
    real = chunked.check_one_file

    def counted(entry: Any, *args: Any, **kwargs: Any) -> Any:
        inspected.append(entry.path)
        return real(entry, *args, **kwargs)

    monkeypatch.setattr(chunked, "check_one_file", counted)
    writer = LocalWriter(tmp_path / "ckpt", 10, durable=False)
    writer.add_file("state.pkl", [pickle.dumps({"step": 10, "items": list(range(50_000))})])
    first = writer.commit()
    upload_checkpoint(first, storage, incremental=True, update_pointer=False)
    verdict = verify_checkpoint(storage, first.name)
    assert verdict.ok and inspected == ["state.pkl"]
    assert verify_checkpoint(storage, first.name).ok
    assert inspected == ["state.pkl"] * (1 if store == "file" else 2)
    inspected.clear()
    assert verify_checkpoint(storage, first.name, deep=True).ok
    assert inspected == ["state.pkl"]
    assert verdict.manifest is not None
    trusting = {c.hash: c.size for c in verdict.manifest.chunk_refs().values()}
    assert verify_checkpoint(storage, first.name, trusted=trusting).ok
    assert inspected == ["state.pkl"] * 2

    inspected.clear()
    writer = LocalWriter(tmp_path / "ckpt", 20, durable=False)
    writer.add_file("state.pkl", [pickle.dumps({"step": 20, "items": list(range(50_000))})])
    second = writer.commit()
    upload_checkpoint(second, storage, incremental=True, update_pointer=False)
    assert verify_checkpoint(storage, second.name).ok
    assert inspected == ["state.pkl"]
