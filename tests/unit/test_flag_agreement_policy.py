"""SavePolicy.agree: the flag agreement off the critical path, as pure logic.

Two policies play two ranks; their exchange is an in-memory all_reduce(MAX)
of what each posted (the transport is torch.distributed's, tested with real
ranks in tests/integration/test_dist_flag_agreement.py). What is checked
here is the decision: a flag is applied one call after it was posted, on
every rank alike; interval saves act at once; nothing is sent twice or lost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from spotguard.contract.control import CheckpointRequest
from spotguard.trainer.channel import Due
from spotguard.trainer.config import Settings
from spotguard.trainer.distributed import Agreement
from spotguard.trainer.policy import SavePolicy


class Wire:
    """Every rank's posted flags, in order: the n-th collect of a rank reduces every rank's n-th post."""

    def __init__(self, world_size: int) -> None:
        self.posts: list[list[list[float]]] = [[] for _ in range(world_size)]
        self.collected = [0] * world_size


class RankEnd:
    """One rank's end of the :class:`Wire` (what SavePolicy uses of DistContext)."""

    def __init__(self, wire: Wire, rank: int) -> None:
        self.wire, self.rank, self.world_size = wire, rank, len(wire.posts)

    def post(self, preempt: bool, save_now: bool, deadline: float | None, interval_due: bool) -> None:
        mine = self.wire.posts[self.rank]
        assert len(mine) == self.wire.collected[self.rank], "posted twice without collecting"
        mine.append(Agreement.flags(preempt, save_now, deadline, interval_due))

    def collect(self) -> Agreement | None:
        n = self.wire.collected[self.rank]
        if n == len(self.wire.posts[self.rank]):
            return None
        self.wire.collected[self.rank] += 1
        return Agreement.of([max(col) for col in zip(*(p[n] for p in self.wire.posts), strict=True)])


def settings(every_steps: int | None = None, every_seconds: float | None = None) -> Settings:
    return Settings(
        directory=Path("ck"),
        storage_uri=None,
        storage_options={},
        save_every_steps=every_steps,
        save_every_seconds=every_seconds,
        checksum="sha256",
        control_dir=Path("ck/.control"),
        keep_local=2,
        retention=None,
        upload=False,
        local_pruner="keep",
        job=None,
        attempt=None,
        async_save=True,
    )


class Ranks:
    """Two ranks' policies and pending requests, calling should_save in lockstep."""

    def __init__(self, every_steps: int | None = None, every_seconds: float | None = None, world: int = 2) -> None:
        wire = Wire(world)
        self.policies = [SavePolicy(settings(every_steps, every_seconds)) for _ in range(world)]
        self.ends = [RankEnd(wire, r) for r in range(world)]
        self.pending: list[list[CheckpointRequest]] = [[] for _ in range(world)]

    def should_save(self, step: int) -> list[bool]:
        return [p.agree(step, self.pending[r], cast(Any, self.ends[r])) for r, p in enumerate(self.policies)]

    def save(self, step: int) -> list[Due]:
        """What Checkpointer.save does with the policy: take the agreed requests, mark the step saved."""
        dues = []
        for r, policy in enumerate(self.policies):
            due = policy.take_agreed(step)
            ids = {q.id for q in due.requests}
            self.pending[r] = [q for q in self.pending[r] if q.id not in ids]
            policy.saved(step)
            dues.append(due)
        return dues


def sigterm(n: int = 1, deadline: float | None = None) -> CheckpointRequest:
    return CheckpointRequest(f"sigterm-{n}", "sigterm", deadline, True)


def test_a_flag_one_rank_sees_is_applied_one_step_later_on_every_rank() -> None:
    ranks = Ranks()
    assert ranks.should_save(3) == [False, False]
    ranks.pending[1].append(sigterm(deadline=1000.0))
    assert ranks.should_save(4) == [False, False]  # posted, not applied yet
    assert ranks.should_save(5) == [True, True]
    assert [p.agreed_preempt for p in ranks.policies] == [True, True]
    dues = ranks.save(5)
    assert [d.preempt for d in dues] == [True, True] and [d.deadline for d in dues] == [1000.0, 1000.0]
    assert dues[0].requests == [] and dues[0].reason == "sigterm"  # rank 0 saves for rank 1's signal
    assert [q.id for q in dues[1].requests] == ["sigterm-1"]
    assert ranks.should_save(6) == [False, False]  # answered once: not sent again
    assert ranks.should_save(7) == [False, False]


def test_interval_saves_act_at_once_and_a_request_still_lags_one_step() -> None:
    ranks = Ranks(every_steps=3)
    due = [s for s in range(1, 10) if ranks.should_save(s) == [True, True] and not ranks.save(s)[0].preempt]
    assert due == [3, 6, 9]
    ranks.pending[0].append(CheckpointRequest("r1", "proactive"))
    assert ranks.should_save(10) == [False, False]
    assert ranks.should_save(11) == [True, True]


def test_a_request_whose_agreed_save_did_not_come_is_sent_again() -> None:
    ranks = Ranks()
    ranks.pending[1].append(sigterm())
    ranks.should_save(1)
    assert ranks.should_save(2) == [True, True]  # the caller skips the save (a framework dropped it)
    assert ranks.should_save(3) == [False, False]
    assert ranks.should_save(4) == [True, True]
    assert [q.id for q in ranks.save(4)[1].requests] == ["sigterm-1"]
    assert ranks.should_save(5) == [False, False] and ranks.should_save(6) == [False, False]


def test_a_second_should_save_of_one_step_keeps_what_the_first_agreed() -> None:
    ranks = Ranks()
    ranks.pending[0].append(CheckpointRequest("r1", "proactive"))
    ranks.should_save(1)
    assert ranks.should_save(2) == [True, True]
    assert ranks.should_save(2) == [True, True]
    assert [q.id for q in ranks.save(2)[0].requests] == ["r1"]
    assert ranks.should_save(3) == [False, False]


def test_the_time_interval_goes_through_the_agreement_and_a_save_since_cancels_it() -> None:
    ranks = Ranks(every_seconds=3600)
    ranks.policies[1].last_save_time -= 7200  # only rank 1's clock says the interval passed
    assert ranks.should_save(1) == [False, False]
    assert ranks.should_save(2) == [True, True]
    ranks.save(2)
    # Rank 1 posted its interval again at should_save(2), before that save: not a second save.
    assert ranks.should_save(3) == [False, False]
    assert ranks.should_save(4) == [False, False]


def test_one_rank_answers_at_once() -> None:
    ranks = Ranks(world=1)
    ranks.pending[0].append(sigterm())
    assert ranks.should_save(1) == [True]
    assert ranks.save(1)[0].preempt
