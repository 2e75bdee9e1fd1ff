"""GPU check: spotguard on the GPUs of this machine, end to end.

    python -m bench.gpu_check [--quick] [--size-mib M] [--frozen-gib G] [--ranks R] [--only NAME,...]
                              [--allow-cpu] [--keep]

Checks, in order (R ranks: min(GPUs, 2) unless ``--ranks``):

- ``env``: torch, CUDA and NCCL versions, every GPU's name and memory.
- ``ddp``: ``spotguard run -- torchrun -m spotguard.demo.train_ddp`` (DDP over
  nccl) with ``file://`` storage; SIGTERM to the supervisor mid-run: exit
  143 with the stopped step verified in storage; the same command resumes
  and finishes; its final digest equals an uninterrupted run's.
- ``fsdp-stall``: the trainer's stall per checkpoint of FSDP2-sharded state,
  spotguard's save vs ``dcp.async_save`` (``bench/dist_worker.py stall``).
- ``fsdp-exact``: FSDP2 state saved by the Checkpointer and restored into a
  fresh FSDP2 model: every parameter shard and optimizer moment bitwise equal.
- ``pinned``: the Checkpointer's snapshot of a CUDA tensor goes to pinned
  host buffers, reused across saves; host-copy GB/s vs a plain ``.cpu()``.
- ``arena``: the Checkpointer's staging arena for a CUDA tensor's host
  buffers: moved into a memory file system after a routine save, the mapping
  page-locked (``cudaHostRegister``); the preemption's save links it, checked
  bitwise, and is timed beside the same save with the arena off
  (``bench/gpu_arena.py``).
- ``finetune``: a 7B model's LoRA fine-tune (``--frozen-gib`` of bfloat16
  weights, frozen, on the GPU) under ``spotguard run``: SIGTERM -> verified,
  the share of the state the emergency checkpoint uploads, a new node's
  restore from storage, and bit-exact continued training
  (``bench/gpu_finetune.py``).

Each check prints plain ``NAME: ...`` lines, then ``PASS NAME`` or
``FAIL NAME: why``; the last line is a JSON summary. Ratios and speeds are
figures, not pass/fail. Exit 0: every check passed; 1: a check failed;
2: usage or environment error (no CUDA without ``--allow-cpu``).
``--allow-cpu`` runs the same checks on CPU with gloo when CUDA is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu_arena import check_arena
from bench.gpu_common import ROOT, Check, CheckFailed, Child, Ctx, MiB, UsageError, child_env, median, run_child
from bench.gpu_finetune import GiB, check_finetune, frozen_default

CHECKS = ("env", "ddp", "fsdp-stall", "fsdp-exact", "pinned", "arena", "finetune")

STEP_RE = re.compile(r"^step (\d+) ")
RESUMED_RE = re.compile(r"resumed from step (\d+) exact=(True|False)")
DIGEST_RE = re.compile(r"final digest ([0-9a-f]{64})")
# A log line of another process may come glued after the step number.
STOPPED_RE = re.compile(r"preempted after step (\d+?)(?=\d{4}-\d\d-\d\d |\D|$)")
EMERGENCY_RE = re.compile(r"stage=emergency seconds=([0-9.]+) result=verified")


# -- env -----------------------------------------------------------------------------


def check_env(ctx: Ctx, c: Check) -> None:
    import torch
    import torch.distributed as dist

    c.say(f"python {sys.version.split()[0]}, torch {c.fig('torch', torch.__version__)}")
    c.say(f"CUDA runtime {c.fig('cuda', torch.version.cuda)}, cuda available: {torch.cuda.is_available()}")
    nccl: str | None = None
    if torch.cuda.is_available():
        try:
            version: Any = torch.cuda.nccl.version
            nccl = ".".join(str(v) for v in version())
        except Exception as exc:  # noqa: BLE001 - reported as missing
            c.say(f"NCCL version unknown: {exc}")
    c.say(f"NCCL {c.fig('nccl', nccl)}, nccl backend available: {dist.is_nccl_available()}")
    gpus = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(
            {
                "name": props.name,
                "total_gib": round(total / 2**30, 1),
                "free_gib": round(free / 2**30, 1),
                "capability": f"{props.major}.{props.minor}",
            }
        )
        c.say(
            f"GPU {i}: {props.name}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free), "
            f"compute capability {props.major}.{props.minor}"
        )
    c.fig("gpus", gpus)
    c.say(
        f"device {ctx.device}, backend {'nccl' if ctx.cuda else 'gloo'}, {ctx.ranks} rank(s), "
        f"size {ctx.size_mib} MiB, launcher {' '.join(Path(a).name for a in ctx.launcher)}"
    )
    c.fig("device", ctx.device)
    c.fig("ranks", ctx.ranks)
    if ctx.cuda and not dist.is_nccl_available():
        raise CheckFailed("CUDA is available but torch.distributed has no nccl backend")


# -- ddp: preemption and bit-exact resume -----------------------------------------------


def check_ddp(ctx: Ctx, c: Check) -> None:
    steps, save_every = (30, 10) if ctx.quick else (200, 25)
    # Slow enough that the SIGTERM lands mid-run even on a fast GPU.
    delay = "0.02" if ctx.cuda and not ctx.quick else "0.05"
    sigterm_at = steps // 3
    work = ctx.root / "ddp"
    work.mkdir()
    train = [
        "-m",
        "spotguard.demo.train_ddp",
        "--steps",
        str(steps),
        "--save-every",
        str(save_every),
        "--log-every",
        "1",
    ]
    env = child_env({"NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "VERSION")} if ctx.cuda else None)
    c.say(
        f"{ctx.ranks} rank(s), {'nccl' if ctx.cuda else 'gloo'}, {steps} steps, save every {save_every}, "
        f"SIGTERM after step {sigterm_at}"
    )

    t0 = time.monotonic()
    ref = run_child(
        [*ctx.torchrun(), *train, "--step-delay", "0"],
        {**env, "SPOTGUARD_CHECKPOINT_DIR": str(work / "reference-ckpt")},
        work / "reference.log",
        ctx.timeout,
    )
    found = ref.find(DIGEST_RE)
    if found is None:
        raise CheckFailed(f"the uninterrupted run printed no final digest:\n{ref.tail()}")
    reference = found[1].group(1)
    c.say(f"uninterrupted run: {time.monotonic() - t0:.1f}s, final digest {reference[:16]}...")
    if ctx.cuda:
        nccl_seen = any("NCCL version" in line for _, line in ref.lines)
        c.say(f"NCCL version line in the trainer's output: {'yes' if nccl_seen else 'no'}")
        c.fig("nccl_line_seen", nccl_seen)

    store = work / "store"
    run = [
        sys.executable,
        "-m",
        "spotguard.cli",
        "run",
        "--workdir",
        str(work / "run"),
        "--storage",
        f"file://{store}",
        "--max-restarts",
        "0",
        "--",
        *ctx.torchrun(),
        *train,
        "--step-delay",
        delay,
    ]
    first = Child(run, env, work / "preempted.log")
    try:
        first.wait_for(lambda ln: bool(STEP_RE.match(ln)) and int(ln.split()[1]) >= sigterm_at, ctx.timeout)
        sent = time.monotonic()
        first.popen.send_signal(signal.SIGTERM)
        rc = first.wait(ctx.timeout)
    finally:
        first.kill()
    c.say(f"supervisor exit status after SIGTERM: {c.fig('sigterm_exit', rc)} (expected 143)")
    if rc != 128 + signal.SIGTERM:
        raise CheckFailed(f"spotguard run exited {rc} after SIGTERM, not 143:\n{first.tail()}")
    stopped_m = first.find(STOPPED_RE)
    verified_m = first.find(EMERGENCY_RE)
    if stopped_m is None or verified_m is None:
        raise CheckFailed(f"no 'preempted after step' or emergency 'result=verified' line:\n{first.tail()}")
    stopped = int(stopped_m[1].group(1))
    to_line = c.fig("sigterm_to_verified_line_s", round(verified_m[0] - sent, 3))
    own = c.fig("emergency_s", float(verified_m[1].group(1)))
    c.say(
        f"preempted after step {stopped}; SIGTERM -> verified line {to_line:.2f}s "
        f"(the supervisor's own figure {own:.2f}s)"
    )

    from spotguard.checkpoint import latest_verified
    from spotguard.storage import open_storage

    info, _ = latest_verified(open_storage(f"file://{store}"))
    c.say(f"newest verified checkpoint in storage: {info.name if info else None}")
    if info is None or info.step != stopped:
        raise CheckFailed(f"storage's newest verified checkpoint is {info}, not step {stopped}")

    t0 = time.monotonic()
    again = run_child(run, env, work / "resumed.log", ctx.timeout)
    resumed = again.find(RESUMED_RE)
    digest = again.find(DIGEST_RE)
    if resumed is None or digest is None:
        raise CheckFailed(f"the second run printed no 'resumed from step' or no final digest:\n{again.tail()}")
    step, exact = int(resumed[1].group(1)), resumed[1].group(2) == "True"
    final = digest[1].group(1)
    c.say(
        f"resumed from step {step} exact={exact}, finished in {time.monotonic() - t0:.1f}s, "
        f"final digest {final[:16]}..."
    )
    c.fig("stopped_step", stopped)
    c.fig("resumed_step", step)
    same = c.fig("bit_exact", final == reference)
    c.say(f"final digest equals the uninterrupted run's: {'yes' if same else 'no'}")
    if step != stopped or not exact:
        raise CheckFailed(f"resumed from step {step} exact={exact}, expected step {stopped} exact=True")
    if not same:
        raise CheckFailed(f"final digest {final} differs from the uninterrupted run's {reference}")


# -- fsdp-stall: spotguard's save vs dcp.async_save -------------------------------------------


def check_fsdp_stall(ctx: Ctx, c: Check) -> None:
    work = ctx.root / "stall"
    work.mkdir()
    out = work / "result.json"
    argv = [
        *ctx.torchrun(),
        str(ROOT / "bench" / "dist_worker.py"),
        "stall",
        "--out",
        str(out),
        "--work",
        str(work),
        "--bytes",
        str(ctx.size_mib * MiB),
        "--rounds",
        str(ctx.rounds),
        "--device",
        ctx.device,
    ]
    run_child(argv, child_env(), work / "stall.log", ctx.timeout * 2)
    r = json.loads(out.read_text())
    sg, plain, asy = r["spotguard"], r["dcp.save"], r["dcp.async_save"]
    if not (len(sg) == len(plain) == len(asy) == ctx.rounds):
        raise CheckFailed(f"expected {ctx.rounds} rounds of each method, got {len(sg)}, {len(plain)}, {len(asy)}")
    vs_async = median([a / b for a, b in zip(sg, asy, strict=True)])
    vs_plain = median([a / b for a, b in zip(sg, plain, strict=True)])
    c.say(
        f"FSDP2 over {r['world_size']} rank(s), {ctx.size_mib} MiB of parameters + AdamW moments "
        f"({r['bytes_per_rank'] / MiB:.0f} MiB per rank), {ctx.rounds} rounds"
    )
    c.say(
        f"trainer stall per checkpoint (median, slowest rank): spotguard {median(sg):.3f}s, "
        f"dcp.async_save {median(asy):.3f}s, dcp.save {median(plain):.3f}s"
    )
    c.say(
        f"spotguard / dcp.async_save {vs_async:.2f}x, spotguard / dcp.save {vs_plain:.2f}x "
        "(median per-round ratio; below 1 is better)"
    )
    c.fig("spotguard_s", round(median(sg), 4))
    c.fig("dcp_async_save_s", round(median(asy), 4))
    c.fig("dcp_save_s", round(median(plain), 4))
    c.fig("vs_async", round(vs_async, 3))
    c.fig("vs_save", round(vs_plain, 3))


# -- fsdp-exact: save FSDP2 state, restore into a fresh model, compare bitwise -------------------------


def check_fsdp_exact(ctx: Ctx, c: Check) -> None:
    work = ctx.root / "exact"
    work.mkdir()
    argv = [
        *ctx.torchrun(),
        "-m",
        "bench.gpu_check",
        "--worker",
        "fsdp-exact",
        "--dir",
        str(work / "ckpt"),
        "--out",
        str(work),
        "--size-mib",
        str(ctx.size_mib),
        "--device",
        ctx.device,
    ]
    run_child(argv, child_env(), work / "exact.log", ctx.timeout)
    results = []
    for rank in range(ctx.ranks):
        path = work / f"rank-{rank}.json"
        if not path.exists():
            raise CheckFailed(f"rank {rank} wrote no result")
        results.append(json.loads(path.read_text()))
    for r in results:
        if r.get("error"):
            raise CheckFailed(f"rank {r['rank']}: {r['error']}")
    tensors = sum(r["tensors"] for r in results)
    nbytes = sum(r["bytes"] for r in results)
    stall = max(r["stall_s"] for r in results)
    c.say(
        f"saved step {results[0]['step']} of FSDP2 state over {ctx.ranks} rank(s): {tensors} local tensors, "
        f"{nbytes / MiB:.1f} MiB; save stall {stall:.3f}s"
    )
    c.fig("tensors", tensors)
    c.fig("bytes", nbytes)
    c.fig("save_stall_s", round(stall, 4))
    bad = [(r["rank"], n) for r in results for n in r["mismatched"] + r["missing"] + r["extra"]]
    changed = all(r["changed_before_restore"] for r in results)
    exact = all(r["exact"] for r in results)
    groups = all(r["groups_equal"] for r in results)
    c.say(
        f"fresh model differed before restore: {'yes' if changed else 'no'}; restored exact={exact}; "
        f"optimizer hyperparameters equal: {'yes' if groups else 'no'}"
    )
    c.say(
        f"parameters and optimizer moments bitwise equal after restore: {'yes' if not bad else 'no'}"
        f" ({tensors - len(bad)}/{tensors})"
    )
    c.fig("bitwise_equal", not bad)
    if not changed:
        raise CheckFailed("the fresh model equalled the saved one before the restore: the comparison proves nothing")
    if bad or not exact or not groups:
        raise CheckFailed(f"restore not bit-exact: exact={exact}, groups equal={groups}, differing: {bad[:10]}")


def _init_process_group(device: str) -> Any:
    import torch
    import torch.distributed as dist

    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
        return dev
    dist.init_process_group("gloo")
    return torch.device("cpu")


def _local_tensors(model: Any, opt: Any) -> dict[str, Any]:
    """This rank's shard of every parameter and optimizer state tensor, copied to CPU."""
    import torch

    def local(t: Any) -> Any:
        return (t.to_local() if hasattr(t, "to_local") else t).detach().cpu().clone()

    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"param.{n}": local(p) for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{names[id(p)]}.{key}"] = local(value)
    return out


