"""The distributed code path of the Checkpointer in one process (a gloo group of one rank, ``distributed=True``).

The multi-rank behaviour is tested with real ranks in
tests/integration/test_dist_checkpointer.py; here the decisions that one
rank takes: what a save answers, what the manifest says, deadlines.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import spotguard
from spotguard.checkpoint.local.commit import verify_local_checkpoint
from spotguard.contract.control import ControlChannel
from spotguard.trainer import distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    return model, opt, sched


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()


def test_save_and_restore_through_the_distributed_path(group: None, tmp_path: Path) -> None:
    model, opt, sched = make()
    train(model, opt, sched, 3)
    ckpt = spotguard.Checkpointer(tmp_path / "ck", distributed=True, save_every_steps=3)
    assert ckpt.should_save(3)
    assert ckpt.save(3, spotguard.torch_state(model, opt, sched, epoch=1), blocking=True) is not None
    ckpt.close()
    path = tmp_path / "ck" / "ckpt-000000000003"
    result = verify_local_checkpoint(path)
    assert result.ok, result.reason
    assert result.manifest is not None and result.manifest.sharding is not None
    assert result.manifest.sharding.world_size == 1 and result.manifest.locally_complete
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    torch.rand(5)

    model2, opt2, sched2 = make()
    ckpt2 = spotguard.Checkpointer(tmp_path / "ck", distributed=True)
    restored = ckpt2.restore(model2, opt2, sched2)
    assert restored is not None and restored.step == 3 and restored.exact and restored.resharded_from is None
    assert restored.extra == {"epoch": 1}
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k])
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(opt2.state_dict()["state"][i][k], v)
    assert sched2.state_dict() == sched.state_dict()
    assert torch.equal(torch.get_rng_state(), rng)
    assert not ckpt2.should_save(3)  # already saved
    ckpt2.close()


def test_a_request_that_arrives_after_the_agreement_waits_for_the_next_should_save(group: None, tmp_path: Path) -> None:
    model, opt, sched = make()
    ckpt = spotguard.Checkpointer(tmp_path / "ck", distributed=True)
    channel = ControlChannel(ckpt.control_dir)
    assert not ckpt.should_save(1)
    channel.request_checkpoint("late", time.time() + 60, True, "late-1")
    ckpt.save(1, spotguard.torch_state(model, opt, sched), blocking=True)
    assert not ckpt.preempted  # the save was not agreed as a preemption
    assert channel.read_ack() is None
    assert ckpt.should_save(2)
    assert ckpt.save(2, spotguard.torch_state(model, opt, sched)) is not None  # synchronous: a preemption
    assert ckpt.preempted
    ack = channel.read_ack()
    assert ack is not None and ack.id == "late-1" and ack.step == 2 and ack.complete
    ckpt.close()


def test_a_deadline_that_passed_abandons_the_save_and_answers_incomplete(group: None, tmp_path: Path) -> None:
    model, opt, sched = make()
    ckpt = spotguard.Checkpointer(tmp_path / "ck", distributed=True)
    channel = ControlChannel(ckpt.control_dir)
    channel.request_checkpoint("late", time.time() - 1, True, "r1")
    assert ckpt.should_save(5)
    assert ckpt.save(5, spotguard.torch_state(model, opt, sched)) is None
    assert ckpt.preempted
    ack = channel.read_ack()
    assert ack is not None and ack.id == "r1" and not ack.complete
    assert not list((tmp_path / "ck").glob("ckpt-*")) and not list((tmp_path / "ck").glob(".tmp-*"))
    ckpt.close()


def test_a_state_that_cannot_be_saved_raises_and_still_ends_a_preemption(group: None, tmp_path: Path) -> None:
    ckpt = spotguard.Checkpointer(tmp_path / "ck", distributed=True)
    ckpt.request_checkpoint("test", preempt=True)
    assert ckpt.should_save(1)
    with pytest.raises(spotguard.checkpoint.StateError):
        ckpt.save(1, {"model": {"w": torch.ones(1)}, "bad": object()})
    assert ckpt.preempted
    ckpt.close()


def test_torch_state_uses_sharded_state_dicts_while_a_distributed_checkpointer_lives(
    group: None, tmp_path: Path
) -> None:
    model, opt, _ = make()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    assert next(iter(spotguard.torch_state(ddp)["model"])).startswith("module.")
    ckpt = spotguard.Checkpointer(tmp_path / "ck", distributed=True)
    assert distributed.active()
    state = spotguard.torch_state(ddp, opt)
    assert next(iter(state["model"])) == "0.weight"
    assert set(state["optimizer"]["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    ckpt.close()
    assert not distributed.active()


def test_a_single_process_checkpoint_is_restored_by_a_distributed_job(group: None, tmp_path: Path) -> None:
    model, opt, sched = make()
    train(model, opt, sched, 2)
    single = spotguard.Checkpointer(tmp_path / "ck")
    single.save(2, spotguard.torch_state(model), blocking=True)
    single.close()
    model2, _, _ = make()
    ckpt = spotguard.Checkpointer(tmp_path / "ck", distributed=True)
    restored = ckpt.restore(model2)
    assert restored is not None and restored.step == 2 and restored.resharded_from == 1
    for k, v in model2.state_dict().items():
        assert torch.equal(v, model.state_dict()[k])
    ckpt.close()


def test_the_manifest_says_which_ranks_and_files(group: None, tmp_path: Path) -> None:
    model, opt, sched = make()
    train(model, opt, sched, 1)
    ckpt = spotguard.Checkpointer(tmp_path / "ck", distributed=True, job="j", attempt=2, keep_local=2)
    ckpt.save(7, spotguard.torch_state(model, opt, sched), metrics={"loss": 1.5}, blocking=True)
    ckpt.save(8, spotguard.torch_state(model, opt, sched), blocking=True)
    assert ckpt.distributed
    ckpt.close()
    doc = json.loads((tmp_path / "ck" / "ckpt-000000000007" / "manifest.json").read_text())
    assert doc["format_version"] == 2 and doc["job"] == "j" and doc["attempt"] == 2
    save_id = doc["sharding"].pop("save_id")
    assert doc["sharding"] == {"world_size": 1, "parts": 1, "part": 0, "ranks": [0]}
    # Each collective save has its own id: parts of two saves of a step never mix.
    next_doc = json.loads((tmp_path / "ck" / "ckpt-000000000008" / "manifest.json").read_text())
    assert len(save_id) == 13 and next_doc["sharding"]["save_id"] != save_id
    assert doc["metrics"] == {"loss": 1.5} and doc["reason"] == "interval"
    assert [f["path"] for f in doc["files"]] == sorted(f["path"] for f in doc["files"])
    assert {f["path"] for f in doc["files"]} >= {"dcp/.metadata", "dcp/__0_0.distcp", "ranks/00000/state.json"}


def test_one_process_restores_a_distributed_checkpoint_whole(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model, opt, sched = make()
        train(model, opt, sched, 3)
        ckpt = spotguard.Checkpointer(tmp_path / "ck", distributed=True)
        ckpt.save(3, spotguard.torch_state(model, opt, sched), blocking=True)
        ckpt.close()
    finally:
        dist.destroy_process_group()
    model2, opt2, sched2 = make()
    restored = spotguard.Checkpointer(tmp_path / "ck").restore(model2, opt2, sched2)
    assert restored is not None and restored.step == 3 and restored.exact
    for k, v in model.state_dict().items():
        assert torch.equal(model2.state_dict()[k], v)
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(opt2.state_dict()["state"][i][k], v)
    assert sched2.state_dict() == sched.state_dict()
