"""The flag agreement of ``should_save`` off the critical path, with two real ranks (gloo on 127.0.0.1).

A flag that one rank sees at ``should_save(k)`` is exchanged while step
``k + 1`` computes and applied at ``should_save(k + 1)`` on every rank;
saves every N steps need no exchange and happen at their own step. If the
ranks applied the answer at different steps, their due steps would differ
and their collective saves would not meet (the run would fail or time out).
"""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

#: Interval saves every SAVE_EVERY steps; rank FLAG_RANK gets SIGTERM right before should_save(FLAG_AT).
SAVE_EVERY, FLAG_AT, FLAG_RANK, STEPS = 3, 4, 1, 9


def train(rank: int, port: int, directory: Path) -> dict[str, Any]:
    """One rank's loop: a small DDP model checkpointed with the public API."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import spotguard

    # Ranks that disagree would wait in a collective: a short timeout turns that into a failure.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt = spotguard.Checkpointer(directory, save_every_steps=SAVE_EVERY, handle_signals=rank == FLAG_RANK)
        due: list[int] = []
        stopped: int | None = None
        for step in range(STEPS):
            optimizer.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            optimizer.step()
            if step == FLAG_AT and rank == FLAG_RANK:
                os.kill(os.getpid(), signal.SIGTERM)  # only this rank sees it
            if ckpt.should_save(step):
                due.append(step)
                ckpt.save(step, spotguard.torch_state(model, optimizer))
            if ckpt.preempted:
                stopped = step
                break
        ckpt.close()
    finally:
        dist.destroy_process_group()
    return {"due": due, "stopped": stopped}


def _rank_1(port: int, directory: Path, out: Path) -> None:
    """Rank 1 in a forked child (no second import of torch): its result as JSON in ``out``."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the test runner's handler (spotguard's chains to it)
    out.write_text(json.dumps(train(1, port, directory)))


def _run_ranks(tmp_path: Path) -> list[dict[str, Any]]:
    """Rank 0 in this process, rank 1 in a child forked from it."""
    import multiprocessing

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    out = tmp_path / "rank1.json"
    child = multiprocessing.get_context("fork").Process(target=_rank_1, args=(port, tmp_path / "ck", out))
    child.start()
    try:
        mine = train(0, port, tmp_path / "ck")
        child.join(timeout=120)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0, f"rank 1 failed (exit code {child.exitcode}); its traceback is in the output above"
    return [mine, json.loads(out.read_text())]


def test_a_flag_one_rank_sees_at_step_k_stops_every_rank_at_step_k_plus_1(tmp_path: Path) -> None:
    from testenv.require import require_module

    require_module("torch")
    from spotguard.checkpoint.local import list_local_committed, read_local_manifest

    results = _run_ranks(tmp_path)
    # The interval save at once (no lag: its step numbers do not move), the preemption's one step after the flag.
    assert [r["due"] for r in results] == [[SAVE_EVERY, FLAG_AT + 1]] * 2
    assert [r["stopped"] for r in results] == [FLAG_AT + 1] * 2
    committed = list_local_committed(tmp_path / "ck")
    assert [p.name for p in committed] == [f"ckpt-{s:012d}" for s in (SAVE_EVERY, FLAG_AT + 1)]
    last = read_local_manifest(committed[-1])
    assert last.reason == "sigterm" and last.sharding is not None and last.sharding.ranks == (0, 1)
