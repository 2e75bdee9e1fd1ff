"""A fine-tune as a user writes it, for the fine-tune SIGTERM benchmark (bench/linear_finetune.py).

One frozen ``nn.Linear(D, D)`` base (``--frozen-bytes`` of float32 weight in
one tensor, and its bias), a small trainable adapter (two low-rank
``nn.Linear``), AdamW over the adapter, ``Checkpointer.from_env()`` and a
checkpoint every ``--save-every`` steps, every other setting the default.
Run under ``spotguard run``. With ``--shape tensors`` the base is
bench/incremental_worker.py's instead (float32 tensors of 64 MiB), the rest
the same. Takes ``ROUTINE`` routine checkpoints, prints ``ready`` once the last is
written, then steps until a preemption's checkpoint is saved, and prints
``preempted after step N: save S`` (its seconds in the trainer).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from typing import Any

RANK = 16
#: Routine checkpoints (every ``--save-every`` steps) before the trainer only saves when asked.
ROUTINE = 4
#: Between steps: a preemption's request waits at most this long (and a step) for the next step
#: boundary. It was 10 ms: where SIGTERM fell in it decided up to a third of a 35 ms figure at
#: either size, and with it the per-round ratios' quartiles; the issue's script has no pause. 2 ms
#: still leaves the supervisor's routine uploads most of a core.
STEP_PAUSE = 0.002
#: BENCH_FINETUNE_PROFILE=PREFIX: the preemption's save runs under cProfile, its statistics written to
#: PREFIX.<frozen bytes>.<step> (routine saves are not profiled).
PROFILE = os.environ.get("BENCH_FINETUNE_PROFILE", "")


def build(frozen_bytes: int, shape: str, forward: bool = False) -> tuple[Any, Any, Any]:
    """(model, optimizer, step function): a frozen base of ``frozen_bytes`` and a trained adapter;
    ``forward``: a step runs the base too (``--shape linear``: a LoRA's step, the base's output
    plus the adapter's)."""
    import torch

    from bench.incremental_worker import frozen_tensors

    torch.manual_seed(0)
    if shape == "linear":
        d = max(8, math.isqrt(frozen_bytes // 4))
        base: Any = torch.nn.Linear(d, d)
        with torch.no_grad():  # kaiming init of a GiB-sized matrix takes seconds on one core
            base.weight.uniform_(-0.05, 0.05)
        base.requires_grad_(False)
    else:
        base = torch.nn.ParameterList(torch.nn.Parameter(t, requires_grad=False) for t in frozen_tensors(frozen_bytes))
    # The adapter's width is the same at every size of base: only the frozen bytes grow.
    width = 4096
    adapter = torch.nn.Sequential(torch.nn.Linear(width, RANK, bias=False), torch.nn.Linear(RANK, width, bias=False))
    model = torch.nn.ModuleDict({"base": base, "adapter": adapter})
    opt = torch.optim.AdamW(adapter.parameters(), lr=1e-3)

    def step() -> None:
        # Without ``forward`` the base is not run: its matrix-vector product reads every byte of it,
        # so a step (and a preemption's wait for the next step boundary) would grow with it.
        x = torch.randn(4, width)
        y = adapter(x)
        if forward and shape == "linear":
            y = y + base(torch.nn.functional.pad(x, (0, base.in_features - width)))[:, :width]
        loss = (y - x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--frozen-bytes", type=int, required=True)
    p.add_argument("--shape", choices=["linear", "tensors"], default="linear")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--forward", action="store_true", help="a step runs the frozen base too (--shape linear)")
    p.add_argument("--keep-saving", action="store_true", help="routine checkpoints go on after the first ROUTINE")
    args = p.parse_args()

    import torch

    import spotguard

    torch.set_num_threads(1)  # the supervisor shares the machine's cores
    model, opt, train_step = build(args.frozen_bytes, args.shape, args.forward)
    ckpt = spotguard.Checkpointer.from_env()
    steps: list[float] = []  # how long each training step took
    step = 0
    while True:
        step += 1
        t0 = time.perf_counter()
        train_step()
        steps.append(time.perf_counter() - t0)
        routine = step % args.save_every == 0 and (args.keep_saving or step <= ROUTINE * args.save_every)
        if routine or ckpt.should_save(step):
            t0 = time.perf_counter()
            if PROFILE and step > ROUTINE * args.save_every:
                from bench.common import profiled

                save = functools.partial(ckpt.save, step, spotguard.torch_state(model, opt))
                profiled(save, f"{PROFILE}.{args.frozen_bytes}.{step}")
            else:
                ckpt.save(step, spotguard.torch_state(model, opt))
            seconds = time.perf_counter() - t0
            if ckpt.preempted:  # the preemption's save: synchronous, written when save() returns
                print(
                    f"preempted after step {step}: save {seconds:.3f}s "
                    f"(snapshot {ckpt.last_stall_seconds:.3f}s, write {ckpt.last_persist_seconds:.3f}s)",
                    flush=True,
                )
                return 0
            if step == ROUTINE * args.save_every:
                if not args.keep_saving:
                    ckpt.wait()
                print(f"step {statistics.median(steps[1:]):.3f}s", flush=True)  # the first warms up
                print("ready", flush=True)
        time.sleep(STEP_PAUSE)


if __name__ == "__main__":
    sys.exit(main())
