"""Distributed checkpoints stored incrementally in a real S3 store: each node's
DCP data files go up as chunks cut at DCP's item boundaries, so a frozen base
is stored once; the global manifest is still a pure function of the part
manifests; verification, restore, a restarted uploader and the chunk sweep
(while a step waits for its other parts) keep every promise they keep for
whole files."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_helpers import PART_LAYOUT, s3_options, write_part

from spotguard.checkpoint import (
    MANIFEST_NAME,
    build_global_manifest,
    checkpoint_name,
    delete_checkpoint,
    read_parts,
    restore_checkpoint,
    upload_checkpoint,
    verify_checkpoint,
    verify_local_checkpoint,
)
from spotguard.checkpoint.format.manifest import parse_manifest, part_manifest_path
from spotguard.checkpoint.store.gc import sweep_chunks
from spotguard.storage import Storage, open_storage

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

#: Frozen elements per rank (float32: 2 MiB each, 8 MiB over four ranks).
BASE = 512 * 1024


def dcp_files(scratch: Path, step: int, index: int) -> dict[str, bytes]:
    """One node's files of a fine-tune's step: each rank's DCP data file (a frozen
    base and an adapter that changes every step), its rank state, and on node 0
    DCP's metadata."""
    files: dict[str, bytes] = {}
    for rank in PART_LAYOUT[index]:
        base = torch.randn(BASE, generator=torch.Generator().manual_seed(rank))
        state = {"model.base": base, "model.adapter": torch.full((512,), float(step + rank))}
        out = scratch / f"dcp-{step}-{rank}"
        dcp.save(state, checkpoint_id=out, no_dist=True)
        files[f"dcp/__{rank}_0.distcp"] = (out / "__0_0.distcp").read_bytes()
        files[f"ranks/{rank:05d}/state.json"] = json.dumps({"rank": rank, "step": step}).encode()
    if index == 0:
        files["dcp/.metadata"] = b"\x80\x04K\x01."  # a harmless pickle (the integer 1)
    return files


def part(tmp_path: Path, step: int, index: int) -> Path:
    return write_part(tmp_path / f"node{index}", step, index, files=dcp_files(tmp_path / "scratch", step, index))


@pytest.fixture
def stores(s3_store: Any, s3_uri: str) -> tuple[Storage, Storage]:
    """Two independent uploaders' views (separate clients) of one job root."""
    return open_storage(s3_uri, **s3_options(s3_store)), open_storage(s3_uri, **s3_options(s3_store))


def test_parts_stored_as_chunks_send_only_what_changed(tmp_path: Path, stores: tuple[Storage, Storage]) -> None:
    a, b = stores
    first = [upload_checkpoint(part(tmp_path, 10, i), s, incremental=True) for i, s in enumerate(stores)]
    assert [r.committed for r in first] == [False, True]
    name = checkpoint_name(10)
    verdict = verify_checkpoint(a, name)
    assert verdict.ok, verdict.problems
    g = verdict.manifest
    assert g is not None and g.chunked and g.is_global
    assert [f.path for f in g.files if f.chunks is None] == [part_manifest_path(0), part_manifest_path(1)]
    # The global manifest is what the stored parts make; they list their files' chunks.
    parts, problems = read_parts(a, name)
    assert problems == [] and all(m.chunked for _, m in parts.values())
    assert a.read_bytes(f"{name}/{MANIFEST_NAME}") == build_global_manifest(parts.values()).to_json()
    # No data file is stored whole below the checkpoint's prefix: only the manifests.
    assert sorted(o.key for o in a.list_objects(f"{name}/")) == [
        f"{name}/{MANIFEST_NAME}",
        f"{name}/{part_manifest_path(0)}",
        f"{name}/{part_manifest_path(1)}",
    ]

    # The next step: only the adapters' items (and the small files) are new.
    second = [upload_checkpoint(part(tmp_path, 20, i), s, incremental=True) for i, s in enumerate(stores)]
    for index, result in enumerate(second):
        total = parse_manifest((tmp_path / f"node{index}" / checkpoint_name(20) / MANIFEST_NAME).read_bytes())
        assert result.reused_bytes >= 2 * BASE * 4, result
        assert result.new_bytes < 0.05 * total.total_size, (result.new_bytes, total.total_size)
    assert second[1].committed and verify_checkpoint(b, checkpoint_name(20)).ok

    # Restored whole: every node's files byte for byte, and the part manifests as stored.
    info = restore_checkpoint(a, checkpoint_name(20), tmp_path / "restore")
    local = Path(info.uri)
    assert verify_local_checkpoint(local).ok
    for index in (0, 1):
        node = tmp_path / f"node{index}" / checkpoint_name(20)
        for path in dcp_files(tmp_path / "scratch", 20, index):
            assert (local / path).read_bytes() == (node / path).read_bytes(), path

    # A restarted uploader ships a part of a committed step again: recognized, nothing overwritten.
    again = upload_checkpoint(tmp_path / "node0" / checkpoint_name(20), a, incremental=True)
    assert again.committed and again.bytes == 0


def test_the_chunk_sweep_keeps_what_a_waiting_part_names(tmp_path: Path, stores: tuple[Storage, Storage]) -> None:
    """Part 0 of a step is stored (its chunks verified) and waits for part 1; the
    checkpoints whose chunks it reuses are deleted and every tombstone expires: the
    sweep still keeps its chunks, and the step commits and verifies once part 1 comes."""
    a, b = stores
    for i, s in enumerate(stores):
        upload_checkpoint(part(tmp_path, 10, i), s, incremental=True)
    waiting = upload_checkpoint(part(tmp_path, 20, 0), a, incremental=True)
    assert not waiting.committed and waiting.reused_bytes >= 2 * BASE * 4
    delete_checkpoint(a, checkpoint_name(10))
    sweep = sweep_chunks(a, grace=0, now=time.time() + 10 * 3600)
    assert sweep.aborted is None
    done = upload_checkpoint(part(tmp_path, 20, 1), b, incremental=True)
    assert done.committed
    verdict = verify_checkpoint(a, checkpoint_name(20))
    assert verdict.ok, verdict.problems
    # Part 1's own chunks of step 10 went with it (nothing named them); part 0's reused ones stayed.
    assert sweep.deleted, "the sweep deleted nothing: the test does not exercise it"


@pytest.mark.parametrize("first_incremental", [True, False])
def test_a_part_is_stored_as_the_parts_already_stored_are(
    tmp_path: Path, stores: tuple[Storage, Storage], first_incremental: bool
) -> None:
    """Nodes told differently (one uploads chunks, the other whole files) still make one
    checkpoint: the later part follows the parts already stored (parts stored both ways
    would never commit)."""
    a, b = stores
    upload_checkpoint(part(tmp_path, 10, 0), a, incremental=first_incremental)
    done = upload_checkpoint(part(tmp_path, 10, 1), b, incremental=not first_incremental)
    assert done.committed
    verdict = verify_checkpoint(a, checkpoint_name(10))
    assert verdict.ok, verdict.problems
    assert verdict.manifest is not None and verdict.manifest.chunked is first_incremental
