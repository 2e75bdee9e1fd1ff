"""Safe pickles remembered by their content's SHA-256 (``spotguard.checkpoint.format.pickle_scan``): the
same bytes are not read as a pickle again, a refused pickle is never remembered, other bytes are
inspected whatever a CRC of theirs says, and the memory is bounded."""

from __future__ import annotations

import io
import os
import pickle
import tempfile
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

from spotguard.checkpoint.format import pickle_scan
from spotguard.checkpoint.format.pickle_scan import UnsafePickleError, check_pickle_safe


@pytest.fixture(autouse=True)
def inspected(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """The bytes of every pickle read by the unpickler, from an empty memory of safe pickles."""
    seen: list[bytes] = []
    real = pickle_scan._inspect

    def recording(f: Any) -> Any:
        seen.append(f.getvalue() if isinstance(f, io.BytesIO) else b"")
        return real(f)

    monkeypatch.setattr(pickle_scan, "_inspect", recording)
    monkeypatch.setattr(pickle_scan, "_safe", type(pickle_scan._safe)())
    yield seen


class _Call:
    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> Any:
        return self.func, self.args


def test_a_safe_pickle_is_read_once_then_known_by_its_bytes(inspected: list[bytes]) -> None:
    data = pickle.dumps({"w": [1.0, 2.0], "step": 3})
    check_pickle_safe(data)
    check_pickle_safe(data)
    with tempfile.SpooledTemporaryFile() as spool:  # as the verification hands it: a stream
        spool.write(data)
        check_pickle_safe(spool)  # type: ignore[arg-type]
        assert spool.tell() == 0  # put back at its start
    assert inspected == [data]
    check_pickle_safe(pickle.dumps({"w": [1.0, 2.0], "step": 4}))  # other bytes: read
    assert len(inspected) == 2


def test_a_refused_pickle_is_refused_every_time(inspected: list[bytes]) -> None:
    data = pickle.dumps({"x": _Call(os.getcwd)})
    for _ in range(2):
        with pytest.raises(UnsafePickleError, match=r"(posix|os)\.getcwd"):
            check_pickle_safe(data)
    assert len(inspected) == 2


def test_bytes_made_to_match_a_safe_pickles_crc_are_read(inspected: list[bytes]) -> None:
    """The manifest's checksum may be a CRC, which other bytes can be made to match: the memory's
    key is the content's SHA-256, so an unsafe pickle of the same length and CRC32 is read and refused."""
    safe = pickle.dumps(("a" * 40, 1), protocol=4)
    check_pickle_safe(safe)
    size = len(pickle.dumps((_Call(os.getcwd), b""), protocol=4))
    pad = len(safe) - size
    unsafe = pickle.dumps((_Call(os.getcwd), b"\x01" * pad), protocol=4)
    unsafe = _with_crc32(unsafe, unsafe.index(b"\x01" * pad) + pad - 4, zlib.crc32(safe))
    assert len(unsafe) == len(safe) and zlib.crc32(unsafe) == zlib.crc32(safe)
    with pytest.raises(UnsafePickleError, match=r"(posix|os)\.getcwd"):
        check_pickle_safe(unsafe)


def _with_crc32(data: bytes, where: int, crc: int) -> bytes:
    """``data`` with the 4 bytes at ``where`` set so that its CRC32 is ``crc``: the CRC is affine in
    them over GF(2), so they are solved for (a basis of the 32 columns, by their highest bits)."""
    body = bytearray(data)

    def crc_with(x: int) -> int:
        body[where : where + 4] = x.to_bytes(4, "little")
        return zlib.crc32(bytes(body))

    base = crc_with(0)
    basis: list[tuple[int, int]] = []  # (column, the input bits making it), distinct highest bits
    for i in range(32):
        column, bits = crc_with(1 << i) ^ base, 1 << i
        for b_column, b_bits in basis:
            if column ^ b_column < column:
                column, bits = column ^ b_column, bits ^ b_bits
        if column:
            basis.append((column, bits))
            basis.sort(reverse=True)
    target, x = crc ^ base, 0
    for b_column, b_bits in basis:
        if target ^ b_column < target:
            target, x = target ^ b_column, x ^ b_bits
    assert target == 0
    crc_with(x)
    return bytes(body)


def test_the_memory_is_bounded(inspected: list[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pickle_scan, "SAFE_MEMO_SIZE", 3)
    pickles = [pickle.dumps({"i": i}) for i in range(4)]
    for data in pickles:
        check_pickle_safe(data)
    check_pickle_safe(pickles[3])  # remembered
    check_pickle_safe(pickles[0])  # the oldest, forgotten: read again
    assert inspected == [*pickles, pickles[0]]
