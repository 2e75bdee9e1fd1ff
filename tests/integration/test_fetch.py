"""fetch_verified: a checkpoint downloaded and checked in one pass, against real storage."""

from __future__ import annotations

from pathlib import Path

import pytest
from ckpt_helpers import assert_state_matches, commit_local, open_test_storage

from spotguard.checkpoint import MANIFEST_NAME, load_checkpoint_state, read_manifest, upload_checkpoint
from spotguard.checkpoint.fetch import fetch_verified
from spotguard.storage import Storage

pytestmark = pytest.mark.integration

NUMEL = 3 << 20  # a model file of about 16 MiB: several ranged reads from S3


def stored(storage: Storage, tmp_path: Path) -> tuple[Path, str, dict[str, int]]:
    src = commit_local(tmp_path / "local", 7, NUMEL)
    name = upload_checkpoint(src, storage).name
    prefix = f"{name}/"
    sizes = {o.key[len(prefix) :]: o.size for o in storage.list_objects(prefix)}
    return src, name, sizes


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_fetch_writes_exactly_the_checked_bytes(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    storage: Storage = open_test_storage(kind, request, tmp_path)
    src, name, sizes = stored(storage, tmp_path)
    manifest = read_manifest(storage, name)
    dest = tmp_path / "restore" / name
    seen: list[int] = []
    assert fetch_verified(storage, name, manifest, sizes, dest, progress=seen.append) == []
    for entry in manifest.files:
        assert (dest / entry.path).read_bytes() == (src / entry.path).read_bytes(), entry.path
    assert sum(seen) == manifest.total_size
    (dest / MANIFEST_NAME).write_bytes((src / MANIFEST_NAME).read_bytes())
    assert_state_matches(load_checkpoint_state(dest), 7, NUMEL)


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_fetch_reports_corrupt_and_missing_files(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    storage: Storage = open_test_storage(kind, request, tmp_path)
    _, name, sizes = stored(storage, tmp_path)
    manifest = read_manifest(storage, name)
    big = max(manifest.files, key=lambda e: e.size)
    small = min(manifest.files, key=lambda e: e.size)
    # Same size, one byte flipped near the end: only a checksum of every byte catches it.
    data = bytearray(storage.read_bytes(f"{name}/{big.path}"))
    data[-100] ^= 0xFF
    storage.write_bytes(f"{name}/{big.path}", bytes(data))
    storage.delete([f"{name}/{small.path}"])
    sizes.pop(small.path)
    problems = fetch_verified(storage, name, manifest, sizes, tmp_path / "restore" / name)
    assert len(problems) == 2, problems
    assert any(p.startswith(f"{big.path}: ") and "checksum mismatch" in p for p in problems), problems
    assert f"{small.path}: missing" in problems
    assert not (tmp_path / "restore" / name / small.path).exists()
