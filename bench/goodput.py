"""Goodput over a preemption trace: a small discrete-event simulation.

A job needs ``job_hours`` of compute. Preemptions arrive as a Poisson process
(mean ``mtbf_hours``), each announced ``notice_seconds`` ahead. Strategies:

- ``none``: no checkpoints; a preemption loses everything done so far.
- ``periodic``: a blocking checkpoint every Young/Daly interval
  sqrt(2 * cost * MTBF); a preemption loses the work since the last one.
- ``spotguard``: two-phase checkpoints (only the snapshot stalls training) at
  their own Young/Daly interval, plus an emergency checkpoint on the notice:
  no work is lost when the emergency save + upload fits the notice, else the
  work since the last periodic checkpoint is lost.

Every preemption also costs ``restart`` seconds (new node, pod start, resume).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Costs:
    stall_spotguard: float  # seconds training is blocked per spotguard checkpoint
    stall_periodic: float  # seconds blocked per blocking checkpoint (save + upload)
    emergency: float  # seconds for an emergency save + upload + verify
    restart: float  # seconds from preemption to training again


@dataclass(frozen=True)
class Trace:
    mtbf_hours: float
    notice_seconds: float
    job_hours: float


@dataclass(frozen=True)
class Result:
    name: str
    interval: str
    goodput: float
    wall_hours: float
    finished: float  # share of simulated jobs that finished before the cap


def young_daly(cost: float, mtbf: float) -> float:
    """The checkpoint interval that minimises expected waste (Young 1974, Daly 2006)."""
    return math.sqrt(2 * cost * mtbf)


CAP_HOURS = 2000.0


def simulate(costs: Costs, trace: Trace, strategy: str, rng: random.Random, cap_hours: float = CAP_HOURS) -> float:
    """Wall seconds to finish the job under ``strategy``."""
    need = trace.job_hours * 3600
    mtbf = trace.mtbf_hours * 3600
    if strategy == "none":
        interval, stall = math.inf, 0.0
    elif strategy == "periodic":
        stall = costs.stall_periodic
        interval = young_daly(stall, mtbf)
    elif strategy == "spotguard":
        stall = costs.stall_spotguard
        interval = young_daly(max(stall, 1e-3), mtbf)
    else:
        raise ValueError(strategy)
    wall, done, saved = 0.0, 0.0, 0.0
    next_preempt = rng.expovariate(1 / mtbf)
    while done < need:
        if wall > cap_hours * 3600:
            return wall  # never finishes in any sensible time
        # Run until the next checkpoint, the end, or the preemption.
        to_ckpt = interval - (done - saved) if interval != math.inf else math.inf
        step = min(to_ckpt, need - done)
        if wall + step < next_preempt:
            wall += step
            done += step
            if done < need and step == to_ckpt:
                wall += stall
                saved = done
            continue
        # Preempted while working.
        done += next_preempt - wall
        wall = next_preempt
        if strategy == "spotguard" and costs.emergency <= trace.notice_seconds:
            saved = done  # the emergency checkpoint made it
        done = saved
        wall += costs.restart
        next_preempt = wall + rng.expovariate(1 / mtbf)
    return wall


def compare(costs: Costs, trace: Trace, trials: int = 400, seed: int = 0) -> list[Result]:
    out = []
    mtbf = trace.mtbf_hours * 3600
    for name, label in (("spotguard", "spotguard (two-phase + emergency on notice)"),
                        ("periodic", "periodic only (blocking save + upload)"),
                        ("none", "none (restart from scratch)")):  # fmt: skip
        rng = random.Random(seed)
        walls = [simulate(costs, trace, name, rng) for _ in range(trials)]
        mean_wall = sum(walls) / len(walls)
        if name == "none":
            interval = "-"
        else:
            cost = costs.stall_spotguard if name == "spotguard" else costs.stall_periodic
            interval = f"{young_daly(max(cost, 1e-3), mtbf) / 60:.1f} min"
        finished = sum(w <= CAP_HOURS * 3600 for w in walls) / len(walls)
        out.append(Result(label, interval, trace.job_hours * 3600 / mean_wall, mean_wall / 3600, finished))
    return out
