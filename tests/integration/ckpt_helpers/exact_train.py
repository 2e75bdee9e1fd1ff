"""A small deterministic training run for the exact-resume test.

MLP with dropout, AdamW, a StepLR schedule stepped per batch, shuffled
synthetic data (a per-epoch permutation from its own torch.Generator), and
noise from python's ``random``, numpy and torch's global RNG, so every RNG
matters. Configured through the ``SPOTGUARD_*`` environment like a real
trainer. With ``--preempt-at S`` it sends itself SIGTERM after step S, takes
the emergency checkpoint and exits 0; run again, it resumes. When it reaches
the end it writes every parameter and optimizer tensor to ``--out`` and the
next random draws to ``--out`` + ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys

import numpy as np
import torch
from safetensors.torch import save_file

import spotguard

N, FEATURES, BATCH = 256, 8, 16


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--preempt-at", type=int, default=-1)
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--upload", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    data = torch.Generator().manual_seed(0)
    x = torch.randn(N, FEATURES, generator=data)
    y = x @ torch.randn(FEATURES, 1, generator=data) + 0.1 * torch.randn(N, 1, generator=data)
    data_gen = torch.Generator().manual_seed(14)

    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.7)

    ckpt = spotguard.Checkpointer.from_env(save_every_steps=args.save_every, upload=args.upload)
    state = ckpt.restore(model, optimizer, scheduler, data_gen=data_gen)
    start = state.step + 1 if state else 0
    perm = state.extra["perm"] if state else None
    print(f"start {start}", flush=True)

    loss = torch.zeros(())
    for step in range(start, args.steps):
        batch = step % (N // BATCH)
        if batch == 0:
            perm = torch.randperm(N, generator=data_gen)
        assert perm is not None
        idx = perm[batch * BATCH : (batch + 1) * BATCH]
        xb = x[idx] + 0.01 * torch.randn(BATCH, FEATURES)
        scale = 1.0 + 0.1 * random.random()
        jitter = float(np.random.rand()) * 1e-3
        model.train()
        loss = ((model(xb) - y[idx]) ** 2).mean() * scale + jitter
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step == args.preempt_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if ckpt.should_save(step):
            ckpt.save(
                step,
                spotguard.torch_state(model, optimizer, scheduler, data_gen=data_gen, perm=perm),
                metrics={"loss": float(loss)},
            )
        if ckpt.preempted:
            ckpt.close()
            print(f"preempted after step {step}", flush=True)
            return 0
    ckpt.close()

    tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for index, per_param in optimizer.state_dict()["state"].items():
        for key, value in per_param.items():
            tensors[f"optimizer.{index}.{key}"] = value.detach().clone()
    save_file(tensors, args.out)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
    draws = {
        "python": [random.random() for _ in range(3)],
        "numpy": np.random.rand(3).tolist(),
        "torch": torch.rand(3).tolist(),
        "data": torch.randperm(10, generator=data_gen).tolist(),
        "scheduler": {k: v for k, v in scheduler.state_dict().items()},
        "param_groups": groups,
        "final_loss": float(loss),
    }
    with open(args.out + ".json", "w") as f:
        json.dump(draws, f, sort_keys=True, default=str)
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
