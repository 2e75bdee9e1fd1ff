"""The write tracker (spotguard.checkpoint.local.written) against this kernel, and its pure helpers.

Every way the process can change a tracked tensor's bytes must show as a
written page: a write through ``.data`` (which version counters miss),
numpy, another thread, the kernel filling the memory on ``read(2)``. Memory
the tracker cannot vouch for (a file mapping, never tracked, forgotten)
counts as written.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

import pytest
import torch

from spotguard.checkpoint.local.written import (
    MEMCMP_MAX_BYTES,
    MIN_TRACKED_BYTES,
    WriteTracker,
    WriteView,
    host_ranges_equal,
    merged,
    overlaps,
    page_envelope,
    private_anonymous,
    tracking_enabled,
)
from testenv.require import require

PAGE = mmap.PAGESIZE


def test_page_envelope() -> None:
    assert page_envelope(4096 + 64, 100, 4096) == (4096, 8192)
    assert page_envelope(4096, 4096, 4096) == (4096, 8192)
    assert page_envelope(4096 + 4000, 200, 4096) == (4096, 12288)


def test_merged_and_overlaps() -> None:
    assert merged([(10, 20), (0, 5), (5, 8), (19, 30), (40, 50)]) == [(0, 8), (10, 30), (40, 50)]
    ranges = merged([(0, 8), (10, 30)])
    assert overlaps(ranges, 7, 9)
    assert not overlaps(ranges, 8, 10)
    assert overlaps(ranges, 29, 100)
    assert not overlaps(ranges, 30, 100)
    assert not overlaps([], 0, 1)


def test_host_ranges_equal_reads_exactly_the_ranges_given() -> None:
    n = 2 * MEMCMP_MAX_BYTES + 11
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 256, (n + 3,), dtype=torch.uint8, generator=g)
    mine = base[3:]  # an odd address: a storage offset, as a slice of a larger buffer has
    theirs = mine.clone()
    small, large = [(0, 10), (PAGE - 1, 2 * PAGE + 1), (n - 1, n)], [(5, n)]
    assert host_ranges_equal(torch, mine, theirs, small + large)
    assert host_ranges_equal(torch, mine, theirs, [])
    theirs[PAGE + 7] ^= 1  # inside the second small range and the large one
    assert not host_ranges_equal(torch, mine, theirs, small)
    assert not host_ranges_equal(torch, mine, theirs, large)
    assert host_ranges_equal(torch, mine, theirs, [(0, PAGE + 7), (PAGE + 8, PAGE + 100), (n - 1, n)])
    theirs[PAGE + 7] ^= 1
    theirs[n - 1] ^= 0x80  # the last byte: by memcmp alone, then inside an unaligned large range
    assert not host_ranges_equal(torch, mine, theirs, [(n - 1, n)])
    assert not host_ranges_equal(torch, mine, theirs, [(1, n)])
    assert host_ranges_equal(torch, mine, theirs, [(0, n - 1)])
    words = torch.zeros(n // 8, dtype=torch.int64)  # other dtypes: compared as their bytes
    other = words.clone()
    other.view(torch.uint8)[8 * 1000 + 3] = 1
    assert not host_ranges_equal(torch, words, other, [(8000, 8008)])
    assert host_ranges_equal(torch, words, other, [(0, 8003), (8004, 8 * (n // 8))])


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), ("off", False), ("false", False)])
def test_the_switch(value: str | None, on: bool) -> None:
    assert tracking_enabled({} if value is None else {"SPOTGUARD_TRACK_WRITES": value}) is on


def test_switched_off_there_is_no_tracker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTGUARD_TRACK_WRITES", "0")
    assert WriteTracker.open() is None


@pytest.fixture
def tracker() -> WriteView:
    shared = WriteTracker.shared()
    require(
        shared is not None, "write tracking (userfaultfd, asynchronous write-protection: Linux 6.7+)", "a newer kernel"
    )
    assert shared is not None
    return shared.view()


def tensor(mib: int = 4) -> torch.Tensor:
    return torch.arange(mib << 18, dtype=torch.float32)


def addr(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()


def inner(t: torch.Tensor) -> tuple[int, int]:
    """The tensor's memory but its first and last page, which it may share with other allocations."""
    ptr, nbytes = addr(t)
    return ptr + PAGE, nbytes - 2 * PAGE


def test_untouched_memory_is_clean_and_each_write_way_is_seen(tracker: WriteView) -> None:
    t = tensor()
    assert tracker.track(*addr(t))
    tracker.collect()
    assert not tracker.written(*inner(t))

    def write_page(i: int, how: str) -> None:
        at = i * PAGE // 4  # a float in page i of the tensor (its start is not page-aligned: near enough)
        if how == "data":
            t.data[at] += 1.0  # bypasses the version counter
        elif how == "numpy":
            t.numpy()[at] = -1.0
        elif how == "thread":
            th = threading.Thread(target=lambda: t.data.__setitem__(at, 7.0))
            th.start()
            th.join()
        else:  # the kernel writes it: read(2) from a pipe into the tensor's memory
            r, w = os.pipe()
            os.write(w, b"\x11" * 16)
            os.close(w)
            os.readv(r, [memoryview(t.numpy()).cast("B")[at * 4 : at * 4 + 16]])
            os.close(r)

    for i, how in enumerate(("data", "numpy", "thread", "read")):
        page = 100 + 50 * i
        write_page(page, how)
        tracker.collect()
        ptr, _ = addr(t)
        base = ptr - ptr % PAGE
        assert tracker.written(base + page * PAGE, 1), how
        assert not tracker.written(base + (page + 10) * PAGE, PAGE), how  # other pages stay clean
        tracker.collect()  # asked once, then protected again: clean until the next write
        assert not tracker.written(*inner(t)), how


