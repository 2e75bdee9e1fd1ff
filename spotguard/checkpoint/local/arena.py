"""Host buffers laid out as the checkpoint's files, in the staging memory: a preemption's save links them.

A preemption's save staged in memory (:mod:`spotguard.checkpoint.local.staged`)
copies the state into the snapshot's host buffers, then writes the buffers
into new files of a memory file system. That write is a second copy of the
whole state, and every page it takes is new: the kernel finds and zeroes it,
and on a virtual machine that hands freed memory back to its host
(virtio-balloon free page reporting) the first write to it also faults in the
host. It was most of what the trainer spent on a 2 GiB preemption's save.

The snapshot's host buffers are kept between saves anyway (the pool of
:func:`~spotguard.checkpoint.local.codec.snapshot_state`). So after a routine save
commits, while nothing is urgent, the trainer moves the host buffers of each
tensor file into an *arena*: one file in the staging memory file system laid
out exactly as that safetensors file (its header, then each tensor's bytes at
the offset the header gives), mapped into the process, each host buffer a
view of its tensor's place. The next snapshot copies the state into those
views as it copied it into the buffers before. A preemption's save that finds
a file's tensors exactly there (same header, every tensor at its offset: the
same layout as the last routine save, as in full training) makes that file by
linking the arena into the checkpoint (``linkat``), checksums it by reading the
mapping, and writes nothing. The state is copied once, into pages that exist.

Why this is as safe as writing the file:

- The linked file's bytes are what the write would have written: the header is
  compared byte for byte with the one the write would make, each tensor's
  bytes are where that header puts them (each blob's memory is checked to be
  the arena's at that offset), and the snapshot finished copying into them
  before phase two started. The manifest records the size and a checksum of the
  file as linked, computed from it.
- Once linked, an arena is the checkpoint's: it is marked *spent*, and the pool
  forgets its buffers before anything could write into them again (the next
  snapshot takes new ones). Only a preemption's save, which is synchronous,
  links; a routine save writes from the same buffers as before.
- An arena is a file opened with ``O_TMPFILE``: it has no name until it is
  linked, so nothing lists, ships or restores it, and its memory goes back when
  the process ends however it ends (a killed trainer leaves nothing behind).
- It takes no more memory than the host buffers it replaces: each buffer is
  moved on its own (its place allocated, copied, the old buffer freed), and only
  when the staging file system has room for the whole file and the process has
  memory for the largest tensor. Where it does not fit, or the file system has
  no ``O_TMPFILE``, the buffers stay where they are and saves write files as
  before.
- Moving gives way to a save: the snapshot and the move of one buffer hold the
  same lock, and a preemption stops the move between buffers.

Host buffers of GPU tensors are page-locked, for asynchronous copies from the
device. Where CUDA is available they get an arena too: its whole file is
allocated first, mapped, and the mapping page-locked (``cudaHostRegister``, as
DCP's stager pins its staging memory: :func:`cuda_page_lock`) before any
buffer moves into it, so a GPU trainer's preemption copies into pinned pages
that exist and writes nothing. The lock is released when the arena is closed.
Without CUDA (or where registering fails) those buffers stay where they are.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import mmap
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard.checkpoint.local.codec import (
    KEPT_SUFFIX,
    POOL_ARENAS,
    POOL_PLACES,
    Snapshot,
    TensorBlob,
    safetensors_header,
)
from spotguard.checkpoint.local.written import libc

log = logging.getLogger(__name__)

#: Files smaller than this keep their host buffers (an arena would cost more than it saves).
MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Plan:
    """The arena one tensor file of a committed snapshot would get (pure data)."""

    file: str
    header: bytes
    #: (key in the file, offset of its bytes in the file, bytes), in file order.
    tensors: tuple[tuple[str, int, int], ...]
    #: Its buffers are page-locked (GPU tensors' host copies): the arena must be too.
    page_locked: bool = field(default=False, compare=False)

    @property
    def size(self) -> int:
        return len(self.header) + sum(n for _, _, n in self.tensors)


def plan_file(file: str, blobs: Mapping[str, TensorBlob]) -> Plan:
    """Pure: the layout of ``file``'s safetensors file holding ``blobs``."""
    header, order = safetensors_header(blobs)
    tensors = []
    offset = len(header)
    for key in order:
        n = blobs[key].nbytes
        tensors.append((key, offset, n))
        offset += n
    return Plan(file, header, tuple(tensors))


