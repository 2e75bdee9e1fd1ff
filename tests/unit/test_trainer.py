"""Trainer-side pure logic: control requests, state capture, RNG restore."""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import numpy as np
import pytest
import torch

import spotguard
from spotguard.trainer import CheckpointRequest, RestoredState, capture_rng, parse_request, restore_rng, torch_state


@pytest.mark.parametrize(
    "doc, expected",
    [
        (
            {"id": "a", "reason": "sigterm", "deadline": 12.5, "preempt": True},
            CheckpointRequest("a", "sigterm", 12.5, True),
        ),
        ({"id": "b", "reason": "proactive"}, CheckpointRequest("b", "proactive", None, False)),
        ({"id": "c", "reason": "notice:aws", "deadline": 100}, CheckpointRequest("c", "notice:aws", 100.0, False)),
        ({"id": "d", "extra": "ignored", "preempt": False}, CheckpointRequest("d", "", None, False)),
    ],
)
def test_parse_request(doc: dict[str, Any], expected: CheckpointRequest) -> None:
    assert parse_request(json.dumps(doc)) == expected


@pytest.mark.parametrize(
    "data, problem",
    [
        ("[]", "not a JSON object"),
        ("{}", "no string 'id'"),
        ('{"id": ""}', "no string 'id'"),
        ('{"id": "x", "deadline": "soon"}', "deadline 'soon' is not a number"),
        ('{"id": "x", "deadline": true}', "is not a number"),
        ('{"id": "x", "preempt": "yes"}', "'preempt' 'yes' is not a boolean"),
        ("{torn", "Expecting"),
    ],
)
def test_parse_request_rejects(data: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_request(data)


def test_importing_spotguard_does_not_import_torch_until_needed() -> None:
    import subprocess

    code = (
        "import sys, spotguard, spotguard.checkpoint, spotguard.storage, spotguard.trainer;"
        "print('torch' in sys.modules, 'boto3' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
    assert spotguard.Checkpointer is not None and spotguard.torch_state is torch_state
    with pytest.raises(AttributeError):
        spotguard.nothing  # noqa: B018


def draws() -> tuple[Any, ...]:
    return (random.random(), float(np.random.rand()), float(torch.rand(1)))


def test_rng_capture_and_restore() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draws()
    rng = capture_rng()
    expected = draws()
    draws()
    restore_rng(rng)
    assert draws() == expected


def test_torch_state_and_restored_state() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    gen = torch.Generator().manual_seed(9)
    nprng = np.random.default_rng(5)
    pyrng = random.Random(7)
    legacy = np.random.RandomState(11)

    class Sampler:
        def __init__(self) -> None:
            self.pos = 0

        def state_dict(self) -> dict[str, int]:
            return {"pos": self.pos}

        def load_state_dict(self, d: dict[str, int]) -> None:
            self.pos = d["pos"]

    sampler = Sampler()
    sampler.pos = 17
    state = torch_state(
        model,
        opt,
        sched,
        gen=gen,
        nprng=nprng,
        pyrng=pyrng,
        legacy=legacy,
        sampler=sampler,
        epoch=3,
        counters={"seen": 12},
    )
    assert set(state) == {"model", "optimizer", "scheduler", "rng", "extra"}
    expected = (torch.rand(2, generator=gen), nprng.random(), pyrng.random(), legacy.rand())

    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    gen2, nprng2, pyrng2, legacy2, sampler2 = (
        torch.Generator(),
        np.random.default_rng(),
        random.Random(),
        np.random.RandomState(),
        Sampler(),
    )
    restored = RestoredState(state, step=5, name="ckpt-000000000005", path="/x", epoch=3)
    extra = restored.load_into(
        model2, opt2, sched2, gen=gen2, nprng=nprng2, pyrng=pyrng2, legacy=legacy2, sampler=sampler2
    )
    assert extra["epoch"] == 3 and extra["counters"] == {"seen": 12}
    assert sampler2.pos == 17
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt2.state_dict()["param_groups"][0]["lr"] == opt.state_dict()["param_groups"][0]["lr"]
    assert sched2.state_dict() == sched.state_dict()
    got = (torch.rand(2, generator=gen2), nprng2.random(), pyrng2.random(), legacy2.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    assert restored["model"] is state["model"] and len(restored) == 5 and "rng" in list(restored)


def test_load_into_names_what_is_missing() -> None:
    restored = RestoredState({"extra": {"epoch": {"kind": "value", "value": 1}}}, step=1, name="ckpt-1", path="/x")
    with pytest.raises(KeyError, match="holds no model state"):
        restored.load_into(torch.nn.Linear(1, 1))
    with pytest.raises(KeyError, match="no extra named 'gen'"):
        restored.load_into(gen=torch.Generator())
    with pytest.raises(TypeError, match="saved as a plain value"):
        restored.load_into(epoch=object())


def test_restored_state_takes_where_it_came_from_at_construction_and_compares_as_its_mapping() -> None:
    metrics = {"loss": 0.5}
    restored = RestoredState(
        {"model": {}}, step=7, name="ckpt-7", path="/x", metrics=metrics, exact=False, resharded_from=4, sharded=True
    )
    assert (restored.exact, restored.resharded_from, restored.sharded, restored.rank_state_own) == (
        False,
        4,
        True,
        True,
    )
    metrics["loss"] = 9.0  # the restored state keeps its own copy
    assert restored.metrics == {"loss": 0.5} and restored.checked_bytes == restored.in_place_bytes == 0
    assert restored == {"model": {}} and RestoredState({}, step=1, name="a", path="/a").metrics == {}


@pytest.mark.parametrize(
    ("upload", "storage_uri", "shares_control_dir", "want"),
    [
        (True, "s3://b/job", False, "self"),  # uploads itself: prunes what it verified
        (False, "s3://b/job", False, "uploader"),  # a sidecar / spotguard run ships and prunes
        (False, None, True, "uploader"),
        (False, "s3://b/job", True, "uploader"),
        (False, None, False, "local-only"),  # nothing ever ships: newer supersedes older
    ],
)
def test_only_the_uploader_prunes(upload: bool, storage_uri: str | None, shares_control_dir: bool, want: str) -> None:
    from spotguard.trainer.config import local_pruner

    assert local_pruner(upload, storage_uri, shares_control_dir) == want


@pytest.mark.parametrize(
    "preempt, pruner, shipping, durable",
    [
        (False, "uploader", True, True),  # routine saves are always fsynced
        (False, "self", True, True),
        (False, "local-only", False, True),
        (True, "uploader", True, False),  # a preemption's save is made durable by its verified upload
        (True, "self", True, False),
        (True, "uploader", False, True),  # no live uploader said it ships: the local copy is all there is
        (True, "self", False, True),
        (True, "local-only", False, True),  # nothing ships it
    ],
)
def test_emergency_save_is_durable(preempt: bool, pruner: str, shipping: bool, durable: bool) -> None:
    from spotguard.trainer.shipping import emergency_save_is_durable

    assert emergency_save_is_durable(preempt, pruner, shipping) is durable


def test_each_generator_kind_round_trips_its_state_for_the_trainer_and_keras_alike() -> None:
    from spotguard.trainer.state import GENERATOR_KINDS, generator_kind, generator_state, set_generator_state

    made = [torch.Generator(), np.random.default_rng(1), np.random.RandomState(2), random.Random(3)]
    assert [generator_kind(g) for g in made] == list(GENERATOR_KINDS)
    assert generator_kind(object()) is None and generator_kind(torch.nn.Linear(1, 1)) is None
    for gen in made:
        kind = generator_kind(gen)
        assert kind is not None
        saved = generator_state(gen, kind)
        if kind == "python_random":
            saved = json.loads(json.dumps(saved))  # as the codec gives it back: tuples become lists
        first = [torch.rand(1, generator=gen).item()] if kind == "torch_generator" else [gen.random()]
        set_generator_state(gen, kind, saved)
        again = [torch.rand(1, generator=gen).item()] if kind == "torch_generator" else [gen.random()]
        assert first == again, kind
