"""A preemption's checkpoint staged in memory, shipped from there.

A preemption's save that an uploader ships at once is not made durable on
the local disk (its durability is the verified upload, see
:class:`~spotguard.checkpoint.local.commit.LocalWriter`). Writing it to that disk
still costs what the disk and its page cache cost: on a VM whose page cache
is new guest memory, or with a few GiB beyond the dirty limits, 2-5 s per
GiB, more than uploading it. In a memory file system shared with the
uploader (``SPOTGUARD_EMERGENCY_STAGING``: a tmpfs such as ``/dev/shm``, an
``emptyDir`` of medium ``Memory``) it costs a copy at memory speed, and the
upload starts that much sooner.

The files live in ``<staging>/.staged-ckpt-<step>-<random>/``; the
checkpoint directory commits them with a symbolic link of the checkpoint's
name (made aside, renamed into place: as atomic as a directory's rename).
Everything that reads local checkpoints follows the link; deleting one
removes the link, then its files.

When not to: a save that would link a file from the previous checkpoint (a
frozen base, :meth:`LocalWriter._link_kept`) writes it nowhere, and a link
cannot cross file systems: that save stays on the disk. A save that would not
fit (the memory file system's free space, the memory this process may still
use: ``MemAvailable`` and its cgroup's limit less what it uses beyond its
inactive page cache) stays on the disk too, and so
does one that fills the memory while it is written (it is written again on
the disk, within the same deadline).

Whoever ships the checkpoints settles them before it exits
(:func:`settle_staged`): one verified in storage is removed from memory (the
store holds it); one that is not is copied to the checkpoint directory, so
that a machine that comes back finds it there, as it would have found a
save written on its disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterable
from pathlib import Path

from spotguard.checkpoint.format.manifest import parse_checkpoint_name
from spotguard.checkpoint.local.arena import linkable
from spotguard.checkpoint.local.codec import KEPT_SUFFIX, Snapshot
from spotguard.checkpoint.local.commit import STAGED_PREFIX, TMP_PREFIX
from spotguard.checkpoint.local.reserve import reserved_bytes
from spotguard.checkpoint.local.written import libc

log = logging.getLogger(__name__)

#: Room kept free in memory beyond the checkpoint itself.
MEMORY_MARGIN = 256 * 1024 * 1024


def may_link_kept(snapshot: Snapshot) -> bool:
    """Pure: whether a save of ``snapshot`` may link a file from the previous
    checkpoint instead of writing it (a file of unchanged tensors only)."""
    if snapshot.previous is None:
        return False
    return any(
        file.endswith(KEPT_SUFFIX) and blobs and all(b.unchanged for b in blobs.values())
        for file, blobs in snapshot.tensors.items()
    )


def fits_in_memory(needed: int, free: int, headroom: int | None, margin: int = MEMORY_MARGIN) -> bool:
    """Pure: whether ``needed`` bytes fit in a memory file system with ``free``
    bytes, when this process may use ``headroom`` more bytes of memory (None: unknown),
    with ``margin`` to spare in both."""
    if needed + margin > free:
        return False
    return headroom is None or needed + margin <= headroom


def parse_meminfo_available(text: str) -> int | None:
    """Pure: ``MemAvailable`` of ``/proc/meminfo``, in bytes."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return int(fields[1]) * 1024
    return None


def cgroup_room(limit: str, current: str, stat: str = "") -> int | None:
    """Pure: what a cgroup v2 ``memory.max`` of ``limit`` leaves beyond
    ``memory.current`` (None: no limit), the cgroup's inactive page cache
    (``inactive_file`` of its ``memory.stat``) counted as room: the kernel
    reclaims it before it refuses memory, and kubelet leaves it out of a pod's
    working set the same way. Without that, the page cache of a pod's routine
    checkpoints, charged to its cgroup, would keep its emergency save out of
    memory."""
    limit, current = limit.strip(), current.strip()
    if not limit.isdigit() or not current.isdigit():
        return None
    inactive = 0
    for line in stat.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == "inactive_file" and fields[1].isdigit():
            inactive = int(fields[1])
    used = max(0, int(current) - inactive)
    return max(0, int(limit) - used)


