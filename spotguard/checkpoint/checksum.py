"""File checksums: CRC32C (default, hardware-accelerated) or SHA-256.

Checksums are written as lowercase hex: 8 digits for CRC32C, 64 for SHA-256.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

ALGORITHMS = ("crc32c", "sha256")
DEFAULT_ALGORITHM = "crc32c"
CHUNK = 8 << 20


class Hasher(Protocol):
    """Incremental checksum over a byte stream."""

    def update(self, data: bytes | memoryview) -> None:
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

    def update(self, data: bytes | memoryview) -> None:
        # The native extension takes only immutable bytes.
        self._crc = self._extend(self._crc, data if isinstance(data, bytes) else bytes(data))

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


class Sha256Hasher:
    """SHA-256 through :mod:`hashlib`."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, data: bytes | memoryview) -> None:
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


def checksum_bytes(data: bytes, algorithm: str) -> str:
    """Checksum of an in-memory byte string."""
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()
