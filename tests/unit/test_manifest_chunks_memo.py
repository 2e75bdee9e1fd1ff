"""A file's chunk list, parsed once, is not checked again for the same content (its CRC32Cs combined once)."""

from __future__ import annotations

import pytest

from spotguard.checkpoint.format import manifest as m
from spotguard.storage import checksum


def _chunks(n: int) -> tuple[list[list[object]], int, str]:
    parts = [bytes([i]) * (100 + i) for i in range(n)]
    chunks = [[f"{i:064x}", len(p), checksum.checksum_bytes(p, "crc32c")] for i, p in enumerate(parts)]
    whole = b"".join(parts)
    return chunks, len(whole), checksum.checksum_bytes(whole, "crc32c")


def test_the_same_list_is_combined_once_and_another_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    combine = checksum.crc32c_of_parts

    def counted(parts: object) -> int:
        calls.append(1)
        return combine(parts)  # type: ignore[arg-type]

    monkeypatch.setattr(checksum, "crc32c_of_parts", counted)
    monkeypatch.setattr(m, "_PARSED_CHUNKS", {})
    chunks, size, crc = _chunks(40)
    first = m._parse_chunks("f", chunks, size, crc, "crc32c")
    again = m._parse_chunks("f", [list(c) for c in chunks], size, crc, "crc32c")
    assert again == first and len(calls) == 1
    # One chunk's CRC32C changed: not the list parsed before, checked, refused.
    bad = [list(c) for c in chunks]
    bad[3][2] = f"{int(str(bad[3][2]), 16) ^ 1:08x}"
    with pytest.raises(m.ManifestError, match="do not combine"):
        m._parse_chunks("f", bad, size, crc, "crc32c")
    # The same chunks said to make another file: checked, refused.
    with pytest.raises(m.ManifestError, match="do not combine"):
        m._parse_chunks("f", chunks, size, f"{int(crc, 16) ^ 1:08x}", "crc32c")
    assert len(calls) == 3


def test_malformed_items_are_refused_whatever_was_parsed_before(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(m, "_PARSED_CHUNKS", {})
    chunks, size, crc = _chunks(3)
    m._parse_chunks("f", chunks, size, crc, "crc32c")
    with pytest.raises(m.ManifestError, match="is not \\[sha256, size, crc32c\\]"):
        m._parse_chunks("f", [*chunks[:2], [chunks[2]]], size, crc, "crc32c")
    with pytest.raises(m.ManifestError, match="not a SHA-256"):
        m._parse_chunks("f", [*chunks[:2], [["x"], 1, "0"]], size, crc, "crc32c")


def test_the_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(m, "_PARSED_CHUNKS", {})
    monkeypatch.setattr(m, "_PARSED_CHUNKS_MAX", 4)
    for n in range(1, 10):
        chunks, size, crc = _chunks(n)
        m._parse_chunks("f", chunks, size, crc, "crc32c")
    assert len(m._PARSED_CHUNKS) == 4
