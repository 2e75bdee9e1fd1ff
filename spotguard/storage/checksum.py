"""File checksums: CRC32C (default, hardware-accelerated) or SHA-256.

Checksums are written as lowercase hex: 8 digits for CRC32C, 64 for SHA-256.
This module lives in the storage layer, the lowest that needs it: the S3 and
GCS backends check the CRC32C a store computed per part against it, and the
checkpoint layer above uses it for the checksums its manifests record.
Standard library and google-crc32c (numpy, where installed, to hand it a
buffer without a copy).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

ALGORITHMS = ("crc32c", "sha256")
DEFAULT_ALGORITHM = "crc32c"
CHUNK = 8 << 20


class Hasher(Protocol):
    """Incremental checksum over a byte stream."""

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Add the next bytes."""
        ...

    def hexdigest(self) -> str:
        """The checksum of everything added so far."""
        ...


class Crc32cHasher:
    """CRC32C through ``google-crc32c`` (native, releases the GIL on large chunks)."""

    def __init__(self) -> None:
        from google_crc32c import extend

        self._extend = extend
        self._crc = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._crc = self._extend(self._crc, data if isinstance(data, bytes) else _uncopied(data))

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


def _uncopied(data: bytearray | memoryview) -> Any:
    """``data`` as a buffer google-crc32c takes: it refuses a memoryview (it
    wants a buffer with no release hook), and copying one costs more than
    the checksum (0.4 s per GiB against 0.07 s here). A numpy array over the
    same memory is one it takes; without numpy (or for a non-contiguous
    view), a copy."""
    try:
        import numpy
    except ImportError:
        return bytes(data)
    try:
        return numpy.frombuffer(data, dtype=numpy.uint8)
    except (TypeError, ValueError):
        return bytes(data)


def crc32c_value(data: bytes | bytearray | memoryview) -> int:
    """The CRC32C of ``data``, in place where it can be (see :func:`_uncopied`): without numpy too,
    which the operator's image (restore, sidecar) does not have."""
    from google_crc32c import value  # as Crc32cHasher: loaded by the first checksum taken

    return int(value(data if isinstance(data, bytes) else _uncopied(data)))


class Sha256Hasher:
    """SHA-256 through :mod:`hashlib`."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def check_algorithm(name: str) -> str:
    """Normalize and validate a checksum algorithm name."""
    norm = name.strip().lower().replace("-", "")
    if norm not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {name!r}: use one of {', '.join(ALGORITHMS)}")
    return norm


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hasher for ``algorithm`` (``crc32c`` or ``sha256``)."""
    algorithm = check_algorithm(algorithm)
    if algorithm == "crc32c":
        return Crc32cHasher()
    return Sha256Hasher()


def checksum_chunks(chunks: Iterable[bytes], algorithm: str) -> tuple[str, int]:
    """Checksum and total size of a stream of chunks."""
    h = new_hasher(algorithm)
    size = 0
    for chunk in chunks:
        h.update(chunk)
        size += len(chunk)
    return h.hexdigest(), size


def checksum_file(path: Path, algorithm: str) -> tuple[str, int]:
    """Checksum and size of a local file, streamed in large chunks."""

    def chunks() -> Iterable[bytes]:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(CHUNK):
                yield chunk

    return checksum_chunks(chunks(), algorithm)


def checksum_bytes(data: bytes | bytearray, algorithm: str) -> str:
    """Checksum of an in-memory byte string."""
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


# -- CRC32C arithmetic for checksums a store computed per part ---------------------------
#
# An S3 multipart upload with additional checksums stores one CRC32C per part
# and, for the object, either the CRC32C of the whole object (``FULL_OBJECT``)
# or a "checksum of checksums" (``COMPOSITE``: CRC32C over the concatenated
# big-endian part CRCs, written ``<base64>-<parts>``). A manifest records the
# CRC32C of the whole file, so part CRCs are combined into the whole-file CRC
# (the zlib ``crc32_combine`` method, with the Castagnoli polynomial) before
# comparing.

_CRC32C_POLY_REFLECTED = 0x82F63B78


def _gf2_times(matrix: list[int], vector: int) -> int:
    total = 0
    i = 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


def _zero_operators() -> list[list[int]]:
    """The operators that append ``2**k`` zero bytes to a CRC32C register, for k in 0..63."""
    op = [_CRC32C_POLY_REFLECTED] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):  # two, four, eight zero bits: one zero byte
        op = _gf2_square(op)
    ops = [op]
    for _ in range(63):
        ops.append(_gf2_square(ops[-1]))
    return ops


_ZERO_OPERATORS: list[list[int]] = []
_ZERO_TABLES: dict[int, tuple[list[int], ...]] = {}


def _byte_tables(matrix: list[int]) -> tuple[list[int], ...]:
    """``matrix`` applied to each byte value at each of the four byte positions of a register
    (four lookups per application instead of up to 32 steps: a manifest of thousands of chunks
    combines their CRC32Cs on every parse)."""
    tables = []
    for shift in (0, 8, 16, 24):
        table = [0] * 256
        for b in range(1, 256):
            low = b & -b
            table[b] = table[b ^ low] ^ matrix[shift + low.bit_length() - 1]
        tables.append(table)
    return tuple(tables)


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc1`` = CRC32C(A), ``crc2`` = CRC32C(B) and ``len(B)``.

    ``crc1`` is advanced over ``len(B)`` zero bytes with one precomputed
    operator per set bit of the length (zlib's ``crc32_combine``, with the
    operators squared once per process instead of at every call, and each
    applied by byte tables built the first time it is used).
    """
    if len2 <= 0:
        return crc1
    if not _ZERO_OPERATORS:
        _ZERO_OPERATORS.extend(_zero_operators())
    k = 0
    while len2:
        if len2 & 1:
            tables = _ZERO_TABLES.get(k)
            if tables is None:
                tables = _ZERO_TABLES[k] = _byte_tables(_ZERO_OPERATORS[k])
            t0, t1, t2, t3 = tables
            crc1 = t0[crc1 & 0xFF] ^ t1[(crc1 >> 8) & 0xFF] ^ t2[(crc1 >> 16) & 0xFF] ^ t3[crc1 >> 24]
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def crc32c_of_parts(parts: Iterable[tuple[int, int]]) -> int:
    """The whole-object CRC32C from ``(crc32c, size)`` of each part, in order."""
    total = 0
    for crc, size in parts:
        total = crc32c_combine(total, crc, size)
    return total


def crc32c_composite(part_crcs: Iterable[int]) -> str:
    """The S3 ``COMPOSITE`` checksum of a multipart object: ``<base64>-<parts>``."""
    crcs = list(part_crcs)
    joined = b"".join(c.to_bytes(4, "big") for c in crcs)
    return f"{crc32c_to_base64(int(checksum_bytes(joined, 'crc32c'), 16))}-{len(crcs)}"


def crc32c_to_base64(crc: int) -> str:
    """A CRC32C as S3 writes it (base64 of 4 big-endian bytes)."""
    import base64

    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def crc32c_from_base64(value: str) -> int | None:
    """The CRC32C an S3 checksum header carries (``<base64>`` or ``<base64>-<parts>``,
    the part count dropped), or None when it is not one."""
    import base64
    import binascii

    text = value.split("-", 1)[0]
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None
