"""The safetensors header checks a streamed restore relies on before placing bytes (pure)."""

from __future__ import annotations

import json
import struct

import pytest

from spotguard.checkpoint.local.codec import (
    StateError,
    TensorBlob,
    parse_safetensors_header,
    safetensors_header,
    safetensors_header_end,
)


def blob(dtype: str, shape: tuple[int, ...], itemsize: int) -> TensorBlob:
    n = itemsize
    for d in shape:
        n *= d
    return TensorBlob(dtype, shape, memoryview(bytes(n)))


def test_the_writers_header_parses_to_tiling_spans() -> None:
    blobs = {
        "a": blob("F32", (3, 5), 4),
        "b": blob("BF16", (7,), 2),
        "c": blob("BOOL", (0,), 1),
        "d": blob("I64", (), 8),
    }
    head, order = safetensors_header(blobs)
    size = len(head) + sum(b.nbytes for b in blobs.values())
    end = safetensors_header_end(head[:8], size)
    assert end == len(head)
    spans = parse_safetensors_header(head[8:end], size)
    assert [s.key for s in spans if s.end > s.start] == [k for k in order if blobs[k].nbytes]
    assert spans[0].start == end and spans[-1].end == size
    by_key = {s.key: s for s in spans}
    assert by_key["a"].shape == (3, 5) and by_key["a"].end - by_key["a"].start == 60
    assert by_key["d"].shape == () and by_key["d"].itemsize == 8


def header(doc: dict[str, object]) -> bytes:
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("doc", "data", "message"),
    [
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 12, "end at byte"),
        ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, "do not hold"),
        ({"x": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, 8, "unknown dtype"),
        ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}, 8, "bad shape"),
        (
            {
                "x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "y": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            6,
            "overlapping or a gap",
        ),
        ({"x": {"dtype": "U8", "shape": [4], "data_offsets": [1, 5]}}, 5, "overlapping or a gap"),
        ({"x": {"dtype": "U8"}}, 4, "needs dtype"),
    ],
)
def test_headers_that_do_not_describe_the_file_are_refused(doc: dict[str, object], data: int, message: str) -> None:
    raw = header(doc)
    with pytest.raises(StateError, match=message):
        parse_safetensors_header(raw, 8 + len(raw) + data)


def test_a_header_length_beyond_the_file_is_refused() -> None:
    with pytest.raises(StateError, match="does not fit"):
        safetensors_header_end(struct.pack("<Q", 1000), 100)
    with pytest.raises(StateError, match="too short"):
        safetensors_header_end(b"\x01\x00", 2)
    with pytest.raises(StateError, match="not JSON"):
        parse_safetensors_header(b"{not json", 100)
