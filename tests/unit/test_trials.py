"""The suite's one seed and one trial scale (testenv/trials.py): pure logic, no I/O."""

from __future__ import annotations

import os
import random

import pytest

from testenv import trials


def test_count_follows_the_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(trials.SCALE_ENV, raising=False)
    assert trials.count(full=20, quick=5) == 5
    monkeypatch.setenv(trials.SCALE_ENV, "full")
    assert trials.count(full=20, quick=5) == 20
    monkeypatch.setenv(trials.SCALE_ENV, "huge")
    with pytest.raises(ValueError, match="SPOTGUARD_TRIALS"):
        trials.count(full=20, quick=5)
    with pytest.raises(ValueError):
        trials.count(full=3, quick=5)


def test_variants_follow_the_scale_and_quick_is_a_subset_of_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(trials.SCALE_ENV, raising=False)
    assert trials.variants(full=["a", "b", "c"], quick=["a", "c"]) == ["a", "c"]
    monkeypatch.setenv(trials.SCALE_ENV, "full")
    assert trials.variants(full=["a", "b", "c"], quick=["a", "c"]) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="subset"):
        trials.variants(full=["a", "b"], quick=["x"])
    with pytest.raises(ValueError, match="subset"):
        trials.variants(full=["a", "b"], quick=[])


def test_the_seed_is_drawn_once_and_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(trials.SEED_ENV, raising=False)
    first = trials.seed()
    assert trials.seed() == first and str(first) == os.environ[trials.SEED_ENV]
    monkeypatch.setenv(trials.SEED_ENV, "not-a-number")
    with pytest.raises(ValueError, match="SPOTGUARD_TEST_SEED"):
        trials.seed()


def test_each_stream_replays_and_streams_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(trials.SEED_ENV, "42")
    a = [trials.rng("x").random() for _ in range(3)]
    assert a == [trials.rng("x").random() for _ in range(3)]
    assert trials.rng("x").random() != trials.rng("y").random()
    monkeypatch.setenv(trials.SEED_ENV, "43")
    assert trials.rng("x").random() != a[0]


def test_stratified_instants_fall_one_in_each_slice() -> None:
    fractions = trials.stratified(7, random.Random(1))
    assert [int(f * 7) for f in fractions] == list(range(7))


def test_replay_command_names_seed_scale_and_test(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(trials.SEED_ENV, "42")
    monkeypatch.setenv(trials.SCALE_ENV, "full")
    cmd = trials.replay_command("tests/a.py::test_b[x y]")
    assert cmd == "SPOTGUARD_TEST_SEED=42 SPOTGUARD_TRIALS=full .venv/bin/python -m pytest 'tests/a.py::test_b[x y]'"
