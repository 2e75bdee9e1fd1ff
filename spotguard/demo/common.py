"""What the demo's training scripts share: the synthetic classification problem and the model
that learns it, the options and the checkpoint interval every script takes alike, and the digest
of a final state that runs are compared by.

torch is imported where it is used, so that ``python -m spotguard.demo.train --help`` answers
without loading it.
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

from spotguard.contract.env import SAVE_EVERY_STEPS, from_env

FEATURES = 16
CLASSES = 4
DATASET_SIZE = 1024
#: Steps between checkpoints where neither ``--save-every`` nor SPOTGUARD_SAVE_EVERY_STEPS says.
SAVE_EVERY = 50


def add_training_options(p: argparse.ArgumentParser) -> None:
    """The options of the classifier's scripts: ``--hidden``, ``--lr``, ``--seed``,
    ``--save-every`` (see :func:`save_every`) and ``--step-delay``."""
    p.add_argument("--hidden", type=int, default=64, help="hidden width (default 64)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--save-every",
        type=int,
        default=None,
        help=f"checkpoint every N steps (default: {SAVE_EVERY_STEPS.name}, else {SAVE_EVERY})",
    )
    p.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="sleep this long after each step (seconds; makes a tiny model take real time)",
    )


def save_every(args: argparse.Namespace) -> int:
    """The checkpoint interval: ``--save-every``, else SPOTGUARD_SAVE_EVERY_STEPS, else :data:`SAVE_EVERY`."""
    if args.save_every is not None:
        return int(args.save_every)
    env_every = from_env(SAVE_EVERY_STEPS)
    return SAVE_EVERY if env_every is None else env_every


def make_problem(seed: int, size: int = DATASET_SIZE) -> tuple[Any, Any]:
    """A fixed synthetic classification problem (the same on every rank): inputs and labels."""
    import torch

    gen = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(size, FEATURES, generator=gen)
    w = torch.randn(FEATURES, CLASSES, generator=gen)
    y = (x @ w + 0.1 * torch.randn(size, CLASSES, generator=gen)).argmax(dim=1)
    return x, y


def classifier(hidden: int) -> Any:
    """The model: two hidden layers with dropout (so the RNG a resumed run restores matters)."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(FEATURES, hidden),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(hidden, CLASSES),
    )


class StateDigest:
    """sha256 over named values, in the order added: a tensor by its bytes (a sharded one,
    a DTensor, by this rank's shard), anything else by its ``repr``."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def add(self, name: str, value: Any) -> None:
        import torch

        self._hash.update(name.encode())
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            self._hash.update(local.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            self._hash.update(repr(value).encode())

    def add_training(self, model: Any, optimizer: Any) -> None:
        """The model's weights and the optimizer's state and settings, in a canonical order."""
        for name, value in sorted(model.state_dict().items()):
            self.add(f"model.{name}", value)
        state = optimizer.state_dict()
        for pid, entries in sorted(state["state"].items()):
            for key, value in sorted(entries.items()):
                self.add(f"optimizer.{pid}.{key}", value)
        groups = [{k: v for k, v in sorted(g.items()) if k != "params"} for g in state["param_groups"]]
        self.add("optimizer.param_groups", groups)

    def digest(self) -> bytes:
        return self._hash.digest()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()
