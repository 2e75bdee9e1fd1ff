"""The pure parts of the Keras integration: where a resume continues, variable
keys, the metrics a checkpoint records, the keep-best mapping of
``ModelCheckpoint``, and RNG state taken and put back (in memory)."""

from __future__ import annotations

import math
import os
import random

import pytest

from testenv.require import require_module

os.environ.setdefault("KERAS_BACKEND", "torch")
keras = require_module("keras")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from spotguard.integrations.keras import (  # noqa: E402
    EPOCH_END,
    FINAL,
    MID_EPOCH,
    ResumePoint,
    SpotguardCallback,
    best_metric_retention,
    capture_rngs,
    checkpoint_metrics,
    restore_rngs,
    variable_keys,
)


@pytest.mark.parametrize(
    ("position", "epoch", "done", "expected"),
    [
        (MID_EPOCH, 2, 3, ResumePoint(2, 3)),  # the same epoch, its first 3 batches skipped
        (MID_EPOCH, 0, 8, ResumePoint(0, 8)),  # after an epoch's last batch, before its validation
        (EPOCH_END, 1, 0, ResumePoint(2, 0)),  # the next epoch from its start
        (FINAL, 3, 0, ResumePoint(4, 0)),  # nothing left of a 4-epoch fit
    ],
)
def test_resume_point_of_a_checkpoints_position(position: str, epoch: int, done: int, expected: ResumePoint) -> None:
    assert ResumePoint.of(position, epoch, done) == expected


def test_resume_point_skips_exactly_the_done_batches_and_knows_the_last() -> None:
    point = ResumePoint.of(MID_EPOCH, 1, 3)
    assert [b for b in range(6) if point.skips(b)] == [0, 1, 2]
    assert [b for b in range(6) if point.last_skipped(b)] == [2]
    fresh = ResumePoint.of(EPOCH_END, 1, 0)
    assert not any(fresh.skips(b) or fresh.last_skipped(b) for b in range(6))


@pytest.mark.parametrize(("position", "epoch", "done"), [("later", 1, 0), (MID_EPOCH, -1, 0), (MID_EPOCH, 0, -2)])
def test_resume_point_refuses_what_it_cannot_place(position: str, epoch: int, done: int) -> None:
    with pytest.raises(ValueError):
        ResumePoint.of(position, epoch, done)


def test_variable_keys_are_paths_with_repeats_numbered() -> None:
    assert variable_keys(["a/kernel", "a/bias", "a/kernel", "b", "a/kernel"]) == [
        "a/kernel",
        "a/bias",
        "a/kernel#2",
        "b",
        "a/kernel#3",
    ]
    assert variable_keys([]) == []


def test_checkpoint_metrics_names_mid_epoch_values_running_and_keeps_numbers_only() -> None:
    logs = {
        "loss": 0.5,
        "accuracy": np.float32(0.75),
        "val_loss": torch.tensor(0.25),
        "lr": float("nan"),
        "note": "x",
        "flag": True,
        "inf": math.inf,
    }
    assert checkpoint_metrics(logs, EPOCH_END) == {"loss": 0.5, "accuracy": 0.75, "val_loss": 0.25}
    assert checkpoint_metrics(logs, FINAL) == {"loss": 0.5, "accuracy": 0.75, "val_loss": 0.25}
    assert checkpoint_metrics(logs, MID_EPOCH) == {
        "running_loss": 0.5,
        "running_accuracy": 0.75,
        "running_val_loss": 0.25,
    }
    assert checkpoint_metrics(None, MID_EPOCH) == {}


@pytest.mark.parametrize(
    ("args", "metric", "mode"),
    [
        (("val_loss",), "val_loss", "min"),
        (("loss", "auto", 100), "running_loss", "min"),
        (("val_accuracy", "max"), "val_accuracy", "max"),
        (("val_mae", "min", "epoch"), "val_mae", "min"),
    ],
)
def test_model_checkpoint_save_best_only_maps_to_keep_best(args: tuple[object, ...], metric: str, mode: str) -> None:
    policy = best_metric_retention(*args)  # type: ignore[arg-type]
    assert (policy.keep_best, policy.metric, policy.mode) == (1, metric, mode)


def test_model_checkpoint_auto_mode_of_a_non_loss_needs_an_explicit_mode() -> None:
    with pytest.raises(ValueError, match="mode='max'"):
        best_metric_retention("val_accuracy")
    with pytest.raises(ValueError):
        best_metric_retention("val_loss", "up")


def _draws(gens: dict[str, object]) -> list[object]:
    """A few numbers from every RNG a fit on torch draws from."""
    tg, npg, rs, pr, sg = (gens[k] for k in ("torch", "numpy", "randomstate", "python", "keras"))
    return [
        random.random(),
        float(np.random.rand()),
        float(torch.rand(())),
        keras.random.uniform((3,)).tolist(),  # Keras's global seed generator
        float(torch.rand((), generator=tg)),
        float(npg.random()),
        float(rs.rand()),  # type: ignore[attr-defined]
        pr.random(),  # type: ignore[attr-defined]
        keras.random.uniform((3,), seed=sg).tolist(),
    ]


def test_rngs_taken_and_put_back_draw_the_same_numbers_again() -> None:
    gens: dict[str, object] = {
        "torch": torch.Generator().manual_seed(1),
        "numpy": np.random.default_rng(2),
        "randomstate": np.random.RandomState(3),
        "python": random.Random(4),
        "keras": keras.random.SeedGenerator(5),
    }
    keras.random.uniform((1,))  # Keras's global seed generator exists
    state = capture_rngs(gens)
    first = _draws(gens)
    assert _draws(gens) != first
    restore_rngs(state, gens)
    assert _draws(gens) == first


def test_a_generator_of_unknown_kind_is_refused_when_the_callback_is_made() -> None:
    with pytest.raises(TypeError, match="generators= takes"):
        SpotguardCallback(generators={"bad": object()})
    with pytest.raises(ValueError, match="save_every_epochs"):
        SpotguardCallback(save_every_epochs=0)
