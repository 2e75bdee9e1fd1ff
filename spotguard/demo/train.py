"""A small, deterministic training script written against spotguard's public API.

It is the example to copy: a model, an optimizer, a learning-rate schedule,
dropout (so the RNG matters) and shuffled data, checkpointed with
``spotguard.Checkpointer`` so that a run preempted and resumed any number of
times ends bit-for-bit where an uninterrupted run ends.

    python -m spotguard.demo.train --steps 300 --output final.safetensors
    spotguard run -- python -m spotguard.demo.train --steps 300

Settings come from the environment the operator or ``spotguard run`` sets
(``SPOTGUARD_CHECKPOINT_DIR``, ``SPOTGUARD_STORAGE_URI``,
``SPOTGUARD_SAVE_EVERY_STEPS``, ...). Output, one line each:
``resumed from step K`` or ``starting from scratch``; ``step N loss X``;
``preempted after step N`` or ``finished N steps``; with ``--output``,
``final sha256 HEX`` of the written state.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from spotguard.demo.common import (
    DATASET_SIZE,
    FEATURES,
    add_training_options,
    classifier,
    make_problem,
    save_every,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(
        prog="python -m spotguard.demo.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=300, help="total training steps (default 300)")
    p.add_argument("--batch-size", type=int, default=32)
    add_training_options(p)
    p.add_argument(
        "--output", type=Path, default=None, help="write the final model and optimizer state here (safetensors)"
    )
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    p.add_argument(
        "--frozen-mib",
        type=float,
        default=0.0,
        help="add a frozen embedding table of this many MiB (a fine-tune's frozen base; "
        "checkpointed, never trained: what incremental checkpoints upload once)",
    )
    return p.parse_args(argv)


def batch_order(epoch: int, seed: int) -> Any:
    """The shuffled sample order of one epoch.

    Derived from (seed, epoch) alone, so the data position is fully given by
    the step number and nothing about the loader needs saving.
    """
    import torch

    gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(DATASET_SIZE, generator=gen)


class FrozenBase:
    """Builds the frozen part of ``--frozen-mib``: an embedding table added to
    the input by sample index, with ``requires_grad=False`` like the base
    model of an adapter fine-tune."""

    @staticmethod
    def wrap(head: Any, mib: float) -> Any:
        from torch import nn

        class WithFrozenBase(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                rows = max(1, int(mib * (1 << 20)) // (4 * FEATURES))
                self.base = nn.Embedding(rows, FEATURES)
                self.base.weight.requires_grad_(False)
                self.head = head

            def forward(self, x: Any, idx: Any) -> Any:
                rows = self.base.num_embeddings
                return self.head(x + 0.01 * self.base(idx % rows))

        return WithFrozenBase()


def build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """Model, optimizer and LR scheduler, initialised from the seed."""
    import torch

    torch.manual_seed(args.seed)
    model = classifier(args.hidden)
    if getattr(args, "frozen_mib", 0.0) > 0:
        model = FrozenBase.wrap(model, args.frozen_mib)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.01)
    # Step-based (not "fraction of total steps"), so the schedule does not
    # depend on how long the run was asked to be.
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
    return model, optimizer, scheduler


def final_state_tensors(model: Any, optimizer: Any) -> dict[str, Any]:
    """Model parameters and every optimizer tensor, flat, for a byte-exact comparison."""
    import torch

    out: dict[str, Any] = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for pid, st in optimizer.state_dict()["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                out[f"optimizer.{pid}.{key}"] = value.detach().clone().contiguous()
            else:
                out[f"optimizer.{pid}.{key}"] = torch.tensor(value)
    return out


def main(argv: list[str] | None = None) -> int:
    """Train; return the exit status (0 also when preempted: the checkpoint is written)."""
    args = parse_args(argv)
    import torch
    from safetensors.torch import save_file

    import spotguard

    # One thread: identical results whatever the machine's core count.
    torch.set_num_threads(1)
    spotguard.deterministic()  # torch.use_deterministic_algorithms(True), without importing the compiler

    ckpt = spotguard.Checkpointer.from_env(save_every_steps=save_every(args))

    model, optimizer, scheduler = build(args)
    x, y = make_problem(args.seed)
    batches_per_epoch = DATASET_SIZE // args.batch_size

    # Loads model, optimizer, scheduler and every RNG from the newest
    # checkpoint (local, else the newest verified one in storage).
    state = ckpt.restore(model, optimizer, scheduler)
    if state is not None:
        start = state.step + 1
        print(f"resumed from step {state.step}", flush=True)
    else:
        start = 0
        print("starting from scratch", flush=True)

    loss_fn = torch.nn.CrossEntropyLoss()
    model.train()
    step = start - 1
    preempted = False
    for step in range(start, args.steps):
        epoch, batch = divmod(step, batches_per_epoch)
        idx = batch_order(epoch, args.seed)[batch * args.batch_size : (batch + 1) * args.batch_size]
        loss = loss_fn(model(x[idx], idx) if args.frozen_mib > 0 else model(x[idx]), y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        if ckpt.should_save(step):
            ckpt.save(step, spotguard.torch_state(model, optimizer, scheduler), metrics={"loss": float(loss.item())})
        if ckpt.preempted:
            preempted = True
            break
        if args.step_delay:
            time.sleep(args.step_delay)

    if preempted:
        ckpt.close()
        print(f"preempted after step {step}", flush=True)
        return 0
    if step >= 0:
        # The final state is a checkpoint too, so storage holds the result
        # (a no-op when this step was just saved).
        ckpt.save(step, spotguard.torch_state(model, optimizer, scheduler), blocking=True)
    ckpt.close()
    print(f"finished {args.steps} steps", flush=True)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.output.with_name(args.output.name + ".tmp")
        save_file(final_state_tensors(model, optimizer), str(tmp))
        os.replace(tmp, args.output)
        digest = hashlib.sha256(args.output.read_bytes()).hexdigest()
        print(f"final sha256 {digest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
