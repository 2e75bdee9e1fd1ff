"""Memory set aside for a preemption's save staged in memory (``SPOTGUARD_STAGING_RESERVE``).

A preemption's save staged in memory (:mod:`spotguard.checkpoint.local.staged`)
writes its files into new pages of a memory file system, and taking a new
page costs more than the copy into it: the kernel finds and zeroes it, and
on a virtual machine that hands freed memory back to its host (virtio-balloon
free page reporting, common on cloud VMs) the first write to it also faults
in the host. On the benchmark machine a 2 GiB save into fresh pages took
0.79 s of CPU alone, and 2 to 12 s while the uploader and the store ran
beside it; into pages set aside beforehand, 0.31 s.

So with the reserve on, the trainer sets that memory aside while nothing is
urgent: after each routine save it commits, the staging directory gets one
reserve file per tensor file of that save, of its size, allocated
(``fallocate``, ``FALLOC_FL_KEEP_SIZE``: the blocks are there, the file's size
stays 0). A preemption's save staged there takes a reserve file for each
tensor file it writes (a rename into its place: two writers never take the
same one), writes it from the start and gives back whatever the file did not
use (``FALLOC_FL_PUNCH_HOLE``). Memory is set aside :data:`STEP` bytes at a
time and gives way to a preemption: once its save is asked for, the reserve
being made is removed and no other is made.

Why this is as safe as writing a new file:

- A reserve holds no checkpoint data and is never read: it is named as a
  temporary file (``.tmp-reserve-<bytes>-<id>``), which nothing lists,
  ships or restores, and which the staging directory's clean-up removes
  (:func:`~spotguard.checkpoint.local.staged.remove_staging`).
- Its size is 0 until the writer writes, and grows as the writer writes, as
  a new file's does: the uploader that sends a file while it is written reads
  only below its size (:mod:`spotguard.sidecar.follow`), so it never sees a
  byte the writer did not write. The manifest records the size and checksum of
  what was written, as before.
- It is memory the process would have taken at the preemption anyway, taken
  earlier. It is only set aside when it leaves the process at least as much
  memory as it takes (:func:`fits`), it counts as room when a save decides
  whether it fits in memory, and it is off by default: it holds a
  checkpoint's size of memory between saves (``spotguard run
  --reserve-staging`` turns it on).

Where ``fallocate`` is not supported (a file system other than tmpfs or a
local disk's), no reserve is made and saves write new files, as without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from spotguard.checkpoint.local.written import libc

log = logging.getLogger(__name__)

#: A reserve file's name: ``<prefix><bytes>-<id>`` (a temporary file's, so the clean-ups remove it).
#: (:data:`spotguard.checkpoint.local.commit.TMP_PREFIX` and then ``reserve-``; this module is below that one).
RESERVE_PREFIX = ".tmp-reserve-"
#: A reserve file while it is allocated (never taken).
MAKING_PREFIX = ".tmp-reserving-"
#: Files smaller than this are written into new pages (taking a reserve would cost more than it saves).
MIN_BYTES = 1 << 20
#: A reserve is allocated this many bytes at a time (so that a preemption's save need not wait for it).
STEP = 256 << 20
#: Reserves are made in whole MiB, at least one more than the file they stand for.
UNIT = 1 << 20

_KEEP_SIZE = 0x01  # FALLOC_FL_KEEP_SIZE
_PUNCH_HOLE = 0x02  # FALLOC_FL_PUNCH_HOLE


def reserve_size(file_size: int) -> int:
    """Pure: the reserve made for a file of ``file_size`` bytes (a save's next file is often a little larger)."""
    return (file_size // UNIT + 2) * UNIT


def parse_reserve_name(name: str) -> int | None:
    """Pure: the size a reserve file's name records, None for any other name."""
    if not name.startswith(RESERVE_PREFIX):
        return None
    size, sep, rest = name[len(RESERVE_PREFIX) :].partition("-")
    if not sep or not rest or not size.isdigit():
        return None
    return int(size)


def plan(wanted: Iterable[int], have: Iterable[int]) -> tuple[list[int], list[int]]:
    """Pure: from the reserve sizes ``wanted`` and those there (``have``), the
    sizes to make and the sizes to remove (each size as often as it is meant)."""
    want, got = Counter(wanted), Counter(have)
    return sorted((want - got).elements()), sorted((got - want).elements())


def fits(new: int, free: int, headroom: int | None, margin: int) -> bool:
    """Pure: whether ``new`` more reserved bytes may be set aside, with ``free``
    bytes free in the staging file system and ``headroom`` bytes of memory this
    process may still use (None: unknown): they must leave at least as much
    memory as they take, and ``margin`` to spare in both."""
    if new + margin > free:
        return False
    return headroom is None or 2 * new + margin <= headroom


def choose(sizes: Iterable[int], needed: int) -> int | None:
    """Pure: which reserve a file of ``needed`` bytes takes: the smallest that
    holds it, else the largest (part of the file then lands in new pages)."""
    ordered = sorted(sizes)
    if not ordered:
        return None
    for size in ordered:
        if size >= needed:
            return size
    return ordered[-1]


def reserves(staging: Path) -> list[tuple[Path, int]]:
    """The reserve files in ``staging`` and the sizes their names record."""
    found = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for e in os.scandir(staging):
            size = parse_reserve_name(e.name)
            if size is not None and e.is_file(follow_symlinks=False):
                found.append((Path(e.path), size))
    return sorted(found)


def reserved_bytes(staging: Path) -> int:
    """Bytes set aside in ``staging``."""
    return sum(size for _, size in reserves(staging))


def _fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    try:
        fallocate = libc().fallocate
    except (OSError, AttributeError) as exc:
        raise OSError(errno.ENOSYS, f"no fallocate in the C library: {exc}") from None
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    if fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Stopped(Exception):
    """Setting memory aside gave way (a preemption's save needs the CPU and the memory now)."""


def _make(staging: Path, size: int, stop: Callable[[], bool]) -> None:
    """One reserve file of ``size`` bytes, allocated a step at a time, asking ``stop`` before each step."""
    making = staging / f"{MAKING_PREFIX}{size}-{uuid.uuid4().hex[:8]}"
    fd = os.open(making, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for offset in range(0, size, STEP):
            if stop():
                raise Stopped
            _fallocate(fd, _KEEP_SIZE, offset, min(STEP, size - offset))
    except BaseException:  # no half-made reservation left, a stop too; raised again
        os.close(fd)
        os.unlink(making)
        raise
    os.close(fd)
    os.rename(making, staging / f"{RESERVE_PREFIX}{size}-{uuid.uuid4().hex[:8]}")


def prepare(
    staging: Path,
    file_sizes: Iterable[int],
    *,
    headroom: int | None,
    margin: int,
    stop: Callable[[], bool] = lambda: False,
) -> int:
    """Make ``staging``'s reserves those for files of ``file_sizes`` (:func:`reserve_size` each):
    remove the others, make the missing ones where they fit. Returns the bytes reserved
    afterwards; a file system without ``fallocate`` gets none (logged). ``stop`` is asked
    between steps of :data:`STEP` bytes: once it is true, the reserve being made is removed
    and no other is made (a preemption's save must not share the CPU or the memory with it)."""
    staging.mkdir(parents=True, exist_ok=True)
    there = reserves(staging)
    make, drop = plan((reserve_size(s) for s in file_sizes), (size for _, size in there))
    for size in drop:
        path = next(p for p, s in there if s == size)
        there.remove((path, size))
        with contextlib.suppress(FileNotFoundError):  # taken meanwhile
            os.unlink(path)
    free = os.statvfs(staging)
    room = free.f_bavail * free.f_frsize
    total = sum(make)
    if make and not fits(total, room, headroom, margin):
        log.info(
            "staging reserve: %d bytes not set aside in %s (%d free there, %s bytes of memory left)",
            total,
            staging,
            room,
            headroom if headroom is not None else "unknown",
        )
        return reserved_bytes(staging)
    for size in make:
        try:
            _make(staging, size, stop)
        except Stopped:
            log.info("staging reserve: setting memory aside stopped for a preemption's save")
            break
        except OSError as exc:
            log.warning("staging reserve: %d bytes not set aside in %s: %s", size, staging, exc)
            break
    return reserved_bytes(staging)


def take(staging: Path, needed: int, target: Path) -> int | None:
    """Move a reserve of ``staging`` to ``target`` (a new file in the same file
    system) for a file of ``needed`` bytes; its reserved size, or None when
    none was there (``target`` then does not exist)."""
    there = reserves(staging)
    while there:
        size = choose((s for _, s in there), needed)
        assert size is not None
        path = next(p for p, s in there if s == size)
        there.remove((path, size))
        try:
            os.rename(path, target)
        except FileNotFoundError:  # another writer took it
            continue
        return size
    return None


def give_back(fd: int, written: int, reserved: int) -> None:
    """Free what a file written into a reserve of ``reserved`` bytes did not use beyond its ``written`` bytes."""
    if reserved > written:
        with contextlib.suppress(OSError):
            _fallocate(fd, _PUNCH_HOLE | _KEEP_SIZE, written, reserved - written)
