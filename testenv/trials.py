"""One seed and one scale for every randomized trial of the test suite.

``SPOTGUARD_TEST_SEED`` (an integer) seeds every trial loop: crash safety,
sidecar SIGTERM trials, torchrun crash trials, chunk GC trials, sharded races,
the fleet. Unset, a seed is drawn once and exported, so that the whole
session (and every process it starts) uses the same one; pytest prints it at
the start and, with a command that replays it, under every failure.

``SPOTGUARD_TRIALS`` picks the scale: ``quick`` (the default, ``make test``)
runs each trial loop at a smaller count, ``full`` (``make soak``) at the
count its acceptance asks for. Each loop names both counts with
:func:`count`, so the two figures sit side by side in the test.

Each test draws from its own stream (:func:`rng` with a name), so a test's
draws do not depend on which other tests ran before it: replaying one test
with the printed seed repeats its trials exactly.

Kill instants are *stratified* (:func:`stratified`): trial ``i`` of ``n``
kills at ``(i + U) / n`` of the measured cycle, ``U`` uniform in [0, 1), so
``n`` trials cover the whole cycle evenly instead of clustering by chance.
"""

from __future__ import annotations

import os
import random
import shlex
from typing import TypeVar

T = TypeVar("T")

SEED_ENV = "SPOTGUARD_TEST_SEED"
SCALE_ENV = "SPOTGUARD_TRIALS"
SCALES = ("quick", "full")


def seed() -> int:
    """The session's seed: ``SPOTGUARD_TEST_SEED``, or one drawn now and exported."""
    value = os.environ.get(SEED_ENV, "").strip()
    if not value:
        value = str(random.SystemRandom().randrange(1 << 31))
        os.environ[SEED_ENV] = value
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{SEED_ENV}={value!r} is not an integer") from None


def scale() -> str:
    """``quick`` (default) or ``full``."""
    value = os.environ.get(SCALE_ENV, "").strip().lower() or "quick"
    if value not in SCALES:
        raise ValueError(f"{SCALE_ENV}={value!r}: expected one of {', '.join(SCALES)}")
    return value


def count(*, full: int, quick: int) -> int:
    """How many trials a loop runs at this scale: ``full`` in ``make soak``, ``quick`` otherwise."""
    if not 0 < quick <= full:
        raise ValueError(f"trial counts must satisfy 0 < quick ({quick}) <= full ({full})")
    return full if scale() == "full" else quick


def variants(*, full: list[T], quick: list[T]) -> list[T]:
    """The variants (parameters) a test runs at this scale: ``quick`` must be a subset of ``full``,
    so that ``make test`` runs each *kind* that ``make soak`` runs, only fewer of its sizes."""
    if not quick or any(q not in full for q in quick):
        raise ValueError(f"quick variants {quick!r} must be a non-empty subset of the full ones {full!r}")
    return full if scale() == "full" else quick


def rng(name: str) -> random.Random:
    """A generator for one test (or one loop), derived from the session's seed and ``name``."""
    return random.Random(f"{seed()}/{name}")


def stratified(n: int, r: random.Random) -> list[float]:
    """``n`` fractions in [0, 1), the i-th uniform in [i/n, (i+1)/n): instants spread over a cycle."""
    return [(i + r.random()) / n for i in range(n)]


def replay_command(nodeid: str) -> str:
    """The command that runs ``nodeid`` again with this session's seed and scale."""
    return f"{SEED_ENV}={seed()} {SCALE_ENV}={scale()} .venv/bin/python -m pytest {shlex.quote(nodeid)}"
