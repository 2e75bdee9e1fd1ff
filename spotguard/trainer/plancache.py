"""DCP's plan caching, one cache per checkpointer, used only where every rank holds it.

``dcp.save`` exchanges every rank's save plan (one write item per tensor
chunk) with the coordinator and sends each rank its final plan back: with a
fine-tune's frozen base of a few hundred shards per rank, pickling and
unpickling those plans is most of a preemption's save. Torch can cache them
(``DefaultSavePlanner(enable_plan_caching=True)``): a rank whose plan did not
change sends an empty one, the coordinator reuses the global plan and
metadata it cached, and the rank its cached final plan.

Torch keeps those caches in class attributes of ``SavePlanner``, under a key
that is the planner's class name by default: every save of a process shares
them, so a process that saved for another group, another run or another
checkpointer before (a test session, a restarted checkpointer) finds plans
that are not this save's; a rank told "unchanged" with nothing cached fails
in ``finish_plan`` while the others wait, and a coordinator with another
save's plans could leave a rank's items out of the metadata.

Here each checkpointer caches under its own key, and the key carries a
*generation* the ranks agree on before every save (:class:`PlanCache`):
each rank says which generation its caches hold (0: none, or its last save
failed) in the ``all_reduce`` that starts every save
(:meth:`~spotguard.trainer.distributed.DistContext.start_save`), and the save
uses that generation's caches only when every rank holds the same one.
Otherwise every rank drops what it cached and the save starts a new
generation, whose plans are exchanged in full and cached again. A save that
raises drops the caches of its rank, so the next save starts afresh.
"""

from __future__ import annotations

import inspect
import logging
import uuid
from typing import Any

log = logging.getLogger(__name__)

#: The class attributes of ``SavePlanner`` where torch caches plans, by key.
_CACHES = (
    "_cached_save_plan",
    "_cached_final_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
)


def agreed_generation(lowest: int, highest: int) -> int:
    """Pure: the generation a save uses, from the lowest and highest any rank holds: the one every
    rank holds, else a new one no rank has cached under."""
    if lowest == highest and lowest > 0:
        return lowest
    return highest + 1


class PlanCache:
    """One checkpointer's DCP plan caches (see the module's docstring)."""

    def __init__(self) -> None:
        self._prefix = f"spotguard.{uuid.uuid4().hex}"
        self.held = 0  # the generation this rank's caches hold; 0: none
        self.supported = _supported()

    def key(self, generation: int) -> str:
        return f"{self._prefix}.{generation}"

    def planner(self, generation: int) -> Any:
        """The planner of a save of ``generation`` (:func:`agreed_generation`): caching under its
        key, the caches of any other generation dropped first. Without plan caching in this torch
        release (or ``generation`` 0), torch's default planner, caching nothing."""
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        if not self.supported or generation <= 0:
            return DefaultSavePlanner()
        if generation != self.held:
            self.drop()
        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = self.key(generation)
        return planner

    def saved(self, generation: int) -> None:
        """The save of ``generation`` returned on this rank: its caches hold that generation."""
        self.held = generation if self.supported and generation > 0 else 0

    def drop(self) -> None:
        """Forget every plan this checkpointer cached (a failed save, a new generation, close)."""
        from torch.distributed.checkpoint.planner import SavePlanner

        held, self.held = self.held, 0
        if held <= 0:
            return
        key = self.key(held)
        for name in _CACHES:
            cache = getattr(SavePlanner, name, None)
            if isinstance(cache, dict):
                cache.pop(key, None)


def _supported() -> bool:
    """Whether this torch release caches plans under a planner's own ``_cached_plans_key``."""
    try:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.planner import SavePlanner
    except ImportError:  # pragma: no cover - a torch without DCP is refused earlier
        return False
    if "enable_plan_caching" not in inspect.signature(DefaultSavePlanner.__init__).parameters:
        return False
    if not all(isinstance(getattr(SavePlanner, name, None), dict) for name in _CACHES):
        return False
    try:
        return isinstance(DefaultSavePlanner(enable_plan_caching=True)._cached_plans_key, str)
    except AttributeError:
        return False