def _bitwise_equal(a: Any, b: Any) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def fsdp_exact_worker(args: argparse.Namespace) -> int:
    """One torchrun rank of ``fsdp-exact``: writes ``rank-N.json`` into ``--out``."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import spotguard

    device = _init_process_group(args.device)
    rank = dist.get_rank()
    result: dict[str, Any] = {"rank": rank, "error": None}
    try:
        width = 1024
        layers = max(1, round(args.size_mib * MiB / 3 / (width * width * 4)))

        def build(seed: int) -> tuple[Any, Any]:
            torch.manual_seed(seed)
            # The last layer's 1001 rows do not split evenly: uneven shards too.
            model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)], nn.Linear(width, 1001))
            model = model.to(device)
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

        model, opt = build(0)
        torch.manual_seed(100 + rank)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, width, device=device)).square().mean().backward()
            opt.step()
        ckpt = spotguard.Checkpointer(args.dir, distributed=True, keep_local=1)
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.save(3, spotguard.torch_state(model, opt))
        result["stall_s"] = time.perf_counter() - t0
        ckpt.wait()
        error = ckpt.last_error
        ckpt.close()
        if error is not None:
            raise RuntimeError(f"the save failed: {error!r}")
        saved = _local_tensors(model, opt)
        groups = [repr({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups]

        fresh, fresh_opt = build(1)
        before = _local_tensors(fresh, fresh_opt)
        result["changed_before_restore"] = any(not _bitwise_equal(v, saved[k]) for k, v in before.items())
        reader = spotguard.Checkpointer(args.dir, distributed=True, keep_local=1)
        restored = reader.restore(fresh, fresh_opt)
        reader.close()
        if restored is None:
            raise RuntimeError("restore found no checkpoint")
        got = _local_tensors(fresh, fresh_opt)
        result.update(
            step=restored.step,
            exact=bool(restored.exact),
            tensors=len(saved),
            bytes=sum(t.numel() * t.element_size() for t in saved.values()),
            mismatched=sorted(k for k in saved.keys() & got.keys() if not _bitwise_equal(saved[k], got[k])),
            missing=sorted(saved.keys() - got.keys()),
            extra=sorted(got.keys() - saved.keys()),
            groups_equal=groups
            == [repr({k: v for k, v in g.items() if k != "params"}) for g in fresh_opt.param_groups],
        )
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0 if result["error"] is None else 1


# -- pinned: the snapshot's host buffers ------------------------------------------------------


def check_pinned(ctx: Ctx, c: Check) -> None:
    import torch

    import spotguard

    device = torch.device("cuda", 0) if ctx.cuda else torch.device("cpu")
    n = ctx.size_mib * MiB // 4
    nbytes = n * 4
    torch.manual_seed(0)
    t = torch.randn(n, device=device)
    state = {"model": {"weight": t}}

    def sync() -> None:
        if ctx.cuda:
            torch.cuda.synchronize()

    ckpt = spotguard.Checkpointer(ctx.root / "pinned", distributed=False, keep_local=1)
    try:
        ckpt.save(0, state)
        ckpt.wait()
        pool = getattr(ckpt, "_pinned", None)
        if not pool:
            raise CheckFailed("the Checkpointer kept no host buffers after a save (reuse_host_buffers)")
        # Pool keys: (index, dtype, shape, from a GPU tensor).
        bufs = {k: b for k, b in pool.items() if bool(k[3]) == ctx.cuda and tuple(k[2]) == (n,)}
        if not bufs:
            raise CheckFailed(f"no host buffer of the saved tensor's shape among {len(pool)} kept")
        pinned = all(b.is_pinned() for b in bufs.values())
        ptrs = {k: b.data_ptr() for k, b in bufs.items()}
        c.say(
            f"host buffers kept after a save: {len(pool)}; the {ctx.size_mib} MiB tensor's pinned: "
            f"{'yes' if pinned else 'no'}{'' if ctx.cuda else ' (CPU tensor: no pinning needed)'}"
        )
        c.fig("pinned", pinned)

        raw = torch.empty(n, pin_memory=True) if ctx.cuda else None
        sg, direct, plain = [], [], []
        for r in range(ctx.rounds):
            t.add_(1.0)  # changed: the snapshot copies it (an unchanged tensor is compared instead, below)
            sync()
            t0 = time.perf_counter()
            ckpt.save(r + 1, state)  # returns once the snapshot is in host memory
            sg.append(time.perf_counter() - t0)
            ckpt.wait()  # its write must not overlap the copies below
            if raw is not None:
                sync()
                t0 = time.perf_counter()
                raw.copy_(t, non_blocking=True)
                sync()
                direct.append(time.perf_counter() - t0)
            sync()
            t0 = time.perf_counter()
            copy = t.cpu() if ctx.cuda else t.clone()
            sync()
            plain.append(time.perf_counter() - t0)
            del copy
        if ckpt.last_error is not None:
            raise CheckFailed(f"a save failed: {ckpt.last_error!r}")
        reused = {k: b.data_ptr() for k, b in getattr(ckpt, "_pinned", {}).items() if k in ptrs} == ptrs
        host = next(iter(bufs.values()))
        matches = _bitwise_equal(host, t.cpu())
        # Unchanged since the last save: compared with its host copy on the tensor's device
        # (in slices), not copied, and its file linked from the previous checkpoint.
        sync()
        t0 = time.perf_counter()
        ckpt.save(ctx.rounds + 1, state)
        compared = time.perf_counter() - t0
        ckpt.wait()
        newest = max((ctx.root / "pinned").glob("ckpt-*"))
        kept = (newest / "model.kept.safetensors").is_file()
    finally:
        ckpt.close()

    def gbps(xs: list[float]) -> float:
        return nbytes / median(xs) / 1e9

    baseline = ".cpu()" if ctx.cuda else "clone()"
    c.say(
        f"same buffers reused by {ctx.rounds} more saves: {'yes' if reused else 'no'}; "
        f"host copy equals the tensor: {'yes' if matches else 'no'}"
    )
    c.say(
        f"host copy of {ctx.size_mib} MiB (median of {ctx.rounds}): Checkpointer.save {gbps(sg):.2f} GB/s, "
        f"plain {baseline} {gbps(plain):.2f} GB/s ({gbps(sg) / gbps(plain):.2f}x)"
        + (f", raw copy into a pinned buffer {gbps(direct):.2f} GB/s" if direct else "")
    )
    c.fig("save_gbps", round(gbps(sg), 3))
    c.fig("plain_gbps", round(gbps(plain), 3))
    if direct:
        c.fig("pinned_copy_gbps", round(gbps(direct), 3))
    c.fig("reused", reused)
    c.say(
        f"an unchanged {ctx.size_mib} MiB tensor: compared with its host copy at {nbytes / compared / 1e9:.2f} GB/s "
        f"(not copied), kept in the previous checkpoint's linked file: {'yes' if kept else 'no'}"
    )
    c.fig("unchanged_compare_gbps", round(nbytes / compared / 1e9, 3))
    c.fig("unchanged_kept", kept)
    if not kept:
        raise CheckFailed("an unchanged tensor was written again instead of kept (model.kept.safetensors)")
    if ctx.cuda and not pinned:
        raise CheckFailed("the snapshot of a CUDA tensor went to pageable host memory, not pinned")
    if not reused:
        raise CheckFailed("the host buffers were not reused by the next saves")
    if not matches:
        raise CheckFailed("the host copy differs from the tensor")


# -- main ----------------------------------------------------------------------------------


RUNNERS: dict[str, Callable[[Ctx, Check], None]] = {
    "env": check_env,
    "ddp": check_ddp,
    "fsdp-stall": check_fsdp_stall,
    "fsdp-exact": check_fsdp_exact,
    "pinned": check_pinned,
    "arena": check_arena,
    "finetune": check_finetune,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--allow-cpu", action="store_true", help="without CUDA, run the checks on CPU with gloo")
    p.add_argument("--quick", action="store_true", help="smallest sizes and fewest rounds")
    p.add_argument(
        "--size-mib",
        type=int,
        default=None,
        help="state size of the FSDP2 and pinned checks (default 512 on GPU, 64 on CPU; --quick: 128, 16)",
    )
    p.add_argument(
        "--frozen-gib",
        type=float,
        default=None,
        help="the finetune check's frozen base (default 14 on GPU: a 7B model in bfloat16; --quick: 1; CPU: 1/16)",
    )
    p.add_argument("--ranks", type=int, default=None, help="ranks of the distributed checks (default min(GPUs, 2))")
    p.add_argument("--only", default=None, help=f"comma-separated checks to run, of {','.join(CHECKS)}")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, checkpoints)")
    p.add_argument("--worker", choices=["fsdp-exact"], help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.size_mib is not None and args.size_mib < 1:
        p.error("--size-mib must be at least 1")
    if args.frozen_gib is not None and args.frozen_gib <= 0:
        p.error("--frozen-gib must be above 0")
    if args.ranks is not None and args.ranks < 1:
        p.error("--ranks must be at least 1")
    return args


def make_ctx(args: argparse.Namespace) -> Ctx:
    try:
        import torch
    except ImportError as exc:
        raise UsageError(f"torch is not installed ({exc}); install spotguard[torch]") from None

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        raise UsageError(
            "CUDA is not available (torch "
            f"{torch.__version__}); run on a GPU machine, or pass --allow-cpu to check on CPU"
        )
    gpus = torch.cuda.device_count() if cuda else 0
    ranks = args.ranks or (min(gpus, 2) if cuda else 2)
    if cuda and ranks > gpus:
        raise UsageError(f"--ranks {ranks}: only {gpus} GPU(s)")
    size = args.size_mib or ((128 if cuda else 16) if args.quick else (512 if cuda else 64))
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.is_file() else [sys.executable, "-m", "torch.distributed.run"]
    root = Path(tempfile.mkdtemp(prefix="spotguard-gpu-check-"))
    frozen = int(args.frozen_gib * GiB) if args.frozen_gib else frozen_default(cuda, args.quick)
    return Ctx(
        cuda=cuda, ranks=ranks, size_mib=size, quick=args.quick, root=root, launcher=launcher, frozen_bytes=frozen
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "fsdp-exact":
        return fsdp_exact_worker(args)
    names = list(CHECKS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in CHECKS]
        if unknown:
            print(f"error: unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}", file=sys.stderr)
            return 2
        if "env" not in names:
            names.insert(0, "env")
    started = time.monotonic()
    try:
        ctx = make_ctx(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        print(json.dumps({"ok": False, "error": str(exc)}), flush=True)
        return 2
    checks: list[Check] = []
    for name in names:
        c = Check(name)
        checks.append(c)
        t0 = time.monotonic()
        try:
            RUNNERS[name](ctx, c)
            c.ok = True
        except CheckFailed as exc:
            c.reason = str(exc)
        except Exception as exc:  # noqa: BLE001 - any error fails this check only
            c.reason = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        c.figures["seconds"] = round(time.monotonic() - t0, 1)
        print(f"PASS {name} ({c.figures['seconds']:.1f}s)" if c.ok else f"FAIL {name}: {c.reason}", flush=True)
    failed = [c.name for c in checks if not c.ok]
    total = time.monotonic() - started
    keep = args.keep or bool(failed)
    if keep:
        print(f"work directory kept: {ctx.root}", flush=True)
    else:
        shutil.rmtree(ctx.root, ignore_errors=True)
    print(f"{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'} in {total:.1f}s", flush=True)
    summary = {
        "ok": not failed,
        "failed": failed,
        "device": ctx.device,
        "ranks": ctx.ranks,
        "size_mib": ctx.size_mib,
        "frozen_bytes": ctx.frozen_bytes,
        "quick": ctx.quick,
        "seconds": round(total, 1),
        "checks": {c.name: {"ok": c.ok, "reason": c.reason, **c.figures} for c in checks},
    }
    print(json.dumps(summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
