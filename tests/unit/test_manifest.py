"""Manifest format: building, parsing, and rejecting malformed or unsafe manifests; checking
files against it from checksums the store computed (CRC32C arithmetic included)."""

from __future__ import annotations

import base64
import json
import random
from dataclasses import replace
from typing import Any

import pytest

from spotguard.checkpoint.format.manifest import (
    FileEntry,
    ManifestError,
    check_file_path,
    checkpoint_name,
    clean_metrics,
    new_manifest,
    parse_checkpoint_name,
    parse_manifest,
    parse_pointer,
    pointer_json,
)
from spotguard.checkpoint.format.verify import check_stored_checksum, needs_content, verify_files_by_store
from spotguard.storage.base import NotFoundError, StoredChecksum
from spotguard.storage.checksum import (
    checksum_bytes,
    crc32c_combine,
    crc32c_composite,
    crc32c_from_base64,
    crc32c_of_parts,
    crc32c_to_base64,
)

GOOD_CRC = "0a1b2c3d"
GOOD_SHA = "ab" * 32


def doc(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "format_version": 1,
        "step": 100,
        "epoch": 2,
        "metrics": {"loss": 0.5},
        "created": "2025-01-02T03:04:05.000006Z",
        "writer": "spotguard 0.1.0",
        "checksum_algorithm": "crc32c",
        "files": [{"path": "model.safetensors", "size": 10, "checksum": GOOD_CRC}],
    }
    base.update(overrides)
    return base


def raw(d: dict[str, Any]) -> bytes:
    return json.dumps(d).encode()


@pytest.mark.parametrize(
    "step, name",
    [(0, "ckpt-000000000000"), (1, "ckpt-000000000001"), (123456789012 - 1, "ckpt-123456789011")],
)
def test_checkpoint_names_roundtrip(step: int, name: str) -> None:
    assert checkpoint_name(step) == name
    assert parse_checkpoint_name(name) == step


@pytest.mark.parametrize("name", ["ckpt-1", "ckpt-0000000000001", "ckpt-00000000000a", "latest", "xckpt-000000000001"])
def test_non_checkpoint_names(name: str) -> None:
    assert parse_checkpoint_name(name) is None


@pytest.mark.parametrize("step", [-1, 10**12, 1.5, True, "3"])
def test_checkpoint_name_rejects_bad_steps(step: Any) -> None:
    with pytest.raises(ValueError):
        checkpoint_name(step)


@pytest.mark.parametrize(
    "path, problem",
    [
        ("model.safetensors", None),
        ("sub/dir/file.bin", None),
        ("../evil", "escapes the checkpoint"),
        ("a/../../evil", "escapes the checkpoint"),
        ("/etc/passwd", "is absolute"),
        ("C:/x", "is absolute"),
        ("a\\b", "backslash"),
        ("a//b", "empty or '.' segment"),
        ("./a", "empty or '.' segment"),
        ("a/", "empty or '.' segment"),
        ("", "non-empty string"),
        ("a\nb", "control character"),
        ("manifest.json", "names the manifest itself"),
        (7, "non-empty string"),
    ],
)
def test_file_path_rules(path: Any, problem: str | None) -> None:
    if problem is None:
        assert check_file_path(path) == path
    else:
        with pytest.raises(ManifestError, match=problem):
            check_file_path(path)


def test_roundtrip_preserves_every_field() -> None:
    m = new_manifest(
        42,
        [FileEntry("model.safetensors", 10, GOOD_CRC), FileEntry("state.json", 3, "ffffffff")],
        "crc32c",
        epoch=3,
        metrics={"loss": 0.25, "acc": 1, "bad": float("nan")},
        job="ns/job",
        attempt=2,
        reason="sigterm",
        request_id="r-1",
        timing={"save_seconds": 0.5},
    )
    again = parse_manifest(m.to_json(), expected_name="ckpt-000000000042")
    assert again == m
    assert again.metrics == {"loss": 0.25, "acc": 1.0, "bad": None}
    assert again.total_size == 13
    assert again.name == "ckpt-000000000042"
    assert again.format_version == 1  # no sharding: written as version 1, as before
    assert again.created.endswith("Z")
    assert again.created_at.tzinfo is not None


