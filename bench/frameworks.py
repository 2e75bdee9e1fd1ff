"""Framework callbacks: what spotguard adds to a Hugging Face Trainer or a
Lightning fit, per step and per checkpoint.

Each round runs the framework alone and the framework with spotguard's
callback, in separate processes (bench.framework_worker), in alternating
order. Per step: a tiny model without checkpoints, so the callback's own
work (one flag check per step) is all that differs. Per checkpoint: a model
of some 20 M parameters (a few hundred MB of weights and optimizer state)
saving every few steps; the stall is the gap after a saving step minus the
gap after a plain one. Without spotguard it is the framework's own save;
with it, that save plus spotguard's commit (files hard-linked at once,
checksums and manifest in the background).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import Section, fmt, goal, median, per_round

if TYPE_CHECKING:
    from bench.common import Ctx

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = {"hf": "Hugging Face Trainer", "lightning": "Lightning"}
OVERHEAD = {"steps": 300, "width": 64, "layers": 2, "save_every": 0}
# Some 20 M parameters each: GPT-2 blocks of width 512 / an MLP of width 1536.
STALL = {
    "hf": {"steps": 36, "width": 512, "layers": 6, "save_every": 8},
    "lightning": {"steps": 36, "width": 1536, "layers": 8, "save_every": 8},
}


def _run(framework: str, mode: str, cfg: dict[str, int]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [
            sys.executable,
            "-m",
            "bench.framework_worker",
            framework,
            "--mode",
            mode,
            "--steps",
            str(cfg["steps"]),
            "--save-every",
            str(cfg["save_every"]),
            "--width",
            str(cfg["width"]),
            "--layers",
            str(cfg["layers"]),
            "--out",
            out.name,
        ]
        env = {
            "PATH": str(Path(sys.executable).parent),
            "OMP_NUM_THREADS": "2",
            "PYTHONPATH": str(ROOT),
            "HOME": tempfile.gettempdir(),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error",
        }
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{framework} {mode} failed:\n{proc.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(Path(out.name).read_text())
        return result


def bench_frameworks(ctx: Ctx) -> Section:
    rounds = ctx.rounds_for(4)
    section = Section(
        "Framework callbacks: per-step overhead and checkpoint stall",
        "frameworks",
        ["framework", "measure", "framework alone", "with spotguard", "ratio (median, IQR, min-max)"],
    )
    for fw, label in FRAMEWORKS.items():
        step: dict[str, list[float]] = {"plain": [], "spotguard": []}
        stall: dict[str, list[float]] = {"plain": [], "spotguard": []}
        for r in range(rounds):
            order = ["plain", "spotguard"] if r % 2 == 0 else ["spotguard", "plain"]
            for mode in order:
                step[mode].append(_run(fw, mode, OVERHEAD)["step_seconds"])
            for mode in order:
                res = _run(fw, mode, STALL[fw])
                stall[mode].append(max(1e-6, res["gap_save"] - res["gap_plain"]))
        over = per_round(step["spotguard"], step["plain"], higher_is_better=False)
        cost = per_round(stall["spotguard"], stall["plain"], higher_is_better=False)
        section.rows.append(
            [
                label,
                "time per training step (no checkpoint)",
                f"{fmt(median(step['plain']) * 1e3)} ms",
                f"{fmt(median(step['spotguard']) * 1e3)} ms",
                over.cell(),
            ]
        )
        cfg = STALL[fw]
        section.rows.append(
            [
                label,
                f"stall of one checkpoint ({cfg['layers']} layers x {cfg['width']})",
                f"{fmt(median(stall['plain']), 3)} s",
                f"{fmt(median(stall['spotguard']), 3)} s",
                cost.cell(),
            ]
        )
        goal(section, f"{label}: the callback's per-step cost is noise (<= 1.05x)", over, 1.05)
        goal(
            section,
            f"{label}: a checkpoint stalls training at most 1.25x as long as the framework's own save",
            cost,
            1.25,
        )
    section.notes.append(
        f"{rounds} interleaved rounds; each run is its own process. Per step: a tiny model "
        f"({OVERHEAD['layers']} layers x {OVERHEAD['width']}), {OVERHEAD['steps']} steps, no checkpoint, so what "
        "differs is the callback's check of spotguard's flags at every step. Per checkpoint: a save every "
        f"{STALL['hf']['save_every']} steps; the stall is the median gap after a saving step minus the median "
        "gap after "
        "a plain one. The framework alone is the Trainer's `save_steps` / Lightning's `ModelCheckpoint`; with "
        "spotguard, the same save plus the commit of its files as a spotguard checkpoint (hard links at once; "
        "checksums and manifest in the background, off the training thread)."
    )
    return section