def plans(snapshot: Snapshot, min_bytes: int = MIN_BYTES, *, lockable: bool | None = None) -> list[Plan]:
    """The arenas worth making after ``snapshot`` was committed: one per tensor file of
    at least ``min_bytes`` whose tensors are all in the pool's host buffers (none linked
    from an earlier checkpoint), either all plain or, where arenas can be page-locked
    (``lockable``; None: where :func:`cuda_page_lock` is available), all page-locked."""
    if lockable is None:
        lockable = cuda_page_lock() is not None
    found = []
    for file, blobs in sorted(snapshot.tensors.items()):
        kinds = {_movable(b) for b in blobs.values()}
        if file.endswith(KEPT_SUFFIX) or len(kinds) != 1 or None in kinds or (kinds == {"locked"} and not lockable):
            continue
        plan = plan_file(file, blobs)
        if plan.size >= min_bytes:
            found.append(dataclasses.replace(plan, page_locked=kinds == {"locked"}))
    return found


def _movable(blob: TensorBlob) -> str | None:
    """``plain`` or ``locked`` where ``blob``'s memory is a torch CPU tensor's host buffer,
    page-locked or not; None otherwise."""
    torch = sys.modules.get("torch")
    owner = blob.owner
    if torch is None or not isinstance(owner, torch.Tensor) or owner.device.type != "cpu":
        return None
    return "locked" if owner.is_pinned() else "plain"


#: ``lock(address, size)`` page-locks that memory for the GPU and returns what unlocks it.
PageLock = Callable[[int, int], Callable[[], None]]


def cuda_page_lock() -> PageLock | None:
    """torch.cuda's ``cudaHostRegister`` where CUDA is available (the call DCP's stager pins
    its staging memory with, ``cudaHostRegisterPortable``), else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    cudart = torch.cuda.cudart()

    def lock(address: int, size: int) -> Callable[[], None]:
        err = int(cudart.cudaHostRegister(address, size, 1))
        if err != 0:
            raise OSError(f"cudaHostRegister of {size} bytes failed (CUDA error {err})")
        return lambda: cudart.cudaHostUnregister(address)

    return lock


@dataclass(eq=False)
class Arena:
    """One tensor file laid out in the staging memory, mapped: the host buffers of its tensors."""

    plan: Plan
    fd: int
    base: Any  # a uint8 tensor over the whole mapping
    #: The pool keys whose host buffers are views of this arena.
    pool_keys: list[Any] = field(default_factory=list)
    complete: bool = False
    #: Linked into a checkpoint: its bytes are that checkpoint's, never written again.
    spent: bool = False
    #: Releases the page lock of a page-locked arena (:func:`cuda_page_lock`).
    unlock: Callable[[], None] | None = None

    @property
    def size(self) -> int:
        return self.plan.size

    def holds(self, blobs: Mapping[str, TensorBlob]) -> bool:
        """Whether the file :func:`~spotguard.checkpoint.local.codec.iter_safetensors` makes of ``blobs``
        is, byte for byte, this arena's memory (the same header; each tensor's bytes at its offset)."""
        if not self.complete or self.spent or len(blobs) != len(self.plan.tensors):
            return False
        if plan_file(self.plan.file, blobs) != self.plan:
            return False
        base = self.base.data_ptr()
        for key, offset, n in self.plan.tensors:
            data = blobs[key].data
            if n and _address(data) != base + offset:
                return False
        return bytes(self.view(0, len(self.plan.header))) == self.plan.header

    def view(self, offset: int, length: int) -> memoryview:
        """The arena's bytes ``[offset, offset + length)``, not copied."""
        return memoryview(self.base.numpy())[offset : offset + length]

    def link(self, target: Path) -> None:
        """Give the arena the name ``target`` (same file system), and mark it spent."""
        _link_fd(self.fd, target)
        self.spent = True

    def close(self) -> None:
        unlock, self.unlock = self.unlock, None
        if unlock is not None:
            unlock()  # the mapping stays while views of it live; only the lock goes
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1


_AT_FDCWD = -100
_AT_SYMLINK_FOLLOW = 0x400


def _link_fd(fd: int, target: Path) -> None:
    """``linkat`` of an open file (one made with ``O_TMPFILE`` too) to ``target``. ``os.link`` calls
    ``link``, which links the ``/proc/self/fd`` entry itself (another file system) instead."""
    linkat = libc().linkat
    linkat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    source = f"/proc/self/fd/{fd}".encode()
    if linkat(_AT_FDCWD, source, _AT_FDCWD, os.fsencode(target), _AT_SYMLINK_FOLLOW) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(target))


def _address(data: memoryview) -> int:
    if data.readonly:
        return -1
    return ctypes.addressof(ctypes.c_char.from_buffer(data))


def linkable(snapshot: Snapshot) -> dict[str, Arena]:
    """The tensor files of ``snapshot`` that are, byte for byte, an arena: file -> arena."""
    arenas = snapshot.arenas
    return {f: a for f, a in arenas.items() if f in snapshot.tensors and a.holds(snapshot.tensors[f])}


