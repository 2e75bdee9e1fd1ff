"""The pure parts of ``spotguard ckpt export --format hf``: key prefixes, tied
weights, the shard index, which files of a Trainer checkpoint make the
model, which checkpoint is best. No storage, no files."""

from __future__ import annotations

import math

import pytest
import torch

from spotguard.checkpoint.format.hf_folder import (
    DEFAULT_MAX_SHARD_SIZE,
    ExportError,
    ModelKeys,
    choose_prefix,
    folder_export_files,
    index_weight_files,
    is_weight_file,
    key_mismatch,
    parse_size,
    prepare_weights,
    resolve_tied,
    shared_storage_groups,
)
from spotguard.checkpoint.restore.stored_tensors import best_first

LLAMA = {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"}
GPT2 = {"transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "lm_head.weight"}


@pytest.mark.parametrize(
    "keys, expected, prefix",
    [
        # A LlamaForCausalLM's own keys: its "model." is the decoder's name, not a wrapper's.
        (LLAMA, LLAMA, ""),
        # Under DDP (module.), compiled under DDP (module._orig_mod.).
        ({f"module.{k}" for k in LLAMA}, LLAMA, "module."),
        ({f"module._orig_mod.{k}" for k in LLAMA}, LLAMA, "module._orig_mod."),
        # Saved as {"model": {"model": state_dict}} (the part's own name again), or a Lightning module's self.model.
        ({f"model.{k}" for k in LLAMA}, LLAMA, "model."),
        ({f"model.{k}" for k in GPT2}, GPT2, "model."),
        # Every key of a Llama without its head starts with "model.": the model's names decide it stays.
        (LLAMA - {"lm_head.weight"}, LLAMA, ""),
        # Without the model's names: wrappers go, "model." stays.
        ({f"module.{k}" for k in LLAMA}, None, "module."),
        ({f"_orig_mod.module.model.{k}" for k in GPT2}, None, "_orig_mod.module."),
        ({f"model.{k}" for k in GPT2}, None, ""),
        # Not every key has it: nothing is removed.
        ({"module.a", "b"}, None, ""),
        # Nothing fits the model: the fewest segments (the key check names what is wrong).
        ({"module.x", "module.y"}, {"a"}, ""),
        (set(), None, ""),
    ],
)
def test_choose_prefix(keys: set[str], expected: set[str] | None, prefix: str) -> None:
    assert choose_prefix(sorted(keys), expected) == prefix


def test_resolve_tied_drops_the_tied_key_and_clones_other_shared_memory() -> None:
    tied = {"lm_head.weight": "transformer.wte.weight"}
    keys = ["transformer.wte.weight", "lm_head.weight", "a", "b", "c"]
    drop, clone = resolve_tied(keys, [["lm_head.weight", "transformer.wte.weight"], ["a", "b", "c"]], tied)
    assert drop == {"lm_head.weight"} and clone == {"b", "c"}
    # Stored apart (spotguard copies each tensor): the tied key still goes, nothing to clone.
    assert resolve_tied(keys, [], tied) == ({"lm_head.weight"}, set())
    # Untied by the config (no mapping): shared memory is written as copies, no key is lost.
    assert resolve_tied(keys, [["lm_head.weight", "transformer.wte.weight"]], {}) == (set(), {"transformer.wte.weight"})
    # The source is absent: the tied key is the only copy and stays.
    assert resolve_tied(["lm_head.weight"], [], tied) == (set(), set())


def test_key_mismatch_counts_a_tied_pair_as_present_when_either_is_there() -> None:
    tied = {"lm_head.weight": "transformer.wte.weight"}
    assert key_mismatch(GPT2 - {"lm_head.weight"}, GPT2, tied) == ([], [])
    assert key_mismatch(GPT2 - {"transformer.wte.weight"}, GPT2, tied) == ([], [])
    assert key_mismatch(GPT2 - {"lm_head.weight"}, GPT2, {}) == (["lm_head.weight"], [])
    assert key_mismatch({*GPT2, "extra"} - {"transformer.h.0.attn.c_attn.weight"}, GPT2, tied) == (
        ["transformer.h.0.attn.c_attn.weight"],
        ["extra"],
    )


def gpt2_like() -> tuple[dict[str, torch.Tensor], ModelKeys]:
    wte = torch.arange(12.0).reshape(4, 3)
    state = {
        "module.transformer.wte.weight": wte,
        "module.lm_head.weight": wte,  # tied: one tensor
        "module.transformer.h.0.attn.c_attn.weight": torch.ones(3, 9),
    }
    model = ModelKeys("GPT2LMHeadModel", frozenset(GPT2), {"lm_head.weight": "transformer.wte.weight"})
    return state, model


def test_prepare_weights_removes_prefix_and_tied_key() -> None:
    state, model = gpt2_like()
    out = prepare_weights(state, model, "test")
    assert out.prefix == "module."
    assert set(out.tensors) == GPT2 - {"lm_head.weight"}
    assert out.dropped == {"lm_head.weight": "transformer.wte.weight"}
    assert shared_storage_groups(out.tensors) == []


def test_prepare_weights_without_the_model_clones_shared_memory() -> None:
    state, _ = gpt2_like()
    assert shared_storage_groups(state) == [["module.lm_head.weight", "module.transformer.wte.weight"]]
    out = prepare_weights(state, None, "test")
    assert set(out.tensors) == GPT2 and out.cloned == ["transformer.wte.weight"]
    assert shared_storage_groups(out.tensors) == []
    assert torch.equal(out.tensors["lm_head.weight"], out.tensors["transformer.wte.weight"])


def test_prepare_weights_refuses_what_does_not_fit() -> None:
    state, model = gpt2_like()
    state["module.lm_head.weight"] = state["module.lm_head.weight"] + 1  # no longer tied
    with pytest.raises(ExportError, match="lm_head.weight differs from transformer.wte.weight"):
        prepare_weights(state, model, "test")
    with pytest.raises(ExportError, match=r"does not fit GPT2LMHeadModel: 1 of its keys missing .*c_attn"):
        prepare_weights({"transformer.wte.weight": torch.ones(2)}, model, "test")
    with pytest.raises(ExportError, match="holds no tensors"):
        prepare_weights({}, None, "test")


def test_index_weight_files() -> None:
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = {
        "metadata": {"total_size": 27},
        "weight_map": {"a": shards[1], "b": shards[0], "c": shards[2], "d": shards[0]},
    }
    assert index_weight_files(index) == shards
    assert all(is_weight_file(f) for f in [*shards, "model.safetensors", "model.safetensors.index.json"])
    assert not is_weight_file("pytorch_model.bin") and not is_weight_file("model-1-of-2.safetensors")
    with pytest.raises(ExportError, match="not a model shard file"):
        index_weight_files({"weight_map": {"a": "../evil.safetensors"}})
    with pytest.raises(ExportError, match="no weight_map"):
        index_weight_files({"metadata": {}})


@pytest.mark.parametrize(
    "raw, value",
    [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("1GiB", 2**30), ("1.5kb", 1500), ("123", 123), (" 2 MiB ", 2**21)],
)
def test_parse_size(raw: str, value: int) -> None:
    assert parse_size(raw) == value


@pytest.mark.parametrize("raw", ["", "5 parsecs", "-1GB", "0", "GB"])
def test_parse_size_refuses(raw: str) -> None:
    with pytest.raises(ValueError):
        parse_size(raw)


def test_default_shard_size_is_the_hubs() -> None:
    assert parse_size("5GB") == DEFAULT_MAX_SHARD_SIZE


def test_folder_export_files_leave_out_training_state_and_pickles() -> None:
    paths = [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "optimizer.pt",
        "scheduler.pt",
        "scaler.pt",
        "rng_state.pth",
        "rng_state_3.pth",
        "trainer_state.json",
        "training_args.bin",
        "global_step10/mp_rank_00_model_states.pt",
        "latest",
        "pytorch_model.bin",
        "parts/00000.json",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    keep, left = folder_export_files(paths)
    assert keep == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    assert left == [
        "global_step10/mp_rank_00_model_states.pt",
        "latest",
        "optimizer.pt",
        "pytorch_model.bin",
        "rng_state.pth",
        "rng_state_3.pth",
        "scaler.pt",
        "scheduler.pt",
        "trainer_state.json",
        "training_args.bin",
    ]


def test_best_first() -> None:
    cands = [
        ("c1", 1, {"loss": 0.5}),
        ("c2", 2, {"loss": 0.2}),
        ("c3", 3, {"loss": 0.2}),
        ("c4", 4, {}),
        ("c5", 5, {"loss": math.nan}),
        ("c6", 6, {"loss": None}),
        ("c7", 7, {"loss": 0.9}),
    ]
    assert best_first(cands, "loss", "min") == ["c3", "c2", "c1", "c7"]  # a tie goes to the newer one
    assert best_first(cands, "loss", "max") == ["c7", "c1", "c3", "c2"]
    assert best_first(cands, "acc", "max") == []
    with pytest.raises(ValueError, match="mode"):
        best_first(cands, "loss", "lowest")
