"""Which pages of the process's memory were written since they were last looked at (:class:`WriteTracker`).

Used by the snapshot (:func:`~spotguard.checkpoint.local.codec.snapshot_state`):
a CPU tensor none of whose pages was written since the last committed
snapshot copied it holds what that snapshot's host buffer holds, so it is
told unchanged without reading a byte of it. A frozen base of 14 GB then
costs its save nothing, where a comparison would read it twice at memory
speed.

The kernel does the tracking: userfaultfd write-protection in asynchronous
mode (Linux 6.7+). The tensor's pages are registered and write-protected;
the first write to a page afterwards, by any code of the process (a
``.data`` write, numpy, a C extension, another thread, the kernel filling
it on ``read(2)``), faults, and the kernel notes the page as written and
lets the write go on, with no handler and no signal. ``PAGEMAP_SCAN`` on
``/proc/self/pagemap`` returns the written pages and protects them again in
one atomic step, so no write between the question and the next protection
is lost.

Why this is as safe as comparing the bytes, and where it is not used:

- Only private anonymous memory is tracked (its ``/proc/self/maps`` entry
  is private and maps no file; the kernel itself would register any): the
  bytes of a file mapping (``torch.load(mmap=True)``) or of memory shared
  with another process (``share_memory_()``) can change with no write of
  this process's own; such tensors are compared, as before.
- Page-locked (pinned) tensors are compared: a device writes them by DMA,
  which no page fault sees. So are GPU tensors.
- A tensor is only trusted while its storage is the very one that was
  tracked (the snapshot keeps a reference to it, so its memory can be
  neither freed nor reused; a ``p.data = other`` swap is a new storage).
- Version counters are not used: writes through ``.data`` bypass them.
- Any error, and any kernel, sandbox (seccomp) or platform without it,
  means "written": the tensor is compared.

``SPOTGUARD_TRACK_WRITES=0`` turns the tracking off (every tensor compared).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import platform
import struct
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from spotguard.contract import env

log = logging.getLogger(__name__)

#: Tensors smaller than this are compared: their pages are few and registering each would split the
#: heap into as many memory areas (the kernel allows about 65 000 per process).
MIN_TRACKED_BYTES = 1 << 20

_SYSCALL = {"x86_64": 323, "aarch64": 282}  # __NR_userfaultfd
_UFFD_USER_MODE_ONLY = 1
_UFFD_API = 0xAA
_FEATURES = (1 << 15) | (1 << 13)  # UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED


def _iowr(kind: int, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | nr


_UFFDIO_API = _iowr(0xAA, 0x3F, 24)
_UFFDIO_REGISTER = _iowr(0xAA, 0x00, 32)
_UFFDIO_WRITEPROTECT = _iowr(0xAA, 0x06, 24)
_REGISTER_MODE_WP = 1 << 1
_WRITEPROTECT_MODE_WP = 1 << 0
_PAGEMAP_SCAN = _iowr(ord("f"), 16, 96)
_SCAN_WP_MATCHING = 1 << 0  # protect the written pages found again, in the same step
_SCAN_CHECK_WPASYNC = 1 << 1  # fail unless every page asked about is tracked
_PAGE_IS_WRITTEN = 1 << 1
_REGIONS = 256  # page regions returned per scan call

_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    """This process's C library (with ``errno``), loaded once."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


#: Written ranges up to this size are compared by ``memcmp`` on the two host buffers: a tensor's edge page,
#: which its neighbours on the heap write, is a few KiB, and torch's slicing and ``equal`` cost about 40 µs
#: a call, at every save for each of hundreds of frozen tensors. Larger ranges go to ``torch.equal``.
MEMCMP_MAX_BYTES = 1 << 20


def host_ranges_equal(torch: Any, mine: Any, theirs: Any, ranges: Iterable[tuple[int, int]]) -> bool:
    """Whether the contiguous CPU tensors ``mine`` and ``theirs`` (of the same byte length) hold the same
    bytes at each [start, end) byte offset of ``ranges`` (within that length): small ranges by ``memcmp``
    on their memory, large ones by ``torch.equal`` of 64-bit words where aligned."""
    memcmp = _memcmp()
    a_ptr, b_ptr = mine.data_ptr(), theirs.data_ptr()
    flats: tuple[Any, Any] | None = None
    for a, b in ranges:
        if b - a <= MEMCMP_MAX_BYTES:
            if memcmp(a_ptr + a, b_ptr + a, b - a) != 0:
                return False
            continue
        if flats is None:
            flats = mine.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8)
        x, y = flats[0][a:b], flats[1][a:b]
        if b % 8 == 0 and a % 8 == 0 and x.data_ptr() % 8 == 0 and y.data_ptr() % 8 == 0:
            x, y = x.view(torch.int64), y.view(torch.int64)
        if not torch.equal(x, y):
            return False
    return True


