"""The parts of an S3 multipart upload: where each begins, the buffer it is read
into, and the request body that lets a stopped transfer end mid-part."""

from __future__ import annotations

import io
import threading
from concurrent.futures import CancelledError

from spotguard.storage.base import ProgressCallback

MiB = 1 << 20

#: How many bytes of a part go out between two questions to its progress callback.
ASK_EVERY = 1 * MiB


class PartStopped(CancelledError):
    """Raised from a part's body when its transfer was stopped: botocore lets a
    ``CancelledError`` through as it is (neither wrapped nor retried), and
    :meth:`S3Storage._upload_part` raises the original exception again."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class AskingBody:
    """A part's bytes as a request body that asks ``ask(0)`` every
    :data:`ASK_EVERY` bytes read: a transfer stopped by its progress callback
    (a routine upload a preemption overtakes) ends its parts on the wire too,
    within a MiB, instead of sending them whole. Reads ``data`` where it is
    (the part's buffer, reused: see :func:`part_buffer`)."""

    def __init__(self, data: bytes | bytearray, ask: ProgressCallback) -> None:
        self._view = memoryview(data)
        self._at = 0
        self._ask = ask
        self._asked_at = 0

    def __len__(self) -> int:
        return self._view.nbytes

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._view.nbytes}[whence]
        self._at = max(0, min(base + offset, self._view.nbytes))
        return self._at

    def read(self, size: int | None = -1) -> bytes:
        here = self._at
        if abs(here - self._asked_at) >= ASK_EVERY:  # also when read again from the start (a retry)
            self._asked_at = here
            try:
                self._ask(0)
            except BaseException as exc:  # noqa: BLE001 - any stop the callback raises passes botocore unwrapped
                raise PartStopped(exc) from exc
        end = self._view.nbytes if size is None or size < 0 else min(self._view.nbytes, here + size)
        self._at = end
        return self._view[here:end].tobytes()


_parts = threading.local()


def part_buffer(length: int) -> bytearray:
    """This thread's buffer for a part of ``length`` bytes, reused from one
    part to the next: reading every part into new memory costs a page fault
    per 4 KiB each time (more than the copy itself, and much more on a
    virtual machine that hands freed memory back to its host)."""
    buf: bytearray | None = getattr(_parts, "buf", None)
    if buf is None or len(buf) != length:
        buf = _parts.buf = bytearray(length)
    return buf


def part_ranges(size: int, part_size: int) -> list[tuple[int, int, int]]:
    """(part number, offset, length) of each part; at most 10,000 parts (S3's limit)."""
    part_size = max(part_size, -(-size // 10_000), 5 * MiB)
    return [(i + 1, off, min(part_size, size - off)) for i, off in enumerate(range(0, size, part_size))]
