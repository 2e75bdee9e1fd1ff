"""A trainer for the incremental-checkpoint benchmark, run under ``spotguard run``.

Two shapes of training state:

- ``finetune``: a frozen base of ``--frozen-bytes`` (a few large float32
  tensors, ``requires_grad=False``, distinct random values) and a small
  trainable adapter (two low-rank matrices of ``--trainable-bytes`` in all)
  trained with AdamW: only the adapter and its optimizer state change from
  one step to the next.
- ``full``: a stack of Linear layers trained with AdamW, parameters and both
  moments ``--trainable-bytes`` in all: every tensor changes at every step.

Checkpoints at steps 1 and 2 (the first stores everything; in the second a
frozen base moves to its part's kept file), then steps until a preemption
asks for a checkpoint, saves it and exits: the preemption's checkpoint is a
training run's usual one, after others. Prints ``ready`` once the routine
checkpoints are taken.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

FROZEN_TENSOR = 64 * 1024 * 1024  # bytes per frozen tensor (the last one may be smaller)
WIDTH = 2048
#: Routine checkpoints before the preemption (steps 1..ROUTINE).
ROUTINE = 2


def finetune_model(frozen_bytes: int, trainable_bytes: int) -> tuple[Any, Any, Any]:
    """A frozen base plus a low-rank adapter, AdamW over the adapter: (model, optimizer, step function)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    block = torch.empty(FROZEN_TENSOR // 4).uniform_(-0.05, 0.05, generator=gen)
    base = torch.nn.ParameterList()
    left = frozen_bytes // 4
    while left > 0:
        n = min(FROZEN_TENSOR // 4, left)
        # Random values, shifted by each tensor's own offset: no two chunks of the base are alike
        # (and 4 GiB are made in a second or two, not drawn one by one).
        values = block[:n] + 1e-3 * (len(base) + 1)
        base.append(torch.nn.Parameter(values, requires_grad=False))
        left -= n
    # Adapter parameters: trainable_bytes / 3 (AdamW keeps two moments of the same size).
    rank = max(1, trainable_bytes // 3 // 4 // (2 * WIDTH))
    down = torch.nn.Linear(WIDTH, rank, bias=False)
    up = torch.nn.Linear(rank, WIDTH, bias=False)
    model = torch.nn.ModuleDict({"base": base, "down": down, "up": up})
    opt = torch.optim.AdamW([down.weight, up.weight], lr=1e-3)

    def step() -> None:
        x = torch.randn(8, WIDTH)
        loss = (up(down(x)) - x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def full_model(trainable_bytes: int) -> tuple[Any, Any, Any]:
    """Linear layers and AdamW, parameters + moments = ``trainable_bytes``: (model, optimizer, step function)."""
    import torch

    torch.manual_seed(0)
    layers = max(1, round(trainable_bytes / 3 / (WIDTH * WIDTH * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        loss = model(torch.randn(4, WIDTH)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("shape", choices=["finetune", "full"])
    p.add_argument("--frozen-bytes", type=int, default=0)
    p.add_argument("--trainable-bytes", type=int, required=True)
    args = p.parse_args()

    import torch

    import spotguard

    torch.set_num_threads(1)  # the supervisor and the store share the machine's cores
    if args.shape == "finetune":
        model, opt, train_step = finetune_model(args.frozen_bytes, args.trainable_bytes)
    else:
        model, opt, train_step = full_model(args.trainable_bytes)
    ckpt = spotguard.Checkpointer.from_env()
    step = 0
    while True:
        step += 1
        train_step()
        if step <= ROUTINE:
            ckpt.save(step, spotguard.torch_state(model, opt))
            if step == ROUTINE:
                print("ready", flush=True)
        elif ckpt.should_save(step):
            ckpt.save(step, spotguard.torch_state(model, opt))
        if ckpt.preempted:
            print(f"preempted after step {step}", flush=True)
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
