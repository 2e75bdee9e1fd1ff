"""When to save, and what the saves so far left behind.

:class:`SavePolicy` answers ``should_save(step)`` from the settings' interval
(every N steps, every S seconds since the last save) and, under
torch.distributed, keeps the one answer every rank agreed on (a single
``all_reduce``, :meth:`~spotguard.trainer.distributed.DistContext.agree`) so
that the save which follows answers the same requests on every rank. It also
says whether a save waits for its write (:meth:`SavePolicy.synchronous`).
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


class SavePolicy:
    """The interval between saves and the last step saved (or restored)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        #: The step checkpointed last (committed, being written, or restored).
        self.last_step: int | None = None
        self.last_save_time = time.monotonic()
        self._agreed: _Agreed | None = None

    def saved(self, step: int | None) -> None:
        """``step`` is checkpointed now (its phase one is done, or it was restored)."""
        self.last_step = step
        self.last_save_time = time.monotonic()

    def interval_due(self, step: int) -> bool:
        """Whether the interval asks for a save after ``step``: a positive
        multiple of ``save_every_steps``, or ``save_every_seconds`` passed."""
        if step == self.last_step:
            return False
        every_steps, every_seconds = self._settings.save_every_steps, self._settings.save_every_seconds
        if every_steps and step > 0 and step % every_steps == 0:
            return True
        return bool(every_seconds and time.monotonic() - self.last_save_time >= every_seconds)

    def synchronous(self, blocking: bool | None, preempt: bool) -> bool:
        """Whether a save waits for its write: as ``blocking`` says, else for
        a preemption or with ``async_save=False``."""
        return blocking if blocking is not None else (preempt or not self._settings.async_save)

    # -- under torch.distributed ------------------------------------------------------
    def agree(self, step: int, pending: list[CheckpointRequest], dist: DistContext) -> bool:
        """Every rank's flags OR-ed (one all_reduce): the same answer everywhere."""
        requests = list(pending)
        mine = Due.of(requests)
        agreed = dist.agree(mine.preempt, bool(requests), mine.deadline, self.interval_due(step))
        self._agreed = _Agreed(step, Due(requests, agreed.preempt, agreed.deadline))
        return agreed.preempt or agreed.save_now or agreed.interval_due

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
