"""The weights of ``spotguard ckpt export --format hf`` are written as
``huggingface_hub`` writes them: the same shard plan, file names, index and
headers as ``save_torch_state_dict`` (the writer behind ``save_pretrained``).
Local files only, no storage."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open

from spotguard.checkpoint.format.hf_folder import SAFE_WEIGHTS_INDEX_NAME, ExportError, write_weights

META = {"spotguard_checkpoint": "ckpt-000000000003"}


def state() -> dict[str, torch.Tensor]:
    # float32: 8, 32, 8 and 12 bytes. With 20-byte shards "big" is over the
    # limit: huggingface_hub gives it a shard of its own without closing the
    # one being filled, so "a" and "b" share a shard around it.
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(n, generator=g) for name, n in (("a", 2), ("big", 8), ("b", 2), ("c", 3))}


def headers(folder: Path) -> dict[str, tuple[list[str], dict[str, str] | None]]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out[path.name] = (sorted(f.keys()), f.metadata())
    return out


@pytest.mark.parametrize("max_shard_size", [20, 10**9])
def test_weights_are_the_folder_save_torch_state_dict_writes(tmp_path: Path, max_shard_size: int) -> None:
    ours, hub = tmp_path / "ours", tmp_path / "hub"
    ours.mkdir()
    hub.mkdir()
    files = write_weights(ours, state(), max_shard_size, META)
    save_torch_state_dict(state(), hub, max_shard_size=max_shard_size, metadata=dict(META))

    assert files == sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in hub.iterdir())
    assert headers(ours) == headers(hub)
    if max_shard_size == 20:
        assert len(files) == 4  # three shards and the index
        index = json.loads((ours / SAFE_WEIGHTS_INDEX_NAME).read_text())
        assert index == json.loads((hub / SAFE_WEIGHTS_INDEX_NAME).read_text())
        assert index["metadata"] == {"total_size": 60, **META}
        assert index["weight_map"]["a"] == index["weight_map"]["b"] != index["weight_map"]["big"]
    else:
        assert files == ["model.safetensors"]
        assert headers(ours)["model.safetensors"][1] == {"format": "pt", **META}


def test_without_huggingface_hub_the_export_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if not installed: importing it fails
    with pytest.raises(ExportError, match=r"pip install 'spotguard\[hf\]'"):
        write_weights(tmp_path, state(), 20, META)
    assert list(tmp_path.iterdir()) == []
