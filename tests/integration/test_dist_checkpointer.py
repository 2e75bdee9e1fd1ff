"""The Checkpointer under torch.distributed: real ranks (torchrun, gloo on CPU).

Run as a script under torchrun, this file is the training worker the tests
start: a small model (DDP or FSDP2), AdamW, a scheduler, dropout and per-rank
data drawn from the global RNGs, checkpointed with the public API.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from reference_runs import ReferenceRuns
from sidecar_helpers import free_port, worker_env

from spotguard.trainer.policy import EXCHANGE_SECONDS
from testenv import trials

TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.fixture(autouse=True)
def _torchrun() -> None:
    from testenv.require import require_tool  # not at the top: torchrun runs this file as its worker

    require_tool("torchrun", path=TORCHRUN)


# -- the worker ------------------------------------------------------------------


def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--mode", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--sigterm-at", type=int, default=-1)
    parser.add_argument("--sigterm-rank", type=int, default=1)
    parser.add_argument("--request-at", type=int, default=-1)
    parser.add_argument("--storage", default=None)
    parser.add_argument("--kill-at", type=int, default=-1, help="SIGKILL --kill-rank while the save of this step runs")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-delay", type=float, default=0.0)
    parser.add_argument("--stager-closes", action="store_true", help="torch's DefaultStager as in torch 2.11")
    args = parser.parse_args(argv)

    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    import spotguard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.stager_closes:
        from torch.distributed.checkpoint import staging

        stage = staging.DefaultStager._stage

        def stage_and_close(self: Any, state_dict: Any, **kwargs: Any) -> Any:
            staged = stage(self, state_dict, **kwargs)
            inner = getattr(self, "_state_dict_stager", None)
            if inner is not None:
                inner.close()  # torch 2.11 does this after every stage
            return staged

        staging.DefaultStager._stage = stage_and_close  # type: ignore[method-assign]
    torch.manual_seed(0)
    model: Any = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4)
    )
    if args.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[3]):
            fully_shard(layer)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)

    ckpt = spotguard.Checkpointer(
        args.dir,
        save_every_steps=args.save_every,
        async_save=not args.sync,
        handle_signals=True,
        storage_uri=args.storage,
        upload=bool(args.storage),
        keep_local=2,  # the tests look at the interval save before the last one
    )
    restored = ckpt.restore(model, optimizer, scheduler)
    start = restored.step + 1 if restored is not None else 0
    info: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "start": start,
        "stopped": None,
        "exact": None if restored is None else restored.exact,
        "resharded_from": None if restored is None else restored.resharded_from,
        "stalls": [],
    }
    # With a signal or a request to agree on, steps outlast the flags' exchange period: every
    # should_save exchanges, and a flag acts at the next step (exactly, on every rank).
    step_seconds = EXCHANGE_SECONDS + 0.02 if args.sigterm_at >= 0 or args.request_at >= 0 else 0.0
    for step in range(start, args.steps):
        time.sleep(step_seconds)
        x = torch.randn(6, 8) + float(np.random.rand()) + random.random()
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step == args.sigterm_at and rank == args.sigterm_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == args.request_at and rank == 0:
            from spotguard.contract.control import ControlChannel

            ControlChannel(ckpt.control_dir).request_checkpoint("test", time.time() + 60, True, "req-1")
        if step == args.kill_at and rank == args.kill_rank:
            import threading

            threading.Timer(args.kill_delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        if ckpt.should_save(step):
            ckpt.save(step, spotguard.torch_state(model, optimizer, scheduler))
            info["stalls"].append(ckpt.last_stall_seconds)
        if ckpt.preempted:
            info["stopped"] = step
            break
    ckpt.close()

    def local(v: Any) -> Any:
        return (v.to_local() if hasattr(v, "to_local") else v).clone() if isinstance(v, torch.Tensor) else v

    osd = optimizer.state_dict()
    final = {
        "model": {k: local(v) for k, v in model.state_dict().items()},
        "optimizer": {
            "state": {i: {k: local(v) for k, v in s.items()} for i, s in osd["state"].items()},
            "param_groups": osd["param_groups"],
        },
        "rng": (random.getstate(), np.random.get_state(), torch.get_rng_state()),
        "lr": scheduler.get_last_lr(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if info["stopped"] is None:
        torch.save(final, out / f"final-{rank}.pt")
    (out / f"info-{rank}.json").write_text(json.dumps(info))
    # DDP's reducer goes before its process group (as in examples/train_ddp.py): torn down at
    # interpreter exit after the group, it sometimes aborts the worker ("terminate called
    # without an active exception").
    del model, optimizer, scheduler, final, osd
    gc.collect()
    dist.destroy_process_group()
    return 0


# -- the tests ---------------------------------------------------------------------


def collect(out: Path, nproc: int) -> list[dict[str, Any]]:
    infos = [json.loads((out / f"info-{r}.json").read_text()) for r in range(nproc)]
    for f in out.glob("info-*.json"):
        f.unlink()
    return infos


def torchrun(nproc: int, ckdir: Path, out: Path, *extra: str, timeout: float = 300) -> list[dict[str, Any]]:
    cmd = [
        str(TORCHRUN),
        "--standalone",
        f"--nproc-per-node={nproc}",
        __file__,
        "--dir",
        str(ckdir),
        "--out",
        str(out),
        *extra,
    ]
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return collect(out, nproc)


def two_nodes(
    base: Path, out: Path, s3_store: Any, s3_uri: str, *extra: str, timeout: float = 300
) -> list[dict[str, Any]]:
    """One rank on each of two "nodes" (two torchrun agents, each with its own checkpoint directory)."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [
            str(TORCHRUN),
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            __file__,
            "--dir",
            str(base / f"node{node}"),
            "--out",
            str(out),
            "--storage",
            s3_uri,
            *extra,
        ]
        procs.append(
            subprocess.Popen(cmd, env=worker_env(s3_store), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    for proc in procs:
        output, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, output[-6000:]
    return collect(out, 2)


def assert_same_final(a: Path, b: Path, nproc: int) -> None:
    import torch

    for r in range(nproc):
        x = torch.load(a / f"final-{r}.pt", weights_only=False)
        y = torch.load(b / f"final-{r}.pt", weights_only=False)
        assert x["model"].keys() == y["model"].keys()
        for k in x["model"]:
            assert torch.equal(x["model"][k], y["model"][k]), (r, k)
        xs, ys = x["optimizer"]["state"], y["optimizer"]["state"]
        assert xs.keys() == ys.keys()
        for i in xs:
            for k in xs[i]:
                assert torch.equal(torch.as_tensor(xs[i][k]), torch.as_tensor(ys[i][k])), (r, i, k)
        assert x["optimizer"]["param_groups"] == y["optimizer"]["param_groups"]
        assert x["rng"][0] == y["rng"][0]
        for p, q in zip(x["rng"][1], y["rng"][1], strict=True):
            assert bool((p == q).all()) if hasattr(p, "all") else p == q
        assert torch.equal(x["rng"][2], y["rng"][2])
        assert x["lr"] == y["lr"]


def uninterrupted(base: Path) -> Path:
    infos = torchrun(2, base / "ck", base / "out")
    assert all(i["start"] == 0 and i["stopped"] is None for i in infos)
    return base / "out"


@pytest.fixture(scope="module")
def reference(reference_runs: ReferenceRuns) -> Path:
    """An uninterrupted 2-rank DDP run (checkpointing as it goes)."""
    return reference_runs.get(("dist_checkpointer", "ddp", 2), uninterrupted)


def uninterrupted_fsdp(base: Path) -> Path:
    torchrun(2, base / "ck", base / "out", "--mode", "fsdp")
    return base / "out"


@pytest.fixture(scope="module")
def fsdp_reference(reference_runs: ReferenceRuns) -> Path:
    """An uninterrupted 2-rank FSDP2 run, made once for every stager the resume is tested with: the stager
    only changes how the interrupted run stages its saves, not where an uninterrupted run ends."""
    return reference_runs.get(("dist_checkpointer", "fsdp", 2), uninterrupted_fsdp)


def part_manifest(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((path / "manifest.json").read_text())
    return doc


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_ddp_sigterm_on_one_rank_then_resume_is_bit_exact(reference: Path, tmp_path: Path, sync: bool) -> None:
    ck, out = tmp_path / "ck", tmp_path / "out"
    flags = ["--sync"] if sync else []
    infos = torchrun(2, ck, out, "--sigterm-at", "6", "--sigterm-rank", "1", *flags)
    assert [i["stopped"] for i in infos] == [7, 7]  # seen at step 6, agreed during step 7
    doc = part_manifest(ck / "ckpt-000000000007")
    assert doc["format_version"] == 2
    assert doc["sharding"].pop("save_id") != part_manifest(ck / "ckpt-000000000004")["sharding"]["save_id"]
    assert doc["sharding"] == {"world_size": 2, "parts": 1, "part": 0, "ranks": [0, 1]}
    paths = {f["path"] for f in doc["files"]}
    assert "dcp/.metadata" in paths and "ranks/00000/state.json" in paths and "ranks/00001/state.json" in paths
    assert any(p.startswith("dcp/__1_") for p in paths)
    assert (ck / "ckpt-000000000004" / "manifest.json").is_file()  # the interval save before
    infos = torchrun(2, ck, out, *flags)
    assert [i["start"] for i in infos] == [8, 8]
    assert all(i["exact"] is True and i["resharded_from"] is None for i in infos)
    assert_same_final(reference, out, 2)


def test_request_seen_by_local_rank_0_only_stops_every_rank(reference: Path, tmp_path: Path) -> None:
    ck, out = tmp_path / "ck", tmp_path / "out"
    infos = torchrun(2, ck, out, "--request-at", "5")
    assert [i["stopped"] for i in infos] == [6, 6]  # seen at step 5, agreed during step 6
    ack = json.loads((ck / ".control" / "checkpoint-ack.json").read_text())
    assert ack == {"id": "req-1", "step": 6, "name": "ckpt-000000000006"}
    assert part_manifest(ck / "ckpt-000000000006")["reason"] == "test"
    infos = torchrun(2, ck, out)
    assert [i["start"] for i in infos] == [7, 7]
    assert_same_final(reference, out, 2)


def test_two_rank_checkpoint_restored_on_four_ranks_is_resharded(tmp_path: Path) -> None:
    ck, out = tmp_path / "ck", tmp_path / "out"
    torchrun(2, ck, out, "--steps", "6", "--save-every", "5")
    infos = torchrun(4, ck, tmp_path / "out4", "--steps", "9", "--save-every", "100")
    assert [i["start"] for i in infos] == [6] * 4
    assert all(i["exact"] is False and i["resharded_from"] == 2 for i in infos)
    import torch

    finals = [torch.load(tmp_path / "out4" / f"final-{r}.pt", weights_only=False) for r in range(4)]
    for f in finals[1:]:  # DDP keeps the replicas identical after resharding
        for k in f["model"]:
            assert torch.equal(f["model"][k], finals[0]["model"][k])
        # Ranks 2 and 3 did not exist: they took rank 0's scheduler.
        assert f["lr"] == finals[0]["lr"]
    # One process (no process group) loads the same checkpoint whole.
    import spotguard

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    restored = spotguard.Checkpointer(ck).restore(model, optimizer, restore_rng=False)
    assert restored is not None and restored.step == 5 and not restored.exact and restored.resharded_from == 2
    assert len(optimizer.state_dict()["state"]) == 4


@pytest.mark.parametrize("stager", ["default", "closes-after-stage"])
def test_fsdp2_resume_is_bit_exact(fsdp_reference: Path, tmp_path: Path, stager: str) -> None:
    """Also where torch's DefaultStager closes itself after every stage (torch 2.11): the
    Checkpointer's later saves must not fail (they did, with KeyError: <class 'type'>)."""
    flags = ["--stager-closes"] if stager == "closes-after-stage" else []
    if flags:
        from torch.distributed.checkpoint import staging

        if not hasattr(staging, "DefaultStager") or not hasattr(staging.DefaultStager, "_stage"):
            pytest.skip("this torch has no DefaultStager._stage to make close its stager")
    ck, out = tmp_path / "ck", tmp_path / "out"
    infos = torchrun(2, ck, out, "--mode", "fsdp", "--sigterm-at", "6", "--sigterm-rank", "0", *flags)
    assert [i["stopped"] for i in infos] == [7, 7]
    assert all(len(i["stalls"]) >= 2 for i in infos), infos  # a routine save, then the SIGTERM one
    infos = torchrun(2, ck, out, "--mode", "fsdp", *flags)
    assert [i["start"] for i in infos] == [8, 8]
    assert_same_final(fsdp_reference, out, 2)


def test_two_nodes_write_their_parts_and_resume_through_storage(
    reference: Path, tmp_path: Path, s3_store: Any, s3_uri: str
) -> None:
    from ckpt_helpers import s3_options

    from spotguard.checkpoint.store.verify_stored import verify_checkpoint
    from spotguard.storage import open_storage

    out = tmp_path / "out"
    infos = two_nodes(tmp_path, out, s3_store, s3_uri, "--sigterm-at", "6", "--sigterm-rank", "1")
    assert [i["stopped"] for i in infos] == [7, 7]
    save_ids = set()
    for node in (0, 1):
        doc = part_manifest(tmp_path / f"node{node}" / "ckpt-000000000007")
        save_ids.add(doc["sharding"].pop("save_id"))
        assert doc["sharding"] == {"world_size": 2, "parts": 2, "part": node, "ranks": [node]}
        paths = {f["path"] for f in doc["files"]}
        assert ("dcp/.metadata" in paths) == (node == 0)
        assert all(p.startswith((f"dcp/__{node}_", f"ranks/{node:05d}/", "dcp/.metadata")) for p in paths), paths
    assert len(save_ids) == 1  # one collective save: both nodes' parts carry its id
    verdict = verify_checkpoint(open_storage(s3_uri, **s3_options(s3_store)), "ckpt-000000000007")
    assert verdict.ok, verdict.reason
    assert verdict.manifest is not None and verdict.manifest.is_global
    # The same nodes come back: their local parts alone cannot be loaded, the global checkpoint is fetched.
    infos = two_nodes(tmp_path, out, s3_store, s3_uri)
    assert [i["start"] for i in infos] == [8, 8]
    assert all(i["exact"] is True for i in infos)
    assert_same_final(reference, out, 2)


@pytest.mark.trials
# Rank 0 coordinates the save (it writes the metadata); rank 1's death too in make soak.
@pytest.mark.parametrize("victim", trials.variants(full=[0, 1], quick=[0]))
def test_a_rank_killed_during_a_save_never_leaves_a_checkpoint_that_does_not_load(
    reference: Path, tmp_path: Path, victim: int
) -> None:
    from spotguard.checkpoint.local.commit import list_local_committed, verify_local_checkpoint

    ck, out = tmp_path / "ck", tmp_path / "out"
    delay = trials.rng(f"dist-kill-{victim}").uniform(0.0, 0.08)
    print(f"SIGKILL to rank {victim} {delay:.3f}s into the save of step 8")
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node=2",
        __file__,
        "--dir",
        str(ck),
        "--out",
        str(out),
        "--kill-at",
        "8",
        "--kill-rank",
        str(victim),
        "--kill-delay",
        f"{delay:.4f}",
    ]
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=300)  # a loaded machine
    assert proc.returncode != 0
    committed = list_local_committed(ck)
    for path in committed:
        verdict = verify_local_checkpoint(path)
        assert verdict.ok, verdict.reason
    infos = torchrun(2, ck, out)
    newest = int(committed[-1].name.split("-")[1]) + 1 if committed else 0
    assert [i["start"] for i in infos] == [newest, newest]
    assert not list(ck.glob(".tmp-*"))
    assert_same_final(reference, out, 2)


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
