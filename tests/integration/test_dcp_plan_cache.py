"""DCP's plan caching under a checkpointer: real ranks (torchrun, gloo on CPU, FSDP2), real files.

Run as a script under torchrun, this file is the training worker. Each rank
records, for every ``dcp.save``, whether its planner sent the coordinator its
plan or an empty one because the plan was cached
(:mod:`spotguard.trainer.plancache`). The coordinator (rank 0) loses its
caches before the fourth save, as a rank whose save failed alone does: the
ranks must then all start a new generation (a rank that sent an empty plan to
a coordinator with nothing cached would be missing from the checkpoint's
metadata). A second checkpointer in the same processes starts with nothing
cached. Every save's metadata names every chunk of both ranks, and the last
save restores bit-exact.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TORCHRUN = Path(sys.executable).with_name("torchrun")
DIM = 256
SAVES = 6
#: Before this save (1-based), the coordinator's plan caches are dropped.
DROPPED = 4


def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import spotguard
    from spotguard.trainer import plancache

    sent: list[bool] = []  # per dcp.save: whether this rank's plan was sent (False: cached, an empty one)
    planned: list[list[str]] = []  # per dcp.save: the items whose write items were made anew
    reused: list[bool] = []  # per save: whether the coordinator wrote the previous .metadata's bytes again
    planner = plancache._reusing_planner_class()
    create_plan, create_items = planner.create_local_plan, plancache._create_items

    def recording(self: Any) -> Any:
        planned.append([])
        plan = create_plan(self)
        sent.append(bool(plan.usable))
        return plan

    def creating(fqn: str, value: Any) -> Any:
        planned[-1].append(fqn)
        return create_items(fqn, value)

    planner.create_local_plan = recording
    plancache._create_items = creating

    # What each dcp.save returned (on rank 1: the coordinator's broadcast), as torch's own pickle of it.
    import hashlib
    from dataclasses import fields

    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.metadata import Metadata

    from spotguard.trainer import dcpwriter

    returned: list[str] = []
    broadcasts: list[tuple[int, int, int]] = []  # per save: (sent as written, loaded, again) in that save
    save = state_dict_saver.save

    def saving(*a: Any, **kw: Any) -> Any:
        b = dcpwriter.BROADCASTS
        before = (b.sent_as_written, b.loaded, b.again)
        md = save(*a, **kw)
        broadcasts.append((b.sent_as_written - before[0], b.loaded - before[1], b.again - before[2]))
        plain = Metadata(**{f.name: getattr(md, f.name) for f in fields(Metadata)})
        returned.append(hashlib.sha256(pickle.dumps(plain)).hexdigest())
        return md

    state_dict_saver.save = saving

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def fine_tune(seed: int) -> tuple[Any, Any]:
        """A frozen base and a head, each sharded by FSDP2, AdamW on the head."""
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Linear(DIM, 8))
        model[0].requires_grad_(False)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def full_state(model: Any, optimizer: Any) -> dict[str, Any]:
        full = {f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()}
        for i, s in optimizer.state_dict()["state"].items():
            for k, v in s.items():
                full[f"optimizer.{i}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
        return full

    model, optimizer = fine_tune(0)
    torch.manual_seed(1 + rank)

    def train_and_save(ckpt: Any, saves: int, first_step: int) -> None:
        for i in range(saves):
            loss = model(torch.randn(4, DIM)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if ckpt is first and i + 1 == DROPPED and rank == 0:
                ckpt._saver._plans.drop()  # the coordinator's caches gone, as after a save that failed here alone
            ckpt.save(first_step + i, spotguard.torch_state(model, optimizer))
            reused.append(ckpt._saver._dcp.metadata_reused)

    first = spotguard.Checkpointer(Path(args.dir) / "first", async_save=False, keep_local=SAVES)
    train_and_save(first, SAVES, 0)
    first.close()
    # Another checkpointer of the same processes: its own caches, none to start with.
    second = spotguard.Checkpointer(Path(args.dir) / "second", async_save=False, keep_local=SAVES)
    train_and_save(second, 2, SAVES)
    second.close()

    full = full_state(model, optimizer)
    if rank == 0:
        torch.save(full, Path(args.out) / "full.pt")
    (Path(args.out) / f"sent-{rank}.json").write_text(json.dumps(sent))
    (Path(args.out) / f"planned-{rank}.json").write_text(json.dumps(planned))
    (Path(args.out) / f"reused-{rank}.json").write_text(json.dumps(reused))
    (Path(args.out) / f"returned-{rank}.json").write_text(json.dumps(returned))
    (Path(args.out) / f"broadcasts-{rank}.json").write_text(json.dumps(broadcasts))

    # A restore of the second checkpointer's last save into a fresh model.
    model2, optimizer2 = fine_tune(7)
    again = spotguard.Checkpointer(Path(args.dir) / "second", async_save=False)
    restored = again.restore(model2, optimizer2)
    assert restored is not None and restored.step == SAVES + 1, restored
    again.close()
    back = full_state(model2, optimizer2)
    if rank == 0:
        torch.save(back, Path(args.out) / "restored.pt")
    dist.destroy_process_group()
    return 0


# -- the test ----------------------------------------------------------------------

pytestmark = pytest.mark.integration


def _chunks(dcp_dir: Path) -> set[tuple[str, tuple[int, ...]]]:
    """Every (item, offsets) the save's metadata names, each with its place in a file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    md = FileSystemReader(str(dcp_dir)).read_metadata()
    out = set()
    for fqn, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        for chunk in meta.chunks:
            offsets = tuple(chunk.offsets)
            assert MetadataIndex(fqn, chunk.offsets) in md.storage_data, (dcp_dir, fqn, offsets)
            out.add((fqn, offsets))
    return out


