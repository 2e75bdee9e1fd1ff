"""spotguard's ResumableSampler and the RNG state as JSON (pure, no Trainer)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from testenv.require import require_module

require_module("lightning")

from spotguard.integrations.lightning import ResumableSampler, rng_state, set_rng_state  # noqa: E402


def epoch(sampler: ResumableSampler, e: int) -> list[int]:
    sampler.set_epoch(e)
    return list(sampler)


def test_each_epoch_is_a_permutation_of_its_own_and_repeatable() -> None:
    a, b = ResumableSampler(range(20), seed=3), ResumableSampler(range(20), seed=3)
    first, second = epoch(a, 0), epoch(a, 1)
    assert sorted(first) == sorted(second) == list(range(20))
    assert first != second
    assert epoch(b, 1) == second and epoch(b, 0) == first
    assert epoch(ResumableSampler(range(20), seed=4), 0) != first


def test_it_draws_nothing_from_the_global_generators() -> None:
    torch.manual_seed(1)
    before = torch.get_rng_state()
    epoch(ResumableSampler(range(50), seed=0), 2)
    assert torch.equal(torch.get_rng_state(), before)


def test_without_shuffle_the_order_is_the_data_order() -> None:
    assert epoch(ResumableSampler(range(7), shuffle=False), 5) == list(range(7))


@pytest.mark.parametrize("consumed", [0, 1, 6, 11])
def test_a_restored_sampler_continues_after_the_consumed_samples(consumed: int) -> None:
    a = ResumableSampler(range(12), seed=9)
    a.set_epoch(2)
    full = list(a)
    state = json.loads(json.dumps(a.state_dict(consumed)))  # what the callback writes
    b = ResumableSampler(range(12), seed=9)
    b.load_state_dict(state)
    b.set_epoch(2)  # Lightning calls it again for the resumed epoch: the position stays
    assert list(b) == full[consumed:]
    assert len(b) == 12  # the epoch's length, not what is left of it
    assert epoch(b, 3) == epoch(ResumableSampler(range(12), seed=9), 3)  # the next epoch whole


def test_a_state_with_the_whole_epoch_consumed_continues_with_the_next_epoch() -> None:
    a = ResumableSampler(range(10), seed=2)
    a.set_epoch(4)
    list(a)
    b = ResumableSampler(range(10), seed=2)
    b.load_state_dict(a.state_dict())
    assert b.epoch == 5
    assert list(b) == epoch(ResumableSampler(range(10), seed=2), 5)


def test_the_default_state_counts_what_the_iteration_yielded() -> None:
    a = ResumableSampler(range(10), seed=0)
    it = iter(a)
    taken = [next(it) for _ in range(4)]
    assert a.state_dict()["consumed"] == 4
    b = ResumableSampler(range(10), seed=0)
    b.load_state_dict(a.state_dict())
    assert taken + list(b) == list(ResumableSampler(range(10), seed=0))


def test_a_state_of_other_data_or_another_setup_is_refused() -> None:
    state = ResumableSampler(range(10), seed=1).state_dict()
    for other in (
        ResumableSampler(range(11), seed=1),
        ResumableSampler(range(10), seed=2),
        ResumableSampler(range(10), seed=1, num_replicas=2, rank=0),
    ):
        with pytest.raises(ValueError, match="sampler state has"):
            other.load_state_dict(state)


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_shard_each_epoch_like_distributed_sampler(drop_last: bool) -> None:
    size, world = 11, 3
    shards = [
        ResumableSampler(range(size), seed=5, num_replicas=world, rank=r, drop_last=drop_last) for r in range(world)
    ]
    lists = [epoch(s, 1) for s in shards]
    assert len({len(x) for x in lists}) == 1 and all(len(x) == len(s) for x, s in zip(lists, shards, strict=True))
    covered = [i for x in lists for i in x]
    if drop_last:
        assert len(covered) == 9 and len(set(covered)) == 9  # the tail dropped, nothing twice
    else:
        assert len(covered) == 12 and set(covered) == set(range(size))  # padded by repeating the start
    # Each rank resumes its own shard.
    state = shards[1].state_dict(2)
    again = ResumableSampler(range(size), seed=5, num_replicas=world, rank=1, drop_last=drop_last)
    again.load_state_dict(state)
    assert list(again) == lists[1][2:]


def test_ranks_default_to_torchruns_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    s = ResumableSampler(range(8))
    assert (s.num_replicas, s.rank, len(s)) == (4, 3, 2)


def test_rng_state_round_trips_through_json() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random()
    np.random.normal()  # a cached gaussian in numpy's state
    saved = json.loads(json.dumps(rng_state()))
    expected = (random.random(), np.random.normal(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    set_rng_state(saved)
    got = (random.random(), np.random.normal(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