def test_memory_never_tracked_or_forgotten_counts_as_written(tracker: WriteView) -> None:
    a, b = tensor(), tensor()
    assert tracker.track(*addr(a))
    tracker.collect()
    assert tracker.written(*addr(b))
    tracker.forget(*addr(a))
    tracker.collect()
    assert tracker.written(*addr(a))


def test_private_anonymous_mappings() -> None:
    maps = [
        "7f0000000000-7f0000001000 rw-p 00000000 00:00 0 \n",
        "7f0000001000-7f0000003000 rw-p 00000000 00:00 0                          [anon:glibc]\n",
        "7f0000003000-7f0000004000 rw-s 00000000 00:01 1234                       /dev/zero (deleted)\n",
        "7f0000004000-7f0000005000 rw-p 00001000 fd:01 5678                       /data/weights.bin\n",
        "7f0000005000-7f0000006000 r--p 00000000 00:00 0                          [vvar]\n",
        "55d000000000-55d000021000 rw-p 00000000 00:00 0                          [heap]\n",
    ]
    assert private_anonymous(maps) == [(0x55D000000000, 0x55D000021000), (0x7F0000000000, 0x7F0000003000)]


@pytest.mark.parametrize("kind", ["private file", "shared file", "shared anonymous", "share_memory_"])
def test_memory_another_writer_can_change_is_refused(tracker: WriteView, tmp_path: Path, kind: str) -> None:
    # Its bytes can change with no write of this process (another writer of the file or the memory).
    size = MIN_TRACKED_BYTES
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * size)
    with path.open("r+b") as fh:
        if kind == "share_memory_":
            t = torch.zeros(size // 4).share_memory_()
        else:
            flags = {
                "private file": mmap.MAP_PRIVATE,
                "shared file": mmap.MAP_SHARED,
                "shared anonymous": mmap.MAP_SHARED | mmap.MAP_ANONYMOUS,
            }[kind]
            m = mmap.mmap(-1 if "anonymous" in kind else fh.fileno(), size, flags=flags)
            t = torch.frombuffer(m, dtype=torch.uint8)
        assert not tracker.track(*addr(t))
        tracker.collect()
        assert tracker.written(*addr(t))


def test_many_written_regions_come_back(tracker: WriteView) -> None:
    # More written regions than one scan call returns: the scan goes on where the kernel stopped.
    t = tensor(8)
    assert tracker.track(*addr(t))
    tracker.collect()
    pages = range(2, 2000, 3)  # about 660 regions of one page
    for i in pages:
        t.data[i * PAGE // 4] = 1.0
    tracker.collect()
    ptr, _ = addr(t)
    base = ptr - ptr % PAGE
    assert all(tracker.written(base + i * PAGE, 1) for i in pages)
    assert not any(tracker.written(base + (i + 1) * PAGE, 1) for i in pages)


def test_views_do_not_take_each_others_writes(tracker: WriteView) -> None:
    # Two users of the process's tracker (two checkpointers): one's question re-protects the pages,
    # and the other must still be told of the write when it asks.
    other = tracker._tracker.view()
    t = tensor()
    assert tracker.track(*addr(t))
    assert other.track(*addr(t))  # the same memory twice: taken, what was written kept for both
    tracker.collect()
    other.collect()
    t.data[100] = 3.0
    tracker.collect()
    assert tracker.written(*addr(t))
    other.collect()
    assert other.written(*addr(t))
    t.data[200_000] = 3.0
    assert other.track(*addr(t))  # tracked again: its protection must not swallow the write for the first
    tracker.collect()
    assert tracker.written(*addr(t))


def test_a_forked_child_neither_asks_nor_tracks_for_its_parent(tracker: WriteView) -> None:
    # The userfaultfd and the pagemap file answer for the process that opened them: in a forked child
    # the inherited tracker would register and scan the parent's memory. There it knows nothing.
    t = tensor()
    assert tracker.track(*addr(t))
    tracker.collect()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child (no torch operator here: its thread pool does not survive a fork)
        try:
            t.numpy()[300_000] = 5.0  # its own write must not go unseen
            tracker.collect()
            other = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buffer = ctypes.c_char.from_buffer(other)
            answers = (tracker.written_ranges(*inner(t)) is None, not tracker.track(ctypes.addressof(buffer), PAGE))
            del buffer
            shared = WriteTracker.shared()
            fresh = shared is not None and shared._pid == os.getpid()
            os.write(w, b"1" if all(answers) and fresh else b"0")
        finally:
            os._exit(0)
    os.close(w)
    verdict = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert verdict == b"1"
    tracker.collect()
    assert not tracker.written(*inner(t))  # the child's write went to its own copy
