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

Before a rank can tell its plan unchanged, torch builds it anew, item by
item (a DTensor's chunk worked out from its mesh and placements), and
compares it with the cached one: with hundreds of frozen shards per rank,
most of a preemption's plan. The planner here (:class:`ReusingSavePlanner`)
takes the previous save's write items of every item the stage found
unchanged (its value the very host copy the previous save planned: the same
object, whose shape, sharding and dtype the stage compared), and plans only
the others.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import uuid
from collections.abc import Collection
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
        #: The last save's write items by DCP name, with the value they were planned for (held: never another's id).
        self.items: dict[str, tuple[Any, list[Any]]] = {}

    def key(self, generation: int) -> str:
        return f"{self._prefix}.{generation}"

    def planner(self, generation: int, unchanged: Collection[str] | None = None, flattened: Any = None) -> Any:
        """The planner of a save of ``generation`` (:func:`agreed_generation`): caching under its
        key, the caches of any other generation dropped first, the write items of the items named in
        ``unchanged`` taken from the previous save (:class:`ReusingSavePlanner`; None: nothing kept for
        the next save either, as where the stager keeps no host copies, which would be held here),
        the state dict flattened as the stage flattened it where ``flattened`` (a
        :class:`~spotguard.trainer.dcpwriter.Flattened`) was made of it.
        Without plan caching in this torch release (or ``generation`` 0), torch's default planner,
        caching nothing."""
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        if not self.supported or generation <= 0:
            self.items = {}
            return DefaultSavePlanner()
        if generation != self.held:
            self.drop()
        planner = _reusing_planner_class()(self, unchanged, flattened)
        planner._cached_plans_key = self.key(generation)
        return planner

    def saved(self, generation: int) -> None:
        """The save of ``generation`` returned on this rank: its caches hold that generation."""
        self.held = generation if self.supported and generation > 0 else 0

    def drop(self) -> None:
        """Forget every plan this checkpointer cached (a failed save, a new generation, close)."""
        from torch.distributed.checkpoint.planner import SavePlanner

        held, self.held = self.held, 0
        self.items = {}
        if held <= 0:
            return
        key = self.key(held)
        for name in _CACHES:
            cache = getattr(SavePlanner, name, None)
            if isinstance(cache, dict):
                cache.pop(key, None)


def plan_items(
    state_dict: dict[str, Any], previous: dict[str, tuple[Any, list[Any]]], unchanged: Collection[str], create: Any
) -> tuple[list[Any], dict[str, tuple[Any, list[Any]]]]:
    """Pure: a rank's write items for a flattened ``state_dict`` in its order, and the memory of them
    for the next save: an item named in ``unchanged`` whose value is the very object ``previous``
    planned takes its write items from there; every other one gets ``create(fqn, value)`` (a list,
    empty for a DTensor of a mesh this rank is not in, as torch's default plan leaves it)."""
    items: list[Any] = []
    memo: dict[str, tuple[Any, list[Any]]] = {}
    for fqn, value in state_dict.items():
        before = previous.get(fqn) if fqn in unchanged else None
        made = before[1] if before is not None and before[0] is value else create(fqn, value)
        memo[fqn] = (value, made)
        items += made
    return items, memo


_PLANNER_CLASS: Any = None


def _reusing_planner_class() -> Any:
    """:class:`ReusingSavePlanner`, defined once torch is imported (torch is imported lazily)."""
    global _PLANNER_CLASS
    if _PLANNER_CLASS is None:
        _PLANNER_CLASS = _define_planner()
    return _PLANNER_CLASS


def _create_items(fqn: str, value: Any) -> list[Any]:
    """Torch's write items of one item, as its ``create_default_local_save_plan`` makes them: none
    for a DTensor of a mesh this rank is not in."""
    from torch.distributed.checkpoint.planner_helpers import _create_write_items
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor) and value.device_mesh.get_coordinate() is None:
        return []
    return list(_create_write_items(fqn, value))


