"""The pieces of gs:// uploads: parallel composite uploads' pieces and keys, and the file readers uploads use.

Pure helpers and small file wrappers for :mod:`spotguard.storage.gcs`: how a
large file is cut into the pieces of a parallel composite upload and where
those pieces wait for their ``compose``; a window of an open file read as a
file of its own (one piece); progress counted once per byte across retries.

A parallel composite upload moves one large file (a model's weights) at the
store's aggregate speed rather than one stream's: its pieces go up at once
as temporary objects (each a resumable upload checked by its CRC32C), one
``compose`` request joins them server-side, the composed object's CRC32C
(GCS computes it over all its bytes) must combine the pieces', and the
pieces are deleted. Pieces live below :data:`COMPOSE_DIR`; an upload that
died leaves them there, where ``list_pending_uploads`` finds them and the
collector's removal of stale uploads deletes them (as it aborts S3's
multipart uploads).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import Future
from typing import IO

from spotguard.storage.base import ObjectInfo, PendingUpload, ProgressCallback
from spotguard.storage.gcs_client import upload_chunk_size

#: The most objects one ``compose`` request joins (a GCS limit).
COMPOSE_LIMIT = 32
#: Where the pieces of a parallel composite upload wait for their ``compose``:
#: ``gc/compose/<upload id>.<piece>/<target key>``.
COMPOSE_DIR = "gc/compose"


def composite_pieces(size: int, threshold: int, min_piece: int) -> list[tuple[int, int]]:
    """Pure: the ``(offset, length)`` pieces a file of ``size`` bytes goes up in:
    one (the whole file) below ``threshold``, else at most :data:`COMPOSE_LIMIT`
    pieces of at least ``min_piece`` bytes (a multiple of 256 KiB), the last one
    the remainder."""
    if threshold <= 0 or size < threshold or size <= min_piece:
        return [(0, size)]
    piece = upload_chunk_size(max(min_piece, -(-size // COMPOSE_LIMIT)))
    return [(offset, min(piece, size - offset)) for offset in range(0, size, piece)]


def piece_key(upload_id: str, index: int, key: str) -> str:
    """Pure: the key of piece ``index`` of a composite upload of ``key``."""
    return f"{COMPOSE_DIR}/{upload_id}.{index:02d}/{key}"


def parse_piece_key(rel: str) -> tuple[str, str] | None:
    """Pure: ``(upload id, target key)`` of a composite upload's piece, or None."""
    head, sep, rest = rel.partition(f"{COMPOSE_DIR}/")
    if head or not sep:
        return None
    piece, sep, key = rest.partition("/")
    upload_id, dot, index = piece.rpartition(".")
    if not sep or not key or not dot or not upload_id or not index.isdigit():
        return None
    return upload_id, key


def pending_uploads(pieces: Iterable[ObjectInfo], prefix: str) -> list[PendingUpload]:
    """Pure: the composite uploads whose ``pieces`` (the objects listed below
    :data:`COMPOSE_DIR`) are stored, for target keys below ``prefix``, each started
    when its first piece was; in key order."""
    started: dict[tuple[str, str], float] = {}
    for info in pieces:
        parsed = parse_piece_key(info.key)
        if parsed is None or not parsed[1].startswith(prefix):
            continue
        upload_id, key = parsed
        started[(key, upload_id)] = min(info.modified, started.get((key, upload_id), info.modified))
    return [PendingUpload(key, upload_id, when) for (key, upload_id), when in sorted(started.items())]


def pieces_of(listed: Iterable[ObjectInfo], upload: PendingUpload) -> list[str]:
    """Pure: the keys of ``upload``'s pieces among the ``listed`` objects."""
    return [info.key for info in listed if parse_piece_key(info.key) == (upload.upload_id, upload.key)]


class Composite:
    """A file going up as pieces joined by ``compose``."""

    def __init__(self, key: str, upload_id: str, pieces: list[tuple[int, int]]) -> None:
        self.key = key
        self.upload_id = upload_id
        self.pieces = pieces
        self.futures: list[Future[int]] = []

    def piece(self, index: int) -> str:
        return piece_key(self.upload_id, index, self.key)


class Window:
    """``length`` bytes of an open file from ``offset``, read as a file of their own."""

    def __init__(self, f: IO[bytes], offset: int, length: int) -> None:
        self._f = f
        self._start = offset
        self._end = offset + length
        f.seek(offset)

    def read(self, n: int = -1) -> bytes:
        left = self._end - self._f.tell()
        return self._f.read(left if n is None or n < 0 else min(n, left)) if left > 0 else b""

    def tell(self) -> int:
        return self._f.tell() - self._start

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: self._start, os.SEEK_CUR: self._f.tell(), os.SEEK_END: self._end}[whence]
        return self._f.seek(base + offset) - self._start


class Furthest:
    """Progress of one file counted by the furthest offset read.

    A retried chunk (or a retried upload) is read again after a seek back;
    counting only past the furthest offset reached makes the reported total
    the file's size."""

    def __init__(self, progress: ProgressCallback | None) -> None:
        self._progress = progress
        self._furthest = 0

    def reached(self, offset: int) -> None:
        if offset > self._furthest:
            if self._progress is not None:
                self._progress(offset - self._furthest)
            self._furthest = offset


class ProgressReader:
    """The file a resumable upload reads, reporting its progress (see :class:`Furthest`)."""

    def __init__(self, f: IO[bytes], reported: Furthest) -> None:
        self._f = f
        self._reported = reported

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._reported.reached(self._f.tell())
        return data

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)
