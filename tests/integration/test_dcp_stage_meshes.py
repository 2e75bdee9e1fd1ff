"""A sharded stage remembers two meshes' equality only for the pairs it met last: a changed item's host
copy gets a mesh of its own at every stage (the stager copies it), and those must not pile up over a
long run. A real FSDP2 model on one gloo rank, staged by torch's stager, in a process of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

_WORKER = """
import os, sys
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.fsdp import fully_shard
from spotguard.trainer.dcpwriter import DcpSaves

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
model[0].requires_grad_(False)
for layer in model:
    fully_shard(layer)
options = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                         use_non_blocking_copy=False)
stager = DefaultStager(options)._state_dict_stager
saves = DcpSaves()
host_meshes = set()
for _ in range(8):
    with torch.no_grad():
        for p in model[1].parameters():  # the head changes, the base does not
            p.to_local().add_(1.0)
    staged = saves.stage({"model": model.state_dict()}, lambda x: stager.stage(x, non_blocking=False), keep=True)
    host_meshes |= {id(v.device_mesh) for k, v in staged["model"].items() if k.startswith("1.")}
    assert saves.unchanged in (frozenset(), frozenset({"model.0.weight", "model.0.bias"})), saves.unchanged
print(len(saves._meshes), len(saves._meshes_now), sorted(saves.unchanged), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.integration
def test_the_mesh_verdicts_of_a_sharded_stage_do_not_pile_up() -> None:
    from testenv.cluster import free_port

    out = subprocess.run([sys.executable, "-c", _WORKER, str(free_port())], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    remembered, pending, unchanged = out.stdout.strip().splitlines()[-1].split(" ", 2)
    assert unchanged == "['model.0.bias', 'model.0.weight']", out.stdout  # the frozen base compared equal
    assert int(remembered) <= 2 and int(pending) == 0, out.stdout  # not one pair per stage