_memcmp_fn: Any = None


def _memcmp() -> Any:
    """libc's ``memcmp``, typed, loaded once."""
    global _memcmp_fn
    if _memcmp_fn is None:
        fn = libc().memcmp
        fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
        fn.restype = ctypes.c_int
        _memcmp_fn = fn
    return _memcmp_fn


def tracking_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``SPOTGUARD_TRACK_WRITES`` leaves write tracking on (the default; a value that is not a
    boolean is named in a warning and leaves it on: both ways keep every checkpoint exact)."""
    try:
        return bool(env.from_env(env.TRACK_WRITES, environ))
    except ValueError as exc:
        log.warning("%s; write tracking stays on", exc)
        return True


def page_envelope(ptr: int, nbytes: int, page: int) -> tuple[int, int]:
    """Pure: the page-aligned [start, end) of the memory ``[ptr, ptr + nbytes)`` lies in."""
    return ptr - ptr % page, -(-(ptr + nbytes) // page) * page


def merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Pure: ``ranges`` sorted, overlapping or touching ones merged."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlaps(sorted_ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Pure: whether [start, end) meets any of ``sorted_ranges`` (sorted, disjoint)."""
    i = bisect.bisect_right(sorted_ranges, (start, float("inf")))
    if i > 0 and sorted_ranges[i - 1][1] > start:
        return True
    return i < len(sorted_ranges) and sorted_ranges[i][0] < end


def private_anonymous(maps: Iterable[str]) -> list[tuple[int, int]]:
    """Pure: the private anonymous mappings (no file: inode 0; private: ``p``) of a
    ``/proc/<pid>/maps`` listing, as sorted [start, end) with touching ones merged."""
    out: list[tuple[int, int]] = []
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or not fields[1].endswith("p") or fields[4] != "0":
            continue
        name = fields[5].strip() if len(fields) > 5 else ""
        if name and not name.startswith(("[heap]", "[anon:", "[stack")):
            continue  # [vvar], [vdso] and the like: not memory a tensor lives in
        low, _, high = fields[0].partition("-")
        out.append((int(low, 16), int(high, 16)))
    return merged(out)


