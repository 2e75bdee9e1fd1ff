"""Committing a framework's own checkpoint folder: the pure parts, and the
local commit / resume round trip (no storage)."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest

from spotguard.checkpoint.format.manifest import FileEntry
from spotguard.checkpoint.format.pickle_scan import UnsafePickleError, check_pickle_safe
from spotguard.checkpoint.local.commit import list_local_committed, read_local_manifest
from spotguard.integrations._core import process_group_backend, torchrun_world_size
from spotguard.storage.checksum import new_hasher
from spotguard.trainer.checkpointer import Checkpointer
from spotguard.trainer.folder import FolderError, folder_files, metrics_of, node_files


def write_folder(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


class Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("true",))


def test_folder_files_sorted_with_excludes(tmp_path: Path) -> None:
    write_folder(tmp_path, {"b.bin": b"1", "a/x.pt": b"2", "training_args.bin": b"3", "a/y.json": b"{}"})
    assert folder_files(tmp_path) == ["a/x.pt", "a/y.json", "b.bin", "training_args.bin"]
    assert folder_files(tmp_path, ("training_args.bin", "a/*.json")) == ["a/x.pt", "b.bin"]


def test_folder_files_refuses_missing_folder_and_manifest_name(tmp_path: Path) -> None:
    with pytest.raises(FolderError, match="does not exist"):
        folder_files(tmp_path / "nope")
    write_folder(tmp_path, {"manifest.json": b"{}"})
    with pytest.raises(FolderError, match="spotguard's manifest"):
        folder_files(tmp_path)


def test_node_files_lists_a_shared_file_once_on_the_lowest_node() -> None:
    gathered = [
        (1, [("model.safetensors", 10, "aa"), ("rng_state_1.pth", 3, "r1")]),
        (0, [("model.safetensors", 10, "aa"), ("rng_state_0.pth", 3, "r0")]),
    ]
    mine0, drop0 = node_files(gathered, 0)
    mine1, drop1 = node_files(gathered, 1)
    assert [e.path for e in mine0] == ["model.safetensors", "rng_state_0.pth"] and drop0 == []
    assert mine1 == [FileEntry("rng_state_1.pth", 3, "r1")] and drop1 == ["model.safetensors"]


def test_node_files_refuses_one_path_with_two_contents() -> None:
    with pytest.raises(FolderError, match="nodes 0 and 1 wrote different contents"):
        node_files([(0, [("optimizer.pt", 5, "x")]), (1, [("optimizer.pt", 5, "y")])], 1)


def test_metrics_of_keeps_finite_numbers_only() -> None:
    assert metrics_of({"loss": 0.5, "epoch": 2, "name": "x", "nan": float("nan"), "flag": True}) == {
        "loss": 0.5,
        "epoch": 2.0,
    }
    assert metrics_of(None) is None and metrics_of({"s": "x"}) is None


def test_torchrun_environment_helpers() -> None:
    assert torchrun_world_size({"WORLD_SIZE": "4"}) == 4
    assert torchrun_world_size({}) == 1 and torchrun_world_size({"WORLD_SIZE": "x"}) == 1
    assert process_group_backend(False) == "gloo"
    assert process_group_backend(True) == "cpu:gloo,cuda:nccl"


def test_numpy_rng_state_passes_the_pickle_scan_and_code_does_not() -> None:
    import random

    import numpy as np
    import torch

    buf = io.BytesIO()
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}, buf)
    check_pickle_safe(buf.getvalue())
    with pytest.raises(UnsafePickleError, match="posix.system|os.system"):
        check_pickle_safe(pickle.dumps(Evil()))


def test_commit_folder_then_resume_folder_round_trip(tmp_path: Path) -> None:
    src = write_folder(
        tmp_path / "framework" / "checkpoint-7",
        {
            "model.safetensors": b"weights",
            "sub/optimizer.pt": b"\x80\x02}q\x00.",
            "training_args.bin": b"\x80\x02}q\x00.",
        },
    )
    ck = Checkpointer(tmp_path / "spotguard", handle_signals=False)
    path = ck.commit_folder(
        7, src, epoch=1, metrics={"loss": 1.5, "note": "x"}, exclude=("training_args.bin",), blocking=True
    )
    assert path is not None and path.name == "ckpt-000000000007"
    m = read_local_manifest(path)
    assert sorted(e.path for e in m.files) == ["model.safetensors", "sub/optimizer.pt"]
    assert m.epoch == 1 and dict(m.metrics) == {"loss": 1.5}
    # The framework's rotation removing its folder leaves the committed copy whole.
    for p in sorted(src.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    src.rmdir()
    ck.close()
    again = Checkpointer(tmp_path / "spotguard", handle_signals=False)
    assert again.resume_folder() == path
    assert (path / "model.safetensors").read_bytes() == b"weights"
    assert again.has_saved(7)  # the resumed step is not saved twice
    again.close()


def test_resume_folder_walks_back_past_a_planted_file_and_a_code_pickle(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck = Checkpointer(tmp_path / "spotguard", handle_signals=False, keep_local=3)
    for step in (1, 2, 3):
        src = write_folder(tmp_path / f"f{step}", {"model.safetensors": b"w%d" % step, "rng_state.pth": b"\x80\x02}."})
        ck.commit_folder(step, src)  # in the background: the next one waits for it
    ck.close()
    newest, middle, oldest = reversed(list_local_committed(tmp_path / "spotguard"))
    (newest / "extra.pt").write_bytes(b"\x80\x02}.")  # not in the manifest
    # A code-running pickle with a manifest that matches it: still refused.
    evil = pickle.dumps(Evil())
    (middle / "rng_state.pth").write_bytes(evil)
    doc = json.loads((middle / "manifest.json").read_text())
    h = new_hasher(doc["checksum_algorithm"])
    h.update(evil)
    for f in doc["files"]:
        if f["path"] == "rng_state.pth":
            f["size"], f["checksum"] = len(evil), h.hexdigest()
    (middle / "manifest.json").write_text(json.dumps(doc))
    again = Checkpointer(tmp_path / "spotguard", handle_signals=False)
    with caplog.at_level("WARNING"):
        assert again.resume_folder() == oldest
    again.close()
    assert "extra.pt: a file the manifest does not list" in caplog.text
    assert "rng_state.pth: pickle would import" in caplog.text and "refused" in caplog.text


def test_stop_requested_follows_a_preempting_request(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "spotguard", handle_signals=False)
    assert not ck.stop_requested
    ck.request_checkpoint("test", preempt=True)
    assert ck.should_save(3) and ck.stop_requested and not ck.preempted
    src = write_folder(tmp_path / "f", {"a.bin": b"x"})
    assert ck.commit_folder(3, src) is not None
    assert ck.preempted and not ck.stop_requested
    ck.close()


def test_commit_folder_links_now_and_checksums_in_the_background(tmp_path: Path) -> None:
    src = write_folder(tmp_path / "checkpoint-4", {"model.safetensors": b"w" * 4096, "a/b.json": b"{}"})
    ck = Checkpointer(tmp_path / "spotguard", handle_signals=False)
    assert ck.commit_folder(4, src) is None  # phase two runs in the background
    # The framework rotates its folder away at once: the checkpoint holds its own links.
    for p in sorted(src.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    assert ck.wait(30)
    assert ck.last_committed is not None and ck.last_committed.name == "ckpt-000000000004"
    m = read_local_manifest(ck.last_committed)
    assert [(e.path, e.size) for e in m.files] == [("a/b.json", 2), ("model.safetensors", 4096)]
    assert m.timing is not None and "persist_seconds" in m.timing
    ck.close()


def test_a_step_saved_again_is_never_committed_again(tmp_path: Path) -> None:
    src = write_folder(tmp_path / "checkpoint-5", {"trainer_state.json": b"{1}"})
    ck = Checkpointer(tmp_path / "spotguard", handle_signals=False)
    first = ck.commit_folder(5, src, blocking=True)
    assert first is not None
    # The framework saves step 5 again, rewriting its (hard-linked) file in place: not re-linked.
    (src / "trainer_state.json").unlink()
    (src / "trainer_state.json").write_bytes(b"{22}")
    ck.request_checkpoint("test", preempt=True)
    assert ck.commit_folder(5, src) == first and ck.preempted  # the request is answered by the commit there is
    assert (first / "trainer_state.json").read_bytes() == b"{1}"
    ck.close()
