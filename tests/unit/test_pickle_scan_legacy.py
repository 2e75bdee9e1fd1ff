"""Legacy (non-zip) ``torch.save`` files: every pickle in them is scanned, and a payload never runs.

A legacy file is five pickles back to back; the object is the fourth. A scan
that stopped at the first (the magic number) passed any payload, and
``torch.load(weights_only=False)`` of such a file ran it.
"""

from __future__ import annotations

import io
import os
import pickle
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

from spotguard.checkpoint.format.manifest import FileEntry, new_manifest
from spotguard.checkpoint.format.pickle_scan import UnsafePickleError, check_pickle_safe
from spotguard.checkpoint.format.verify import verify_files
from spotguard.checkpoint.local.codec import StateError
from spotguard.checkpoint.local.commit import load_legacy_pickle
from spotguard.storage.checksum import checksum_bytes


class MakesMarker:
    """Unpickled, it calls ``os.mkdir(path)``: a harmless stand-in for ``os.system``, seen afterwards."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.path,))


def legacy_saved(obj: Any, path: Path) -> Path:
    torch.save(obj, path, _use_new_zipfile_serialization=False)
    return path


def verify_problems(name: str, data: bytes) -> list[str]:
    """What verifying a checkpoint holding this one file says (the path every restore takes)."""
    manifest = new_manifest(1, [FileEntry(name, len(data), checksum_bytes(data, "crc32c"))], "crc32c")

    def read(_path: str) -> Iterator[bytes]:
        yield data

    problems, _ = verify_files(manifest, {name: len(data)}, read)
    return problems


def test_a_payload_in_a_legacy_torch_save_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    path = legacy_saved({"weight": torch.ones(3), "extra": MakesMarker(marker)}, tmp_path / "model.pt")
    assert path.read_bytes()[:2] != b"PK"  # the legacy format indeed

    with pytest.raises(UnsafePickleError, match=r"object would import posix\.mkdir, which can run code"):
        check_pickle_safe(path.read_bytes())
    with path.open("rb") as f, pytest.raises(UnsafePickleError, match=r"posix\.mkdir"):
        check_pickle_safe(f)
    with pytest.raises(StateError, match=r"model\.pt: .*posix\.mkdir.*refused"):
        load_legacy_pickle(path)
    (problem,) = verify_problems("model.pt", path.read_bytes())
    assert "posix.mkdir" in problem and "refused: loading it could run code" in problem
    assert not marker.exists(), "the payload ran"

    # The payload is live: an unrestricted load runs it (what the scan is there to prevent).
    torch.load(path, weights_only=False)
    assert marker.is_dir()


def test_a_legacy_torch_save_of_tensors_passes_and_loads(tmp_path: Path) -> None:
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "step": 7, "b": torch.zeros(2, dtype=torch.int64)}
    path = legacy_saved(state, tmp_path / "model.pt")
    check_pickle_safe(path.read_bytes())
    assert verify_problems("model.pt", path.read_bytes()) == []
    loaded = load_legacy_pickle(path)
    assert loaded["step"] == 7 and torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])


def legacy_pickles(payload_at: int, payload: Any) -> bytes:
    """A legacy file's five pickles (no storages), ``payload`` in place of pickle ``payload_at``."""
    parts: list[Any] = [MAGIC_NUMBER, PROTOCOL_VERSION, {"protocol_version": PROTOCOL_VERSION}, {"a": 1}, []]
    parts[payload_at] = payload
    return b"".join(pickle.dumps(p, protocol=2) for p in parts)


@pytest.mark.parametrize(
    ("index", "what"), [(1, "protocol version"), (2, "system info"), (3, "object"), (4, "storage keys")]
)
def test_every_pickle_of_a_legacy_file_is_scanned(tmp_path: Path, index: int, what: str) -> None:
    with pytest.raises(UnsafePickleError, match=f"legacy torch.save file's {what} would import posix.mkdir"):
        check_pickle_safe(legacy_pickles(index, MakesMarker(tmp_path / "m")))
    check_pickle_safe(legacy_pickles(index, [] if index == 4 else PROTOCOL_VERSION))


def test_a_legacy_file_cut_short_is_refused() -> None:
    whole = legacy_pickles(4, [])
    cut = whole[: whole.index(pickle.dumps({"a": 1}, protocol=2))]
    with pytest.raises(UnsafePickleError, match="legacy torch.save file, object pickle: malformed pickle"):
        check_pickle_safe(cut)


def test_bytes_after_a_plain_pickle_are_refused(tmp_path: Path) -> None:
    """Only a legacy file (first pickle: the literal magic number) may go on past its first pickle."""
    data = pickle.dumps({"a": 1}) + pickle.dumps(MakesMarker(tmp_path / "m"))
    with pytest.raises(UnsafePickleError, match="data after the pickle"):
        check_pickle_safe(data)


def test_torchs_tar_format_is_refused() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        body = pickle.dumps({"a": 1}, protocol=2)
        info = tarfile.TarInfo("pickle")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    with pytest.raises(UnsafePickleError, match="tar archive"):
        check_pickle_safe(buf.getvalue())
