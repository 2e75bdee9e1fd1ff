"""Deleting a pruned checkpoint's large files a step at a time, so that no other write waits behind it.

A file freed in one go hands all its blocks back in one journal transaction
of the file system. On ext4 (and others) the next commit of that transaction
is what *every* ``fsync`` of the machine waits for, and on a disk mounted
with ``discard`` the commit also discards each freed extent before it ends.
Measured on a virtual disk: while a 2 GiB file is unlinked, another process's
``fsync`` of a few bytes takes 80-105 ms instead of 1-2 ms; a preemption's
save, which fsyncs what it commits, waits that long behind a routine prune.

So a large file whose data no other name holds is first shrunk by
:data:`STEP` bytes at a time, each step committed on its own (``fsync``),
then unlinked: each commit frees at most one step (measured the same way:
5-13 ms at most). The whole delete takes somewhat longer; it runs in the
background at the lowest priority (:func:`~spotguard.checkpoint.local.commit.remove_checkpoint_dir`).

A file is shrunk only when nothing else can see its bytes change:

- it has one link (a newer checkpoint that hard-linked it, as the kept file
  of an incremental save is, holds the same data: that file is only unlinked).
  Checkpoints are linked by path from their committed directory; the doomed
  one was renamed first, so no new link can appear once its count is read;
- it lives on a file system with blocks (not a memory one: ``tmpfs`` frees
  pages, with no journal, and a staged checkpoint's file there may be a
  trainer's mapped host buffers, :mod:`~spotguard.checkpoint.local.arena`);
- it is a regular file larger than one step.

Anything else, and any error, falls back to a plain unlink.

While a preemption's checkpoint is saved and shipped (:func:`held`: the
uploader's emergency path), the steps of this process wait: even one step's
commit is time the emergency's own fsyncs would wait for. A process that ends
meanwhile leaves the renamed directory for the next clean-up.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from spotguard.checkpoint.local.written import libc

#: Bytes freed per committed step.
STEP = 16 << 20

#: ``statfs`` magic numbers of file systems whose files hold memory, not blocks.
MEMORY_FILE_SYSTEMS = frozenset({0x01021994, 0x858458F6, 0x958458F6})  # tmpfs, ramfs, hugetlbfs


_holders = 0
_holders_lock = threading.Lock()
_free = threading.Event()
_free.set()


@contextlib.contextmanager
def held() -> Iterator[None]:
    """While inside, this process's releases wait between steps (a step under way ends first)."""
    global _holders
    with _holders_lock:
        _holders += 1
        _free.clear()
    try:
        yield
    finally:
        with _holders_lock:
            _holders -= 1
            if _holders == 0:
                _free.set()


def shrinks(mode: int, links: int, size: int, fs_type: int | None, step: int = STEP) -> bool:
    """Pure: whether a file of ``mode``, ``links`` and ``size`` on a file system of ``fs_type`` (None:
    unknown) is shrunk in steps before its unlink."""
    return (
        stat.S_ISREG(mode) and links == 1 and size > step and fs_type is not None and fs_type not in MEMORY_FILE_SYSTEMS
    )


def steps(size: int, step: int = STEP) -> list[int]:
    """Pure: the sizes a file of ``size`` bytes is truncated to, one per step, the last 0."""
    out: list[int] = []
    while size > 0:
        size = max(0, size - step)
        out.append(size)
    return out


class _StatFs(ctypes.Structure):
    # struct statfs on 64-bit Linux: f_type comes first; the rest is room for the kernel to fill.
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


def fs_type(fd: int) -> int | None:
    """The ``statfs`` magic number of the file system ``fd`` is on, None where it cannot be read."""
    buf = _StatFs()
    try:
        fstatfs = libc().fstatfs
    except AttributeError:
        return None
    fstatfs.argtypes = [ctypes.c_int, ctypes.POINTER(_StatFs)]
    if fstatfs(fd, ctypes.byref(buf)) != 0:
        return None
    return int(buf.f_type) & 0xFFFFFFFF


def release_file(path: str | os.PathLike[str], step: int = STEP) -> None:
    """Unlink ``path``, first shrinking it ``step`` bytes at a time (see the module's docstring)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if shrinks(st.st_mode, st.st_nlink, st.st_size, fs_type(fd), step):
                for size in steps(st.st_size, step):
                    _free.wait()
                    if os.fstat(fd).st_nlink != 1:
                        break  # cannot happen for a renamed checkpoint; never shrink a file shared since
                    os.ftruncate(fd, size)
                    os.fsync(fd)
        finally:
            os.close(fd)
    with contextlib.suppress(OSError):  # as ``shutil.rmtree(ignore_errors=True)``: what stays is cleaned up later
        os.unlink(path)


def release_tree(root: str | os.PathLike[str], step: int = STEP) -> None:
    """Remove the directory ``root`` and everything below it, each file by :func:`release_file`
    (links are removed, never followed). Errors are ignored, as ``shutil.rmtree(ignore_errors=True)``."""
    for top, dirs, files in os.walk(root, topdown=False):
        for name in files:
            release_file(Path(top) / name, step)
        for name in dirs:
            p = Path(top) / name
            with contextlib.suppress(OSError):
                if p.is_symlink():
                    p.unlink()
                else:
                    p.rmdir()
    with contextlib.suppress(OSError):
        os.rmdir(root)
