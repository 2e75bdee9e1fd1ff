"""Whether a job read again differs only in what no decision rests on (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from spotguard.operator.kubeapi import same_but_metadata

READ: dict[str, Any] = {
    "metadata": {"name": "j", "generation": 1, "resourceVersion": "10", "annotations": {}},
    "spec": {"suspend": False},
    "status": {"attempt": 1},
}


@pytest.mark.parametrize(
    ("case", "fresh", "same"),
    [
        (
            "a new version, a finalizer and annotations",
            {"metadata": {**READ["metadata"], "resourceVersion": "11", "finalizers": ["f"], "annotations": {"a": "b"}}},
            True,
        ),
        ("another generation", {"metadata": {**READ["metadata"], "generation": 2}}, False),
        ("being deleted", {"metadata": {**READ["metadata"], "deletionTimestamp": "2026-12-07T00:00:00Z"}}, False),
        ("another spec", {"spec": {"suspend": True}}, False),
        ("another status", {"status": {"attempt": 2}}, False),
        ("its status cleared", {"status": {}}, False),
    ],
)
def test_same_but_metadata(case: str, fresh: dict[str, Any], same: bool) -> None:
    assert same_but_metadata(READ, {**READ, **fresh}) is same, case


def test_no_status_and_an_empty_one_are_the_same() -> None:
    bare = {k: v for k, v in READ.items() if k != "status"}
    assert same_but_metadata(bare, {**bare, "status": {}})
