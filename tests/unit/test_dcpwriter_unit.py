"""The sharded save's pure parts (``spotguard.trainer.dcpwriter``): a state's tensors by DCP name, the
state less its unchanged tensors, the staged state put back together in its own shape and flattened as
DCP flattens it."""

from __future__ import annotations

from typing import Any

from spotguard.trainer.dcpwriter import Flattened, _leaves, _with, _without

STATE = {
    "model": {"base.weight": "B", "head.weight": "H"},
    "optimizer": {"state": {"head.weight": {"exp_avg": "M", "step": "S"}}},
}


def test_leaves_are_named_as_dcp_flattens_a_state() -> None:
    assert dict(_leaves(STATE)) == {
        "model.base.weight": "B",
        "model.head.weight": "H",
        "optimizer.state.head.weight.exp_avg": "M",
        "optimizer.state.head.weight.step": "S",
    }


def test_unchanged_tensors_are_left_out_of_the_staging_and_put_back_in_place() -> None:
    unchanged = {"model.base.weight": "b", "optimizer.state.head.weight.step": "s"}
    changed = _without(STATE, unchanged.keys())
    assert changed == {"model": {"head.weight": "H"}, "optimizer": {"state": {"head.weight": {"exp_avg": "M"}}}}
    staged = {"model": {"head.weight": "h"}, "optimizer": {"state": {"head.weight": {"exp_avg": "m"}}}}
    assert _with(STATE, staged, unchanged) == {
        "model": {"base.weight": "b", "head.weight": "h"},
        "optimizer": {"state": {"head.weight": {"exp_avg": "m", "step": "s"}}},
    }


def test_a_part_left_unchanged_entirely_is_dropped_then_rebuilt() -> None:
    unchanged = {"model.base.weight": "b", "model.head.weight": "h"}
    changed = _without(STATE, unchanged.keys())
    assert "model" not in changed
    staged = {"optimizer": {"state": {"head.weight": {"exp_avg": "m", "step": "s"}}}}
    assert _with(STATE, staged, unchanged)["model"] == {"base.weight": "b", "head.weight": "h"}


def test_two_meshes_are_compared_once_and_the_verdict_remembered() -> None:
    """A host copy's mesh is another object than its tensor's (the stager copies it): ``==`` (Python,
    per shard per save) is asked once per pair of meshes, its verdict kept with both (ids never reused)."""
    from spotguard.trainer.dcpwriter import DcpSaves

    class Mesh:
        asked = 0

        def __init__(self, ranks: tuple[int, ...]) -> None:
            self.ranks = ranks

        def __eq__(self, other: object) -> bool:
            Mesh.asked += 1
            return isinstance(other, Mesh) and self.ranks == other.ranks

        __hash__ = object.__hash__

    saves = DcpSaves()
    mine, copy, other = Mesh((0, 1)), Mesh((0, 1)), Mesh((0, 2))
    assert saves._same_mesh(mine, mine) and Mesh.asked == 0  # the same object: nothing asked
    assert all(saves._same_mesh(mine, copy) for _ in range(5)) and Mesh.asked == 1
    assert not any(saves._same_mesh(mine, other) for _ in range(5)) and Mesh.asked == 2


def test_the_previous_metadata_is_reused_only_for_the_same_items_in_the_same_places() -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from spotguard.trainer.dcpwriter import _MetadataFile

    described: dict[str, object] = {"model.w": object()}
    metadata = Metadata(state_dict_metadata=described, planner_data={"model.w": ("model", "w")})
    where = {MetadataIndex("model.w", (0,)): _StorageInfo("__0_0.distcp", 0, 64)}
    last = _MetadataFile(described, metadata.planner_data, getattr(metadata, "version", None), where, b"pickled")
    assert last.made_of(metadata, {MetadataIndex("model.w", (0,), index=3): _StorageInfo("__0_0.distcp", 0, 64)})
    # An item elsewhere (another file, offset or length), or another item:
    assert not last.made_of(metadata, {MetadataIndex("model.w", (0,)): _StorageInfo("__0_1.distcp", 0, 64)})
    assert not last.made_of(metadata, {MetadataIndex("model.w", (0,)): _StorageInfo("__0_0.distcp", 64, 64)})
    assert not last.made_of(metadata, {MetadataIndex("model.v", (0,)): _StorageInfo("__0_0.distcp", 0, 64)})
    # A global plan made anew (torch's plan cache hands another object), even of equal content:
    assert not last.made_of(Metadata(state_dict_metadata=dict(described), planner_data=metadata.planner_data), where)
    assert not last.made_of(Metadata(state_dict_metadata=described, planner_data=dict(metadata.planner_data)), where)


def _tensor_state() -> dict[str, Any]:
    import torch

    from spotguard.trainer.distributed import split_tensors

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    tensors, _ = split_tensors({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    return dict(tensors)


def test_the_stage_flattens_a_state_as_dcp_does() -> None:
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    tree = _tensor_state()
    flattened = Flattened.of(torch, tree)
    assert flattened is not None
    flat, mappings = flatten_state_dict(tree)
    assert list(flattened.flat) == list(flat)  # the same names in the same order: the plan's order
    assert flattened.mappings == mappings
    assert all(flattened.flat[k] is v for k, v in flat.items())
    assert Flattened.of(torch, {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}) is None  # torch raises on it
    assert Flattened.of(torch, {"a": {"b": 1.0}}) is None  # not a tensor: flattened by torch


def test_the_planner_takes_the_stages_flattening_only_for_the_tree_it_was_made_of() -> None:
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from spotguard.trainer.plancache import PlanCache

    tree = _tensor_state()
    flattened = Flattened.of(torch, tree)
    cache = PlanCache()
    try:
        planner = cache.planner(1, None, flattened)
        planner.set_up_planner(dict(tree))  # dcp.save's shallow copy of the staged tree
        assert planner.state_dict == flattened.flat and planner.state_dict is not flattened.flat

        other = dict(tree, model={**tree["model"], "0.weight": torch.full((3, 3), 7.0)})  # another save's tree
        planner = cache.planner(1, None, flattened)
        planner.set_up_planner(other)
        flat, mappings = flatten_state_dict(other)
        assert planner.state_dict.keys() == flat.keys()
        assert planner.state_dict["model.0.weight"] is other["model"]["0.weight"]  # not the stale one
        assert planner.mappings == mappings
    finally:
        cache.drop()
