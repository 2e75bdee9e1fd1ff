"""One torchrun worker of the distributed benchmarks (``bench.dist``).

    torchrun --nproc-per-node N bench/dist_worker.py flags  --out result.json
    torchrun --nproc-per-node N bench/dist_worker.py stall  --out result.json --bytes B --rounds R [--device cuda]
    spotguard run ... -- torchrun --nproc-per-node N bench/dist_worker.py sigterm --bytes B
    spotguard run ... -- torchrun --nproc-per-node N bench/dist_worker.py finetune --bytes B --save-every S \
        [--head-only] [--routine N]

``flags``: the per-step cost of the Checkpointer's flag agreement (an
all-reduce issued in ``should_save`` and waited for at the next one) next to
a small DDP model's training step and a blocking all-reduce of the same flags.
``stall``: how long the trainer is blocked per checkpoint of FSDP2-sharded
state: spotguard's two-phase save, ``dcp.save`` and ``dcp.async_save``, in
interleaved rounds; the slowest rank's time counts (the next step waits for it).
``sigterm``: steps until preempted, for the SIGTERM -> globally verified timing.
``finetune``: an FSDP2 fine-tune (a frozen base of B bytes, a small trained
head) that checkpoints every S steps until preempted; rank 0 prints ``saved N``.
Rank 0 writes the results as JSON.

``--device cuda`` (``stall`` and ``sigterm``): the sharded state lives on each
rank's GPU (``LOCAL_RANK``) and the process group is nccl; the default is
gloo on CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: BENCH_DIST_PROFILE=PREFIX: ``finetune --routine N``: a preemption's save runs under cProfile on each rank,
#: its statistics written to PREFIX.<bytes>.<rank>.<step> (routine saves are not profiled).
PROFILE = os.environ.get("BENCH_DIST_PROFILE", "")


def _gather_max(value: float, device: str = "cpu") -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _device(device: str) -> Any:
    """``cpu``, or this rank's GPU for ``cuda``."""
    import torch

    if device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _sharded_state(total_bytes: int, device: str = "cpu") -> tuple[Any, Any]:
    """An FSDP2-sharded stack of Linear layers and AdamW after one step:
    parameters + two moments ~= ``total_bytes`` over all ranks."""
    import torch
    from torch.distributed.fsdp import fully_shard

    width = 1024
    layers = max(1, round(total_bytes / 3 / (width * width * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    if device != "cpu":
        model = model.to(_device(device))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width, device=_device(device))).sum().backward()
    opt.step()
    return model, opt


def _fine_tune_state(frozen_bytes: int, head_only: bool = False, layers: int = 0) -> tuple[Any, Any]:
    """FSDP2: frozen Linear layers of ``frozen_bytes`` in all (``requires_grad=False``, the same
    values in every run) and a small trained head, AdamW over the head. ``head_only``: a step
    runs the head alone (on features the base would give), so its time does not grow with the base.
    ``layers``: that many square layers, as wide as the bytes make them; else layers of 4 MiB."""
    import torch
    from torch.distributed.fsdp import fully_shard

    class HeadOnly(torch.nn.Sequential):
        def forward(self, x: Any) -> Any:
            return self[-1](x)

    if layers:
        width = max(16, math.isqrt(frozen_bytes // (layers * 4)))
    else:
        width = 1024
        layers = max(1, round(frozen_bytes / (width * width * 4)))
    torch.manual_seed(0)
    kind = HeadOnly if head_only else torch.nn.Sequential
    model = kind(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    model.append(torch.nn.Linear(width, 16))
    for layer in list(model)[:-1]:
        layer.weight.requires_grad_(False)
    for layer in model:
        fully_shard(layer)
    if not head_only:
        # A root unit over the base runs its hooks over every layer at each step (at 2 GiB, 512
        # layers: 48 ms a step against 7 ms without it): the step would grow with the base after all.
        fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, opt


def run_finetune(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import spotguard

    model, opt = _fine_tune_state(args.bytes, args.head_only, args.layers)
    # --routine N: the first N checkpoints every S steps, then only when asked (a preemption).
    every = args.save_every if not args.routine else 10**9
    ckpt = spotguard.Checkpointer.from_env(save_every_steps=every)
    x = torch.randn(8, model[-1].in_features, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    step = 0
    while True:
        step += 1
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        routine = bool(args.routine) and step % args.save_every == 0 and step <= args.routine * args.save_every
        if ckpt.should_save(step) or routine:
            if PROFILE and args.routine and step > args.routine * args.save_every:
                from bench.common import profiled

                save = functools.partial(ckpt.save, step, spotguard.torch_state(model, opt))
                profiled(save, f"{PROFILE}.{args.bytes}.{dist.get_rank()}.{step}")
            else:
                t0 = time.perf_counter()
                state = spotguard.torch_state(model, opt)
                t1 = time.perf_counter()
                ckpt.save(step, state)
                if ckpt.preempted:
                    t2 = time.perf_counter()
                    rank = dist.get_rank()
                    print(f"rank {rank} preempted: state dicts {t1 - t0:.4f}s, save {t2 - t1:.4f}s", flush=True)
            if dist.get_rank() == 0:
                print(f"saved {step}", flush=True)
        if ckpt.preempted:
            return 0
        time.sleep(0.05)


def run_flags(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spotguard

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
    work = Path(args.work) / f"flags-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    ckpt = spotguard.Checkpointer(work, save_every_steps=10**9, keep_local=1)
    if not ckpt.distributed:
        raise SystemExit("the Checkpointer did not go distributed under torchrun")

    def train_step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(20):  # warm-up
        train_step()
        ckpt.should_save(1)
    group = dist.new_group(backend="gloo")
    flags = torch.zeros(4, dtype=torch.float64)
    steps, agree, bare = [], [], []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        train_step()
        t1 = time.perf_counter()
        if step % 2:  # alternate which one follows the step (and meets the ranks' skew)
            ckpt.should_save(step)
            t2 = time.perf_counter()
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            t3 = time.perf_counter()
            agree.append(t2 - t1)
            bare.append(t3 - t2)
        else:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            t2 = time.perf_counter()
            ckpt.should_save(step)
            t3 = time.perf_counter()
            bare.append(t2 - t1)
            agree.append(t3 - t2)
        steps.append(t1 - t0)
    ckpt.close()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(work, ignore_errors=True)
    return {"step_seconds": steps, "agree_seconds": agree, "bare_seconds": bare, "world_size": dist.get_world_size()}


def run_stall(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import spotguard

    model, opt = _sharded_state(args.bytes, args.device)
    work = Path(args.work)
    rank = dist.get_rank()
    ckpt = spotguard.Checkpointer(work / "spotguard", async_save=True, keep_local=1, distributed=True)
    if not ckpt.distributed:
        raise SystemExit("the Checkpointer did not go distributed under torchrun")
    ckpt.save(0, spotguard.torch_state(model, opt))  # warm-up: allocates the reusable host buffers
    ckpt.wait()
    step = 0

    def sg() -> float:
        nonlocal step
        step += 1
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.save(step, spotguard.torch_state(model, opt))
        stall = time.perf_counter() - t0
        ckpt.wait()
        dist.barrier()
        return _gather_max(stall, args.device)

    def plain(n: int) -> float:
        target = work / f"dcp-save-{n}"
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(target))
        stall = time.perf_counter() - t0
        dist.barrier()
        if rank == 0:
            shutil.rmtree(target, ignore_errors=True)
        return _gather_max(stall, args.device)

    group = dist.new_group(backend="gloo")  # async_save persists on its own group, as the docs advise

    def asynchronous(n: int) -> float:
        target = work / f"dcp-async-{n}"
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        fut = dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=str(target), process_group=group)
        stall = time.perf_counter() - t0
        fut.result()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(target, ignore_errors=True)
        return _gather_max(stall, args.device)

    asynchronous(-1)  # warm-up of torch's staging too
    out: dict[str, list[float]] = {"spotguard": [], "dcp.save": [], "dcp.async_save": []}
    methods = {"spotguard": lambda n: sg(), "dcp.save": plain, "dcp.async_save": asynchronous}
    names = list(methods)
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(methods[name](r))
    ckpt.close()
    nbytes = sum(p.to_local().numel() * 4 * 3 for p in model.parameters())
    return {**out, "world_size": dist.get_world_size(), "bytes_per_rank": _gather_max(float(nbytes), args.device)}


def run_sigterm(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    import spotguard

    model, opt = _sharded_state(args.bytes, args.device)  # each rank holds its shard
    ckpt = spotguard.Checkpointer.from_env(save_every_steps=10**9)
    step = 0
    if dist.get_rank() == 0:
        print("ready", flush=True)
    while True:
        step += 1
        for p in model.parameters():
            p.data.to_local()[:1].add_(1.0)
        if ckpt.should_save(step):
            ckpt.save(step, spotguard.torch_state(model, opt))
        if ckpt.preempted:
            return 0
        time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["flags", "stall", "sigterm", "finetune"])
    p.add_argument("--out", type=Path)
    p.add_argument("--bytes", type=int, default=256 << 20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--head-only", action="store_true", help="finetune: a step runs the trained head alone")
    p.add_argument("--layers", type=int, default=0, help="finetune: this many frozen layers (else 4 MiB each)")
    p.add_argument("--routine", type=int, default=0, help="finetune: routine checkpoints before only preemptions")
    p.add_argument("--work", default=tempfile.gettempdir())
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the sharded state lives (stall, sigterm); cuda: nccl, one GPU per rank",
    )
    args = p.parse_args()
    if args.device == "cuda" and args.mode == "flags":
        p.error("--device cuda: only the stall and sigterm modes")

    import torch.distributed as dist

    if args.device == "cuda":
        import torch

        device = _device(args.device)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    try:
        if args.mode == "sigterm":
            return run_sigterm(args)
        if args.mode == "finetune":
            return run_finetune(args)
        result = run_flags(args) if args.mode == "flags" else run_stall(args)
        if dist.get_rank() == 0 and args.out is not None:
            args.out.write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
