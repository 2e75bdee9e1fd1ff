"""When to save, and what the saves so far left behind.

:class:`SavePolicy` answers ``should_save(step)`` from the settings' interval
(every N steps, every S seconds since the last save) and, under
torch.distributed, keeps the one answer every rank agreed on so that the
save which follows answers the same requests on every rank. The agreement
is off the critical path (:meth:`SavePolicy.agree`): the flags a rank sees at
``should_save(k)`` go out in an all_reduce that runs during step ``k + 1``
and decide ``should_save(k + 1)`` on every rank; saves every N steps are a
function of the step and happen at once. It also says whether a save waits
for its write (:meth:`SavePolicy.synchronous`).
:class:`SaveRecord` holds what the Checkpointer reports about its saves
(``last_committed``, ``last_error``, the seconds of each phase); the local
and collective saves (:mod:`~spotguard.trainer.persist`,
:mod:`~spotguard.trainer.collective`) and the uploader write it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from spotguard.contract.control import CheckpointRequest
from spotguard.trainer.channel import Due
from spotguard.trainer.config import Settings
from spotguard.trainer.distributed import DistContext


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

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        #: The step checkpointed last (committed, being written, or restored).
        self.last_step: int | None = None
        self.last_save_time = time.monotonic()
        self._agreed: _Agreed | None = None
        self._posted: _Posted | None = None
        self._saves = 0

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
    def agree(self, step: int, pending: list[CheckpointRequest], dist: DistContext) -> bool:
        """``should_save(step)`` under torch.distributed: the same answer on every rank.

        A blocking all_reduce per step would cost a round trip of the
        slowest rank at every step; instead the flags go out without waiting
        and are applied one call later. ``should_save(k)`` (1) collects the
        exchange posted by the previous call: the requests this rank sent in
        it, any rank's preempt, the earliest deadline, any rank's time
        interval (unless a save came since); (2) posts the requests that
        arrived since and this rank's time interval; (3) answers with (1),
        or at once for a multiple of ``save_every_steps``. Every rank does
        the same calls, so every rank acts on a flag at the same step: one
        step after the first rank saw it. A request is sent once; one whose
        agreed save did not come (the caller skipped ``save``) is sent again.
        With one rank there is nothing to agree on: the answer is at once.
        """
        if dist.world_size == 1:
            requests = list(pending)
            mine = Due.of(requests)
            self._agreed = _Agreed(step, mine, bool(requests))
            return bool(requests) or self.interval_due(step)
        answer = dist.collect()
        posted, self._posted = self._posted, None
        # A second should_save of one step (a framework's callbacks) adds to what the first agreed on.
        held = self._agreed if self._agreed is not None and self._agreed.step == step else None
        requests = list(held.due.requests) if held is not None else []
        preempt = held.due.preempt if held is not None else False
        deadline = held.due.deadline if held is not None else None
        now = held.now if held is not None else False
        if answer is not None and posted is not None:
            known = {r.id for r in requests}
            live = {r.id for r in pending}
            requests += [r for r in posted.requests if r.id in live and r.id not in known]
            preempt = preempt or answer.preempt
            if answer.deadline is not None:
                deadline = answer.deadline if deadline is None else min(deadline, answer.deadline)
            now = now or answer.save_now or answer.preempt or (answer.interval_due and posted.saves == self._saves)
        self._agreed = _Agreed(step, Due(requests, preempt, deadline), now)
        sent = {r.id for r in requests}
        news = [r for r in pending if r.id not in sent]
        mine = Due.of(news)
        dist.post(mine.preempt, bool(news), mine.deadline, self.seconds_due(step))
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
