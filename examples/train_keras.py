"""Keras 3 training (torch backend) that survives preemption, with spotguard.

Run it under ``spotguard run``::

    spotguard run --storage s3://my-bucket/jobs/keras -- python examples/train_keras.py

spotguard is one line of it: ``SpotguardCallback()`` in ``fit``'s
callbacks. A SIGTERM (a spot preemption) makes the callback checkpoint the
state after the current batch (weights, optimizer, metrics, RNGs, position);
spotguard commits and uploads it and the fit stops. The same command
resumes from it, mid-epoch or at an epoch end, and a run preempted any
number of times ends with the same bytes as an uninterrupted one: dropout
draws from the layers' seed generators, the data order from the global
RNGs (``shuffle=True`` on arrays) or from generators handed to the
callback (``--data dataloader``: a torch ``DataLoader`` shuffling with a
generator of its own; ``--data pydataset``: a ``keras.utils.PyDataset``
that shuffles itself at each epoch's start).

Output: ``starting from scratch`` or ``resumed from step K``; ``step N loss
X``; ``preempted after step N`` or ``finished N steps``; at the end ``final
digest HEX`` (sha256 over weights and optimizer state) so that runs can be
compared. ``--pause-for-preemption-at N`` makes the script wait after step
N, and ``--pause-for-preemption-after-epoch E`` at the end of epoch E (after
its validation), until a preemption (SIGTERM, a request) reaches it, so that
a test can stop it at a chosen point.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import torch

from spotguard.integrations.keras import SpotguardCallback

FEATURES = 16
CLASSES = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=4, help="epochs to train (default 4)")
    p.add_argument("--samples", type=int, default=128, help="training samples (default 128)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per step (default 8)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data",
        choices=("arrays", "dataloader", "pydataset"),
        default="arrays",
        help="arrays: numpy arrays with fit(shuffle=True) (default); dataloader: a torch DataLoader "
        "shuffling with a generator of its own; pydataset: a keras.utils.PyDataset shuffling itself at "
        "each epoch's start with a generator of its own (both generators handed to the callback)",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=None,
        help="checkpoint every N steps (default SPOTGUARD_SAVE_EVERY_STEPS, else 50)",
    )
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep after each step (seconds)")
    p.add_argument("--pause-for-preemption-at", type=int, default=None, metavar="STEP",
                   help="after step STEP, wait until a preemption request arrives")  # fmt: skip
    p.add_argument("--pause-for-preemption-after-epoch", type=int, default=None, metavar="EPOCH",
                   help="at the end of epoch EPOCH (1-based, after validation), wait until a preemption "
                   "request arrives")  # fmt: skip
    return p.parse_args(argv)


def make_model(hidden: int, lr: float) -> keras.Model:
    """A small MLP with dropout (the RNG a resumed run must get right)."""
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(hidden, activation="relu"), keras.layers.Dropout(0.1),
        keras.layers.Dense(hidden, activation="relu"), keras.layers.Dropout(0.1),
        keras.layers.Dense(CLASSES),
    ])  # fmt: skip
    schedule = keras.optimizers.schedules.ExponentialDecay(lr, decay_steps=20, decay_rate=0.5)
    model.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=schedule, weight_decay=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def make_data(seed: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed synthetic classification problem: features and labels."""
    rng = np.random.default_rng(seed + 7)
    x = rng.standard_normal((samples, FEATURES)).astype("float32")
    w = rng.standard_normal((FEATURES, CLASSES)).astype("float32")
    y = (x @ w + 0.1 * rng.standard_normal((samples, CLASSES))).argmax(axis=1).astype("int64")
    return x, y


