"""A preemption's save runs with the cyclic garbage collector paused (spotguard.gcpause)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from spotguard import gcpause


@pytest.fixture(autouse=True)
def _collector_restored() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    (gc.enable if enabled else gc.disable)()


def test_a_pause_nests_and_ends_with_the_outermost() -> None:
    gc.enable()
    with gcpause.paused():
        assert not gc.isenabled()
        with gcpause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()


def test_a_collector_the_trainer_disabled_stays_disabled() -> None:
    gc.disable()
    with gcpause.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_an_inactive_pause_leaves_the_collector_alone_and_a_raise_ends_the_pause() -> None:
    gc.enable()
    with gcpause.paused(False):
        assert gc.isenabled()
    with pytest.raises(RuntimeError), gcpause.paused():
        raise RuntimeError("the save failed")
    assert gc.isenabled()
