"""``spotguard demo``: preempt a training run several times and prove nothing changed.

Trains the packaged demo model (``python -m spotguard.demo.train``) under
``spotguard run``, sends it SIGTERM at random steps as a spot machine's
shutdown would, runs the same command again each time (which resumes from
the newest verified checkpoint), trains the same model once without
interruption, and compares the two final states byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from spotguard.contract import env as envvars

_STEP_RE = re.compile(r"^step (\d+) ")
_RESUMED_RE = re.compile(r"^resumed from step (\d+)")
_STAGE_RE = re.compile(r"stage=(\w+) seconds=([0-9.]+)")

# Seconds per training step: slow enough that a preemption lands mid-run at
# a random step, fast enough that the whole demo takes well under a minute.
STEP_DELAY = 0.01


@dataclass
class DemoOptions:
    """What ``spotguard demo`` was asked for."""

    steps: int = 300
    preemptions: int = 3
    save_every: int = 50
    storage: str | None = None
    seed: int | None = None
    workdir: Path | None = None
    step_delay: float = STEP_DELAY
    out: Callable[[str], None] = field(default=lambda line: print(line, flush=True))


@dataclass
class Segment:
    """One start of ``spotguard run``: where it resumed, where it stopped, what it measured."""

    resumed_from: int | None = None
    last_step: int | None = None
    exit_status: int | None = None
    stages: dict[str, list[float]] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)


def preemption_points(steps: int, count: int, rng: random.Random) -> list[int]:
    """Pure: ``count`` distinct increasing steps spread over the run (not at its very ends)."""
    low, high = max(1, steps // 10), max(2, steps - steps // 10)
    count = max(0, min(count, high - low))
    return sorted(rng.sample(range(low, high), count))


def lost_steps(segments: list[Segment]) -> list[int]:
    """Pure: steps trained but not kept, per preemption.

    A preempted segment's last completed step minus the step its successor
    resumed from (the checkpoint holds the state *after* that step).
    """
    lost: list[int] = []
    for before, after in zip(segments, segments[1:], strict=False):
        if before.last_step is None:
            continue
        resumed = after.resumed_from if after.resumed_from is not None else -1
        lost.append(max(0, before.last_step - resumed))
    return lost


def _train_command(steps: int, output: Path, save_every: int, step_delay: float) -> list[str]:
    return [
        sys.executable,
        "-m",
        "spotguard.demo.train",
        "--steps",
        str(steps),
        "--save-every",
        str(save_every),
        "--output",
        str(output),
        "--step-delay",
        str(step_delay),
        "--log-every",
        "1",
    ]


def _run_segment(cmd: list[str], env: dict[str, str], preempt_at: int | None, verbose_log: Path) -> Segment:
    """Run one ``spotguard run``; SIGTERM it once the trainer reports ``preempt_at``."""
    seg = Segment()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    sent = False
    assert proc.stdout is not None
    with verbose_log.open("a", encoding="utf-8") as logf:
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            logf.write(line + "\n")
            seg.lines.append(line)
            # The supervisor prefixes its own lines; the trainer's are bare.
            m = _STEP_RE.match(line)
            if m:
                seg.last_step = int(m.group(1))
                if preempt_at is not None and not sent and seg.last_step >= preempt_at:
                    proc.send_signal(signal.SIGTERM)
                    sent = True
            m = _RESUMED_RE.match(line)
            if m:
                seg.resumed_from = int(m.group(1))
            for stage, seconds in _STAGE_RE.findall(line):
                seg.stages.setdefault(stage, []).append(float(seconds))
    seg.exit_status = proc.wait()
    return seg


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fmt_seconds(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"median {statistics.median(values):.3f}s, max {max(values):.3f}s (n={len(values)})"


def run_demo(options: DemoOptions) -> int:
    """Run the demo; print progress and the report. Returns 0 when bitwise identical."""
    out = options.out
    rng = random.Random(options.seed)
    own_tmp = options.workdir is None
    root = Path(tempfile.mkdtemp(prefix="spotguard-demo-")) if own_tmp else options.workdir
    assert root is not None
    root.mkdir(parents=True, exist_ok=True)
    try:
        return _demo(options, rng, root, out)
    finally:
        if own_tmp:
            shutil.rmtree(root, ignore_errors=True)


def _demo(options: DemoOptions, rng: random.Random, root: Path, out: Callable[[str], None]) -> int:
    storage = options.storage or (root / "store").as_uri()
    log_path = root / "demo.log"
    env = dict(os.environ)
    # The demo's own settings win over anything inherited from the shell.
    for key in [k for k in env if k.startswith(envvars.PREFIX)]:
        if key != envvars.TESTENV_RUN.name:
            env.pop(key)
    env["PYTHONUNBUFFERED"] = "1"
    points = preemption_points(options.steps, options.preemptions, rng)
    out(
        f"spotguard demo: {options.steps} steps of a small MLP, {len(points)} preemptions "
        f"at steps {', '.join(map(str, points)) or 'none'}"
    )
    out(f"storage: {storage}")

    out("training once without interruption (reference) ...")
    ref_out = root / "reference.safetensors"
    ref_env = dict(env)
    ref_env[envvars.CHECKPOINT_DIR.name] = str(root / "reference-checkpoints")
    ref = subprocess.run(
        _train_command(options.steps, ref_out, options.save_every, 0.0),
        env=ref_env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    with log_path.open("a", encoding="utf-8") as logf:
        logf.write(ref.stdout + ref.stderr)
    if ref.returncode != 0 or not ref_out.is_file():
        out(f"reference run failed (exit status {ref.returncode}); log in {log_path}:")
        out("\n".join((ref.stdout + ref.stderr).splitlines()[-20:]))
        out("bitwise identical: no")
        return 1

    run_cmd = [
        sys.executable,
        "-m",
        "spotguard.cli",
        "run",
        "--workdir",
        str(root / "run"),
        "--storage",
        storage,
        "--max-restarts",
        "0",
        "--",
        *_train_command(options.steps, root / "final.safetensors", options.save_every, options.step_delay),
    ]
    segments: list[Segment] = []
    for i, point in enumerate([*points, None], start=1):
        label = f"preempt at step {point}" if point is not None else "run to the end"
        seg = _run_segment(run_cmd, env, point, log_path)
        segments.append(seg)
        resumed = "scratch" if seg.resumed_from is None else f"step {seg.resumed_from}"
        out(
            f"start {i}: resumed from {resumed}, {label}: stopped after step {seg.last_step}, "
            f"exit status {seg.exit_status}"
        )
        expected = 0 if point is None else 128 + signal.SIGTERM
        if seg.exit_status != expected:
            out(f"unexpected exit status {seg.exit_status} (wanted {expected}); log in {log_path}:")
            out("\n".join(seg.lines[-20:]))
            out("bitwise identical: no")
            return 1

    final = root / "final.safetensors"
    identical = final.is_file() and final.read_bytes() == ref_out.read_bytes()
    stages: dict[str, list[float]] = {}
    for seg in segments:
        for stage, values in seg.stages.items():
            stages.setdefault(stage, []).extend(values)
    survived = sum(1 for s in segments[:-1] if s.exit_status == 128 + signal.SIGTERM)
    out("")
    out("report")
    out(f"  preemptions survived: {survived}/{len(points)}")
    out(f"  steps lost per preemption: {', '.join(map(str, lost_steps(segments))) or 'n/a'}")
    out(f"  emergency save: {_fmt_seconds(stages.get('save', []))}")
    out(f"  upload: {_fmt_seconds(stages.get('upload', []))}")
    out(f"  verify: {_fmt_seconds(stages.get('verify', []))}")
    out(f"  preemption to verified checkpoint: {_fmt_seconds(stages.get('emergency', []))}")
    out(
        f"  final state sha256: resumed {_digest(final)[:16] if final.is_file() else 'missing'}, "
        f"uninterrupted {_digest(ref_out)[:16]}"
    )
    out(f"bitwise identical: {'yes' if identical else 'no'}")
    return 0 if identical else 1