class ShuffledBatches(keras.utils.PyDataset):  # type: ignore[misc]
    """Batches of (x, y) in an order drawn at each epoch's start from ``rng``.

    At the start, not the end, of an epoch: ``fit`` calls ``on_epoch_begin``
    after spotguard put back the RNGs of the epoch's start (a resume's
    replay then draws the same order); ``on_epoch_end`` also runs when a
    fit starts, before the resume."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, rng: np.random.Generator) -> None:
        super().__init__()
        self.x, self.y, self.batch_size, self.rng = x, y, batch_size, rng
        self.order = np.arange(len(x))

    def __len__(self) -> int:
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rows = self.order[index * self.batch_size : (index + 1) * self.batch_size]
        return self.x[rows], self.y[rows]

    def on_epoch_begin(self) -> None:
        self.order = self.rng.permutation(len(self.x))


class Progress(keras.callbacks.Callback):  # type: ignore[misc]
    """Prints the resume point and ``step N loss X``, sleeps ``delay``, and
    can pause until spotguard has a preemption request. Listed before
    SpotguardCallback, so that a request that arrives in a pause is seen by
    spotguard at the same batch or epoch end."""

    def __init__(self, spotguard: SpotguardCallback, delay: float, pause_at: int | None,
                 pause_after_epoch: int | None) -> None:  # fmt: skip
        super().__init__()
        self.spotguard = spotguard
        self.delay = delay
        self.pause_at = pause_at
        self.pause_after_epoch = pause_after_epoch
        self.announced = False
        self.last_step = 0

    def announce(self) -> None:
        if self.announced:
            return
        self.announced = True
        start = self.spotguard.resumed_from
        print("starting from scratch" if start is None else f"resumed from step {start}", flush=True)
        self.last_step = start or 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.announce()

    def on_train_end(self, logs: Any = None) -> None:
        self.announce()

    def wait_for_preemption(self, where: str) -> None:
        print(f"waiting for a preemption after {where}", flush=True)
        while not self.spotguard.checkpointer.request_pending:
            time.sleep(0.02)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        step = int(self.model.optimizer.iterations.value)
        if step == self.last_step:
            return  # a batch done before the checkpoint, read again but not trained on
        self.last_step = step
        print(f"step {step} loss {float((logs or {}).get('loss', float('nan'))):.6f}", flush=True)
        if self.pause_at is not None and step == self.pause_at:
            self.wait_for_preemption(f"step {step}")
        if self.delay:
            time.sleep(self.delay)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.pause_after_epoch is not None and epoch + 1 == self.pause_after_epoch:
            self.wait_for_preemption(f"epoch {epoch + 1}")


def digest(model: keras.Model) -> str:
    """sha256 over the model's and the optimizer's variables, by path."""
    h = hashlib.sha256()
    for prefix, variables in (("model", model.variables), ("optimizer", model.optimizer.variables)):
        for v in sorted(variables, key=lambda v: str(v.path)):
            h.update(f"{prefix}.{v.path}".encode())
            h.update(np.ascontiguousarray(keras.ops.convert_to_numpy(v)).tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    """Train; 0 also when preempted (the checkpoint is committed)."""
    args = parse_args(argv)
    # Bit-identical results whatever the machine's core count.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if args.save_every is not None:
        os.environ["SPOTGUARD_SAVE_EVERY_STEPS"] = str(args.save_every)
    elif not os.environ.get("SPOTGUARD_SAVE_EVERY_STEPS"):
        os.environ["SPOTGUARD_SAVE_EVERY_STEPS"] = "50"

    keras.utils.set_random_seed(args.seed)
    model = make_model(args.hidden, args.lr)
    x, y = make_data(args.seed, args.samples + max(args.batch_size, args.samples // 4))
    (x, x_val), (y, y_val) = np.split(x, [args.samples]), np.split(y, [args.samples])

    generators: dict[str, Any] = {}
    if args.data == "dataloader":
        # The loader's order comes from a generator of its own: the callback saves it.
        shuffle = torch.Generator().manual_seed(args.seed)
        generators["shuffle"] = shuffle
        dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        train: dict[str, Any] = {"x": torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                                                  generator=shuffle)}  # fmt: skip
    elif args.data == "pydataset":
        order = np.random.default_rng(args.seed)
        generators["order"] = order
        train = {"x": ShuffledBatches(x, y, args.batch_size, order)}
    else:
        train = {"x": x, "y": y, "batch_size": args.batch_size, "shuffle": True}

    spotguard = SpotguardCallback(generators=generators)
    progress = Progress(spotguard, args.step_delay, args.pause_for_preemption_at, args.pause_for_preemption_after_epoch)
    model.fit(**train, epochs=args.epochs, validation_data=(x_val, y_val), verbose=0,
              callbacks=[progress, spotguard])  # fmt: skip

    if spotguard.preempted:
        print(f"preempted after step {spotguard.last_saved_step or spotguard.resumed_from}", flush=True)
        return 0
    print(f"finished {spotguard.step} steps", flush=True)
    print(f"final digest {digest(model)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