def test_sha256_manifests() -> None:
    m = parse_manifest(raw(doc(checksum_algorithm="sha256", files=[{"path": "a", "size": 1, "checksum": GOOD_SHA}])))
    assert m.checksum_algorithm == "sha256"


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    assert parse_manifest(raw(doc(future_field={"x": 1}))).step == 100


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"{not json", "malformed JSON"),
        (b"\xff\xfe", "malformed JSON"),
        (b"[]", "top level is not a JSON object"),
        (raw(doc(format_version=4)), "format_version 4 is not supported"),
        (raw(doc(format_version=0)), "format_version 0 is not supported"),
        (raw(doc(format_version="1")), "'format_version' must be an integer"),
        (raw(doc(step=-5)), "out of range"),
        (raw(doc(step=True)), "'step' must be an integer"),
        (raw(doc(epoch="x")), "'epoch' must be an integer"),
        (raw(doc(checksum_algorithm="md5")), "unknown checksum_algorithm"),
        (raw(doc(created="yesterday")), "not an RFC 3339 time"),
        (raw(doc(created=5)), "'created' must be an RFC 3339 string"),
        (raw(doc(metrics=[1])), "'metrics' must be an object"),
        (raw(doc(metrics={"loss": "low"})), "metric 'loss' is not a number"),
        (raw(doc(files={})), "'files' must be a list"),
        (raw(doc(timing={"save_seconds": "slow"})), "'timing' must map names to seconds"),
        (raw(doc(reason=3)), "'reason' must be a string"),
        (raw(doc(files=["x"])), "is not an object"),
        (raw(doc(files=[{"path": "../x", "size": 1, "checksum": GOOD_CRC}])), "escapes the checkpoint"),
        (raw(doc(files=[{"path": "/abs", "size": 1, "checksum": GOOD_CRC}])), "is absolute"),
        (raw(doc(files=[{"path": "a", "size": -1, "checksum": GOOD_CRC}])), "size must be a non-negative integer"),
        (raw(doc(files=[{"path": "a", "size": 1, "checksum": "xyz"}])), "is not a crc32c hex digest"),
        (raw(doc(files=[{"path": "a", "size": 1, "checksum": GOOD_SHA}])), "is not a crc32c hex digest"),
        (raw(doc(files=[{"path": "a", "size": 1, "checksum": "0A1B2C3D"}])), "is not a crc32c hex digest"),
        (
            raw(doc(files=[{"path": "a", "size": 1, "checksum": GOOD_CRC}] * 2)),
            "listed twice",
        ),
    ],
)
def test_malformed_manifests_are_named(data: bytes, problem: str) -> None:
    with pytest.raises(ManifestError, match=problem):
        parse_manifest(data)


def test_step_must_match_the_checkpoint_name() -> None:
    with pytest.raises(ManifestError, match="does not match the checkpoint name"):
        parse_manifest(raw(doc(step=100)), expected_name="ckpt-000000000101")


@pytest.mark.parametrize(
    "metrics, expected",
    [
        ({"a": 1}, {"a": 1.0}),
        ({"a": float("inf"), "b": -2.5}, {"a": None, "b": -2.5}),
        (None, {}),
    ],
)
def test_clean_metrics(metrics: Any, expected: dict[str, Any]) -> None:
    assert clean_metrics(metrics) == expected


def test_clean_metrics_rejects_non_numbers() -> None:
    with pytest.raises(ValueError, match="not a number"):
        clean_metrics({"a": "x"})


@pytest.mark.parametrize(
    "data, step",
    [
        (pointer_json(7), 7),
        (b'{"step": 7, "name": "ckpt-000000000008"}', None),
        (b'{"step": "7", "name": "ckpt-000000000007"}', None),
        (b"garbage", None),
        (b"{}", None),
    ],
)
def test_pointer_parsing(data: bytes, step: int | None) -> None:
    assert parse_pointer(data) == step


# -- checksums the store computed: CRC32C arithmetic and the verification that uses it ---------


def crc(data: bytes) -> int:
    return int(checksum_bytes(data, "crc32c"), 16)


@pytest.mark.parametrize("sizes", [(0, 0), (1, 0), (0, 7), (5, 3), (1000, 1), (4096, 12345)])
def test_crc32c_combine_equals_the_crc_of_the_concatenation(sizes: tuple[int, int]) -> None:
    rng = random.Random(sum(sizes))
    a, b = rng.randbytes(sizes[0]), rng.randbytes(sizes[1])
    assert crc32c_combine(crc(a), crc(b), len(b)) == crc(a + b)


def test_whole_object_crc32c_from_parts() -> None:
    rng = random.Random(1)
    parts = [rng.randbytes(n) for n in (5000, 5000, 17, 0, 333)]
    assert crc32c_of_parts((crc(p), len(p)) for p in parts) == crc(b"".join(parts))
    assert crc32c_of_parts([]) == crc(b"")


def test_composite_checksum_is_the_crc_of_the_part_crcs() -> None:
    parts = [b"a" * 10, b"b" * 3]
    joined = crc(parts[0]).to_bytes(4, "big") + crc(parts[1]).to_bytes(4, "big")
    assert crc32c_composite(crc(p) for p in parts) == f"{base64.b64encode(crc(joined).to_bytes(4, 'big')).decode()}-2"


