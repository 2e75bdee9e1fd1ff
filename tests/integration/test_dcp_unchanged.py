"""A sharded fine-tune's saves write what changed: real ranks (torchrun, gloo on CPU, FSDP2), the real S3 store.

Run as a script under torchrun, this file is the training worker: a frozen
base and a small adapter, each sharded by FSDP2, AdamW on the adapter,
checkpointed with the public API (``spotguard.trainer.dcpwriter``). The
first save writes each rank's items into its kept file; the next one links
that file (the same inode) and writes only the adapter and its optimizer
state anew; one value of the base changed in place is seen (its kept file
written again, then linked); the upload of a linked file takes its chunks
from the previous manifest without reading them; a restore on four ranks is
bit-exact.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TORCHRUN = Path(sys.executable).with_name("torchrun")
#: The frozen base: DIM x DIM float32 (4 MiB), the adapter DIM x 8.
DIM = 1024
STEPS = 8
#: After this step's update, one value of the frozen base is changed in place (a write that bypasses autograd).
NUDGE = 5


def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--restore-only", action="store_true", help="restore, write the state, stop")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import spotguard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Linear(DIM, 8))
    model[0].requires_grad_(False)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ckpt = spotguard.Checkpointer(args.dir, save_every_steps=2, async_save=False, keep_local=10)
    restored = ckpt.restore(model, optimizer)
    if not args.restore_only:
        torch.manual_seed(1 + rank)
        for step in range(STEPS):
            loss = model(torch.randn(4, DIM)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step == NUDGE:
                with torch.no_grad():
                    model[0].weight.to_local()[0, 0] += 1.0
            if ckpt.should_save(step) or step == STEPS - 1:
                ckpt.save(step, spotguard.torch_state(model, optimizer))
    else:
        assert restored is not None and restored.step == STEPS - 1
    ckpt.close()
    full = {f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()}
    for i, s in optimizer.state_dict()["state"].items():
        for k, v in s.items():
            full[f"optimizer.{i}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    if rank == 0:
        torch.save(full, Path(args.out) / f"full-{dist.get_world_size()}.pt")
    dist.destroy_process_group()
    return 0


# -- the test ----------------------------------------------------------------------

pytestmark = pytest.mark.integration


def torchrun(nproc: int, ckdir: Path, out: Path, *extra: str) -> None:
    from sidecar_helpers import worker_env

    from testenv.require import require_tool

    require_tool("torchrun", path=TORCHRUN)
    cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={nproc}", __file__, "--dir", str(ckdir), "--out", str(out)]
    proc = subprocess.run([*cmd, *extra], env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_a_frozen_base_is_linked_not_hashed_and_restores_resharded(
    s3_store: Any, s3_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from sidecar_helpers import s3_storage

    from spotguard.checkpoint import KnownChunks, upload_checkpoint
    from spotguard.checkpoint.format.manifest import checkpoint_name, parse_manifest, part_manifest_path
    from spotguard.checkpoint.local.unchanged import Unchanged

    ck, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    torchrun(2, ck, out)
    saves = [checkpoint_name(s) for s in (2, 4, 6, STEPS - 1)]
    assert sorted(p.name for p in ck.glob("ckpt-*")) == saves
    linked = {saves[1]: saves[0], saves[3]: saves[2]}  # the base was changed between the second and third
    for rank in (0, 1):
        kept = {name: ck / name / "dcp" / f"__{rank}_0.distcp" for name in saves}
        for name in (saves[0], saves[2]):  # every item written
            assert not (ck / name / "dcp" / f"__{rank}_1.distcp").exists()
        assert kept[saves[2]].stat().st_ino != kept[saves[0]].stat().st_ino
        for name, source in linked.items():  # the kept file linked: nothing written but the adapter's items
            assert kept[name].stat().st_ino == kept[source].stat().st_ino
            changed = (ck / name / "dcp" / f"__{rank}_1.distcp").stat().st_size
            assert changed < kept[name].stat().st_size / 20

    # The upload of a later save takes the linked file's chunks from the previous manifest: none is read.
    read: list[str] = []
    match = Unchanged.match

    def reading(self: Unchanged, path: str, offset: int, data: bytes) -> Any:
        read.append(path)
        return match(self, path, offset, data)

    monkeypatch.setattr(Unchanged, "match", reading)
    storage = s3_storage(s3_store, s3_uri)
    known: KnownChunks | bool = True
    for name in saves:
        read.clear()
        result = upload_checkpoint(ck / name, storage, incremental=known)
        assert result.committed, result
        part = parse_manifest(storage.read_bytes(f"{name}/{part_manifest_path(0)}"))
        known = KnownChunks.of(part)
        kept_reads = [p for p in read if p.endswith("_0.distcp")]
        if name not in linked:
            assert kept_reads  # written anew: read and hashed
        else:
            assert kept_reads == [], (name, sorted(set(read)))
            assert result.new_bytes < 0.05 * result.reused_bytes, result

    # Resumed on four ranks (resharded) from the newest save: bit-exact.
    torchrun(4, ck, out, "--restore-only")
    before, after = torch.load(out / "full-2.pt"), torch.load(out / "full-4.pt")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)


if __name__ == "__main__":
    code = _worker(sys.argv[1:])
    # Its result is written: skip the interpreter's teardown, where gloo's threads (after
    # destroy_process_group) were seen to abort a rank on a loaded machine ("terminate called
    # without an active exception"), as in test_dist_flag_agreement.py.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
