"""A fine-tune's preemption as a user's script meets it: SIGTERM -> verified at two sizes of frozen base.

The trainer (bench/linear_finetune_worker.py) is a fine-tune written the
plain way: a frozen ``nn.Linear(D, D)`` base (one large tensor), a small
adapter trained with AdamW, ``Checkpointer.from_env()``, a checkpoint every
10 steps, under ``spotguard run`` with ``file://`` storage and every other
setting the default. After four routine checkpoints (the last one verified
in storage), SIGTERM. The same with bench/incremental_worker.py's base
(float32 tensors of 64 MiB: the incremental benchmark's fine-tune shape),
and with the ``nn.Linear`` base run by every step (a LoRA's step reads the
whole base, forward and backward: a preemption waits for the step in
progress, which grows with the base; reported, not judged).

Sizes: BENCH_FINETUNE_SIGTERM_GB (default ``0.0625,2``: 64 MiB and 2 GiB),
the smallest the reference; the goal: the largest within 1.5x of it, worse
quartile of per-round ratios. Rounds: --rounds, else 5; sizes alternate
which goes first from round to round.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import (
    CpuWatch,
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
from bench.linear_finetune_worker import ROUTINE

if TYPE_CHECKING:
    from bench.common import Ctx

ROOT = Path(__file__).resolve().parent.parent
SAVE_EVERY = 10
#: Seconds between the last routine checkpoint's verification and SIGTERM (BENCH_FINETUNE_SIGTERM_PAUSE).
PAUSE = float(os.environ.get("BENCH_FINETUNE_SIGTERM_PAUSE", "0.5"))
#: BENCH_FINETUNE_SIGTERM_KEEP_SAVING=1: the trainer goes on checkpointing every SAVE_EVERY steps, so that
#: SIGTERM comes while a routine checkpoint is uploaded or verified (the script as users write it).
KEEP_SAVING = os.environ.get("BENCH_FINETUNE_SIGTERM_KEEP_SAVING", "") == "1"
#: BENCH_FINETUNE_SIGTERM_SHAPES: the trainers to run (default: all of SHAPES).
ONLY = [x for x in os.environ.get("BENCH_FINETUNE_SIGTERM_SHAPES", "").split(",") if x]
#: Trainers: (--shape, whether a step runs the base) -> label.
SHAPES = {
    "linear": "one nn.Linear(D, D)",
    "tensors": "float32 tensors of 64 MiB",
    "linear-forward": "one nn.Linear(D, D), run by every step",
}
_STEP = re.compile(r"^step ([0-9.]+)s")
_TRAINER_SAVE = re.compile(r"^preempted after step \d+: save ([0-9.]+)s")
#: The stages of the emergency path that the report shows, in order.
STAGES = ("save", "upload", "verify", "emergency")


@dataclass
class Run:
    """One ``spotguard run`` preempted by SIGTERM."""

    to_verified: float  # SIGTERM -> the supervisor's stage=verify line of the SIGTERM checkpoint
    stages: dict[str, float]
    trainer_save: float = float("nan")  # the trainer's own ckpt.save() of the preemption, seconds
    step: float = float("nan")  # one training step, seconds (the trainer's first, timed)
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds from SIGTERM to verified, per process
    fields: dict[str, str] = field(default_factory=dict)


def run_once(work: Path, shape: str, frozen: int) -> Run:
    """One trainer of ``shape`` with ``frozen`` bytes of base, preempted once its routine checkpoints are verified."""
    workdir = work / f"bench-ft-sigterm-{uuid.uuid4().hex[:8]}"
    trainer = [sys.executable, "-m", "bench.linear_finetune_worker", "--frozen-bytes", str(frozen)]
    trainer += ["--shape", shape.removesuffix("-forward"), "--save-every", str(SAVE_EVERY)]
    cmd, env = run_under_spotguard(workdir, ROOT, trainer)
    if shape.endswith("-forward"):
        cmd.append("--forward")
    if KEEP_SAVING:
        cmd.append("--keep-saving")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = _Lines(proc)
    try:
        t_ready = out.wait_for(lambda line: line.strip() == "ready", 0.0, 900)
        last = f"name=ckpt-{ROUTINE * SAVE_EVERY:012d}"
        out.wait_for(lambda line: _is_stage("pointer")(line) and last in line, t_ready, 900)
        time.sleep(PAUSE)  # a few more training steps
        os.sync()  # nothing written before the signal is flushed on the clock
        watch = CpuWatch(root=proc.pid, store="-", interval=0.05)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        # The SIGTERM checkpoint's own verification (a routine one may be verified meanwhile).
        t_saved = out.wait_for(_is_stage("save"), t0, 600)
        saved = next(st for st in map(stage_line, out.since(t_saved)) if st is not None and st.stage == "save")
        name = f"name={saved.fields.get('name')} "
        t_verified = out.wait_for(lambda line: _is_stage("verify")(line) and name in line, t0, 600)
        cpu = watch.stop()
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.join()
    stages: dict[str, float] = {}
    fields: dict[str, str] = {}
    trainer_save = step = float("nan")
    for line in out.since(0.0):
        m = _STEP.match(line)
        if m is not None:
            step = float(m.group(1))
    for line in out.since(t0):
        m = _TRAINER_SAVE.match(line)
        if m is not None:
            trainer_save = float(m.group(1))
        st = stage_line(line)
        if st is None or st.stage not in STAGES:
            continue
        stages[st.stage] = stages.get(st.stage, 0.0) + st.seconds
        if st.stage == "upload":
            fields.update(st.fields)
    if proc.returncode not in (0, 143, -signal.SIGTERM) or "emergency" not in stages:
        raise RuntimeError(f"{shape} {frozen}: no verified SIGTERM checkpoint:\n" + "".join(out.since(t0))[-4000:])
    shutil.rmtree(workdir, ignore_errors=True)
    return Run(t_verified - t0, stages, trainer_save, step, cpu, fields)


def bench_finetune_sigterm(ctx: Ctx) -> Section:
    sizes = [float(x) for x in os.environ.get("BENCH_FINETUNE_SIGTERM_GB", "0.0625,2").split(",")]
    rounds = ctx.rounds_for(5)
    shapes = {k: v for k, v in SHAPES.items() if not ONLY or k in ONLY}
    runs: dict[tuple[str, float], list[Run]] = {(s, gb): [] for s in shapes for gb in sizes}
    for r in range(rounds):
        for shape in shapes:
            for gb in sizes if r % 2 == 0 else list(reversed(sizes)):
                run = run_once(ctx.work, shape, int(gb * GiB))
                runs[(shape, gb)].append(run)
                print(
                    f"   {shape} {gb:g} GiB round {r + 1}: SIGTERM -> verified {run.to_verified:.3f}s, "
                    f"trainer's save {run.trainer_save:.3f}s, step {run.step:.3f}s, stages {run.stages}, "
                    f"CPU { ({k: round(v, 2) for k, v in run.cpu.items()}) }",
                    flush=True,
                )
    s = Section(
        "A fine-tune's SIGTERM: one large frozen tensor or many",
        "finetune-sigterm",
        [
            "frozen base",
            "size",
            "SIGTERM -> verified (s, median, min-max)",
            f"vs {min(sizes):g} GiB, per round [IQR]",
            "the trainer's save (s, median)",
            "a step (s)",
            " / ".join(STAGES) + " (s, medians)",
            "CPU, all processes (s, median)",
        ],
    )
    lo = min(sizes)
    for shape, label in shapes.items():
        for gb in sizes:
            rs = runs[(shape, gb)]
            lat = [x.to_verified for x in rs]
            s.rows.append(
                [
                    label,
                    *size_and_latency_cells(gb, lo, lat, [x.to_verified for x in runs[(shape, lo)]]),
                    fmt(median([x.trainer_save for x in rs]), 3),
                    fmt(median([x.step for x in rs]), 3),
                    " / ".join(fmt(median([x.stages.get(k, 0.0) for x in rs]), 3) for k in STAGES),
                    fmt(median([x.cpu.get("all", 0.0) for x in rs]), 2),
                ]
            )
    for shape, label in shapes.items():
        for gb in sizes:
            if gb == lo or shape.endswith("-forward"):  # its step grows with the base: no goal for the save
                continue
            growth = per_round(
                [x.to_verified for x in runs[(shape, gb)]],
                [x.to_verified for x in runs[(shape, lo)]],
                higher_is_better=False,
            )
            goal(
                s,
                f"{label}: SIGTERM -> verified at {gb:g} GiB frozen within 1.5x of {lo * 1024:g} MiB",
                growth,
                1.5,
            )
    s.notes.append(
        "`spotguard run -- python -m bench.linear_finetune_worker --frozen-bytes B --shape linear|tensors` "
        f"(file:// storage, every default): a frozen base of B bytes, a rank-16 adapter trained with AdamW, a "
        f"checkpoint every {SAVE_EVERY} steps; after {ROUTINE} routine checkpoints, the last verified in "
        "storage, SIGTERM to the supervisor. SIGTERM -> verified: until the supervisor's `stage=verify` line "
        f"for the SIGTERM checkpoint. {rounds} rounds, sizes alternating which goes first. Stages: `save` (the "
        "supervisor's request until the trainer's checkpoint is committed), `upload`, `verify`, `emergency` "
        "(the supervisor's whole emergency path)."
    )
    if "linear" in shapes:
        ctx.costs["finetune_sigterm_" + "_".join(f"{gb:g}" for gb in sizes)] = median(
            [x.to_verified for x in runs[("linear", max(sizes))]]
        )
    return s


def main() -> int:
    """Run the section alone: ``python -m bench.linear_finetune [rounds]``; prints its markdown."""
    return run_section_alone(bench_finetune_sigterm)


if __name__ == "__main__":
    sys.exit(main())