def memory_headroom() -> int | None:
    """How much more memory this process may use: the machine's available
    memory, and its cgroup's limit (v2) if lower; None when neither is known."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        available = parse_meminfo_available(Path("/proc/meminfo").read_text())
        if available is not None:
            found.append(available)
    with contextlib.suppress(OSError, ValueError):
        rel = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        stat = ""
        with contextlib.suppress(OSError):
            stat = (base / "memory.stat").read_text()
        room = cgroup_room((base / "memory.max").read_text(), (base / "memory.current").read_text(), stat)
        if room is not None:
            found.append(room)
    return min(found) if found else None


def choose_staging(staging: Path | None, snapshot: Snapshot) -> Path | None:
    """Where a preemption's save of ``snapshot`` is written: ``staging`` when it
    fits there and links nothing, else None (the checkpoint directory)."""
    if staging is None:
        return None
    if may_link_kept(snapshot):
        return None
    # Files linked from the host buffers' arenas there take no new room (spotguard.checkpoint.local.arena).
    needed = snapshot.nbytes - sum(a.size for a in linkable(snapshot).values())
    try:
        staging.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(staging).free
    except OSError as exc:
        log.warning("emergency staging %s unusable (%s): writing to the checkpoint directory", staging, exc)
        return None
    headroom = memory_headroom()
    # Memory set aside there beforehand (spotguard.checkpoint.local.reserve) is taken, not newly allocated.
    if not fits_in_memory(max(0, needed - reserved_bytes(staging)), free, headroom):
        log.warning(
            "emergency staging %s: %d bytes do not fit (%d free there, %s bytes of memory left): "
            "writing to the checkpoint directory",
            staging,
            needed,
            free,
            headroom if headroom is not None else "unknown",
        )
        return None
    return staging


def staged_links(directory: Path) -> list[tuple[Path, Path]]:
    """The checkpoints of ``directory`` committed as links to staged files: (link, its target)."""
    found = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for e in entries:
        if parse_checkpoint_name(e.name) is None or not e.is_symlink():
            continue
        target = Path(os.readlink(e.path))
        if target.name.startswith(STAGED_PREFIX):
            found.append((Path(e.path), target))
    return sorted(found)


def settle_staged(directory: Path, verified_step: int) -> tuple[list[str], list[str]]:
    """Before the staging memory goes: take staged checkpoints verified in
    storage (step at most ``verified_step``) out of ``directory`` (their
    links; their files go with the staging directory, :func:`remove_staging`),
    copy the others into ``directory`` in their links' place; a link whose
    files are gone is removed. Returns the names removed and the names copied."""
    removed: list[str] = []
    copied: list[str] = []
    for link, held in staged_links(directory):
        step = parse_checkpoint_name(link.name)
        assert step is not None
        if not held.is_dir():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(link)
            removed.append(link.name)
        elif step <= verified_step:
            # The link goes now; its files with the staging directory (see remove_staging).
            os.unlink(link)
            removed.append(link.name)
        else:
            _materialize(link, held)
            copied.append(link.name)
    return removed, copied


def remove_staging(
    staging: Path, keep: Iterable[Path] = (), *, background: bool = False, remove_dir: bool = False
) -> None:
    """Remove what a staging directory holds (its staged files, leftover temporary ones, memory set aside
    by :mod:`spotguard.checkpoint.local.reserve`), but ``keep``;
    ``remove_dir``: then the directory itself, when nothing else is left in it.

    ``background``: by a process of its own at the lowest CPU priority, which
    goes on after the caller exits (freeing memory takes the kernel 0.1-0.2 s
    per GiB, and an uploader on its way out of a preemption has nothing to
    wait for). What it leaves, the next run's clean-up removes."""
    kept = {Path(p) for p in keep}
    doomed = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for e in os.scandir(staging):
            if Path(e.path) not in kept and (e.name.startswith(STAGED_PREFIX) or e.name.startswith(TMP_PREFIX)):
                doomed.append(e.path)
    if background and doomed:
        with contextlib.suppress(OSError):
            subprocess.Popen(  # noqa: S603 - this interpreter, our own paths
                [sys.executable, "-c", _REMOVE, str(staging) if remove_dir else "", *doomed],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            return
    for path in doomed:
        _remove(path)
    if remove_dir:
        with contextlib.suppress(OSError):
            staging.rmdir()


def _remove(path: str) -> None:
    """Remove a directory's tree, or a file (memory set aside, :mod:`spotguard.checkpoint.local.reserve`)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# The background removal: at the lowest priority, the doomed paths, then the directory if asked and empty.
_REMOVE = """import os, shutil, sys
os.nice(19)
for p in sys.argv[2:]:
    if os.path.isdir(p) and not os.path.islink(p):
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            os.unlink(p)
        except OSError:
            pass
if sys.argv[1]:
    try:
        os.rmdir(sys.argv[1])
    except OSError:
        pass
"""


def _materialize(link: Path, held: Path) -> None:
    """Replace ``link`` by a copy of ``held`` in its directory; the checkpoint is listed at every instant."""
    copy = link.parent / f"{TMP_PREFIX}copy-{link.name}-{uuid.uuid4().hex[:8]}"
    shutil.copytree(held, copy, symlinks=True)
    if _exchange(copy, link):
        os.unlink(copy)  # now the link
    else:
        os.unlink(link)
        os.rename(copy, link)
    shutil.rmtree(held, ignore_errors=True)
    log.warning("%s was not verified in storage: copied from memory into %s", link.name, link.parent)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        renameat2 = libc().renameat2
    except (OSError, AttributeError, TypeError):
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return int(rc) == 0
