"""Distributed data-parallel training that survives preemption, with spotguard.

Run it under ``spotguard run`` with torchrun (gloo on CPU, nccl on GPU)::

    spotguard run --storage s3://my-bucket/jobs/ddp -- \\
        torchrun --nproc-per-node 2 examples/train_ddp.py --steps 300

SIGTERM to ``spotguard run`` (a spot preemption) reaches every rank through
torchrun; all ranks agree on one step, checkpoint it together and stop; the
supervisor uploads and verifies it and exits 143. The same command resumes.
A run preempted any number of times ends with the same bytes as an
uninterrupted one, because everything that decides the next step is in the
checkpoint or derived from the step number:

- model, optimizer and LR scheduler (``spotguard.torch_state``);
- every rank's RNG (dropout here), saved per rank;
- the data each rank reads at a step, a pure function of (seed, step, rank).

Only spotguard's public API is used: ``Checkpointer.from_env``, ``restore``,
``should_save``, ``save``, ``preempted``, ``torch_state``.

Output (rank 0): ``resumed from step K exact=True|False resharded_from=W`` or
``starting from scratch``; ``step N loss X``; ``preempted after step N`` or
``finished N steps``; at the end ``final digest HEX`` (sha256 over model,
optimizer and every rank's RNG) so runs can be compared.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import spotguard
from spotguard.demo.common import DATASET_SIZE, StateDigest, add_training_options, classifier, make_problem, save_every


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="total training steps (default 300)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    add_training_options(p)
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args(argv)


def setup() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes: nccl on GPUs, gloo on CPUs."""
    if torch.cuda.is_available():
        # Deterministic cuBLAS (set before CUDA initializes).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        device = torch.device("cuda", local_rank)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    # Bit-identical results whatever the machine's core count.
    torch.set_num_threads(1)
    spotguard.deterministic()  # torch.use_deterministic_algorithms(True), without importing the compiler
    return dist.get_rank(), dist.get_world_size(), device


def batch_indices(seed: int, step: int, rank: int, batch_size: int) -> torch.Tensor:
    """The samples ``rank`` trains on at ``step``: a pure function of (seed, step, rank).

    No data-loader position needs saving; a resumed run reads exactly what
    the uninterrupted one read. (With another world size the ranks, and so
    the data, differ: that is the inexact part of resharding.)
    """
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 4099 + rank)
    return torch.randint(0, DATASET_SIZE, (batch_size,), generator=gen)


def build_model(hidden: int, seed: int) -> nn.Module:
    """The same initial weights on every rank (DDP also broadcasts rank 0's)."""
    torch.manual_seed(seed)
    model: nn.Module = classifier(hidden)
    return model


def parallelize(model: nn.Module, device: torch.device) -> nn.Module:
    """Data parallelism: DDP (every rank holds the whole model and optimizer).

    ``find_unused_parameters=True`` keeps DDP's gradient buckets as they are
    built here. By default DDP re-buckets after the first step of every
    (re)start; with more than two ranks another bucket layout sums the
    gradients in another order, and a resumed run would drift from an
    uninterrupted one in the last bits. (Torch then warns once per rank that
    no parameter was unused: expected.)

    A sharded wrapper (FSDP2's ``fully_shard``) works the same way with
    spotguard: torch_state/restore go through torch.distributed.checkpoint.
    """
    return DistributedDataParallel(
        model.to(device), device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=True
    )


def local_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> bytes:
    """sha256 of what this rank holds: parameters, optimizer state, RNG.

    Sharded tensors (DTensor) contribute their local shard, so the digests
    of all ranks together cover the whole state.
    """
    digest = StateDigest()
    digest.add_training(model, optimizer)
    digest.add("rng.torch", torch.get_rng_state())
    if torch.cuda.is_available():
        digest.add("rng.cuda", torch.cuda.get_rng_state())
    return digest.digest()


def global_digest(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> str:
    """sha256 over every rank's :func:`local_digest`, in rank order (collective)."""
    mine = torch.frombuffer(bytearray(local_digest(model, optimizer)), dtype=torch.uint8).to(device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return hashlib.sha256(b"".join(p.cpu().numpy().tobytes() for p in parts)).hexdigest()


def main(argv: list[str] | None = None) -> int:
    """Train; 0 also when preempted (the checkpoint is written)."""
    args = parse_args(argv)
    rank, _world, device = setup()
    try:
        return train(args, rank, device)
    finally:
        # The model is gone by now (train's locals): DDP's reducer must go before its process
        # group. Destroyed the other way round, the reducer's gloo work is torn down at
        # interpreter exit after the group was shut down, and the process sometimes aborts
        # there ("terminate called without an active exception") after training finished.
        gc.collect()
        dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int, device: torch.device) -> int:
    """The training loop: model, optimizer and data live (and die) here."""
    # Distributed because a process group is initialized: should_save and
    # preempted agree on every rank, save is collective.
    ckpt = spotguard.Checkpointer.from_env(save_every_steps=save_every(args))

    model = parallelize(build_model(args.hidden, args.seed), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
    x, y = make_problem(args.seed)
    x, y = x.to(device), y.to(device)
    # Each rank's own dropout stream on a fresh start; restore() puts back
    # every rank's saved RNG on a resume.
    torch.manual_seed(args.seed * 7919 + rank + 1)

    state = ckpt.restore(model, optimizer, scheduler)
    start = state.step + 1 if state is not None else 0
    if rank == 0:
        if state is None:
            print("starting from scratch", flush=True)
        else:
            print(
                f"resumed from step {state.step} exact={state.exact} resharded_from={state.resharded_from}", flush=True
            )

    loss_fn = nn.CrossEntropyLoss()
    model.train()
    step = start - 1
    preempted = False
    for step in range(start, args.steps):
        idx = batch_indices(args.seed, step, rank, args.batch_size).to(device)
        loss = loss_fn(model(x[idx]), y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
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
        if rank == 0:
            print(f"preempted after step {step}", flush=True)
        return 0
    if step >= 0:
        # The final state is a checkpoint too (a no-op when just saved).
        ckpt.save(step, spotguard.torch_state(model, optimizer, scheduler), blocking=True)
    ckpt.close()
    digest = global_digest(model, optimizer, device)
    if rank == 0:
        print(f"finished {args.steps} steps", flush=True)
        print(f"final digest {digest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
