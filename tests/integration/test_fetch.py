"""fetch_verified: a checkpoint downloaded and checked in one pass, against real storage."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import assert_state_matches, commit_local, open_test_storage, s3_options, spy_whole_reads

from spotguard.checkpoint import MANIFEST_NAME, load_checkpoint_state, read_manifest, upload_checkpoint
from spotguard.checkpoint.restore.fetch import fetch_verified
from spotguard.storage import Storage, open_storage
from testenv.require import require_root, require_tool

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
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


def test_s3_tensor_files_are_read_into_their_files_pages(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A safetensors file is fetched by ranges straight into the file (``fetch_into``
    on a mapping of it); none of its bytes comes as a ``bytes`` of its own."""
    from spotguard.storage.s3 import S3Storage

    storage = open_test_storage("s3", request, tmp_path, read_chunk_size=1 << 20)
    assert isinstance(storage, S3Storage)
    src, name, sizes = stored(storage, tmp_path)
    manifest = read_manifest(storage, name)
    into: list[int] = []
    as_bytes: list[str] = []
    real_into, real_iter = storage._get_range_into, storage.iter_chunks

    def get_range_into(key: str, start: int, sinks: list[memoryview], etag: str) -> None:
        into.append(start)
        real_into(key, start, sinks, etag)

    def iter_chunks(key: str, chunk_size: int | None = None) -> Any:
        as_bytes.append(key)
        return real_iter(key, chunk_size)

    monkeypatch.setattr(storage, "_get_range_into", get_range_into)
    monkeypatch.setattr(storage, "iter_chunks", iter_chunks)
    dest = tmp_path / "restore" / name
    assert fetch_verified(storage, name, manifest, sizes, dest) == []
    for entry in manifest.files:
        assert (dest / entry.path).read_bytes() == (src / entry.path).read_bytes(), entry.path
    assert not [k for k in as_bytes if k.endswith(".safetensors")]
    assert len(into) >= 16  # the 12 MiB model file in 1 MiB ranges


_FULL_CHILD = """
import json, subprocess, sys
from pathlib import Path
from spotguard.checkpoint import read_manifest
from spotguard.checkpoint.restore.fetch import fetch_verified
from spotguard.storage import open_storage
args = json.loads(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", args["mount"]], check=True)
storage = open_storage(args["uri"], **args["options"])
manifest = read_manifest(storage, args["name"])
print(json.dumps(fetch_verified(storage, args["name"], manifest, args["sizes"], Path(args["mount"]) / args["name"])))
"""


def test_a_full_disk_while_fetching_into_a_file_is_a_named_problem(
    s3_store: Any, s3_uri: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The file's blocks are allocated before it is mapped: a disk without room
    says so (never a SIGBUS on a page of the mapping). The disk is a real
    1 MiB tmpfs in a mount namespace of a child process alone."""
    unshare = require_tool("unshare", "install util-linux (unshare makes the test's private mount namespace)")
    require_root("mounting a tmpfs")
    storage = open_storage(s3_uri, **s3_options(s3_store))
    _, name, sizes = stored(storage, tmp_path)
    mount = tmp_path / "small"
    mount.mkdir()
    args = {"mount": str(mount), "uri": s3_uri, "options": s3_options(s3_store), "name": name, "sizes": sizes}
    done = subprocess.run(
        [unshare, "-m", "--propagation", "private", sys.executable, "-c", _FULL_CHILD, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr  # not killed by SIGBUS
    problems = json.loads(done.stdout.strip().splitlines()[-1])
    assert any(p.startswith("model.safetensors: ") and "No space left on device" in p for p in problems), problems


def test_s3_chunks_are_read_into_their_files_pages_and_checked_by_size_and_crc(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint stored incrementally is assembled by reading each chunk
    from the socket into its place in the file (``read_into``); a chunk that
    is not the one recorded is named, whether its size or its bytes differ."""
    from spotguard.checkpoint.restore.fetch import fetch_chunks
    from spotguard.storage.s3 import S3Storage

    storage = open_test_storage("s3", request, tmp_path)
    assert isinstance(storage, S3Storage)
    src = commit_local(tmp_path / "local", 7, NUMEL)
    name = upload_checkpoint(src, storage, incremental=True).name
    manifest = read_manifest(storage, name)
    refs = [ref for entry in manifest.files for ref in entry.chunks or ()]
    assert len(refs) >= 2
    real_bytes = storage.read_bytes
    into, as_bytes = spy_whole_reads(storage, monkeypatch)
    dest = tmp_path / "restore" / name
    assert fetch_chunks(storage, manifest, dest) == []
    for entry in manifest.files:
        assert (dest / entry.path).read_bytes() == (src / entry.path).read_bytes(), entry.path
    assert sorted(into) == sorted(ref.key for ref in refs)
    assert not [k for k in as_bytes if k in into]
    big = max(refs, key=lambda r: r.size)
    small = min(refs, key=lambda r: r.size)
    data = real_bytes(big.key)
    storage.write_bytes(big.key, data[:-1])  # one byte short
    flipped = bytearray(real_bytes(small.key))
    flipped[0] ^= 0x01
    storage.write_bytes(small.key, bytes(flipped))  # same size, one bit off
    problems = fetch_chunks(storage, manifest, tmp_path / "again" / name)
    assert any(p.startswith(f"{big.key}: size ") and "truncated" in p for p in problems), problems
    assert any(p.startswith(f"{small.key}: crc32c checksum mismatch") for p in problems), problems


def test_a_range_that_fails_ends_the_fetch_with_its_own_error(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure of the store on one range ends the fetch with that error, once no
    other range writes into the file's mapping any more (closing a mapping that a
    range still fills would fail, and hide the store's error)."""
    from spotguard.storage import StorageError
    from spotguard.storage.s3 import S3Storage

    storage = open_test_storage("s3", request, tmp_path, read_chunk_size=1 << 20)
    assert isinstance(storage, S3Storage)
    _, name, sizes = stored(storage, tmp_path)
    manifest = read_manifest(storage, name)
    real = storage._get_range_into

    def get_range_into(key: str, start: int, sinks: list[memoryview], etag: str) -> None:
        if start == 2 << 20:
            raise StorageError("the store said no")
        time.sleep(0.2)  # the other ranges are still being read when it fails
        real(key, start, sinks, etag)

    monkeypatch.setattr(storage, "_get_range_into", get_range_into)
    with pytest.raises(StorageError, match="the store said no"):
        fetch_verified(storage, name, manifest, sizes, tmp_path / "restore" / name)
