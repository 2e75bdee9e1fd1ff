"""A sharded fine-tune's preemption at two sizes of frozen base: SIGTERM -> verified, 2 ranks.

The trainer is ``bench/dist_worker.py finetune --head-only``: FSDP2
(``fully_shard``) over 2 gloo ranks, a frozen base of Linear layers
(``requires_grad=False``) and a small head trained with AdamW, a step that
runs the head alone (its time does not grow with the base),
``Checkpointer.from_env()``, a checkpoint every few steps (the first three), under
``spotguard run`` with ``file://`` storage and every other setting the
default. Once the third routine checkpoint is verified, SIGTERM; measured:
until the supervisor's ``stage=verify`` line of the SIGTERM checkpoint.

Sizes: BENCH_DIST_FROZEN_GB (default ``0.25,2``: 256 MiB and 2 GiB), the
smallest the reference; the goal: the largest within 1.5x of it, worse
quartile of per-round ratios. BENCH_DIST_FROZEN_BEFORE: a checkout of the
code to compare with (e.g. ``git worktree add DIR <commit>``), run in the
same rounds (its ``spotguard`` on ``PYTHONPATH``, this checkout's worker).
Rounds: --rounds, else 4; sizes and code alternate which goes first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import (
    GiB,
    Section,
    fmt,
    goal,
    median,
    per_round,
    run_section_alone,
    run_under_spotguard,
    size_and_latency_cells,
    stage_line,
)
from bench.incremental import _is_stage, _Lines

if TYPE_CHECKING:
    from bench.common import Ctx

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "dist_worker.py"
SAVE_EVERY = 5
ROUTINE = 3  # routine checkpoints verified before SIGTERM
STAGES = ("save", "upload", "verify", "emergency")


@dataclass
class Run:
    to_verified: float
    stages: dict[str, float]


#: BENCH_DIST_FROZEN_LAYERS=N: a frozen base of N layers at every size (as wide as the bytes make them), instead
#: of layers of 4 MiB (512 per rank at 2 GiB): what grows with the bytes alone, apart from DCP's work per item.
LAYERS = int(os.environ.get("BENCH_DIST_FROZEN_LAYERS", "0"))


def _torchrun() -> list[str]:
    from bench.dist import _free_port

    torchrun = str(Path(sys.executable).parent / "torchrun")
    return [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]


def run_once(work: Path, frozen: int, code: Path) -> Run:
    """One fine-tune with ``frozen`` bytes of base, spotguard from ``code``, preempted after its routine checkpoints."""
    workdir = work / f"bench-dist-frozen-{uuid.uuid4().hex[:8]}"
    trainer = [*_torchrun(), str(WORKER), "finetune", "--bytes", str(frozen), "--save-every", str(SAVE_EVERY)]
    shape = ["--layers", str(LAYERS)] if LAYERS else []
    cmd, env = run_under_spotguard(workdir, code, [*trainer, "--head-only", "--routine", str(ROUTINE), *shape])
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = _Lines(proc)
    try:
        last = f"name=ckpt-{ROUTINE * SAVE_EVERY:012d}"
        out.wait_for(lambda line: _is_stage("verify")(line) and last in line, 0.0, 1200)
        time.sleep(0.5)  # a few more steps
        os.sync()  # nothing written before the signal is flushed on the clock
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        t_saved = out.wait_for(_is_stage("save"), t0, 600)
        saved = next(st for st in map(stage_line, out.since(t_saved)) if st is not None and st.stage == "save")
        name = f"name={saved.fields.get('name')} "
        t_verified = out.wait_for(lambda line: _is_stage("verify")(line) and name in line, t0, 600)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.join()
    stages: dict[str, float] = {}
    for line in out.since(t0):
        st = stage_line(line)
        if st is not None and st.stage in STAGES:
            stages[st.stage] = stages.get(st.stage, 0.0) + st.seconds
    for line in out.since(t0):
        if " preempted: state dicts " in line:
            print(f"     {line.strip()}", flush=True)  # the trainer's own part, per rank
    if "emergency" not in stages:
        raise RuntimeError(f"{frozen}: no verified SIGTERM checkpoint:\n" + "".join(out.since(t0))[-4000:])
    shutil.rmtree(workdir, ignore_errors=True)
    return Run(t_verified - t0, stages)


def bench_dist_frozen(ctx: Ctx) -> Section:
    sizes = [float(x) for x in os.environ.get("BENCH_DIST_FROZEN_GB", "0.25,2").split(",")]
    before = os.environ.get("BENCH_DIST_FROZEN_BEFORE")
    codes = {"this code": ROOT, **({"before": Path(before).resolve()} if before else {})}
    rounds = ctx.rounds_for(4)
    runs: dict[tuple[str, float], list[Run]] = {(c, gb): [] for c in codes for gb in sizes}
    for r in range(rounds):
        for code in codes if r % 2 == 0 else list(reversed(codes)):
            for gb in sizes if r % 2 == 0 else list(reversed(sizes)):
                run = run_once(ctx.work, int(gb * GiB), codes[code])
                runs[(code, gb)].append(run)
                print(
                    f"   {code} {gb:g} GiB round {r + 1}: SIGTERM -> verified {run.to_verified:.3f}s, "
                    f"stages { ({k: round(v, 3) for k, v in run.stages.items()}) }",
                    flush=True,
                )
    s = Section(
        "A sharded fine-tune's SIGTERM (FSDP2, 2 ranks): 256 MiB vs 2 GiB frozen",
        "dist-frozen",
        [
            "code",
            "frozen base",
            "SIGTERM -> verified (s, median, min-max)",
            f"vs {min(sizes) * 1024:g} MiB, per round [IQR]",
            " / ".join(STAGES) + " (s, medians)",
        ],
    )
    lo = min(sizes)
    for code in codes:
        for gb in sizes:
            rs = runs[(code, gb)]
            lat = [x.to_verified for x in rs]
            s.rows.append(
                [
                    code,
                    *size_and_latency_cells(gb, lo, lat, [x.to_verified for x in runs[(code, lo)]]),
                    " / ".join(fmt(median([x.stages.get(k, 0.0) for x in rs]), 3) for k in STAGES),
                ]
            )
    for gb in sizes:
        if gb == lo:
            continue
        growth = per_round(
            [x.to_verified for x in runs[("this code", gb)]],
            [x.to_verified for x in runs[("this code", lo)]],
            higher_is_better=False,
        )
        goal(
            s,
            f"FSDP2 fine-tune: SIGTERM -> verified at {gb:g} GiB frozen within 1.5x of {lo * 1024:g} MiB",
            growth,
            1.5,
        )
    s.notes.append(
        "`spotguard run -- torchrun --nproc-per-node 2 bench/dist_worker.py finetune --bytes B --head-only "
        f"--routine {ROUTINE}` (file:// storage, every default): FSDP2 over 2 gloo ranks, a frozen base of B "
        + (
            f"bytes ({LAYERS} Linear layers at every size), a head"
            if LAYERS
            else "bytes (Linear layers of 4 MiB), a head"
        )
        + " trained with AdamW, a step running the head alone; a checkpoint "
        f"every {SAVE_EVERY} steps "
        f"for the first {ROUTINE}; once the last is verified in storage, SIGTERM to the supervisor. "
        f"SIGTERM -> verified: until the supervisor's `stage=verify` line for the SIGTERM checkpoint. {rounds} "
        "rounds, sizes and code alternating which goes first."
        + (" `before`: the code of BENCH_DIST_FROZEN_BEFORE, in the same rounds." if before else "")
    )
    return s


def main() -> int:
    """Run the section alone: ``python -m bench.dist_frozen [rounds]``; prints its markdown."""
    return run_section_alone(bench_dist_frozen)


if __name__ == "__main__":
    sys.exit(main())