def test_crc32c_base64_round_trip_and_junk() -> None:
    value = crc(b"spotguard")
    assert crc32c_from_base64(crc32c_to_base64(value)) == value
    assert crc32c_from_base64(crc32c_to_base64(value) + "-3") == value
    assert crc32c_from_base64("not base64!") is None
    assert crc32c_from_base64(base64.b64encode(b"12345").decode()) is None


def _manifest(files: dict[str, bytes], algorithm: str = "crc32c") -> Any:
    entries = [FileEntry(p, len(d), checksum_bytes(d, algorithm)) for p, d in files.items()]
    return new_manifest(5, entries, algorithm)


FILES = {"model.safetensors": b"m" * 100, "state.json": b"{}", "legacy.pt": b"\x80\x04N."}


def _stored(data: bytes) -> StoredChecksum:
    return StoredChecksum("crc32c", checksum_bytes(data, "crc32c"), len(data), "full-object")


def test_store_checksums_replace_reading_back_except_for_possible_pickles() -> None:
    manifest = _manifest(FILES)
    reads: list[str] = []

    def read_chunks(path: str) -> list[bytes]:
        reads.append(path)
        return [FILES[path]]

    checks = verify_files_by_store(
        manifest, {p: len(d) for p, d in FILES.items()}, lambda p: _stored(FILES[p]), read_chunks
    )
    assert checks.problems == []
    assert reads == ["legacy.pt"]  # a possible pickle is always inspected byte by byte
    assert (checks.store_checked, checks.read_back, checks.method) == (2, 1, "mixed")
    assert needs_content("legacy.pt") and not needs_content("model.safetensors")


def test_a_store_checksum_that_differs_from_the_manifest_is_a_problem() -> None:
    files = {"model.safetensors": b"m" * 100}
    manifest = _manifest(files)
    checks = verify_files_by_store(
        manifest, {"model.safetensors": 100}, lambda p: _stored(b"x" * 100), lambda p: pytest.fail("read back")
    )
    assert checks.method == "store-checksum"
    assert len(checks.problems) == 1 and "crc32c checksum mismatch (the store computed" in checks.problems[0]


def test_without_a_store_checksum_the_bytes_are_read_back() -> None:
    files = {"model.safetensors": b"m" * 100, "state.json": b"{}"}
    manifest = _manifest(files)
    checks = verify_files_by_store(
        manifest, {p: len(d) for p, d in files.items()}, lambda p: None, lambda p: [files[p]]
    )
    assert checks.problems == [] and checks.method == "read-back" and checks.read_bytes == 102


def test_a_sha256_manifest_is_read_back_even_with_a_store_crc32c() -> None:
    files = {"model.safetensors": b"m" * 100}
    manifest = _manifest(files, "sha256")
    checks = verify_files_by_store(
        manifest, {"model.safetensors": 100}, lambda p: _stored(files[p]), lambda p: [files[p]]
    )
    assert checks.problems == [] and checks.method == "read-back"


def test_missing_and_resized_files_are_named_without_asking_the_store() -> None:
    files = {"model.safetensors": b"m" * 100, "state.json": b"{}"}
    manifest = _manifest(files)

    def gone(path: str) -> StoredChecksum | None:
        raise NotFoundError(path)

    checks = verify_files_by_store(manifest, {"model.safetensors": 99}, gone, lambda p: pytest.fail("read"))
    assert checks.problems == [
        "model.safetensors: size 99 bytes, manifest says 100 (truncated)",
        "state.json: missing",
    ]
    entry = FileEntry("model.safetensors", 100, checksum_bytes(files["model.safetensors"], "crc32c"))
    assert "size 90 bytes" in (check_stored_checksum(entry, "crc32c", _stored(b"m" * 90)) or "")


def test_the_same_bytes_parse_once() -> None:
    m = new_manifest(7, [FileEntry("a", 1, GOOD_CRC)], "crc32c", metrics={"loss": 0.5})
    data = m.to_json()
    first = parse_manifest(data, expected_name="ckpt-000000000007")
    assert parse_manifest(bytes(data), expected_name="ckpt-000000000007") is first
    assert parse_manifest(bytearray(data), expected_name="ckpt-000000000007") is first
    # Another expected name is checked anew, not answered from what was parsed for the first.
    with pytest.raises(ManifestError, match="does not match the checkpoint name"):
        parse_manifest(data, expected_name="ckpt-000000000008")
    # One byte more or less is other bytes: parsed for what they say.
    other = data.replace(b'"loss": 0.5', b'"loss": 0.25')
    assert other != data
    assert parse_manifest(other).metrics == {"loss": 0.25}
    assert parse_manifest(data).metrics == {"loss": 0.5}
    # Another manifest's bytes are its own.
    later = replace(first, step=8)
    assert parse_manifest(later.to_json(), expected_name="ckpt-000000000008").step == 8
    # Bad bytes fail at every parse (a failure is not remembered).
    for _ in range(2):
        with pytest.raises(ManifestError):
            parse_manifest(data[:-5])
