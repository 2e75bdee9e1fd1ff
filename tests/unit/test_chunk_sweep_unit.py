"""The chunk sweep planner and the newer-format check: table tests, no storage."""

from __future__ import annotations

import json

import pytest

from spotguard.checkpoint.format.manifest import FORMAT_VERSION, chunk_key
from spotguard.checkpoint.store.gc import newer_format_version, plan_sweep
from spotguard.storage.base import ObjectInfo

NOW = 1_700_000_000.0
GRACE = 3600.0


def digest(n: int) -> str:
    return f"{n:02x}" * 32


def chunk(n: int, age: float, size: int = 100) -> tuple[str, ObjectInfo]:
    return digest(n), ObjectInfo(chunk_key(digest(n)), size, NOW - age)


OLD = GRACE + 1
YOUNG = GRACE - 1

CASES: list[tuple[str, list[tuple[str, ObjectInfo]], set[int], list[int]]] = [
    ("nothing stored", [], set(), []),
    ("an old unreferenced chunk goes", [chunk(1, OLD)], set(), [1]),
    ("a referenced chunk stays, however old", [chunk(1, OLD * 100)], {1}, []),
    ("a young unreferenced chunk stays (an upload before its manifest)", [chunk(1, YOUNG)], set(), []),
    ("exactly grace old goes", [chunk(1, GRACE)], set(), [1]),
    ("modified in the future (clock skew) stays", [chunk(1, -60)], set(), []),
    (
        "shared chunks stay, unique old ones go",
        [chunk(1, OLD), chunk(2, OLD), chunk(3, OLD), chunk(4, YOUNG)],
        {2, 3},
        [1],
    ),
    ("references to chunks not stored change nothing", [chunk(1, OLD)], {7, 8}, [1]),
    ("sorted by digest", [chunk(9, OLD), chunk(3, OLD), chunk(5, OLD)], set(), [3, 5, 9]),
]


@pytest.mark.parametrize(("stored", "referenced", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan_sweep(stored: list[tuple[str, ObjectInfo]], referenced: set[int], want: list[int]) -> None:
    chunks = dict(stored)
    assert plan_sweep(chunks, {digest(n) for n in referenced}, GRACE, NOW) == [digest(n) for n in want]


def test_grace_zero_takes_every_unreferenced_chunk() -> None:
    chunks = dict([chunk(1, 0.0), chunk(2, 0.0), chunk(3, 5.0)])
    assert plan_sweep(chunks, {digest(2)}, 0.0, NOW) == [digest(1), digest(3)]


def test_plan_sweep_does_not_touch_its_inputs() -> None:
    chunks = dict([chunk(1, OLD), chunk(2, OLD)])
    referenced = {digest(2)}
    plan_sweep(chunks, referenced, GRACE, NOW)
    assert set(chunks) == {digest(1), digest(2)} and referenced == {digest(2)}


VERSIONS: list[tuple[str, bytes, int | None]] = [
    ("this spotguard's version", json.dumps({"format_version": FORMAT_VERSION}).encode(), None),
    ("an older version", json.dumps({"format_version": 1}).encode(), None),
    ("a newer version", json.dumps({"format_version": FORMAT_VERSION + 1}).encode(), FORMAT_VERSION + 1),
    ("version 99", json.dumps({"format_version": 99, "files": "anything"}).encode(), 99),
    ("not JSON", b"{not json", None),
    ("not UTF-8", b"\xff\xfe", None),
    ("a list", b"[99]", None),
    ("no version", b"{}", None),
    ("a string version", json.dumps({"format_version": "99"}).encode(), None),
    ("a boolean version", b'{"format_version": true}', None),
]


@pytest.mark.parametrize(("data", "want"), [v[1:] for v in VERSIONS], ids=[v[0] for v in VERSIONS])
def test_newer_format_version(data: bytes, want: int | None) -> None:
    assert newer_format_version(data) == want
