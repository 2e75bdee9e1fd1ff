"""The upload-intent protocol's pure parts: the lease, the shortest grace, and the sweep's plan with live uploads."""

from __future__ import annotations

import pytest

from spotguard.checkpoint.store.gc import plan_sweep
from spotguard.checkpoint.store.intents import (
    Intent,
    Intents,
    check_grace,
    check_orphan_grace,
    lease_seconds,
    minimum_orphan_grace,
)
from spotguard.contract.env import GC_LEASE_SECONDS
from spotguard.storage.base import ObjectInfo

LEASE_ENV, DEFAULT_LEASE = GC_LEASE_SECONDS.name, GC_LEASE_SECONDS.default


def test_the_lease_comes_from_the_environment_and_bounds_the_grace() -> None:
    assert lease_seconds({}) == DEFAULT_LEASE == minimum_orphan_grace({})
    assert lease_seconds({LEASE_ENV: "2.5"}) == 2.5
    for bad in ("soon", "0", "-1"):
        with pytest.raises(ValueError, match=LEASE_ENV):
            lease_seconds({LEASE_ENV: bad})
    check_orphan_grace(DEFAULT_LEASE, {})
    with pytest.raises(ValueError, match=r"shorter than the upload lease \(60s\).*use at least 60"):
        check_orphan_grace(0, {})
    check_orphan_grace(3, {LEASE_ENV: "3"})


def info(digest: str, modified: float) -> ObjectInfo:
    return ObjectInfo(key=f"chunks/{digest[:2]}/{digest}", size=1, modified=modified)


def test_a_live_upload_keeps_what_it_names_and_what_was_stored_since_it_began() -> None:
    old, named, fresh, free = ("a" * 64), ("b" * 64), ("c" * 64), ("d" * 64)
    chunks = {old: info(old, 100.0), named: info(named, 100.0), fresh: info(fresh, 500.0), free: info(free, 100.0)}
    # Nothing in progress: every unreferenced chunk older than the grace goes.
    assert plan_sweep(chunks, {old}, grace=10, now=1000.0) == sorted([named, fresh, free])
    live = Intents(live=[Intent("gc/uploads/x.json", "ckpt-000000000020", frozenset({named}), since=400.0)])
    assert live.floor == 400.0 and live.known == {named} and live.checkpoints == {"ckpt-000000000020"}
    assert plan_sweep(chunks, {old} | live.known, grace=10, now=1000.0, floor=live.floor) == [free]
    # Two uploads: the older one's beginning is the floor.
    two = Intents(live=[*live.live, Intent("gc/uploads/y.json", "ckpt-000000000030", frozenset(), since=50.0)])
    assert two.floor == 50.0
    assert plan_sweep(chunks, two.known, grace=10, now=1000.0, floor=two.floor) == []


@pytest.mark.parametrize("grace", [float("nan"), float("inf"), float("-inf"), -1.0, -0.001])
def test_a_grace_must_be_a_finite_number_of_seconds_not_negative(grace: float) -> None:
    with pytest.raises(ValueError, match="finite number of seconds, 0 or more"):
        check_grace(grace)
    with pytest.raises(ValueError, match="finite number of seconds, 0 or more"):
        check_orphan_grace(grace, {})
    assert check_grace(0) == 0.0 and check_grace(3600) == 3600.0


def test_an_infinite_lease_is_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match=LEASE_ENV):
        lease_seconds({LEASE_ENV: "inf"})


def test_the_grace_check_says_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"use at least 7200, or a lease of at most 3600"):
        check_orphan_grace(3600, {LEASE_ENV: "7200"})
