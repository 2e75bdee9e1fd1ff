"""A chunk damaged in the store heals on every upload path, against the real S3 store.

A stored chunk of a frozen base is overwritten with other bytes of the same
size after step 10 (its ``HEAD`` still answers, so only a checksum check finds
it), or deleted (a routine upload's ``HEAD`` finds that one). Every uploader
must then forget it and send it again from local bytes, so that the next
steps verify: a node's part of a distributed checkpoint (whose upload checks
its own chunks before its part manifest is stored, and raises), and the
Checkpointer's own upload (``upload=True, incremental=True``). The sidecar's
whole-checkpoint path is ``test_incremental.py``'s.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ckpt_helpers import s3_options, write_part
from sidecar_helpers import s3_storage

from spotguard.checkpoint import latest_verified, read_manifest, verify_checkpoint
from spotguard.checkpoint.format.manifest import checkpoint_name, parse_manifest, part_manifest_path
from spotguard.sidecar.deadline import ThroughputTracker
from spotguard.sidecar.metrics import SidecarMetrics
from spotguard.sidecar.shipper import CheckpointShipper

pytestmark = pytest.mark.integration

KiB = 1 << 10
LAYOUT = {0: (0, 1), 1: (2, 3)}


#: How a stored chunk is damaged: overwritten with other bytes of the same size (its ``HEAD``
#: still answers, so only a checksum check finds it), or deleted.
DAMAGE = ["overwrite", "delete"]


def damage(storage: Any, key: str, how: str) -> None:
    if how == "delete":
        storage.delete([key])
        return
    good = storage.read_bytes(key)
    storage.write_bytes(key, bytes([good[0] ^ 0xFF]) + good[1:])


def node_files(step: int, index: int) -> dict[str, bytes]:
    """One node's files: a frozen shard per rank (the same bytes at every step) and a state that changes."""
    files: dict[str, bytes] = {}
    for rank in LAYOUT[index]:
        files[f"dcp/__{rank}_0.distcp"] = random.Random(rank).randbytes(256 * KiB)
        files[f"ranks/{rank:05d}/state.json"] = json.dumps({"rank": rank, "step": step}).encode()
    if index == 0:
        files["dcp/.metadata"] = b"\x80\x04K\x01."  # a harmless pickle (the integer 1)
    return files


@pytest.mark.parametrize("how", DAMAGE)
def test_a_part_whose_own_check_finds_a_damaged_chunk_sends_it_again(
    s3_store: Any, s3_uri: str, tmp_path: Path, how: str
) -> None:
    """Two nodes' shippers, incremental. After step 10 a chunk of node 0's frozen shard is damaged:
    node 0's part of step 20 fails its own check of its chunks (inside the upload), the shipper
    forgets that chunk, and the next upload sends it again: steps 20, 30 and 40 all commit and
    verify, and the newest verified checkpoint moves past 10."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    shippers = [
        CheckpointShipper(
            node,
            s3_storage(s3_store, s3_uri),
            SidecarMetrics(),
            ThroughputTracker(30.0, 5.0),
            keep_local=10,
            incremental=True,
        )
        for node in nodes
    ]
    storage = s3_storage(s3_store, s3_uri)

    def write(step: int) -> None:
        for index, node in enumerate(nodes):
            write_part(node, step, index, layout=LAYOUT, files=node_files(step, index))

    def ship_until(step: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while any(s.last_shipped is None or s.last_shipped.step < step for s in shippers):
            failed = [s.failed for s in shippers]
            assert time.monotonic() < deadline, f"step {step} never verified on every node: {failed}"
            for shipper in shippers:
                shipper.ship(housekeeping=False)
            time.sleep(0.2)

    write(10)
    ship_until(10)
    part0 = parse_manifest(storage.read_bytes(f"{checkpoint_name(10)}/{part_manifest_path(0)}"))
    frozen = next(f for f in part0.files if f.path == "dcp/__0_0.distcp")
    assert frozen.chunks is not None and len(frozen.chunks) == 1
    key = frozen.chunks[0].key
    damage(storage, key, how)
    assert not verify_checkpoint(storage, checkpoint_name(10)).ok

    for step in (20, 30, 40):
        write(step)
    ship_until(40)
    for step in (10, 20, 30, 40):  # the chunk sent again under its key heals every checkpoint naming it
        assert verify_checkpoint(storage, checkpoint_name(step)).ok, step
    info, _ = latest_verified(storage)
    assert info is not None and info.step == 40
    # Step 20's part 0 names the chunk that was damaged: the failure was met, not avoided.
    part20 = parse_manifest(storage.read_bytes(f"{checkpoint_name(20)}/{part_manifest_path(0)}"))
    assert key in {ref.key for f in part20.files for ref in f.chunks or ()}


def frozen_state(step: int) -> dict[str, Any]:
    """A fine-tune's state: a frozen base (the same at every step) and an adapter that changes."""
    rng = np.random.default_rng(1)
    base = {f"base.{i}": rng.standard_normal((256, 1024), dtype=np.float32) for i in range(4)}
    return {"model": {**base, "adapter": np.full((8, 1024), float(step), dtype=np.float32)}, "step": step}


@pytest.mark.parametrize("how", DAMAGE)
def test_an_uploading_trainer_sends_a_damaged_chunk_again(s3_store: Any, s3_uri: str, tmp_path: Path, how: str) -> None:
    """``Checkpointer(upload=True, incremental=True)``. After step 10 every chunk it stored is
    damaged in the store (the frozen base's among them, which every later step reuses). Step 20's
    verification names them; the Checkpointer forgets them and uploads step 20 again, sending them
    from local bytes: 20 verifies, and so does every step after it."""
    from spotguard import Checkpointer

    storage = s3_storage(s3_store, s3_uri)
    ck = Checkpointer(
        tmp_path / "ck",
        storage_uri=s3_uri,
        storage_options=s3_options(s3_store),
        upload=True,
        incremental=True,
        keep_local=1,
        async_save=False,
    )

    def save(step: int) -> int | None:
        ck.save(step, frozen_state(step))
        assert ck.wait(60)
        info, _ = latest_verified(storage)
        return info.step if info is not None else None

    try:
        assert save(10) == 10
        refs = read_manifest(storage, checkpoint_name(10)).chunk_refs()
        for ref in refs.values():
            damage(storage, ref.key, how)
        assert not verify_checkpoint(storage, checkpoint_name(10)).ok
        for step in (20, 30, 40, 50):
            assert save(step) == step, ck.last_error
    finally:
        ck.close()
    assert ck.last_error is None, ck.last_error
    for step in (20, 30, 40, 50):
        assert verify_checkpoint(storage, checkpoint_name(step)).ok, step
    # Step 20 reused what step 10 stored: the damage was met, not avoided.
    assert set(refs) & set(read_manifest(storage, checkpoint_name(20)).chunk_refs())
