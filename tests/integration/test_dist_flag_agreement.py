"""The flag agreement of ``should_save`` off the critical path, with two real ranks (gloo on 127.0.0.1).

With steps longer than the exchange period, a flag that one rank sees at
``should_save(k)`` is exchanged while step ``k + 1`` computes and applied at
``should_save(k + 1)`` on every rank; with short steps the exchanges are
spaced a few steps apart and the flag acts within two periods, at one step
on every rank. Saves every N steps need no exchange and happen at their own
step. If the ranks applied the answer at different steps, their due steps
would differ and their collective saves would not meet (the run would fail
or time out).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from spotguard.trainer.policy import EXCHANGE_MAX_CALLS, EXCHANGE_SECONDS

#: Interval saves every SAVE_EVERY steps; rank FLAG_RANK gets SIGTERM right before should_save(FLAG_AT).
SAVE_EVERY, FLAG_AT, FLAG_RANK, STEPS = 3, 4, 1, 9
#: A step this long (a sleep) is longer than the exchange period: every call exchanges.
LONG_STEP = EXCHANGE_SECONDS + 0.02
#: Short steps: the exchanges are a few steps apart.
FAST = {"save_every": 25, "flag_at": 40, "steps": 120, "step_seconds": 0.0}


def train(
    rank: int,
    port: int,
    directory: Path,
    *,
    save_every: int = SAVE_EVERY,
    flag_at: int = FLAG_AT,
    steps: int = STEPS,
    step_seconds: float = LONG_STEP,
) -> dict[str, Any]:
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
        ckpt = spotguard.Checkpointer(
            directory, save_every_steps=save_every, handle_signals=rank == FLAG_RANK, keep_local=2
        )
        due: list[int] = []
        stopped: int | None = None
        for step in range(steps):
            time.sleep(step_seconds)
            optimizer.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            optimizer.step()
            if step == flag_at and rank == FLAG_RANK:
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


def _rank_1(port: int, directory: Path, out: Path, kwargs: dict[str, Any]) -> None:
    """Rank 1 in a child process of its own: its result as JSON in ``out``."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the test runner's handler (spotguard's chains to it)
    out.write_text(json.dumps(train(1, port, directory, **kwargs)))
    # Its result is written: skip the interpreter's teardown, where torch (gloo's threads, after
    # destroy_process_group) was once seen to abort ("terminate called without an active exception")
    # in a run on a loaded machine. What this test checks, the ranks' agreement, is in the result.
    os._exit(0)


def _run_ranks(tmp_path: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """Rank 0 in this process, rank 1 in a fresh child (spawned, not forked: a child forked
    from a test process whose torch already ran its thread pools can hang in them)."""
    import multiprocessing

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    out = tmp_path / "rank1.json"
    child = multiprocessing.get_context("spawn").Process(target=_rank_1, args=(port, tmp_path / "ck", out, kwargs))
    child.start()
    try:
        mine = train(0, port, tmp_path / "ck", **kwargs)
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
    from spotguard.checkpoint.local.commit import list_local_committed, read_local_manifest

    results = _run_ranks(tmp_path)
    # The interval save at once (no lag: its step numbers do not move), the preemption's one step after the flag.
    assert [r["due"] for r in results] == [[SAVE_EVERY, FLAG_AT + 1]] * 2
    assert [r["stopped"] for r in results] == [FLAG_AT + 1] * 2
    committed = list_local_committed(tmp_path / "ck")
    assert [p.name for p in committed] == [f"ckpt-{s:012d}" for s in (SAVE_EVERY, FLAG_AT + 1)]
    last = read_local_manifest(committed[-1])
    assert last.reason == "sigterm" and last.sharding is not None and last.sharding.ranks == (0, 1)


def test_with_short_steps_a_flag_stops_every_rank_at_one_step_within_two_exchange_periods(tmp_path: Path) -> None:
    from testenv.require import require_module

    require_module("torch")
    from spotguard.checkpoint.local.commit import list_local_committed, read_local_manifest

    results = _run_ranks(tmp_path, **FAST)
    flag_at, every = int(FAST["flag_at"]), int(FAST["save_every"])
    stopped = results[0]["stopped"]
    assert stopped is not None and [r["stopped"] for r in results] == [stopped] * 2, results
    # Spaced exchanges (steps of about a millisecond: far more than one per exchange period), bounded lag.
    assert flag_at + 1 < stopped <= flag_at + 2 * EXCHANGE_MAX_CALLS, results
    # The interval saves at their own steps, then the preemption's: the same on both ranks.
    assert [r["due"] for r in results] == [[s for s in range(every, stopped, every)] + [stopped]] * 2, results
    last = read_local_manifest(list_local_committed(tmp_path / "ck")[-1])
    assert last.reason == "sigterm" and last.step == stopped
