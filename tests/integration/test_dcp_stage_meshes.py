"""A sharded stage remembers two meshes' equality only for the pairs it met last: a changed item's host
copy gets a mesh of its own at every stage (the stager copies it), and those must not pile up over a
long run. A real FSDP2 model on one gloo rank, staged by torch's stager, in a process of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

_SETUP = """
import os, sys
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.fsdp import fully_shard
from spotguard.trainer.dcpwriter import DcpSaves

model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
model[0].requires_grad_(False)
for layer in model:
    fully_shard(layer)
options = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                         use_non_blocking_copy=False)
stager = DefaultStager(options)._state_dict_stager
saves = DcpSaves()
"""

_WORKER = (
    _SETUP
    + """
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
)


@pytest.mark.integration
def test_the_mesh_verdicts_of_a_sharded_stage_do_not_pile_up() -> None:
    from testenv.cluster import free_port

    out = subprocess.run([sys.executable, "-c", _WORKER, str(free_port())], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    remembered, pending, unchanged = out.stdout.strip().splitlines()[-1].split(" ", 2)
    assert unchanged == "['model.0.bias', 'model.0.weight']", out.stdout  # the frozen base compared equal
    assert int(remembered) <= 2 and int(pending) == 0, out.stdout  # not one pair per stage


_SPEC_WORKER = (
    _SETUP
    + """
from torch.distributed.tensor import Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec

BASE = {"model.0.weight", "model.0.bias"}

def stage():
    with torch.no_grad():
        for p in model[1].parameters():  # the head changes at every step
            p.to_local().add_(1.0)
    saves.stage({"model": model.state_dict()}, lambda x: stager.stage(x, non_blocking=False), keep=True)
    return set(saves.unchanged)

stage()
for _ in range(3):
    assert stage() == BASE, saves.unchanged
assert set(saves._shaped) == BASE, sorted(saves._shaped)  # remembered for what stayed unchanged only
weight = model[0].weight
# The same bytes in the same storage, sharded otherwise (a new spec): not the host copy's sharding.
weight._spec = DTensorSpec(weight._spec.mesh, (Replicate(),), tensor_meta=weight._spec.tensor_meta)
assert stage() == {"model.0.bias"}, saves.unchanged
assert stage() == BASE, saves.unchanged  # copied anew with its new sharding, then unchanged again
with torch.no_grad():
    weight.to_local()[-1, -1] += 1.0  # one byte of the base written, on its last page
assert stage() == {"model.0.bias"}, saves.unchanged
print("ok", flush=True)
dist.destroy_process_group()
"""
)


@pytest.mark.integration
def test_a_sharded_stage_trusts_a_remembered_sharding_only_while_it_is_the_same() -> None:
    from testenv.cluster import free_port

    out = subprocess.run(
        [sys.executable, "-c", _SPEC_WORKER, str(free_port())], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok", out.stdout
