"""DCP plan caches keyed per checkpointer and agreed between ranks (spotguard.trainer.plancache)."""

from __future__ import annotations

import pytest

from spotguard.trainer.plancache import PlanCache, agreed_generation


@pytest.mark.parametrize(
    ("lowest", "highest", "used"),
    [
        (0, 0, 1),  # nothing cached anywhere: a first generation
        (3, 3, 3),  # every rank holds generation 3: its caches are used
        (0, 3, 4),  # a rank holds none (its save failed, it restarted): a new one for all
        (2, 3, 4),  # ranks disagree: a new one, cached under a key no rank used
    ],
)
def test_a_generation_is_used_only_where_every_rank_holds_it(lowest: int, highest: int, used: int) -> None:
    assert agreed_generation(lowest, highest) == used


def test_each_checkpointer_caches_under_its_own_keys_and_drops_them() -> None:
    pytest.importorskip("torch")
    from torch.distributed.checkpoint.planner import SavePlanner

    a, b = PlanCache(), PlanCache()
    if not a.supported:
        pytest.skip("this torch release has no plan caching")
    assert a.key(1) != b.key(1)
    planner = a.planner(1)
    assert planner._cached_plans_key == a.key(1) and planner._enable_plan_caching
    SavePlanner._cached_save_plan[a.key(1)] = SavePlanner._cached_save_plan[b.key(1)] = object()
    a.saved(1)
    assert a.held == 1
    a.planner(1)  # the same generation: kept
    assert a.key(1) in SavePlanner._cached_save_plan
    a.planner(2)  # a new one: the old dropped, another checkpointer's left alone
    assert a.key(1) not in SavePlanner._cached_save_plan and a.held == 0
    assert b.key(1) in SavePlanner._cached_save_plan
    b.saved(1)
    b.drop()
    assert b.key(1) not in SavePlanner._cached_save_plan and b.held == 0
    assert not a.planner(0)._enable_plan_caching  # generation 0: torch's default planner, caching nothing


def test_an_unchanged_item_takes_the_write_items_planned_for_that_very_value() -> None:
    from spotguard.trainer.plancache import plan_items

    made: list[str] = []

    def create(fqn: str, value: object) -> list[tuple[str, object]]:
        made.append(fqn)
        return [(fqn, value)]

    base, head, other = object(), object(), object()
    items, memo = plan_items({"base": base, "head": head}, {}, {"base", "head"}, create)
    assert made == ["base", "head"] and items == [("base", base), ("head", head)]

    made.clear()
    again, memo2 = plan_items({"base": base, "head": other}, memo, {"base"}, create)
    assert made == ["head"]  # the base's items reused: the very same objects, in the state's order
    assert again[0] is items[0] and again[1] == ("head", other)

    made.clear()
    plan_items({"base": other, "head": head}, memo2, {"base", "head"}, create)
    assert made == ["base", "head"]  # named unchanged but another value, or a value planned under another name
    made.clear()
    plan_items({"base": base}, memo2, set(), create)
    assert made == ["base"]  # the same value not named unchanged: planned again


def test_a_plan_is_the_cached_one_when_its_items_are_those_or_equal_to_them() -> None:
    import torch
    from torch.distributed.checkpoint.planner import SavePlan
    from torch.distributed.checkpoint.planner_helpers import _compare_save_plans, _create_write_items

    from spotguard.trainer.plancache import _same_plan

    compared: list[int] = []

    def compare(a: SavePlan, b: SavePlan) -> bool:
        compared.append(len(a.items))
        return _compare_save_plans(a, b)

    base, head = _create_write_items("base", torch.zeros(4)), _create_write_items("head", torch.zeros(2))
    cached = SavePlan([*base, *head])
    assert _same_plan(SavePlan([*base, *head]), cached, compare) and compared == []  # the same items: not compared
    assert _same_plan(SavePlan([*base, *_create_write_items("head", torch.ones(2))]), cached, compare)
    assert compared == [1]  # only the item made anew, equal in name, size and chunk
    assert not _same_plan(SavePlan([*base, *_create_write_items("head", torch.ones(3))]), cached, compare)
    assert not _same_plan(SavePlan(list(base)), cached, compare)
