"""Pure parts of the distributed Checkpointer: torchrun facts, tensor/skeleton split."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from spotguard.trainer.distributed import RankInfo, fill_tensors, rank_info_from_env, rank_prefix, split_tensors


@pytest.mark.parametrize(
    "env, rank, world, expected",
    [
        ({}, 3, 4, RankInfo(3, 4, 3, 4, 0)),
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "GROUP_RANK": "1"}, 3, 4, RankInfo(3, 4, 1, 2, 1)),
        ({"LOCAL_WORLD_SIZE": "2"}, 2, 4, RankInfo(2, 4, 0, 2, 1)),
        ({"LOCAL_WORLD_SIZE": "3"}, 1, 4, RankInfo(1, 4, 1, 4, 0)),  # inconsistent: one node
    ],
)
def test_rank_info_from_env(env: dict[str, str], rank: int, world: int, expected: RankInfo) -> None:
    info = rank_info_from_env(env, rank, world)
    assert info == expected
    assert info.parts == world // info.local_world_size
    assert info.node_leader == (info.local_rank == 0)


def test_rank_info_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="LOCAL_RANK must be an integer"):
        rank_info_from_env({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "x"}, 0, 2)


def test_rank_prefix() -> None:
    assert rank_prefix(7) == "ranks/00007/"


def test_split_and_fill_round_trip() -> None:
    w, b, s = torch.ones(2), torch.zeros(3), torch.tensor(4.0)
    state = {
        "model": OrderedDict([("0.weight", w), ("0.bias", b)]),
        "optimizer": {
            "state": {"0.weight": {"step": s, "exp_avg": w}, "0.bias": {"momentum_buffer": None}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["0.weight", "0.bias"]}],
        },
        "other": [b, 1, (w, "x")],
    }
    tensors, skeleton = split_tensors(state)
    assert tensors == {
        "model": {"0.weight": w, "0.bias": b},
        "optimizer": {"state": {"0.weight": {"step": s, "exp_avg": w}}},
        "other": {"0": b, "2": {"0": w}},
    }
    assert skeleton["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert skeleton["optimizer"]["state"]["0.bias"] == {"momentum_buffer": None}
    assert isinstance(skeleton["model"], OrderedDict)
    assert not any(isinstance(v, torch.Tensor) for v in skeleton["model"].values())
    back = fill_tensors(skeleton, tensors)
    assert back["model"]["0.weight"] is w and back["other"][2][0] is w and back["other"][2][1] == "x"
    assert isinstance(back["other"][2], tuple)
    assert back["optimizer"]["state"]["0.weight"]["step"] is s
    # Filling one subtree at a time, from a tree rooted at its key.
    model = fill_tensors(skeleton["model"], tensors["model"], ("model",))
    assert model["0.bias"] is b


def test_fill_names_a_tensor_with_no_place() -> None:
    _, skeleton = split_tensors({"model": {"a": torch.ones(1), "b": torch.ones(1)}})
    with pytest.raises(KeyError, match="model.b"):
        fill_tensors(skeleton, {"model": {"a": torch.ones(1)}})


def test_no_tensors() -> None:
    assert split_tensors({"a": 1, "b": [None]}) == (None, {"a": 1, "b": [None]})
