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
    emergency: float  # seconds for an emergency save + upload + verify (median)
    restart: float  # seconds from preemption to training again
    # Spread of the emergency time from one preemption to the next: each takes
    # ``emergency * exp(sigma * N(0, 1))`` (lognormal; 0: always the median).
    emergency_sigma: float = 0.0
    # Seconds from a two-phase checkpoint's snapshot to its verification in storage (0: at once).
    ship: float = 0.0


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
    """Wall seconds to finish the job under ``strategy``.

    A two-phase checkpoint stalls training only for its snapshot, but it is durable only once shipped
    (``costs.ship``): a preemption before that falls back to the one before it, and the next checkpoint
    does not start before the last one shipped (the interval is at least ``ship``).
    """
    need = trace.job_hours * 3600
    mtbf = trace.mtbf_hours * 3600
    ship = 0.0
    if strategy == "none":
        interval, stall = math.inf, 0.0
    elif strategy == "periodic":
        stall = costs.stall_periodic  # blocking: saved and uploaded when training goes on
        interval = young_daly(stall, mtbf)
    elif strategy == "spotguard":
        stall, ship = costs.stall_spotguard, costs.ship
        interval = max(young_daly(max(stall, 1e-3), mtbf), ship)
    else:
        raise ValueError(strategy)
    wall, done, saved, last = 0.0, 0.0, 0.0, 0.0  # saved: durable progress; last: the newest checkpoint's
    shipping: tuple[float, float] | None = None  # (progress, when it is verified) of a checkpoint on its way
    next_preempt = rng.expovariate(1 / mtbf)
    while done < need:
        if wall > cap_hours * 3600:
            return wall  # never finishes in any sensible time
        # Run until the next checkpoint, the end, or the preemption.
        to_ckpt = interval - (done - last) if interval != math.inf else math.inf
        step = min(to_ckpt, need - done)
        if wall + step < next_preempt:
            wall += step
            done += step
            if done < need and step == to_ckpt:
                wall += stall
                if shipping is not None and shipping[1] <= wall:
                    saved = shipping[0]
                shipping, last = (done, wall + ship), done
            continue
        # Preempted while working.
        done += next_preempt - wall
        wall = next_preempt
        if shipping is not None and shipping[1] <= wall:
            saved = shipping[0]
        if strategy == "spotguard" and emergency_time(costs, rng) <= trace.notice_seconds:
            saved = done  # the emergency checkpoint made it
        done = last = saved
        shipping = None
        wall += costs.restart
        next_preempt = wall + rng.expovariate(1 / mtbf)
    return wall


def emergency_time(costs: Costs, rng: random.Random) -> float:
    """One preemption's emergency save + upload + verify, drawn around the measured median."""
    if costs.emergency_sigma <= 0:
        return costs.emergency
    return costs.emergency * math.exp(costs.emergency_sigma * rng.gauss(0.0, 1.0))


def needed_throughput(gib: float, notice_seconds: float, fixed_seconds: float) -> float | None:
    """Pure: the throughput (GiB/s) a node needs to move ``gib`` within a notice of
    ``notice_seconds`` when ``fixed_seconds`` of it go to what does not depend on the bytes
    moved; None when those alone take the notice (no throughput is enough)."""
    budget = notice_seconds - fixed_seconds
    if budget <= 0:
        return None
    return gib / budget


def sigma_from_quartile(median: float, upper_quartile: float) -> float:
    """The lognormal sigma whose 75th percentile is ``upper_quartile`` (median * e^(0.6745 sigma))."""
    if median <= 0 or upper_quartile <= median:
        return 0.0
    return math.log(upper_quartile / median) / 0.6745


def in_time_share(costs: Costs, notice_seconds: float, trials: int = 20000, seed: int = 0) -> float:
    """The share of preemptions whose emergency checkpoint verifies within the notice."""
    rng = random.Random(seed)
    return sum(emergency_time(costs, rng) <= notice_seconds for _ in range(trials)) / trials


@dataclass(frozen=True)
class Scenario:
    """A workload the users have, with the costs of this machine scaled per GiB."""

    name: str
    costs: Costs
    notice_seconds: float
    mtbf_hours: float = 1.0
    job_hours: float = 24.0


@dataclass(frozen=True)
class ScenarioResult:
    scenario: Scenario
    in_time: float  # share of preemptions whose emergency checkpoint verified within the notice
    spotguard: Result
    periodic: Result


def run_scenario(sc: Scenario, trials: int = 400, seed: int = 7) -> ScenarioResult:
    """Goodput of spotguard and of periodic-only checkpoints for one scenario, and the in-time share."""
    res = compare(sc.costs, Trace(sc.mtbf_hours, sc.notice_seconds, sc.job_hours), trials=trials, seed=seed)
    by = {r.name.split(" ")[0]: r for r in res}
    return ScenarioResult(sc, in_time_share(sc.costs, sc.notice_seconds, seed=seed), by["spotguard"], by["periodic"])


def compare(costs: Costs, trace: Trace, trials: int = 400, seed: int = 0) -> list[Result]:
    out = []
    mtbf = trace.mtbf_hours * 3600
    for name, label in (
        ("spotguard", "spotguard (two-phase + emergency on notice)"),
        ("periodic", "periodic only (blocking save + upload)"),
        ("none", "none (restart from scratch)"),
    ):
        rng = random.Random(seed)
        walls = [simulate(costs, trace, name, rng) for _ in range(trials)]
        mean_wall = sum(walls) / len(walls)
        if name == "none":
            interval = "-"
        else:
            cost = costs.stall_spotguard if name == "spotguard" else costs.stall_periodic
            floor = costs.ship if name == "spotguard" else 0.0  # the next starts once the last one shipped
            interval = f"{max(young_daly(max(cost, 1e-3), mtbf), floor) / 60:.1f} min"
        finished = sum(w <= CAP_HOURS * 3600 for w in walls) / len(walls)
        out.append(Result(label, interval, trace.job_hours * 3600 / mean_wall, mean_wall / 3600, finished))
    return out
