"""The distributed benchmarks: flag agreement, sharded-save stall, SIGTERM -> globally verified.

Each runs ``bench/dist_worker.py`` under ``torchrun`` (gloo on CPU); the
SIGTERM benchmark under ``spotguard run`` as a user would. Figures are
ratios against a baseline measured in the same run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING, Any

from bench.common import MiB, Section, Spread, fmt, goal, median, parse_stage_lines, per_round

if TYPE_CHECKING:
    from bench.common import Ctx

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "dist_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(nproc: int) -> list[str]:
    return [
        str(Path(sys.executable).parent / "torchrun"),
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _worker(ctx: Ctx, nproc: int, mode: str, *extra: str) -> dict[str, Any]:
    out = ctx.work / f"dist-{mode}-{uuid.uuid4().hex[:6]}.json"
    cmd = [*_torchrun(nproc), str(WORKER), mode, "--out", str(out), "--work", str(ctx.work), *extra]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return dict(json.loads(out.read_text()))


def bench_flags(ctx: Ctx) -> Section:
    reps = ctx.rounds_for(3)
    rows: list[list[str]] = []
    s = Section(
        "Flag agreement per step (distributed)",
        "flags",
        [
            "ranks",
            "should_save (us, mean per step)",
            "blocking gloo all_reduce (us, mean per step)",
            "training step (ms, median)",
            "should_save / step, per round [IQR]",
            "blocking all_reduce / step, per round [IQR]",
        ],
    )
    for nproc in (2, 4):
        agree, bare, step, shares, bare_shares = [], [], [], [], []
        for _ in range(reps):
            r = _worker(ctx, nproc, "flags")
            # Means, not medians: most calls between exchanges cost next to nothing, the
            # exchanging ones more, and what a step pays is their average.
            a, b, st = fmean(r["agree_seconds"]), fmean(r["bare_seconds"]), median(r["step_seconds"])
            agree.append(a)
            bare.append(b)
            step.append(st)
            shares.append(100 * a / st)
            bare_shares.append(100 * b / st)
        share = Spread.of(shares, higher_is_better=False)
        rows.append(
            [
                str(nproc),
                fmt(median(agree) * 1e6, 0),
                fmt(median(bare) * 1e6, 0),
                fmt(median(step) * 1e3, 2),
                share.cell("%", 1),
                Spread.of(bare_shares, higher_is_better=False).cell("%", 1),
            ]
        )
        goal(s, f"should_save at most 5% of a DDP step ({nproc} ranks)", share, 5.0, suffix="%")
        ctx.costs[f"flags_us_{nproc}"] = median(agree) * 1e6
    s.rows += rows
    s.notes.append(
        "Under torch.distributed `should_save(step)` agrees on five numbers (preempt, save now, earliest "
        "deadline, time interval due, the next exchange period) with an all-reduce (MAX) on a gloo group of its "
        "own, so every rank answers the same; the all-reduce is issued without waiting (`async_op=True`) and its "
        "answer applied at the next exchange, so it overlaps the steps between. Exchanges are spaced to about "
        "100 ms of steps, at most 16 steps (every step when a step is longer), the same calls on every rank, "
        "so a flag acts 1 to 2 periods after a rank saw it. Baseline: one training step of a small DDP model "
        "(256-256-10 MLP, batch 32, SGD, gloo on CPU) in the same processes; "
        f"{reps} runs of 300 steps each: median step, mean `should_save` per step (exchanging calls and the "
        "others averaged). The blocking all_reduce of the "
        "same four numbers on another gloo group, timed in the same steps (alternating which goes first), is "
        "what an agreement that waits at every step costs (spotguard's `should_save` did that before): it "
        "meets the ranks' skew and a round trip."
    )
    return s


def bench_dist_stall(ctx: Ctx) -> Section:
    reps = ctx.rounds_for(5)
    nbytes = int(os.environ.get("BENCH_DIST_STATE_MB", "256")) * MiB
    r = _worker(ctx, 2, "stall", "--bytes", str(nbytes), "--rounds", str(reps))
    sg, plain, asy = r["spotguard"], r["dcp.save"], r["dcp.async_save"]
    vs_async = per_round(sg, asy, higher_is_better=False)
    vs_plain = per_round(sg, plain, higher_is_better=False)
    s = Section(
        "Trainer stall per checkpoint of sharded state (FSDP2, 2 ranks)",
        "dist-stall",
        ["method", "trainer blocked (s, median of slowest rank)", "spotguard / method, per round [IQR]"],
    )
    s.rows += [
        [
            "spotguard two-phase save (stage to host, DCP write + checksums + part manifest in background)",
            fmt(median(sg), 3),
            "1.0x",
        ],
        ["dcp.save (blocking)", fmt(median(plain), 3), vs_plain.cell()],
        ["dcp.async_save (stages, then writes in the background)", fmt(median(asy), 3), vs_async.cell()],
    ]
    goal(s, "spotguard's stall at most dcp.async_save's", vs_async, 1.0)
    s.notes.append(
        f"FSDP2 (`fully_shard`) over 2 gloo ranks on CPU, parameters and AdamW moments "
        f"{nbytes / MiB:.0f} MiB in all ({r['bytes_per_rank'] / MiB:.0f} MiB per rank); {reps} interleaved "
        "rounds after a warm-up of each. The stall is the wall time of the call on the slowest rank "
        "(spotguard: `save()` including `torch_state`; DCP: `get_state_dict` + the call). spotguard's "
        "background work also checksums every file and commits the node's part manifest, which the "
        "uploader verifies in storage; `dcp.async_save` writes files and nothing else."
    )
    ctx.costs["dist_stall_sg"] = median(sg)
    return s


def _sigterm_once(ctx: Ctx, nproc: int, nbytes: int) -> tuple[float, int, dict[str, float], float]:
    from spotguard.checkpoint import latest_verified

    assert ctx.s3 is not None
    prefix = f"bench-dist-sigterm-{uuid.uuid4().hex[:8]}"
    workdir = ctx.work / prefix
    spotguard_bin = Path(sys.executable).parent / "spotguard"
    proc = subprocess.Popen(
        [
            str(spotguard_bin),
            "run",
            "--storage",
            f"s3://{ctx.s3.bucket}/{prefix}",
            "--workdir",
            str(workdir),
            "--grace-seconds",
            "600",
            "--no-incremental",  # whole files, against a raw upload of the same bytes
            "--",
            *_torchrun(nproc),
            str(WORKER),
            "sigterm",
            "--bytes",
            str(nbytes),
        ],
        env={**_env(), **ctx.s3.env()},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip().endswith("ready"):
            break
    else:
        raise RuntimeError("workers never became ready:\n" + "".join(lines[-20:]))
    time.sleep(1.0)
    os.sync()
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=900)
    latency = time.perf_counter() - t0
    storage = ctx.storage(prefix)
    info, _ = latest_verified(storage)
    if info is None:
        raise RuntimeError("no verified checkpoint after SIGTERM:\n" + rest[-3000:])
    # Baseline: the project's concurrent multipart upload of the same files, nothing else.
    from spotguard.checkpoint import restore_checkpoint

    copy = Path(restore_checkpoint(storage, info.name, workdir / "copy").uri)
    files = sorted(p for p in copy.rglob("*") if p.is_file() and p.name != "manifest.json")
    raw_storage = ctx.storage(f"{prefix}-raw")
    os.sync()
    t1 = time.perf_counter()
    raw_storage.upload_files([(p, f"x/{p.relative_to(copy)}") for p in files])
    raw = time.perf_counter() - t1
    for store, pre in ((storage, ""), (raw_storage, "")):
        keys = [o.key for o in store.list_objects(pre)]
        if keys:
            store.delete(keys)
    return latency, proc.returncode, parse_stage_lines(rest), raw


def bench_dist_sigterm(ctx: Ctx) -> Section:
    reps = ctx.rounds_for(3)
    nbytes = int(float(os.environ.get("BENCH_DIST_SIGTERM_GB", "0.5")) * 1024 * MiB)
    s = Section(
        "SIGTERM to a globally verified checkpoint (torchrun under spotguard run)",
        "dist-sigterm",
        [
            "ranks",
            "SIGTERM -> globally verified (s)",
            "raw upload of the same bytes (s)",
            "ratio, per round [IQR]",
            "exit codes",
        ],
    )
    stage_rows: list[str] = []
    for nproc in (2, 4):
        lat, raws, codes, stages_all = [], [], set(), []
        for r in range(reps):
            latency, rc, stages, raw = _sigterm_once(ctx, nproc, nbytes)
            lat.append(latency)
            raws.append(raw)
            codes.add(str(rc))
            stages_all.append(stages)
            print(
                f"   {nproc} ranks round {r + 1}: SIGTERM -> verified {latency:.2f}s, raw {raw:.2f}s, stages {stages}",
                flush=True,
            )
        ratio = per_round(lat, raws, higher_is_better=False)
        s.rows.append([str(nproc), fmt(median(lat)), fmt(median(raws)), ratio.cell(), ",".join(sorted(codes))])
        ctx.costs[f"dist_sigterm_{nproc}"] = median(lat)
        keys = ["save", "upload", "verify", "pointer", "emergency"]
        stage_rows.append(
            f"| {nproc} | " + " | ".join(f"{median([st.get(k, 0.0) for st in stages_all]):.2f}" for k in keys) + " |"
        )
    s.notes.append(
        f"`spotguard run -- torchrun --nproc-per-node N bench/dist_worker.py sigterm`: an FSDP2-sharded "
        f"state of {nbytes / MiB:.0f} MiB (parameters + AdamW moments) over N gloo ranks; SIGTERM to the "
        "supervisor reaches every rank through torchrun, all ranks save the same step (synchronous "
        "emergency save), the supervisor uploads the node's part, verifies it, writes the global manifest "
        "and moves the pointer, then exits 143. Baseline: the same files uploaded with the project's "
        f"concurrent multipart upload and nothing else. {reps} rounds per rank count."
    )
    s.notes.append(
        "Median seconds per stage from the supervisor's `stage=<name> seconds=<s>` lines "
        "(`save` is the ranks' emergency save as the supervisor waits for it, `emergency` the whole "
        "path):\n\n| ranks | save | upload | verify | pointer | emergency |\n|---|---|---|---|---|---|\n"
        + "\n".join(stage_rows)
    )
    return s


# --- FSDP2 fine-tune, stored incrementally ------------------------------------------------------

FINE_TUNE_SAVE_EVERY = 3
FINE_TUNE_MODES = {"incremental": "incremental (the default)", "plain": "plain (--no-incremental)"}


def _fine_tune_once(ctx: Ctx, mode: str, nbytes: int) -> tuple[float, int, int, int, dict[str, float]]:
    """One run: two routine checkpoints verified, then SIGTERM. SIGTERM -> globally verified
    seconds, exit code, bytes the SIGTERM checkpoint added to the store, the state's bytes,
    the supervisor's stage seconds."""
    from spotguard.checkpoint import latest_verified, list_checkpoint_names, verify_checkpoint

    assert ctx.s3 is not None
    prefix = f"bench-dist-finetune-{uuid.uuid4().hex[:8]}"
    storage = ctx.storage(prefix)
    cmd = [
        str(Path(sys.executable).parent / "spotguard"),
        "run",
        "--storage",
        f"s3://{ctx.s3.bucket}/{prefix}",
        "--workdir",
        str(ctx.work / prefix),
        "--grace-seconds",
        "600",
        "--incremental" if mode == "incremental" else "--no-incremental",
        "--",
        *_torchrun(2),
        str(WORKER),
        "finetune",
        "--bytes",
        str(nbytes),
        "--save-every",
        str(FINE_TUNE_SAVE_EVERY),
    ]
    proc = subprocess.Popen(
        cmd, env={**_env(), **ctx.s3.env()}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    second = 2 * FINE_TUNE_SAVE_EVERY
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip().endswith(f"saved {second}"):
            break
    else:
        raise RuntimeError("the fine-tune never saved twice:\n" + "".join(lines[-20:]))
    deadline = time.monotonic() + 600
    while (info := latest_verified(storage)[0]) is None or info.step < second:
        if time.monotonic() > deadline:
            raise RuntimeError("the second checkpoint never verified:\n" + "".join(lines[-20:]))
        time.sleep(0.2)
    os.sync()
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=900)
    latency = time.perf_counter() - t0
    seen: set[str] = set()
    added, total = 0, 0
    for name in list_checkpoint_names(storage):
        verdict = verify_checkpoint(storage, name, quiet=True)
        if not verdict.ok or verdict.manifest is None:
            continue
        m = verdict.manifest
        refs = m.chunk_refs()
        total = m.total_size
        added = sum(r.size for d, r in refs.items() if d not in seen) if m.chunked else total
        seen |= refs.keys()
    keys = [o.key for o in storage.list_objects("")]
    if keys:
        storage.delete(keys)
    return latency, proc.returncode, added, total, parse_stage_lines(rest)


