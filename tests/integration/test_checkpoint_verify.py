"""Every kind of damage is detected and named, locally and in storage (file://, S3 and GCS),
and resume walks back past it to the newest good checkpoint."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import assert_state_matches, commit_local, open_test_storage

from spotguard.checkpoint import (
    MANIFEST_NAME,
    CheckpointCorruptError,
    LocalWriter,
    StateError,
    latest_verified,
    load_checkpoint_state,
    read_local_manifest,
    restore_latest,
    upload_checkpoint,
    verify_checkpoint,
    verify_local_checkpoint,
)
from spotguard.storage import Storage
from spotguard.storage.checksum import checksum_bytes

pytestmark = pytest.mark.integration

GOOD, BAD = "ckpt-000000000001", "ckpt-000000000002"
MARKER_ENV = "SPOTGUARD_TEST_PWNED"


class RunsCode:
    """Unpickling this would create a marker file (it must never happen)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def flip_byte(data: bytes) -> bytes:
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]


def rewrite_manifest(doc: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> bytes:
    change(doc)
    return json.dumps(doc).encode()


def add_escape(doc: dict[str, Any]) -> None:
    doc["files"][0]["path"] = "../" + GOOD + "/" + doc["files"][0]["path"]


def add_absolute(doc: dict[str, Any]) -> None:
    doc["files"][0]["path"] = "/etc/passwd"


# (name, how to damage the stored BAD checkpoint, fragment the problem must contain)
DAMAGE: list[tuple[str, str, str]] = [
    ("flipped byte", "model.safetensors", "model.safetensors: crc32c checksum mismatch"),
    ("truncated file", "optimizer.safetensors", "optimizer.safetensors: size"),
    ("missing file", "state.json", "state.json: missing"),
    ("manifest path with ..", MANIFEST_NAME, "escapes the checkpoint ('..')"),
    ("manifest absolute path", MANIFEST_NAME, "'/etc/passwd' is absolute"),
    ("malformed manifest JSON", MANIFEST_NAME, "manifest.json: malformed JSON"),
    ("pickle that would run code", "model.pt", "model.pt: pickle would import posix.system, which can run code"),
]


def build_pickle_checkpoint(directory: Path, marker: Path) -> Path:
    """A legacy-style checkpoint (a torch.save file, no state.json) whose files
    all match its manifest, but whose pickle would run code."""
    writer = LocalWriter(directory, 2)
    writer.add_bytes("model.pt", pickle.dumps({"w": [1.0], "evil": RunsCode(marker)}, protocol=4))
    return writer.commit()


def damage_local(ckpt: Path, case: str, marker: Path) -> Path:
    if case == "flipped byte":
        p = ckpt / "model.safetensors"
        p.write_bytes(flip_byte(p.read_bytes()))
    elif case == "truncated file":
        p = ckpt / "optimizer.safetensors"
        p.write_bytes(p.read_bytes()[:100])
    elif case == "missing file":
        (ckpt / "state.json").unlink()
    elif case in ("manifest path with ..", "manifest absolute path"):
        doc = json.loads((ckpt / MANIFEST_NAME).read_bytes())
        change = add_escape if case == "manifest path with .." else add_absolute
        (ckpt / MANIFEST_NAME).write_bytes(rewrite_manifest(doc, change))
    elif case == "malformed manifest JSON":
        (ckpt / MANIFEST_NAME).write_bytes(b'{"format_version": 1, "step": 2,')
    return ckpt


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "pwned"


@pytest.mark.parametrize("case, file, problem", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_local_damage_is_named(tmp_path: Path, marker: Path, case: str, file: str, problem: str) -> None:
    local = tmp_path / "local"
    good = commit_local(local, 1)
    if case == "pickle that would run code":
        bad = build_pickle_checkpoint(local, marker)
    else:
        bad = damage_local(commit_local(local, 2), case, marker)
    assert verify_local_checkpoint(good).ok
    result = verify_local_checkpoint(bad)
    assert not result.ok
    assert any(problem in p for p in result.problems), result.problems
    if case == "pickle that would run code":
        with pytest.raises(StateError, match="would import posix.system"):
            load_checkpoint_state(bad)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["file", "s3", "gs"])
@pytest.mark.parametrize("case, file, problem", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_stored_damage_is_named_and_skipped(
    request: pytest.FixtureRequest, tmp_path: Path, marker: Path, kind: str, case: str, file: str, problem: str
) -> None:
    storage: Storage = open_test_storage(kind, request, tmp_path)
    local = tmp_path / "local"
    upload_checkpoint(commit_local(local, 1), storage)
    if case == "pickle that would run code":
        with pytest.raises(CheckpointCorruptError, match="would import posix.system"):
            upload_checkpoint(build_pickle_checkpoint(local, marker), storage)  # stored, never published
    else:
        upload_checkpoint(commit_local(local, 2), storage)
        key = f"{BAD}/{file}"
        if case == "flipped byte":
            storage.write_bytes(key, flip_byte(storage.read_bytes(key)))
        elif case == "truncated file":
            storage.write_bytes(key, storage.read_bytes(key)[:100])
        elif case == "missing file":
            storage.delete([key])
        elif case == "manifest path with ..":
            doc = json.loads(storage.read_bytes(key))
            storage.write_bytes(key, rewrite_manifest(doc, add_escape))
        elif case == "manifest absolute path":
            doc = json.loads(storage.read_bytes(key))
            storage.write_bytes(key, rewrite_manifest(doc, add_absolute))
        elif case == "malformed manifest JSON":
            storage.write_bytes(key, b'{"format_version": 1, "step": 2,')

    assert verify_checkpoint(storage, GOOD).ok
    result = verify_checkpoint(storage, BAD)
    assert not result.ok
    assert any(problem in p for p in result.problems), result.problems

    info, skipped = latest_verified(storage)
    assert info is not None and info.name == GOOD and info.step == 1
    assert [s.name for s in skipped] == [BAD]
    assert problem in skipped[0].reason

    seen: list[str] = []
    restored = restore_latest(storage, tmp_path / "restore", on_skip=lambda s: seen.append(s.reason))
    assert restored is not None and restored.name == GOOD
    assert len(seen) == 1 and (problem in seen[0] or "missing" in seen[0] or "checksum" in seen[0]), seen
    assert_state_matches(load_checkpoint_state(Path(restored.uri)), 1)
    assert not (tmp_path / "restore" / BAD).exists()
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["file", "s3", "gs"])
def test_sha256_checkpoints_verify_and_detect_damage(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> None:
    storage: Storage = open_test_storage(kind, request, tmp_path)
    ckpt = commit_local(tmp_path / "local", 1, algorithm="sha256")
    assert read_local_manifest(ckpt).checksum_algorithm == "sha256"
    upload_checkpoint(ckpt, storage)
    assert verify_checkpoint(storage, GOOD).ok
    key = f"{GOOD}/model.safetensors"
    storage.write_bytes(key, flip_byte(storage.read_bytes(key)))
    result = verify_checkpoint(storage, GOOD)
    assert [p.split(" (")[0] for p in result.problems] == ["model.safetensors: sha256 checksum mismatch"]


def test_a_file_replaced_with_valid_but_different_data_is_caught(tmp_path: Path) -> None:
    """Same size, valid safetensors, wrong content: only the checksum can tell."""
    local = tmp_path / "local"
    a = commit_local(local, 1)
    b = commit_local(local, 2)
    (b / "model.safetensors").write_bytes((a / "model.safetensors").read_bytes())
    result = verify_local_checkpoint(b)
    assert result.problems and "model.safetensors: crc32c checksum mismatch" in result.problems[0]
    assert checksum_bytes((a / "model.safetensors").read_bytes(), "crc32c") in result.problems[0]


def test_a_safe_legacy_torch_checkpoint_loads_with_weights_only(tmp_path: Path) -> None:
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.arange(3.0), "step": 5}, buf)
    writer = LocalWriter(tmp_path, 5)
    writer.add_bytes("model.pt", buf.getvalue())
    ckpt = writer.commit()
    assert verify_local_checkpoint(ckpt).ok
    state = load_checkpoint_state(ckpt)
    assert torch.equal(state["model"]["w"], torch.arange(3.0)) and state["model"]["step"] == 5