def overlaps_within(sorted_ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Pure: whether [start, end) lies wholly inside one of ``sorted_ranges`` (sorted, disjoint)."""
    i = bisect.bisect_right(sorted_ranges, (start, float("inf"))) - 1
    return i >= 0 and sorted_ranges[i][0] <= start and end <= sorted_ranges[i][1]


class WriteTracker:
    """The process's write tracking (see the module's docstring): one userfaultfd for the whole
    process, so that no two users register the same memory twice; each user asks through a
    :class:`WriteView` of its own. Thread-safe."""

    _shared: WriteTracker | None = None
    _opened = False
    _shared_lock = threading.Lock()

    def __init__(self, uffd: int, pagemap: int) -> None:
        self._uffd = uffd
        self._pagemap = pagemap
        # Both answer for the process that opened them: a forked child inheriting this object
        # would register and scan its parent's memory. In any other process it tracks nothing.
        self._pid = os.getpid()
        self._page = mmap.PAGESIZE
        self._lock = threading.RLock()
        self._tracked: dict[tuple[int, int], int] = {}  # page envelope -> how many holders
        self._views: weakref.WeakSet[WriteView] = weakref.WeakSet()
        self._regions = ctypes.create_string_buffer(24 * _REGIONS)
        self._anonymous: list[tuple[int, int]] | None = None  # private anonymous mappings, merged

    @classmethod
    def shared(cls) -> WriteTracker | None:
        """The process's tracker (opened at the first call), or None where there is none."""
        with cls._shared_lock:
            if not cls._opened or (cls._shared is not None and cls._shared._pid != os.getpid()):
                cls._shared, cls._opened = cls.open(), True  # first call, or a forked child's
            return cls._shared

    @classmethod
    def open(cls) -> WriteTracker | None:
        """A new tracker, or None where the kernel, the sandbox or ``SPOTGUARD_TRACK_WRITES`` does not
        allow it. One per process (:meth:`shared`): memory one tracker registered, another cannot."""
        nr = _SYSCALL.get(platform.machine())
        if not sys.platform.startswith("linux") or nr is None or not tracking_enabled():
            return None
        uffd = -1
        for flags in (os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY, os.O_CLOEXEC | os.O_NONBLOCK):
            uffd = int(libc().syscall(nr, flags))
            if uffd >= 0:
                break
        if uffd < 0:
            log.info("write tracking unavailable (userfaultfd: %s): unchanged tensors are compared", _errno())
            return None
        pagemap = -1
        try:
            api = bytearray(struct.pack("QQQ", _UFFD_API, _FEATURES, 0))
            fcntl.ioctl(uffd, _UFFDIO_API, api, True)
            if struct.unpack("QQQ", api)[1] & _FEATURES != _FEATURES:
                raise OSError("the kernel lacks asynchronous write-protection")
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            tracker = cls(uffd, pagemap)
            tracker._self_test()
        except OSError as exc:
            log.info("write tracking unavailable (%s): unchanged tensors are compared", exc)
            os.close(uffd)
            if pagemap >= 0:
                os.close(pagemap)
            return None
        return tracker

    def _self_test(self) -> None:
        """Track two fresh pages, write one: only that one may come back as written."""
        probe = mmap.mmap(-1, 2 * self._page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = self.view()
        try:
            probe[:] = b"\1" * len(probe)
            buffer = ctypes.c_char.from_buffer(probe)
            start = ctypes.addressof(buffer)
            del buffer  # the address stays valid while the mapping is open
            if not view.track(start, len(probe)):
                raise OSError("registration of anonymous memory failed")
            view.collect()
            clean = not view.written(start, len(probe))
            probe[self._page + 1] = 2
            view.collect()
            seen = view.written(start + self._page, 1) and not view.written(start, 1)
            view.forget(start, len(probe))
            if not (clean and seen):
                raise OSError("the kernel's written pages do not match the writes made")
        finally:
            probe.close()

    def close(self) -> None:
        for fd in (self._uffd, self._pagemap):
            with contextlib.suppress(OSError):
                os.close(fd)

    def view(self) -> WriteView:
        """A user's own view: what was written between two of *its* :meth:`WriteView.collect` calls."""
        view = WriteView(self)
        with self._lock:
            self._views.add(view)
        return view

    def _track(self, envelope: tuple[int, int]) -> bool:
        start, end = envelope
        with self._lock:
            if self._pid != os.getpid():
                return False
            if not self._private_anonymous(start, end):
                log.debug("memory at %#x (%d bytes) not tracked: not private anonymous memory", start, end - start)
                return False
            # Protecting pages already tracked would clear what was written to them: hand that to
            # every view first.
            if any(overlaps([e], start, end) for e in self._tracked):
                self._scan_all()
            try:
                fcntl.ioctl(
                    self._uffd,
                    _UFFDIO_REGISTER,
                    bytearray(struct.pack("QQQQ", start, end - start, _REGISTER_MODE_WP, 0)),
                    True,
                )
                fcntl.ioctl(
                    self._uffd,
                    _UFFDIO_WRITEPROTECT,
                    bytearray(struct.pack("QQQ", start, end - start, _WRITEPROTECT_MODE_WP)),
                    True,
                )
            except OSError as exc:
                log.debug("memory at %#x (%d bytes) not tracked: %s", start, end - start, exc)
                return False
            self._tracked[envelope] = self._tracked.get(envelope, 0) + 1
            return True

    def _private_anonymous(self, start: int, end: int) -> bool:
        """Whether [start, end) lies in private anonymous mappings (read from ``/proc/self/maps``,
        again when the copy read since the last scan does not cover it)."""
        for fresh in (False, True):
            if fresh or self._anonymous is None:
                with open("/proc/self/maps", encoding="ascii", errors="replace") as fh:
                    self._anonymous = private_anonymous(fh)
            if overlaps_within(self._anonymous, start, end):
                return True
        return False

    def _forget(self, envelope: tuple[int, int], times: int = 1, unprotect: bool = False) -> None:
        with self._lock:
            left = self._tracked.get(envelope, 0) - times
            if left > 0:
                self._tracked[envelope] = left
                return
            self._tracked.pop(envelope, None)
            start, end = envelope
            if unprotect and not any(overlaps([e], start, end) for e in self._tracked):
                # Writes to it need not fault any more (the memory is still mapped: its holder asks).
                with contextlib.suppress(OSError):
                    fcntl.ioctl(
                        self._uffd, _UFFDIO_WRITEPROTECT, bytearray(struct.pack("QQQ", start, end - start, 0)), True
                    )

    def _release(self, held: dict[tuple[int, int], int]) -> None:
        """A view is gone: forget what it still held."""
        for envelope, times in list(held.items()):
            self._forget(envelope, times)

    def _scan_all(self) -> list[tuple[int, int]]:
        """Scan every tracked range (written pages protected again in the same step), hand what was
        written to every view; returns the ranges answered for. A range the kernel cannot answer for
        is handed over as written, and is no longer tracked."""
        written: list[tuple[int, int]] = []
        answered: list[tuple[int, int]] = []
        for start, end in merged(self._tracked):
            try:
                written.extend(self._scan(start, end))
                answered.append((start, end))
            except OSError as exc:
                log.warning("write tracking lost for %d bytes (%s): they are compared", end - start, exc)
                written.append((start, end))
                for envelope in [e for e in self._tracked if start <= e[0] and e[1] <= end]:
                    del self._tracked[envelope]
        for view in list(self._views):
            view._pending.extend(written)
        self._anonymous = None
        return answered

    def _scan(self, start: int, end: int) -> list[tuple[int, int]]:
        if self._pid != os.getpid():
            raise OSError("the tracker belongs to the parent of this forked process")
        out: list[tuple[int, int]] = []
        while start < end:
            arg = (ctypes.c_uint64 * 12)(
                96,  # size
                _SCAN_WP_MATCHING | _SCAN_CHECK_WPASYNC,
                start,
                end,
                0,  # walk_end, set by the kernel
                ctypes.addressof(self._regions),
                _REGIONS,
                0,  # max_pages: all
                0,  # category_inverted
                _PAGE_IS_WRITTEN,  # category_mask: written pages only
                0,
                _PAGE_IS_WRITTEN,  # return_mask
            )
            n = int(libc().ioctl(self._pagemap, ctypes.c_ulong(_PAGEMAP_SCAN), ctypes.byref(arg)))
            if n < 0:
                raise OSError(ctypes.get_errno(), f"PAGEMAP_SCAN: {_errno()}")
            out.extend(struct.unpack_from("QQ", self._regions, 24 * i) for i in range(n))
            walk_end = int(arg[4])
            if walk_end <= start:
                raise OSError("PAGEMAP_SCAN made no progress")
            start = walk_end
        return out


class WriteView:
    """One user's questions to the process's :class:`WriteTracker`.

    :meth:`track` a range (registered and protected now), :meth:`collect`
    once per snapshot before any tensor is read (what was written since this
    view's last collect, by anyone's scan in between), then ask
    :meth:`written_ranges` per range. One snapshot at a time uses a view.
    """

    def __init__(self, tracker: WriteTracker) -> None:
        self._tracker = tracker
        self._page = tracker._page
        self._pending: list[tuple[int, int]] = []  # written pages handed over since the last collect
        self._scanned: list[tuple[int, int]] = []  # tracked ranges the last collect answered for
        self._written: list[tuple[int, int]] = []  # pages written before the last collect
        self._held: dict[tuple[int, int], int] = {}  # what this view tracks (page envelope -> times)
        weakref.finalize(self, tracker._release, self._held)

    def track(self, ptr: int, nbytes: int) -> bool:
        """Register the pages of ``[ptr, ptr + nbytes)`` and write-protect them now: a write from
        here on shows in the next :meth:`collect`. False when refused (memory that is not private
        and anonymous, or that the kernel will not register)."""
        envelope = page_envelope(ptr, nbytes, self._page)
        if not self._tracker._track(envelope):
            return False
        self._held[envelope] = self._held.get(envelope, 0) + 1
        return True

    def forget(self, ptr: int, nbytes: int, *, unprotect: bool = False) -> None:
        """Stop asking about a range :meth:`track` took (its memory may be freed from now on);
        ``unprotect``: the memory is still mapped, and its pages are left writable without a fault
        (where no other tracked range shares them)."""
        envelope = page_envelope(ptr, nbytes, self._page)
        if self._held.get(envelope, 0) > 0:
            self._held[envelope] -= 1
            if not self._held[envelope]:
                del self._held[envelope]
            self._tracker._forget(envelope, unprotect=unprotect)

    def collect(self) -> None:
        """Take what was written to the tracked pages since this view's last collect (or since they
        were tracked); the pages are protected again in the same atomic step."""
        with self._tracker._lock:
            self._scanned = self._tracker._scan_all()
            self._written, self._pending = merged(self._pending), []

    def written(self, ptr: int, nbytes: int) -> bool:
        """Whether any page of ``[ptr, ptr + nbytes)`` was written before the last :meth:`collect`,
        or was not tracked then (never known clean)."""
        return self.written_ranges(ptr, nbytes) != []

    def written_ranges(self, ptr: int, nbytes: int) -> list[tuple[int, int]] | None:
        """The parts of ``[ptr, ptr + nbytes)`` on pages written before the last :meth:`collect`, as
        [start, end) offsets from ``ptr`` (empty: none written); None when not tracked then."""
        start, end = page_envelope(ptr, nbytes, self._page)
        if not overlaps_within(self._scanned, start, end):
            return None
        i = bisect.bisect_right(self._written, (start, float("inf"))) - 1
        out: list[tuple[int, int]] = []
        for low, high in self._written[max(i, 0) :]:
            if low >= end:
                break
            if high > start:
                out.append((max(low, ptr) - ptr, min(high, ptr + nbytes) - ptr))
        return [(a, b) for a, b in out if a < b]


def _errno() -> str:
    err = ctypes.get_errno()
    return os.strerror(err) if err else "unknown error"