def close_all(pool: dict[Any, Any] | None) -> None:
    """Close every arena of ``pool`` (its memory goes back once nothing maps it)."""
    if pool is None:
        return
    for arena in pool.pop(POOL_ARENAS, {}).values():
        arena.close()


class Stopped(Exception):
    """Moving host buffers gave way (a preemption's save needs the CPU and the memory now)."""


def _open(staging: Path, size: int) -> int:
    fd = os.open(staging, os.O_TMPFILE | os.O_RDWR, 0o644)
    try:
        os.ftruncate(fd, size)
    except BaseException:  # the descriptor closed on any exit, an interrupt too; raised again
        os.close(fd)
        raise
    return fd


def build(
    staging: Path,
    plan: Plan,
    pool: dict[Any, Any],
    lock: threading.Lock,
    *,
    places: Any,
    headroom: int | None,
    margin: int,
    stop: Callable[[], bool] = lambda: False,
    page_lock: PageLock | None = None,
) -> Arena | None:
    """Move the host buffers of ``plan``'s file into a new arena in ``staging``.

    ``places`` is the pool's record of the committed snapshot the plan was made
    from: the move stops as soon as another snapshot has used the pool. Returns
    the arena, registered in the pool (complete or not: the buffers already
    moved are views of it), or None when it does not fit or cannot be made.
    Raises :class:`Stopped` when ``stop`` says so (between buffers). A plan of
    page-locked buffers gets an arena page-locked by ``page_lock`` (None:
    :func:`cuda_page_lock`), or none where that is not available."""
    import torch

    if plan.page_locked:
        page_lock = page_lock or cuda_page_lock()
        if page_lock is None:
            return None

    staging.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        free = os.statvfs(staging)
        room = free.f_bavail * free.f_frsize
        largest = max((n for _, _, n in plan.tensors), default=0)
        if plan.size + margin > room or (headroom is not None and largest + margin > headroom):
            log.info(
                "staging arena: %s (%d bytes) not moved to %s (%d free there, %s bytes of memory left)",
                plan.file,
                plan.size,
                staging,
                room,
                headroom if headroom is not None else "unknown",
            )
            return None
    where = {(file, key): pool_key for pool_key, (_, file, key) in places.items()}
    fd = _open(staging, plan.size)
    try:
        # Page-locking takes every page at once: all of them are allocated first (no hole to fault on).
        os.posix_fallocate(fd, 0, plan.size if plan.page_locked else len(plan.header))
        memory = mmap.mmap(fd, plan.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:  # the descriptor closed on any exit, an interrupt too; raised again
        os.close(fd)
        raise
    base = torch.frombuffer(memory, dtype=torch.uint8)
    memory[: len(plan.header)] = plan.header
    arena = Arena(plan, fd, base)
    if plan.page_locked:
        assert page_lock is not None
        try:
            arena.unlock = page_lock(base.data_ptr(), plan.size)
        except (OSError, RuntimeError) as exc:
            log.info("staging arena: %s not page-locked (%s); its buffers stay where they are", plan.file, exc)
            arena.close()
            return None
    try:
        for key, offset, n in plan.tensors:
            if stop():
                raise Stopped
            if n and not plan.page_locked:  # no hole left: a write through the mapping never faults for room
                os.posix_fallocate(fd, offset, n)
            with lock:
                pool_key = where.get((plan.file, key))
                host = pool.get(pool_key) if pool_key is not None else None
                if pool.get(POOL_PLACES) is not places or host is None or host.nbytes != n:
                    log.debug("staging arena: %s changed while its buffers were moved", plan.file)
                    if arena.pool_keys:
                        return _registered(pool, arena)
                    arena.close()
                    return None
                view = base[offset : offset + n].view(host.dtype).view(host.shape)
                view.copy_(host)
                pool[pool_key] = view
                arena.pool_keys.append(pool_key)
    except BaseException:  # buffers moved so far kept, the rest closed, on any exit; raised again
        if arena.pool_keys:
            with lock:
                _registered(pool, arena)
        else:
            arena.close()
        raise
    with lock:
        arena.complete = True
        return _registered(pool, arena)


def _registered(pool: dict[Any, Any], arena: Arena) -> Arena:
    """Record ``arena`` as its file's in ``pool`` (with the pool's lock held)."""
    arenas: dict[str, Arena] = pool.setdefault(POOL_ARENAS, {})
    old = arenas.get(arena.plan.file)
    if old is not None and old is not arena:
        old.close()  # its buffers still in the pool stay mapped; it is never linked
    arenas[arena.plan.file] = arena
    return arena
