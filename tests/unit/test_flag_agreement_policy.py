"""SavePolicy.agree: the flag agreement off the critical path, as pure logic.

Two policies play two ranks; their exchange is an in-memory all_reduce(MAX)
of what each posted (the transport is torch.distributed's, tested with real
ranks in tests/integration/test_dist_flag_agreement.py). What is checked
here is the decision: a flag is applied at the exchange after the one that
posted it, on every rank alike (the next call when steps are long, a few
calls later when they are short); interval saves act at once; nothing is
sent twice or lost. The ranks' clocks are fake: each call advances them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from spotguard.contract.control import CheckpointRequest
from spotguard.trainer.channel import Due
from spotguard.trainer.config import CheckpointerConfig
from spotguard.trainer.distributed import Agreement
from spotguard.trainer.policy import EXCHANGE_MAX_CALLS, EXCHANGE_SECONDS, ExchangeSchedule, SavePolicy


class Wire:
    """Every rank's posted flags, in order: the n-th collect of a rank reduces every rank's n-th post."""

    def __init__(self, world_size: int) -> None:
        self.posts: list[list[list[float]]] = [[] for _ in range(world_size)]
        self.collected = [0] * world_size


class RankEnd:
    """One rank's end of the :class:`Wire` (what SavePolicy uses of DistContext)."""

    def __init__(self, wire: Wire, rank: int) -> None:
        self.wire, self.rank, self.world_size = wire, rank, len(wire.posts)

    def post(self, preempt: bool, save_now: bool, deadline: float | None, interval_due: bool, every: int = 1) -> None:
        mine = self.wire.posts[self.rank]
        assert len(mine) == self.wire.collected[self.rank], "posted twice without collecting"
        mine.append(Agreement.flags(preempt, save_now, deadline, interval_due, every))

    def collect(self) -> Agreement | None:
        n = self.wire.collected[self.rank]
        if n == len(self.wire.posts[self.rank]):
            return None
        self.wire.collected[self.rank] += 1
        return Agreement.of([max(col) for col in zip(*(p[n] for p in self.wire.posts), strict=True)])


def settings(every_steps: int | None = None, every_seconds: float | None = None) -> CheckpointerConfig:
    return CheckpointerConfig(
        directory=Path("ck"), save_every_steps=every_steps, save_every_seconds=every_seconds, checksum="sha256"
    )


class Clock:
    """A rank's fake monotonic clock: ``seconds`` pass at every should_save call."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.now = seconds, 1000.0

    def __call__(self) -> float:
        return self.now


class Ranks:
    """Two ranks' policies and pending requests, calling should_save in lockstep
    (steps of ``step_seconds``: longer than the exchange period by default, so
    every call exchanges)."""

    def __init__(
        self,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        world: int = 2,
        step_seconds: float | list[float] = 0.1,
    ) -> None:
        self.wire = wire = Wire(world)
        self.policies = [SavePolicy(settings(every_steps, every_seconds)) for _ in range(world)]
        paces = step_seconds if isinstance(step_seconds, list) else [step_seconds] * world
        self.clocks = [Clock(s) for s in paces]
        for policy, clock in zip(self.policies, self.clocks, strict=True):
            policy.exchanges.clock = clock
        self.ends = [RankEnd(wire, r) for r in range(world)]
        self.pending: list[list[CheckpointRequest]] = [[] for _ in range(world)]

    def should_save(self, step: int) -> list[bool]:
        for clock in self.clocks:
            clock.now += clock.seconds
        return [
            p.agree(step, lambda r=r: self.pending[r], cast(Any, self.ends[r]))  # type: ignore[misc]
            for r, p in enumerate(self.policies)
        ]

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


def test_short_steps_exchange_every_few_calls_and_every_rank_acts_at_one_step() -> None:
    ranks = Ranks(step_seconds=0.01)  # 10 ms steps: 10 calls per exchange
    for step in range(1, 60):
        assert ranks.should_save(step) == [False, False]
    period = int(EXCHANGE_SECONDS / 0.01)
    assert 1 < period < EXCHANGE_MAX_CALLS
    assert [p.exchanges.every for p in ranks.policies] == [period, period]
    posts = len(ranks.wire.posts[0])
    for step in range(60, 60 + 4 * period):
        ranks.should_save(step)
    assert len(ranks.wire.posts[0]) - posts in (4, 5)  # one exchange per period, not one per step
    seen = 60 + 4 * period
    ranks.pending[1].append(sigterm(deadline=1000.0))
    step = seen
    while True:
        answers = ranks.should_save(step)
        assert answers[0] == answers[1]  # the same answer on every rank, at every call
        if answers[0]:
            break
        step += 1
    assert period <= step - seen <= 2 * period - 1, (
        step,
        seen,
        period,
    )  # sent at the next exchange, acted at the one after
    dues = ranks.save(step)
    assert [d.preempt for d in dues] == [True, True] and [q.id for q in dues[1].requests] == ["sigterm-1"]


def test_the_most_calls_any_rank_proposes_is_the_period_of_all() -> None:
    ranks = Ranks(step_seconds=[0.01, 0.025])  # rank 0 measures 10 calls per exchange, rank 1 4
    for step in range(1, 80):
        ranks.should_save(step)
        assert len(ranks.wire.posts[0]) == len(ranks.wire.posts[1])  # the same calls exchange on both
    assert [p.exchanges.every for p in ranks.policies] == [10, 10]


def test_interval_saves_between_exchanges_act_at_once() -> None:
    ranks = Ranks(every_steps=7, step_seconds=0.0001)  # the longest period
    due = [s for s in range(1, 120) if ranks.should_save(s) == [True, True] and ranks.save(s)]
    assert due == list(range(7, 120, 7))


def test_the_schedule_proposes_one_call_for_slow_steps_and_is_bounded_for_fast_ones() -> None:
    now = [0.0]
    sched = ExchangeSchedule(clock=lambda: now[0])
    assert sched.due() and sched.exchanged(None) == 1  # nothing measured yet
    now[0] += 0.5
    assert sched.due() and sched.exchanged(1) == 1  # a step of 0.5 s: every call
    now[0] += 1e-7
    assert sched.due() and sched.exchanged(1) == EXCHANGE_MAX_CALLS
    assert sched.due() and sched.exchanged(3) >= 1 and sched.next == sched.calls - 1 + 3  # the agreed period
    assert not sched.due() and not sched.due() and sched.due()