def _define_planner() -> Any:
    from torch.distributed.checkpoint import _version
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
    from torch.distributed.checkpoint.planner_helpers import _compare_save_plans

    # Whether torch's ``finish_plan`` caches the local plan a save made (else its ``create_local_plan`` does).
    promoted_in_finish_plan = "_pending_local_plan" in DefaultSavePlanner.finish_plan.__code__.co_names
    # Whether torch's ``set_up_planner`` is the one this module knows: the state dict flattened (then its
    # sharded tensors), kept with whether this rank is the coordinator, nothing else.
    set_up_known = tuple(inspect.signature(DefaultSavePlanner.set_up_planner).parameters) == (
        "self",
        "state_dict",
        "storage_meta",
        "is_coordinator",
    ) and set(DefaultSavePlanner.set_up_planner.__code__.co_names) <= {
        "flatten_state_dict",
        "mappings",
        "flatten_sharded_tensors",
        "_flatten_sharded_tensors",
        "state_dict",
        "is_coordinator",
    }

    class ReusingSavePlanner(DefaultSavePlanner):
        """Torch's default planner, with plan caching, whose local plan reuses the write items of the
        items a stage found unchanged (see the module's docstring); the rest of its caching is torch's
        ``create_local_plan``'s, step for step."""

        def __init__(self, cache: PlanCache, unchanged: Collection[str] | None, flattened: Any = None) -> None:
            super().__init__(enable_plan_caching=True)
            self._cache = cache
            self._unchanged = unchanged
            self._flattened = flattened

        def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
            """Torch's, but the state dict flattened as the stage flattened it, where it was made of the
            very tree ``dcp.save`` hands here (:class:`~spotguard.trainer.dcpwriter.Flattened`: the
            same names, paths and order as torch's ``flatten_state_dict``, every leaf a tensor)."""
            flattened, self._flattened = self._flattened, None
            done = (
                flattened.of_saved(state_dict)
                if flattened is not None
                and set_up_known
                and self.flatten_state_dict
                and _version._derived_version is None  # not the 2.3 walk
                else None
            )
            if done is None or (self.flatten_sharded_tensors and _any_sharded_tensor(done[0].values())):
                super().set_up_planner(state_dict, storage_meta, is_coordinator)
                return
            self.state_dict, self.mappings = done
            self.is_coordinator = is_coordinator

        def create_local_plan(self) -> Any:
            previous = self._cache.items
            self._cache.items = {}
            items, memo = plan_items(self.state_dict, previous, self._unchanged or (), _create_items)
            if self._unchanged is not None:
                self._cache.items = memo
            plan = SavePlan(items)
            if self.flatten_state_dict:
                plan = dataclasses.replace(plan, planner_data=self.mappings)
            self.plan = plan
            cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
            if cached is not None and _same_plan(plan, cached, _compare_save_plans):
                return SavePlan([], usable=False)
            if promoted_in_finish_plan:  # promoted by finish_plan once the global plan succeeded
                self._pending_local_plan = plan
            else:  # an earlier release: cached at once, as its create_local_plan does
                SavePlanner._cached_save_plan[self._cached_plans_key] = plan
            return self.plan

    ReusingSavePlanner.__module__ = __name__
    return ReusingSavePlanner


def _any_sharded_tensor(values: Any) -> bool:
    """Whether any of ``values`` is a ``ShardedTensor`` (torch's planner rewrites those)."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    return any(issubclass(kind, ShardedTensor) for kind in {type(v) for v in values})


def _same_plan(plan: Any, cached: Any, compare: Any) -> bool:
    """Torch's ``_compare_save_plans(plan, cached)`` (``compare``), item by item, but for the items that
    are the very write items of the cached plan (reused by :func:`plan_items`: equal to themselves),
    which are not compared field by field again."""
    from torch.distributed.checkpoint.planner import SavePlan

    if plan.usable != cached.usable or len(plan.items) != len(cached.items):
        return False
    pairs = [(a, b) for a, b in zip(plan.items, cached.items, strict=True) if a is not b]
    return not pairs or bool(compare(SavePlan([a for a, _ in pairs]), SavePlan([b for _, b in pairs])))


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
