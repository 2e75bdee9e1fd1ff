"""Reading DCP checkpoints never runs code: spotguard.checkpoint.format.dcp."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from spotguard.checkpoint.format.dcp import SafeFileSystemReader, UnsafeMetadataError, load_full_state, parse_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def write_dcp(path: Path, state: dict[str, Any]) -> None:
    dcp_save(state, storage_writer=FileSystemWriter(path), no_dist=True)


def sample_state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": {"0.weight": torch.randn(3, 4), "0.bias": torch.randn(3)},
        "optimizer": {"state": {"0.weight": {"step": torch.tensor(5.0), "exp_avg": torch.randn(3, 4)}}},
    }


def test_a_real_checkpoint_loads(tmp_path: Path) -> None:
    state = sample_state()
    write_dcp(tmp_path / "dcp", state)
    loaded = load_full_state(tmp_path / "dcp")
    assert torch.equal(loaded["model"]["0.weight"], state["model"]["0.weight"])
    assert torch.equal(loaded["model"]["0.bias"], state["model"]["0.bias"])
    assert torch.equal(
        loaded["optimizer"]["state"]["0.weight"]["exp_avg"], state["optimizer"]["state"]["0.weight"]["exp_avg"]
    )
    assert float(loaded["optimizer"]["state"]["0.weight"]["step"]) == 5.0
    metadata = SafeFileSystemReader(tmp_path / "dcp").read_metadata()
    assert isinstance(metadata, Metadata)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_metadata_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    write_dcp(tmp_path / "dcp", sample_state())
    marker = tmp_path / "pwned"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(UnsafeMetadataError, match="would import (posix|os).system"):
        load_full_state(tmp_path / "dcp")
    with pytest.raises(UnsafeMetadataError):
        SafeFileSystemReader(tmp_path / "dcp").read_metadata()
    assert not marker.exists()


def test_code_hidden_inside_real_metadata_is_refused(tmp_path: Path) -> None:
    write_dcp(tmp_path / "dcp", sample_state())
    path = tmp_path / "dcp" / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # our own, just written
    marker = tmp_path / "pwned"
    metadata.planner_data = {"x": _Evil(marker)}
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeMetadataError, match="system"):
        load_full_state(tmp_path / "dcp")
    assert not marker.exists()


def test_byte_items_are_refused(tmp_path: Path) -> None:
    write_dcp(tmp_path / "dcp", sample_state())
    path = tmp_path / "dcp" / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    metadata.state_dict_metadata["extra"] = BytesStorageMetadata()
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeMetadataError, match="'extra' is stored as BytesStorageMetadata"):
        load_full_state(tmp_path / "dcp")


def test_a_checkpoint_with_byte_items_written_by_dcp_is_refused(tmp_path: Path) -> None:
    state = sample_state()
    state["step"] = 7  # DCP stores a non-tensor as a pickled byte item
    write_dcp(tmp_path / "dcp", state)
    with pytest.raises(UnsafeMetadataError, match="BytesStorageMetadata"):
        load_full_state(tmp_path / "dcp")


def test_data_files_outside_the_directory_are_refused(tmp_path: Path) -> None:
    write_dcp(tmp_path / "dcp", sample_state())
    path = tmp_path / "dcp" / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeMetadataError, match="not a DCP data file"):
        parse_metadata(path.read_bytes())


@pytest.mark.parametrize("data", [b"", b"not a pickle", pickle.dumps({"a": 1}), pickle.dumps([1, 2])])
def test_garbage_is_refused(data: bytes) -> None:
    with pytest.raises(UnsafeMetadataError):
        parse_metadata(data)


def test_only_torch_dtypes_are_taken_from_torch() -> None:
    # GLOBAL torch load: a torch function, not a dtype.
    data = b"\x80\x04ctorch\nload\n."
    with pytest.raises(UnsafeMetadataError, match="torch.load"):
        parse_metadata(data)
    buf = io.BytesIO()
    pickle.dump(torch.float32, buf)
    with pytest.raises(UnsafeMetadataError, match="holds a dtype"):
        parse_metadata(buf.getvalue())