def bench_dist_fine_tune(ctx: Ctx) -> Section:
    reps = ctx.rounds_for(3)
    nbytes = int(float(os.environ.get("BENCH_DIST_FINETUNE_GB", "0.5")) * 1024 * MiB)
    s = Section(
        "FSDP2 fine-tune stored incrementally (torchrun under spotguard run, 2 ranks)",
        "dist-finetune",
        [
            "mode",
            "state (MiB)",
            "stored by the SIGTERM checkpoint (MiB)",
            "share of the state, per round [IQR]",
            "SIGTERM -> globally verified (s, median)",
            "incremental / plain, per round [IQR]",
            "save / upload / verify (s)",
        ],
    )
    runs: dict[str, list[tuple[float, int, int, int, dict[str, float]]]] = {m: [] for m in FINE_TUNE_MODES}
    for r in range(reps):
        for mode in FINE_TUNE_MODES if r % 2 == 0 else reversed(FINE_TUNE_MODES):
            run = _fine_tune_once(ctx, mode, nbytes)
            runs[mode].append(run)
            print(f"   {mode} round {r + 1}: SIGTERM -> verified {run[0]:.2f}s, added {run[2]} of {run[3]} bytes")
    shares: dict[str, Spread] = {}
    for mode, label in FINE_TUNE_MODES.items():
        rr = runs[mode]
        shares[mode] = Spread.of([100.0 * a / t for _, _, a, t, _ in rr], higher_is_better=False)
        ratio = per_round([x[0] for x in rr], [x[0] for x in runs["plain"]], higher_is_better=False)
        stages = " / ".join(f"{median([x[4].get(k, 0.0) for x in rr]):.2f}" for k in ("save", "upload", "verify"))
        s.rows.append(
            [
                label,
                f"{median([x[3] for x in rr]) / MiB:.0f}",
                f"{median([x[2] for x in rr]) / MiB:.1f}",
                shares[mode].cell("%", 1),
                fmt(median([x[0] for x in rr])),
                "1.00x" if mode == "plain" else ratio.cell(),
                stages,
            ]
        )
    goal(
        s,
        "FSDP2 fine-tune: a checkpoint after the first stores < 5% of the state",
        shares["incremental"],
        5.0,
        suffix="%",
    )
    exits = sorted({str(x[1]) for rr in runs.values() for x in rr})
    s.notes.append(
        f"`spotguard run -- torchrun --nproc-per-node 2 bench/dist_worker.py finetune`: FSDP2 (`fully_shard`) "
        f"over 2 gloo ranks, a frozen base of {nbytes / MiB:.0f} MiB (Linear layers, `requires_grad=False`) "
        f"and a trained head with AdamW; a checkpoint every {FINE_TUNE_SAVE_EVERY} steps; SIGTERM once the "
        "second is verified in storage, so the SIGTERM checkpoint follows others, as in a training run. "
        "Stored: the chunks the SIGTERM checkpoint's manifest names that no earlier checkpoint named (plain: "
        f"every byte). {reps} rounds, the modes alternating which goes first; exit codes {', '.join(exits)}. "
        "Bit-exact resume after three SIGTERMs is `tests/integration/test_run_torchrun.py::"
        "test_fsdp2_fine_tune_stored_incrementally_resumes_bit_identical` (part of `make test`)."
    )
    return s
