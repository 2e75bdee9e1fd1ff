"""When to save, and what the saves so far left behind.

:class:`SavePolicy` answers ``should_save(step)`` from the settings' interval
(every N steps, every S seconds since the last save) and, under
torch.distributed, keeps the one answer every rank agreed on so that the
save which follows answers the same requests on every rank. The agreement
is off the critical path (:meth:`SavePolicy.agree`): the flags go out in an
all_reduce that is not waited for, and the exchange that decides is the
next one, ``every`` calls later (:class:`ExchangeSchedule`: one step when
steps are long, a few when they are short, so that the exchanges cost
noise); saves every N steps are a function of the step and happen at once.
It also says whether a save waits for its write
(:meth:`SavePolicy.synchronous`).
:class:`SaveRecord` holds what the Checkpointer reports about its saves
(``last_committed``, ``last_error``, the seconds of each phase); the local
and collective saves (:mod:`~spotguard.trainer.persist`,
:mod:`~spotguard.trainer.collective`) and the uploader write it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spotguard.contract.control import CheckpointRequest
from spotguard.trainer.channel import Due, TrainerChannel
from spotguard.trainer.config import CheckpointerConfig
from spotguard.trainer.distributed import DistContext

#: Flags are exchanged about this often at most: one exchange costs the
#: training thread some 0.1-0.3 ms (issuing gloo's all_reduce, collecting the
#: last one), noise against this much time of steps; a preemption's save
#: starts at most about twice this later (against a notice of 30 s or more).
EXCHANGE_SECONDS = 0.1
#: At least one exchange per this many ``should_save`` calls: the lag in steps
#: stays bounded even if steps slow down at once after a fast stretch.
EXCHANGE_MAX_CALLS = 16


class ExchangeSchedule:
    """Which ``should_save`` calls exchange flags, the same calls on every rank.

    Every exchange carries each rank's proposal for the next period: how many
    calls fit in :data:`EXCHANGE_SECONDS` at the pace measured since its last
    exchange (1 when a step takes longer, at most :data:`EXCHANGE_MAX_CALLS`).
    The all_reduce makes it the most any rank proposed (ranks in lockstep
    measure the same pace; the largest rides over one rank's hiccup), and
    the call that collects that answer schedules the next exchange with it:
    every rank counts the same calls, so every rank exchanges at the same
    ones. A flag a rank sees is sent at its next exchange and acted on at
    the one after: ``every`` to ``2 * every - 1`` calls later, about twice
    :data:`EXCHANGE_SECONDS` plus a step (at most ``2 * EXCHANGE_MAX_CALLS``
    steps should the steps slow down at once).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.calls = 0  # should_save calls so far
        self.next = 0  # the call that exchanges next
        self.every = 1  # the period agreed last
        self._last: tuple[int, float] | None = None  # the last exchange: its call and time

    def due(self) -> bool:
        """Count one call; whether it exchanges."""
        call, self.calls = self.calls, self.calls + 1
        return call >= self.next

    def exchanged(self, agreed: int | None) -> int:
        """This call exchanges (collected ``agreed``, the period the last
        exchange settled on, None for the first one): schedule the next, and
        return this rank's proposal to post."""
        call, now = self.calls - 1, self.clock()
        self.every = max(1, min(EXCHANGE_MAX_CALLS, agreed or 1))
        self.next = call + self.every
        last, self._last = self._last, (call, now)
        if last is None or call <= last[0]:
            return 1
        per_call = (now - last[1]) / (call - last[0])
        if per_call <= 0:
            return EXCHANGE_MAX_CALLS
        return max(1, min(EXCHANGE_MAX_CALLS, int(EXCHANGE_SECONDS / per_call)))


@dataclass
class SaveRecord:
    """What the Checkpointer reports about its saves (its attributes of the same names)."""

    last_committed: Path | None = None
    last_error: BaseException | None = None
    #: Seconds the training thread waited in the last save (phase one).
    last_stall_seconds: float = 0.0
    #: Seconds the last write took (phase two).
    last_persist_seconds: float = 0.0


@dataclass(frozen=True)
class _Agreed:
    """What every rank agreed on in ``should_save(step)``."""

    step: int
    due: Due
    #: The answer ``should_save(step)`` gave (a request on another rank, or the time interval, without one here).
    now: bool = False


@dataclass(frozen=True)
class _Posted:
    """The flags this rank sent in the exchange now in flight."""

    #: The requests they stand for (answered by the save the exchange decides).
    requests: list[CheckpointRequest]
    #: Saves so far when posted: a time interval that a save since then met is not due any more.
    saves: int


class SavePolicy:
    """The interval between saves and the last step saved (or restored)."""

    def __init__(self, settings: CheckpointerConfig) -> None:
        self._settings = settings
        #: The step checkpointed last (committed, being written, or restored).
        self.last_step: int | None = None
        self.last_save_time = time.monotonic()
        self._agreed: _Agreed | None = None
        self._posted: _Posted | None = None
        self._saves = 0
        self.exchanges = ExchangeSchedule()

    def saved(self, step: int | None) -> None:
        """``step`` is checkpointed now (its phase one is done, or it was restored)."""
        self.last_step = step
        self.last_save_time = time.monotonic()
        self._saves += 1

    def interval_due(self, step: int) -> bool:
        """Whether the interval asks for a save after ``step``: a positive
        multiple of ``save_every_steps``, or ``save_every_seconds`` passed."""
        return self.steps_due(step) or self.seconds_due(step)

    def steps_due(self, step: int) -> bool:
        """Whether ``step`` is a positive multiple of ``save_every_steps`` not
        saved yet: the same on every rank, no agreement needed."""
        every = self._settings.save_every_steps
        return bool(every and step > 0 and step % every == 0 and step != self.last_step)

    def seconds_due(self, step: int) -> bool:
        """Whether ``save_every_seconds`` passed since the last save (each
        rank's clock: under torch.distributed it goes through the agreement)."""
        every = self._settings.save_every_seconds
        return bool(every and step != self.last_step and time.monotonic() - self.last_save_time >= every)

    def synchronous(self, blocking: bool | None, preempt: bool) -> bool:
        """Whether a save waits for its write: as ``blocking`` says, else for
        a preemption or with ``async_save=False``."""
        return blocking if blocking is not None else (preempt or not self._settings.async_save)

    # -- under torch.distributed ------------------------------------------------------
    def agree(self, step: int, pending: Callable[[], list[CheckpointRequest]], dist: DistContext) -> bool:
        """``should_save(step)`` under torch.distributed: the same answer on every rank.

        A blocking all_reduce per step would cost a round trip of the
        slowest rank at every step; instead the flags go out without waiting
        and are applied at the next exchange (:class:`ExchangeSchedule`: the
        next call when steps are long, a few calls later when they are short).
        An exchanging call (1) collects the exchange posted by the previous
        one: the requests this rank sent in it, any rank's preempt, the
        earliest deadline, any rank's time interval (unless a save came
        since); (2) posts the requests that arrived since and this rank's
        time interval; (3) answers with (1). A call between exchanges
        answers only a multiple of ``save_every_steps`` (at once, on every
        rank alike). Every rank makes the same calls, so every rank acts on
        a flag at the same step. A request is sent once; one whose agreed
        save did not come (the caller skipped ``save``) is sent again. With
        one rank there is nothing to agree on: the answer is at once.
        ``pending`` polls for requests: only exchanging calls need them.
        """
        if dist.world_size == 1:
            requests = list(pending())
            mine = Due.of(requests)
            self._agreed = _Agreed(step, mine, bool(requests))
            return bool(requests) or self.interval_due(step)
        # A second should_save of one step (a framework's callbacks) adds to what the first agreed on.
        held = self._agreed if self._agreed is not None and self._agreed.step == step else None
        if not self.exchanges.due():
            if held is None:
                self._agreed = held = _Agreed(step, Due([], False, None))
            return held.now or self.steps_due(step)
        answer = dist.collect()
        posted, self._posted = self._posted, None
        waiting = pending()
        requests = list(held.due.requests) if held is not None else []
        preempt = held.due.preempt if held is not None else False
        deadline = held.due.deadline if held is not None else None
        now = held.now if held is not None else False
        if answer is not None and posted is not None:
            known = {r.id for r in requests}
            live = {r.id for r in waiting}
            requests += [r for r in posted.requests if r.id in live and r.id not in known]
            preempt = preempt or answer.preempt
            if answer.deadline is not None:
                deadline = answer.deadline if deadline is None else min(deadline, answer.deadline)
            now = now or answer.save_now or answer.preempt or (answer.interval_due and posted.saves == self._saves)
        self._agreed = _Agreed(step, Due(requests, preempt, deadline), now)
        sent = {r.id for r in requests}
        news = [r for r in waiting if r.id not in sent]
        mine = Due.of(news)
        proposal = self.exchanges.exchanged(answer.every if answer is not None else None)
        dist.post(mine.preempt, bool(news), mine.deadline, self.seconds_due(step), proposal)
        self._posted = _Posted(news, self._saves)
        return now or self.steps_due(step)

    @property
    def agreed_preempt(self) -> bool:
        """Whether the ranks agreed, in the last ``should_save``, on a preemption's save."""
        return self._agreed is not None and self._agreed.due.preempt

    def take_agreed(self, step: int) -> Due:
        """What every rank agreed on in ``should_save(step)``: its requests,
        whether one preempts, the earliest deadline (nothing when the last
        ``should_save`` was for another step). A request that arrived since
        waits for the next ``should_save``."""
        agreed = self._agreed if self._agreed is not None and self._agreed.step == step else None
        self._agreed = None
        return agreed.due if agreed is not None else Due([], False, None)


class SaveTrigger:
    """When a Checkpointer's save is due and which requests it answers: in one
    process the pending requests (signals, the request file) and the interval;
    under torch.distributed what every rank agreed on (:meth:`SavePolicy.agree`)."""

    def __init__(self, policy: SavePolicy, channel: TrainerChannel, dist: DistContext | None) -> None:
        self._policy = policy
        self._channel = channel
        self._dist = dist

    def should_save(self, step: int) -> bool:
        """:meth:`Checkpointer.should_save`."""
        if self._dist is not None:
            return self._policy.agree(step, self._polled, self._dist)
        return bool(self._polled()) or self._policy.interval_due(step)

    def _polled(self) -> list[CheckpointRequest]:
        """The pending requests, the request file and signals read now."""
        self._channel.poll()
        return self._channel.pending

    def take(self, step: int) -> Due:
        """The requests the save of ``step`` answers: the pending ones, or
        under torch.distributed those every rank agreed on in ``should_save(step)``."""
        if self._dist is None:
            return self._channel.take()
        due = self._policy.take_agreed(step)
        self._channel.drop(due.requests)
        return due

    @property
    def stop_requested(self) -> bool:
        """:attr:`Checkpointer.stop_requested`."""
        if self._dist is not None:
            return self._policy.agreed_preempt
        return any(r.preempt for r in self._polled())