def test_plans_are_cached_per_checkpointer_and_only_where_every_rank_holds_them(tmp_path: Path) -> None:
    import torch
    from sidecar_helpers import worker_env

    from spotguard.checkpoint.format.manifest import checkpoint_name
    from testenv.require import require_tool

    require_tool("torchrun", path=TORCHRUN)
    ck, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node=2", __file__, "--dir", str(ck), "--out", str(out)]
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    sent = [json.loads((out / f"sent-{rank}.json").read_text()) for rank in (0, 1)]
    # The first save of each checkpointer sends every plan; the next ones, unchanged, send none,
    # except the save after the coordinator lost its caches: every rank sends again, then caches.
    expected = [True, False, False, True, False, False] + [True, False]
    assert sent == [expected, expected], sent

    # The frozen base is planned at a checkpointer's first save and after the coordinator lost its
    # caches (a new generation forgets every write item), else its items are the previous save's.
    for rank in (0, 1):
        planned = json.loads((out / f"planned-{rank}.json").read_text())
        base = [{fqn for fqn in names if fqn.startswith("model.0.")} for names in planned]
        assert base == [{"model.0.weight", "model.0.bias"} if full else set() for full in expected], planned
        assert all(any(fqn.startswith("model.1.") for fqn in names) for names in planned), planned  # the head

    # The coordinator pickles its .metadata where the global plan was made anew (the first save of a
    # checkpointer or a generation), or where items moved (the second save: the changed ones leave the
    # kept file, which is linked from then on); else it writes the previous save's bytes again, and
    # they are what torch would write.
    reused = json.loads((out / "reused-0.json").read_text())
    assert reused == [False, False, True, False, True, True] + [False, False], reused
    for dcp_dir in (ck / "first" / checkpoint_name(s) / "dcp" for s in range(1, SAVES)):
        again = pickle.loads((dcp_dir / ".metadata").read_bytes())
        assert again.storage_meta is None
        assert pickle.dumps(again) == (dcp_dir / ".metadata").read_bytes(), dcp_dir

    # DCP's broadcast of the global metadata: the coordinator sent the bytes it had just written at
    # every save; rank 1 loaded them, or took the object it made last time where they were the same
    # (at least wherever the coordinator wrote the previous bytes again); both ranks' dcp.save returned
    # the same metadata.
    broadcasts = [json.loads((out / f"broadcasts-{rank}.json").read_text()) for rank in (0, 1)]
    assert broadcasts[0] == [[1, 0, 0]] * (SAVES + 2), broadcasts[0]
    assert all(loaded + again == 1 and sent == 0 for sent, loaded, again in broadcasts[1]), broadcasts[1]
    assert all(again for (_, _, again), r in zip(broadcasts[1], reused, strict=True) if r), (broadcasts[1], reused)
    returned = [json.loads((out / f"returned-{rank}.json").read_text()) for rank in (0, 1)]
    assert returned[0] == returned[1] and len(returned[0]) == SAVES + 2, returned

    # Every save names every chunk of both ranks, each stored.
    first = [ck / "first" / checkpoint_name(s) / "dcp" for s in range(SAVES)]
    second = [ck / "second" / checkpoint_name(s) / "dcp" for s in range(SAVES, SAVES + 2)]
    whole = _chunks(first[0])
    assert any(offsets and offsets[0] > 0 for _, offsets in whole), whole  # rank 1's shards are there
    for dcp_dir in first[1:] + second:
        assert _chunks(dcp_dir) == whole, dcp_dir

    trained, restored = torch.load(out / "full.pt"), torch.load(out / "restored.pt")
    assert sorted(trained) == sorted(restored)
    assert all(torch.equal(trained[k], restored[k]) for k in trained)


if __name__ == "__main__":
    code = _worker(sys.argv[1:])
    # Its result is written: skip the interpreter's teardown (gloo's threads after
    # destroy_process_group were seen to abort a rank on a loaded machine), as the other workers do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
