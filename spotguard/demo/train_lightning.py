"""PyTorch Lightning training that survives preemption, with spotguard.

Run it under ``spotguard run`` (one process, or torchrun with DDP on CPU)::

    spotguard run --storage s3://my-bucket/jobs/pl -- python examples/train_lightning.py
    spotguard run --storage s3://my-bucket/jobs/pl -- \\
        torchrun --nproc-per-node 2 examples/train_lightning.py

spotguard is two lines of it: ``SpotguardCallback()`` in the Trainer's
callbacks, and ``ckpt_path=spotguard_ckpt_path()`` in ``fit``. A SIGTERM
(a spot preemption) makes every rank checkpoint the same step through
Lightning's own ``save_checkpoint``; spotguard commits and uploads it and
the fit stops. The same command resumes from it, and a run preempted any
number of times, mid-epoch or at an epoch end, ends with the same bytes as
an uninterrupted one: the callback also restores every rank's RNG (dropout
here) and the loader's position (spotguard's ``ResumableSampler``, or a
torchdata ``StatefulDataLoader`` with ``--loader stateful``).

Output (rank 0): ``starting from scratch`` or ``resumed from step K``;
``step N loss X``; ``preempted after step N`` or ``finished N steps``; at
the end ``final digest HEX`` (sha256 over weights and optimizer state) so
runs can be compared. ``--pause-for-preemption-at N`` makes the script wait
after step N until a preemption (SIGTERM, a request) reaches it, so that a
test can stop it at a chosen step, such as the last one of an epoch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from spotguard.contract.env import SAVE_EVERY_STEPS, to_env
from spotguard.demo.common import StateDigest, add_training_options, classifier, make_problem, save_every
from spotguard.integrations.lightning import ResumableSampler, SpotguardCallback, spotguard_ckpt_path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=4, help="epochs to train (default 4)")
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (default: the epochs)")
    p.add_argument("--samples", type=int, default=128, help="dataset size (default 128)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per step (default 8)")
    add_training_options(p)
    p.add_argument(
        "--loader",
        choices=("sampler", "stateful"),
        default="sampler",
        help="sampler: a DataLoader with spotguard's ResumableSampler (default); "
        "stateful: torchdata's StatefulDataLoader with shuffle=True",
    )
    p.add_argument(
        "--pause-for-preemption-at",
        type=int,
        default=None,
        metavar="STEP",
        help="after step STEP, wait until a preemption request arrives",
    )
    return p.parse_args(argv)


class Classifier(pl.LightningModule):
    """A small MLP with dropout (the RNG a resumed run must get right)."""

    def __init__(self, hidden: int, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = classifier(hidden)
        self.loss_fn = nn.CrossEntropyLoss()
        self.last_loss = float("nan")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss: torch.Tensor = self.loss_fn(self.net(x), y)
        self.last_loss = float(loss.detach())
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def make_dataset(seed: int, samples: int) -> TensorDataset:
    """A fixed synthetic classification problem (the same on every rank)."""
    return TensorDataset(*make_problem(seed, samples))


def make_loader(kind: str, dataset: TensorDataset, batch_size: int, seed: int) -> Any:
    """A shuffling loader whose position the checkpoint holds.

    ``sampler``: a plain DataLoader with spotguard's ResumableSampler (its
    own generator per epoch; shards itself under several ranks).
    ``stateful``: torchdata's StatefulDataLoader, whose state Lightning
    saves; its shuffle seed comes from the global generator (seeded below),
    and under several ranks Lightning gives it a DistributedSampler.
    """
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(dataset, batch_size=batch_size, shuffle=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=ResumableSampler(dataset, seed=seed))


class Progress(pl.Callback):
    """Prints ``step N loss X`` (rank 0), sleeps ``delay``, and can pause
    after one step until spotguard has a preemption request."""

    def __init__(self, spotguard: SpotguardCallback, delay: float, pause_at: int | None) -> None:
        self.spotguard = spotguard
        self.delay = delay
        self.pause_at = pause_at

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if trainer.is_global_zero:
            print(f"step {step} loss {getattr(pl_module, 'last_loss', float('nan')):.6f}", flush=True)
        if self.pause_at is not None and step == self.pause_at:
            if trainer.is_global_zero:
                print(f"waiting for a preemption after step {step}", flush=True)
            while not self.spotguard.checkpointer.request_pending:
                time.sleep(0.02)
        if self.delay:
            time.sleep(self.delay)


def digest(module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over the weights and the optimizer state, in a canonical order."""
    digest = StateDigest()
    digest.add_training(module, optimizer)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    """Train; 0 also when preempted (the checkpoint is committed)."""
    args = parse_args(argv)
    # Bit-identical results whatever the machine's core count.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.environ[SAVE_EVERY_STEPS.name] = to_env(SAVE_EVERY_STEPS, save_every(args))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    rank = int(os.environ.get("RANK", "0"))

    # Under torchrun this joins the process group (Lightning reuses it) and
    # every rank gets the same checkpoint.
    ckpt_path = spotguard_ckpt_path()
    if rank == 0:
        if ckpt_path is None:
            print("starting from scratch", flush=True)
        else:
            print(f"resumed from step {int(Path(ckpt_path).parent.name.split('-')[1])}", flush=True)

    torch.manual_seed(args.seed)
    model = Classifier(args.hidden, args.lr)
    dataset = make_dataset(args.seed, args.samples)
    # Each rank's own stream (dropout, the StatefulDataLoader's shuffle seed
    # on one rank); a resume puts back every rank's saved RNG.
    pl.seed_everything(args.seed * 7919 + rank + 1, verbose=False)
    loader = make_loader(args.loader, dataset, args.batch_size, args.seed)

    spotguard = SpotguardCallback()
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=local_world,
        num_nodes=max(1, world // local_world),
        strategy="ddp" if world > 1 else "auto",
        callbacks=[Progress(spotguard, args.step_delay, args.pause_for_preemption_at), spotguard],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    trainer.fit(model, loader, ckpt_path=ckpt_path)

    if spotguard.preempted:
        if trainer.is_global_zero:
            print(f"preempted after step {trainer.global_step}", flush=True)
        return 0
    final = digest(model, trainer.optimizers[0])
    if trainer.is_global_zero:
        print(f"finished {trainer.global_step} steps", flush=True)
        print(f"final digest {final}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
