"""torch's distributed state dicts taken with what torch works out about the model reused
(``spotguard.trainer.statedicts``): the same dicts as ``get_state_dict``, that work done once per
model while its parameters and buffers stay the same objects, and the model not held after the
last distributed Checkpointer closed. Real torch modules and optimizers; no process group needed."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import state_dict as sd

from spotguard.trainer import statedicts


@pytest.fixture
def checkpointer_alive() -> Iterator[None]:
    statedicts.enter()
    try:
        yield
    finally:
        statedicts.leave()


@pytest.fixture
def verified(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every model torch's ``_verify_options`` is asked about."""
    calls: list[Any] = []
    real = sd._verify_options

    def counting(model: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(sd, "_verify_options", counting)
    return calls


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


def test_the_state_dicts_are_torchs_and_the_model_is_worked_out_once(
    checkpointer_alive: None, verified: list[Any]
) -> None:
    model, optimizer = trained()
    statedicts.get_state_dicts(model, optimizer)
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    second = statedicts.get_state_dicts(model, optimizer)
    assert verified == [model]  # the second call reused what the first worked out
    want_model, want_optim = sd.get_state_dict(model, optimizer)
    assert same(second, {"model": want_model, "optimizer": want_optim})


class Walked(torch.nn.Sequential):
    """A model that counts torch's walks through it: ``_get_fqns`` asks every module on a name's path
    for its ``_fqn_modifiers``."""

    walks = 0

    def _fqn_modifiers(self) -> dict[str, str]:
        Walked.walks += 1
        return {}


def test_names_are_not_walked_again_while_the_model_stays_the_same(checkpointer_alive: None) -> None:
    torch.manual_seed(0)
    model = Walked(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW(model[1].parameters(), lr=1e-2)
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    Walked.walks = 0
    statedicts.get_state_dicts(model, optimizer)
    assert Walked.walks > 0
    walked = Walked.walks
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    second = statedicts.get_state_dicts(model, optimizer)
    assert Walked.walks == walked  # every name's FQNs came from the first call's answers
    want_model, want_optim = sd.get_state_dict(model, optimizer)
    assert Walked.walks > walked  # torch's own call walks them: the count sees walks
    assert same(second, {"model": want_model, "optimizer": want_optim})
    model[1].weight = torch.nn.Parameter(torch.ones(2, 8))  # another object: the model is walked again
    walked = Walked.walks
    statedicts.get_state_dicts(model, torch.optim.AdamW(model[1].parameters(), lr=1e-2))
    assert Walked.walks > walked


def test_a_model_that_changed_is_worked_out_again(checkpointer_alive: None, verified: list[Any]) -> None:
    model, optimizer = trained()
    statedicts.get_state_dicts(model, optimizer)
    model.append(torch.nn.Linear(2, 2))  # a new submodule: new names
    grown = statedicts.get_state_dicts(model, optimizer)
    assert "3.weight" in grown["model"]
    model[3].weight = torch.nn.Parameter(torch.ones(2, 2))  # the same name, another object
    replaced = statedicts.get_state_dicts(model, optimizer)
    assert torch.equal(replaced["model"]["3.weight"], torch.ones(2, 2))
    other, other_optimizer = trained()
    statedicts.get_state_dicts(other, other_optimizer)
    assert verified == [model, model, model, other]


def test_nothing_is_reused_without_a_distributed_checkpointer(verified: list[Any]) -> None:
    model, optimizer = trained()
    for _ in range(2):
        statedicts.get_state_dicts(model, optimizer)
    assert verified == [model, model]  # torch's own get_state_dict, every time


def test_the_model_is_not_held_once_the_last_distributed_checkpointer_closed() -> None:
    statedicts.enter()
    model, optimizer = trained()
    statedicts.get_state_dicts(model, optimizer)
    gone = weakref.ref(model)
    statedicts.leave()
    del model, optimizer
    gc.collect()
    assert gone() is None


def test_a_frozen_parameters_alias_is_handed_again_only_while_it_is_the_same_view(checkpointer_alive: None) -> None:
    model, optimizer = trained()
    first = statedicts.get_state_dicts(model, optimizer)["model"]
    second = statedicts.get_state_dicts(model, optimizer)["model"]
    assert second["0.weight"] is first["0.weight"]  # frozen, untouched: no detach
    assert second["2.weight"] is not first["2.weight"]  # trained: detached anew
    with torch.no_grad():
        model[0].weight.add_(1.0)  # written in place: its version moved
    written = statedicts.get_state_dicts(model, optimizer)["model"]
    assert written["0.weight"] is not second["0.weight"]
    model[0].weight.data = torch.zeros(8, 8)  # another storage, no version step: the old alias shows the old one
    swapped = statedicts.get_state_dicts(model, optimizer)["model"]
    assert torch.equal(swapped["0.weight"], torch.zeros(8, 8))
    model[0].bias.requires_grad_(True)  # unfrozen
    unfrozen = statedicts.get_state_dicts(model, optimizer)["model"]
    assert unfrozen["0.bias"] is not swapped["0.bias"]
    assert unfrozen["0.weight"] is swapped["0.weight"]
    assert not any(v.requires_grad for v in unfrozen.values())
    want_model, want_optim = sd.get_state_dict(model, optimizer)
    assert same(statedicts.get_state_dicts(model, optimizer), {"model": want_model, "optimizer": want_optim})
