"""Manifest format version 2: sharding, part manifests, and the global manifest built from them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from spotguard.checkpoint.format.manifest import (
    FORMAT_VERSION,
    FORMAT_VERSION_SHARDED,
    FileEntry,
    Manifest,
    ManifestError,
    Sharding,
    new_manifest,
    parse_manifest,
    parse_part_manifest_path,
    part_manifest_path,
)
from spotguard.checkpoint.store.global_manifest import build_global_manifest
from spotguard.storage.checksum import checksum_bytes

CRC = "0a1b2c3d"


def part(
    index: int,
    ranks: tuple[int, ...],
    *,
    parts: int = 2,
    world_size: int = 4,
    step: int = 10,
    files: list[str] | None = None,
    algorithm: str = "crc32c",
    created: str = "2026-01-02T03:04:05.000000Z",
    sharding_id: str | None = None,
    **kw: Any,
) -> tuple[bytes, Manifest]:
    names = (
        files
        if files is not None
        else [f"dcp/__{r}_0.distcp" for r in ranks] + [f"ranks/{r:05d}/state.json" for r in ranks]
    )
    digest = CRC if algorithm == "crc32c" else "ab" * 32
    m = new_manifest(
        step,
        [FileEntry(n, 7, digest) for n in names],
        algorithm,
        created=created,
        sharding=Sharding(world_size, parts, index, ranks, sharding_id),
        **kw,
    )
    return m.to_json(), m


def test_version_1_bytes_are_unchanged_without_sharding() -> None:
    m = new_manifest(5, [FileEntry("model.safetensors", 3, CRC)], "crc32c", created="2026-01-01T00:00:00.000000Z")
    doc = json.loads(m.to_json())
    assert doc["format_version"] == 1 and "sharding" not in doc
    assert m.sharding is None and not m.is_part and m.locally_complete
    expected = (
        b'{\n "format_version": 1,\n "step": 5,\n "epoch": null,\n "metrics": {},\n'
        b' "created": "2026-01-01T00:00:00.000000Z",\n "writer": "' + m.writer.encode() + b'",\n'
        b' "checksum_algorithm": "crc32c",\n "files": [\n  {\n   "path": "model.safetensors",\n'
        b'   "size": 3,\n   "checksum": "0a1b2c3d"\n  }\n ]\n}\n'
    )
    assert m.to_json() == expected


def test_part_manifest_roundtrip() -> None:
    data, m = part(1, (2, 3), epoch=1, metrics={"loss": 0.5}, job="ns/j", attempt=2, reason="sigterm")
    doc = json.loads(data)
    assert doc["format_version"] == FORMAT_VERSION_SHARDED == 2 and FORMAT_VERSION == 3
    assert doc["sharding"] == {"world_size": 4, "parts": 2, "part": 1, "ranks": [2, 3]}
    again = parse_manifest(data, expected_name="ckpt-000000000010")
    assert again == m
    assert again.sharding == Sharding(4, 2, 1, (2, 3))
    assert again.is_part and not again.is_global and not again.locally_complete


def test_a_single_part_is_locally_complete() -> None:
    _, m = part(0, (0, 1), parts=1, world_size=2)
    assert m.is_part and m.locally_complete


def test_part_manifest_path() -> None:
    assert part_manifest_path(0) == "parts/00000.json"
    assert part_manifest_path(12) == "parts/00012.json"
    assert parse_part_manifest_path("parts/00012.json") == 12
    assert parse_part_manifest_path("parts/12.json") is None
    with pytest.raises(ValueError):
        part_manifest_path(-1)


def sharded_doc(sharding: Any, version: int = 2, files: list[str] | None = None) -> bytes:
    return json.dumps(
        {
            "format_version": version,
            "step": 1,
            "created": "2026-01-01T00:00:00Z",
            "checksum_algorithm": "crc32c",
            "sharding": sharding,
            "files": [{"path": p, "size": 1, "checksum": CRC} for p in (files or ["a"])],
        }
    ).encode()


@pytest.mark.parametrize(
    "sharding, version, files, problem",
    [
        ({"world_size": 2, "parts": 2, "part": 0, "ranks": [0]}, 1, None, "needs format_version 2"),
        ("x", 2, None, "'sharding' must be an object"),
        ({"world_size": 0, "parts": 1, "part": 0, "ranks": [0]}, 2, None, "world_size must be at least 1"),
        ({"world_size": 2, "parts": 3, "part": 0, "ranks": [0]}, 2, None, "parts must be in"),
        ({"world_size": 2, "parts": 2, "part": 2, "ranks": [0]}, 2, None, "part 2 out of range"),
        ({"world_size": 2, "parts": 2, "part": 0, "ranks": []}, 2, None, "'ranks' is empty"),
        ({"world_size": 2, "parts": 2, "part": 0, "ranks": [1, 0]}, 2, None, "not sorted and distinct"),
        ({"world_size": 2, "parts": 2, "part": 0, "ranks": [0, 0]}, 2, None, "not sorted and distinct"),
        ({"world_size": 2, "parts": 2, "part": 0, "ranks": [2]}, 2, None, "out of range for world_size"),
        ({"world_size": 2, "parts": 2, "part": 0, "ranks": ["0"]}, 2, None, "list of integers"),
        ({"world_size": 2, "parts": 1, "part": 0, "ranks": [0]}, 2, None, "only part must cover ranks 0..1"),
        ({"world_size": 2, "parts": 2, "part": None, "ranks": [0]}, 2, None, "global manifest must cover"),
        ({"world_size": 2, "parts": 2, "part": 0, "ranks": [0]}, 2, ["parts/00000.json"], "inside parts/"),
        (
            {"world_size": 2, "parts": 2, "part": None, "ranks": [0, 1]},
            2,
            ["parts/00000.json"],
            "does not list parts/00001.json",
        ),
        (
            {"world_size": 2, "parts": 1, "part": None, "ranks": [0, 1]},
            2,
            ["parts/00000.json", "parts/00001.json"],
            "has 1 part",
        ),
        (
            {"world_size": 2, "parts": 1, "part": None, "ranks": [0, 1]},
            2,
            ["parts/00000.json", "parts/x"],
            "is not a part manifest",
        ),
    ],
)
def test_malformed_sharding_is_named(sharding: Any, version: int, files: list[str] | None, problem: str) -> None:
    with pytest.raises(ManifestError, match=problem):
        parse_manifest(sharded_doc(sharding, version, files))


def test_version_2_without_sharding_is_read() -> None:
    doc = json.loads(sharded_doc(None))
    del doc["sharding"]
    assert parse_manifest(json.dumps(doc).encode()).sharding is None


def test_build_global_manifest() -> None:
    p0 = part(
        0,
        (0, 1),
        epoch=3,
        metrics={"loss": 0.25, "nan": float("nan")},
        job="ns/j",
        attempt=1,
        reason="interval",
        request_id="r",
        timing={"save_seconds": 1.0},
    )
    p1 = part(1, (2, 3), created="2026-01-02T03:04:06.000000Z", metrics={"loss": 9.0})
    g = build_global_manifest([p1, p0])
    assert g.sharding == Sharding(4, 2, None, (0, 1, 2, 3))
    assert g.is_global and g.locally_complete and not g.is_part
    assert g.format_version == 2
    assert [f.path for f in g.files] == [f.path for f in p0[1].files] + [f.path for f in p1[1].files] + [
        "parts/00000.json",
        "parts/00001.json",
    ]
    assert g.files[-2] == FileEntry("parts/00000.json", len(p0[0]), checksum_bytes(p0[0], "crc32c"))
    assert g.files[-1] == FileEntry("parts/00001.json", len(p1[0]), checksum_bytes(p1[0], "crc32c"))
    # Scalars from part 0, created the latest of the parts.
    assert (g.step, g.epoch, g.job, g.attempt, g.reason, g.request_id) == (10, 3, "ns/j", 1, "interval", "r")
    assert dict(g.metrics) == {"loss": 0.25, "nan": None}
    assert g.timing == {"save_seconds": 1.0}
    assert g.writer == p0[1].writer
    assert g.created == "2026-01-02T03:04:06.000000Z"
    assert parse_manifest(g.to_json(), expected_name="ckpt-000000000010") == g


def test_global_manifest_is_a_pure_function_of_the_parts() -> None:
    p0, p1 = part(0, (0, 1)), part(1, (2, 3))
    first = build_global_manifest([p0, p1]).to_json()
    assert build_global_manifest([p1, p0]).to_json() == first
    assert build_global_manifest([p0, p1]).to_json() == first


def test_a_single_part_makes_a_global_manifest() -> None:
    p0 = part(0, (0,), parts=1, world_size=1, files=["dcp/__0_0.distcp"])
    g = build_global_manifest([p0])
    assert [f.path for f in g.files] == ["dcp/__0_0.distcp", "parts/00000.json"]
    assert g.sharding == Sharding(1, 1, None, (0,))


def test_sha256_parts() -> None:
    p0, p1 = part(0, (0, 1), algorithm="sha256"), part(1, (2, 3), algorithm="sha256")
    g = build_global_manifest([p0, p1])
    assert g.checksum_algorithm == "sha256"
    assert g.files[-1].checksum == checksum_bytes(p1[0], "sha256")


@pytest.mark.parametrize(
    "parts, problem",
    [
        ([], "no part manifests"),
        ([part(0, (0, 1)), part(0, (0, 1))], "part 0: given twice"),
        ([part(0, (0, 1))], r"part\(s\) 1 of 2 missing"),
        ([part(0, (0, 1)), part(1, (2, 3), step=11)], "part 1: step 11, but part 0 has step 10"),
        ([part(0, (0, 1)), part(1, (2, 3, 4), world_size=5)], "part 1: world_size 5, but part 0 has 4"),
        ([part(0, (0, 1)), part(1, (2, 3), parts=3)], "part 1: 3 parts, but part 0 says 2"),
        ([part(0, (0, 1)), part(1, (2, 3), algorithm="sha256")], "part 1: checksum algorithm sha256"),
        ([part(0, (0, 1)), part(1, (1, 2, 3))], "part 1: rank 1 is also in part 0"),
        ([part(0, (0,)), part(1, (2, 3))], r"ranks \[1\] of world_size 4 are in no part"),
        (
            [part(0, (0, 1), files=["dcp/.metadata"]), part(1, (2, 3), files=["a", "dcp/.metadata"])],
            "part 1: file 'dcp/.metadata' is also in part 0",
        ),
    ],
)
def test_inconsistent_parts_are_refused_naming_the_part(parts: list[tuple[bytes, Manifest]], problem: str) -> None:
    with pytest.raises(ManifestError, match=problem):
        build_global_manifest(parts)


def test_parts_of_different_saves_are_refused_and_the_save_id_is_kept() -> None:
    p0 = part(0, (0, 1))
    with_id = [part(0, (0, 1), sharding_id="s1"), part(1, (2, 3), sharding_id="s1")]
    assert build_global_manifest(with_id).sharding == Sharding(4, 2, None, (0, 1, 2, 3), "s1")
    with pytest.raises(ManifestError, match="part 1 is from another save of step 10"):
        build_global_manifest([part(0, (0, 1), sharding_id="s1"), part(1, (2, 3), sharding_id="s2")])
    with pytest.raises(ManifestError, match="another save"):
        build_global_manifest([p0, part(1, (2, 3), sharding_id="s2")])
    with pytest.raises(ManifestError, match="save_id"):
        parse_manifest(p0[0].replace(b'"ranks"', b'"save_id": "../x", "ranks"'))


def test_a_global_or_single_manifest_is_not_a_part() -> None:
    single = new_manifest(10, [FileEntry("a", 1, CRC)], "crc32c")
    with pytest.raises(ManifestError, match="not a part manifest"):
        build_global_manifest([(single.to_json(), single)])
    g = build_global_manifest([part(0, (0, 1)), part(1, (2, 3))])
    with pytest.raises(ManifestError, match="not a part manifest"):
        build_global_manifest([(g.to_json(), g)])


def test_bytes_must_match_the_parsed_part() -> None:
    data, m = part(0, (0, 1))
    _, other = part(0, (0, 1), epoch=5)
    with pytest.raises(ManifestError, match="part 0: its bytes do not parse"):
        build_global_manifest([(data, other), part(1, (2, 3))])
    assert m != other
