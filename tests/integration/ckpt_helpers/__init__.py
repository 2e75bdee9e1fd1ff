"""Helpers shared by the checkpoint integration tests (and their subprocess scripts)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

HELPERS = Path(__file__).resolve().parent
REPO = HELPERS.parent.parent.parent


def s3_options(s3_store: Any) -> dict[str, Any]:
    """open_storage() options for the test S3 store (explicit, not from the environment)."""
    return {
        "endpoint_url": s3_store.endpoint_url,
        "access_key": s3_store.access_key,
        "secret_key": s3_store.secret_key,
        "region": s3_store.region,
    }


def subprocess_env(s3_store: Any | None = None, **extra: str) -> dict[str, str]:
    """Environment for a spotguard subprocess: this interpreter's, plus S3 settings."""
    env = dict(os.environ)
    env.pop("SPOTGUARD_STORAGE_URI", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if s3_store is not None:
        env.update(s3_store.env())
    env.update(extra)
    return env


def step_tensors(step: int, numel: int = 4096) -> dict[str, Any]:
    """Deterministic content for checkpoint ``step`` (numpy only: fast to import)."""
    import numpy as np

    rng = np.random.default_rng(step)
    return {
        "model": {
            "w": rng.standard_normal(numel).astype(np.float32),
            "b": rng.integers(0, 1 << 30, size=numel // 4, dtype=np.int64),
        },
        "optimizer": {"m": rng.standard_normal(numel // 2).astype(np.float64)},
        "step": step,
        "note": f"state of step {step}",
    }


def assert_state_matches(state: dict[str, Any], step: int, numel: int = 4096) -> None:
    """The loaded state is exactly what step_tensors(step) produced."""
    import numpy as np

    want = step_tensors(step, numel)
    assert state["step"] == step
    assert state["note"] == want["note"]
    for part in ("model", "optimizer"):
        assert set(state[part]) == set(want[part])
        for key, arr in want[part].items():
            got = state[part][key]
            assert got.dtype == arr.dtype and got.shape == arr.shape, (part, key)
            assert np.array_equal(got, arr), (part, key)


def open_test_storage(kind: str, request: Any, tmp_path: Path, **options: Any) -> Any:
    """A fresh storage root of ``kind`` ("file", "s3" or "gs") for one test."""
    from spotguard.storage import open_storage

    if kind == "file":
        return open_storage(f"file://{tmp_path}/remote/job", **options)
    if kind == "gs":
        gcs_store = request.getfixturevalue("gcs_store")
        return open_storage(request.getfixturevalue("gs_uri"), **gcs_store.options(), **options)
    s3_store = request.getfixturevalue("s3_store")
    s3_uri = request.getfixturevalue("s3_uri")
    return open_storage(s3_uri, **s3_options(s3_store), **options)


def commit_local(
    directory: Path, step: int, numel: int = 4096, *, algorithm: str = "crc32c", metrics: dict[str, float] | None = None
) -> Path:
    """Write step_tensors(step) as a committed local checkpoint."""
    from spotguard.checkpoint import snapshot_state, write_checkpoint

    return write_checkpoint(
        directory, step, snapshot_state(step_tensors(step, numel)), algorithm=algorithm, metrics=metrics
    )


#: The layout of the sharded test checkpoints: part (node) -> global ranks.
PART_LAYOUT = {0: (0, 1), 1: (2, 3)}
PART_WORLD = 4


def part_files(step: int, index: int, ranks: tuple[int, ...], big: int = 0) -> dict[str, bytes]:
    """Content of one node's files of ``step`` (``big`` bytes more in its first shard file)."""
    files = {f"dcp/__{r}_0.distcp": os.urandom(64) + f"step {step} rank {r}".encode() * 100 for r in ranks}
    if big:
        first = f"dcp/__{ranks[0]}_0.distcp"
        files[first] += os.urandom(big)
    for r in ranks:
        files[f"ranks/{r:05d}/state.json"] = json.dumps({"rank": r, "step": step}).encode()
    if 0 in ranks:
        files["dcp/.metadata"] = b"\x80\x04K\x01."  # a harmless pickle (the integer 1)
    return files


def write_part(
    root: Path,
    step: int,
    index: int,
    *,
    layout: dict[int, tuple[int, ...]] | None = None,
    world_size: int = PART_WORLD,
    algorithm: str = "crc32c",
    save_id: str | None = None,
    big: int = 0,
    files: dict[str, bytes] | None = None,
) -> Path:
    """A committed local part directory ``root/ckpt-<step>`` of a distributed
    checkpoint (files, then the part manifest): ``files``, else :func:`part_files`'."""
    from spotguard.checkpoint import MANIFEST_NAME, FileEntry, Sharding, checkpoint_name
    from spotguard.checkpoint.format.manifest import new_manifest
    from spotguard.storage.checksum import checksum_bytes

    layout = PART_LAYOUT if layout is None else layout
    ranks = layout[index]
    ckpt = root / checkpoint_name(step)
    entries = []
    for path, data in sorted((part_files(step, index, ranks, big) if files is None else files).items()):
        (ckpt / path).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / path).write_bytes(data)
        entries.append(FileEntry(path, len(data), checksum_bytes(data, algorithm)))
    manifest = new_manifest(
        step,
        entries,
        algorithm,
        metrics={"loss": 1.0 / (step + 1)},
        epoch=step // 10,
        sharding=Sharding(world_size, len(layout), index, ranks, save_id),
    )
    (ckpt / MANIFEST_NAME).write_bytes(manifest.to_json())
    return ckpt


def replace_stored_file(storage: Any, name: str, path: str, data: bytes) -> None:
    """Replace ``path`` of the stored checkpoint ``name`` with ``data`` and fix its manifest to
    match, as an attacker with write access to the bucket would: the file itself when the
    checkpoint is stored whole, a chunk of its own when it is stored as chunks."""
    from spotguard.checkpoint.format.chunks import hash_chunk
    from spotguard.storage.checksum import new_hasher

    doc = json.loads(storage.read_bytes(f"{name}/manifest.json"))
    hasher = new_hasher(doc["checksum_algorithm"])
    hasher.update(data)
    entry = next(f for f in doc["files"] if f["path"] == path)
    entry["size"], entry["checksum"] = len(data), hasher.hexdigest()
    if "chunks" in entry:
        ref = hash_chunk(data)
        entry["chunks"] = [[ref.hash, ref.size, ref.checksum]]
        storage.write_bytes(ref.key, data)
    else:
        storage.write_bytes(f"{name}/{path}", data)
    storage.write_bytes(f"{name}/manifest.json", json.dumps(doc).encode())


def flip_a_stored_byte(storage: Any, name: str, path: str) -> str:
    """Flip one byte in the middle of ``path`` of the stored checkpoint ``name`` (in the chunk
    holding it when stored as chunks), the manifest left as it was; returns the key damaged."""
    from spotguard.checkpoint.store.stored import read_manifest

    entry = next(f for f in read_manifest(storage, name).files if f.path == path)
    key = f"{name}/{path}"
    if entry.chunks:
        key = entry.chunks[len(entry.chunks) // 2].key
    data = bytearray(storage.read_bytes(key))
    data[len(data) // 2] ^= 0x01
    storage.write_bytes(key, bytes(data))
    return key


def spy_whole_reads(storage: Any, monkeypatch: Any) -> tuple[list[str], list[str]]:
    """The keys ``storage`` then reads whole into the caller's memory
    (``read_into``) and as ``bytes`` of their own (``read_bytes``), in order."""
    into: list[str] = []
    as_bytes: list[str] = []
    real_into, real_bytes = storage.read_into, storage.read_bytes

    def read_into(key: str, sinks: list[memoryview]) -> int:
        into.append(key)
        return int(real_into(key, sinks))

    def read_bytes(key: str) -> bytes:
        as_bytes.append(key)
        return bytes(real_bytes(key))

    monkeypatch.setattr(storage, "read_into", read_into)
    monkeypatch.setattr(storage, "read_bytes", read_bytes)
    return into, as_bytes


def save_preempted_in_memory(ck: Any, step: int, state: Any) -> tuple[Path, Path]:
    """A preemption's save of ``state`` at ``step`` by the Checkpointer ``ck`` (then closed), staged in
    memory: its link in the checkpoint directory, and the staged files it points to."""
    import time

    ck.request_checkpoint("sigterm", preempt=True, deadline=time.time() + 30)
    assert ck.should_save(step)
    path = ck.save(step, state)
    ck.close()
    assert path is not None and path.is_symlink(), path
    return path, Path(os.readlink(path))
