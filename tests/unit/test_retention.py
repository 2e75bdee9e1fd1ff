"""The retention planner: table tests, no storage."""

from __future__ import annotations

from typing import Any

import pytest

from spotguard.checkpoint.store.retention import RetentionCandidate, RetentionPolicy, plan_retention


def c(step: int, **metrics: float | None) -> RetentionCandidate:
    return RetentionCandidate(f"ckpt-{step:012d}", step, metrics)


def names(*steps: int) -> tuple[str, ...]:
    return tuple(f"ckpt-{s:012d}" for s in steps)


LOSSES = [c(10, loss=0.9), c(20, loss=0.3), c(30, loss=0.5), c(40, loss=0.3), c(50, loss=0.7), c(60, loss=0.8)]

CASES: list[tuple[str, list[RetentionCandidate], RetentionPolicy, int | None, tuple[str, ...]]] = [
    ("no rule keeps everything", LOSSES, RetentionPolicy(), 60, ()),
    ("nothing verified deletes nothing", LOSSES, RetentionPolicy(keep_last=1), None, ()),
    ("keep-last 2", LOSSES, RetentionPolicy(keep_last=2), 60, names(10, 20, 30, 40)),
    ("keep-last 0 still keeps newest verified", LOSSES, RetentionPolicy(keep_last=0), 60, names(10, 20, 30, 40, 50)),
    ("keep-last larger than count", LOSSES, RetentionPolicy(keep_last=10), 60, ()),
    (
        "newest verified is older than the newest",
        LOSSES,
        RetentionPolicy(keep_last=1),
        40,
        names(10, 20, 30),
    ),
    (
        "keep-best 2 by min loss, tie goes to the newer",
        LOSSES,
        RetentionPolicy(keep_last=0, keep_best=1, metric="loss", mode="min"),
        60,
        names(10, 20, 30, 50),
    ),
    (
        "keep-best 2 by min loss",
        LOSSES,
        RetentionPolicy(keep_last=0, keep_best=2, metric="loss"),
        60,
        names(10, 30, 50),
    ),
    (
        "keep-best by max",
        LOSSES,
        RetentionPolicy(keep_last=0, keep_best=1, metric="loss", mode="max"),
        60,
        names(20, 30, 40, 50),
    ),
    (
        "keep-best ignores checkpoints without the metric",
        [c(10), c(20, loss=None), c(30, loss=1.0), c(40)],
        RetentionPolicy(keep_last=0, keep_best=2, metric="loss"),
        40,
        names(10, 20),
    ),
    (
        "keep-every 20",
        LOSSES,
        RetentionPolicy(keep_last=0, keep_every=20),
        60,
        names(10, 30, 50),
    ),
    (
        "rules combine as a union",
        LOSSES,
        RetentionPolicy(keep_last=1, keep_best=1, metric="loss", keep_every=30),
        60,
        names(10, 20, 50),
    ),
    (
        "checkpoints newer than the newest verified are kept",
        LOSSES,
        RetentionPolicy(keep_last=0),
        30,
        names(10, 20),
    ),
    ("empty", [], RetentionPolicy(keep_last=1), None, ()),
    ("single", [c(5)], RetentionPolicy(keep_last=0), 5, ()),
    (
        "unsorted input",
        [c(30), c(10), c(20)],
        RetentionPolicy(keep_last=1),
        30,
        names(10, 20),
    ),
]


@pytest.mark.parametrize("title, candidates, policy, verified, deleted", CASES, ids=[x[0] for x in CASES])
def test_plan(
    title: str,
    candidates: list[RetentionCandidate],
    policy: RetentionPolicy,
    verified: int | None,
    deleted: tuple[str, ...],
) -> None:
    newest = f"ckpt-{verified:012d}" if verified is not None else None
    plan = plan_retention(candidates, policy, newest)
    assert plan.delete == deleted
    # Every candidate is either kept (with a reason) or deleted, never both.
    assert set(plan.keep) | set(plan.delete) == {x.name for x in candidates}
    assert not set(plan.keep) & set(plan.delete)
    assert all(plan.keep.values())
    if newest is not None:
        assert newest in plan.keep


def test_reasons_are_recorded() -> None:
    plan = plan_retention(LOSSES, RetentionPolicy(keep_last=1, keep_best=1, metric="loss", keep_every=30), names(60)[0])
    assert plan.keep[names(60)[0]] == ("newest verified", "last 1", "every 30th step")
    assert plan.keep[names(40)[0]] == ("best 1 by loss (min)",)


def test_newest_verified_not_among_candidates_deletes_nothing() -> None:
    plan = plan_retention(LOSSES, RetentionPolicy(keep_last=0), "ckpt-000000000099")
    assert plan.delete == ()


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"keep_last": -1}, "keep_last must be a non-negative integer"),
        ({"keep_best": 2}, "keep_best needs a metric"),
        ({"mode": "median"}, "mode must be 'min' or 'max'"),
        ({"keep_every": 0}, "keep_every must be at least 1"),
        ({"keep_last": 1.5}, "keep_last must be a non-negative integer"),
    ],
)
def test_policy_validation(kwargs: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        RetentionPolicy(**kwargs)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, RetentionPolicy()),
        (
            {
                "SPOTGUARD_KEEP_LAST": "3",
                "SPOTGUARD_KEEP_BEST": "2",
                "SPOTGUARD_BEST_METRIC": "val_loss",
                "SPOTGUARD_BEST_MODE": "MAX",
                "SPOTGUARD_KEEP_EVERY": "1000",
            },
            RetentionPolicy(keep_last=3, keep_best=2, metric="val_loss", mode="max", keep_every=1000),
        ),
        ({"SPOTGUARD_KEEP_LAST": " "}, RetentionPolicy()),
    ],
)
def test_policy_from_env(env: dict[str, str], expected: RetentionPolicy) -> None:
    assert RetentionPolicy.from_env(env) == expected


def test_policy_from_env_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="SPOTGUARD_KEEP_LAST must be an integer"):
        RetentionPolicy.from_env({"SPOTGUARD_KEEP_LAST": "many"})


def ck(*steps: int) -> list[str]:
    return [f"ckpt-{s:012d}" for s in steps]


@pytest.mark.parametrize(
    ("committed", "verified", "keep", "want"),
    [
        (ck(10, 20, 30), set(), 1, []),  # nothing verified in storage: keep everything
        (ck(10, 20, 30), set(ck(30)), 1, ck(10, 20)),
        (ck(10, 20, 30), set(ck(30)), 2, ck(10)),
        (ck(10, 20, 30), set(ck(20)), 1, ck(10)),  # 30 is not verified yet: kept
        (ck(10, 20, 30, 40), set(ck(10, 20)), 1, ck(10)),  # never what is newer than the newest verified
        (ck(10, 20, 30), set(ck(30)), 0, ck(10, 20)),  # keep at least one
        (ck(30, 10, 20), set(ck(30)), 1, ck(10, 20)),  # by step, not listing order
    ],
)
def test_plan_local_prune(committed: list[str], verified: set[str], keep: int, want: list[str]) -> None:
    from spotguard.checkpoint.store.retention import plan_local_prune

    assert plan_local_prune(committed, verified, keep) == want
