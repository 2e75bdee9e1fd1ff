"""How the follower waits for the bytes of a file being written (spotguard.sidecar.follow.Growth).

Every part of a file being uploaded while it is written waits for its own
bytes. One thread looks at the file's size for all of them; each waiter is
woken once its bytes are in, and every waiter is stopped when the follower
stops or the file is closed.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from spotguard.sidecar import follow
from spotguard.sidecar.follow import FollowStopped, Growth

STEP = 4096


def _waiters(growth: Growth, ends: list[int], sizes: dict[int, int], path: Path) -> list[threading.Thread]:
    """Threads that each wait for one end and record the file's size when they return (or -1: stopped)."""

    def run(end: int) -> None:
        try:
            growth.wait(end)
            sizes[end] = path.stat().st_size
        except FollowStopped:
            sizes[end] = -1

    threads = [threading.Thread(target=run, args=(end,), daemon=True) for end in ends]
    for t in threads:
        t.start()
    return threads


def test_each_waiter_returns_once_its_bytes_are_in_and_one_thread_looks_for_all(tmp_path: Path) -> None:
    path = tmp_path / "growing.bin"
    path.touch()
    growth = Growth(os.open(path, os.O_RDONLY), lambda: False)
    ends = [STEP * k for k in range(1, 41, 5)]  # eight waiters, as an upload's eight workers
    sizes: dict[int, int] = {}
    threads = _waiters(growth, ends, sizes, path)
    started = time.monotonic()
    with open(path, "wb") as f:
        for _ in range(40):
            f.write(b"x" * STEP)
            f.flush()
            time.sleep(0.01)
    for t in threads:
        t.join(10)
    elapsed = time.monotonic() - started
    growth.close()
    assert sorted(sizes) == ends
    assert all(sizes[end] >= end for end in ends), sizes  # none woke before its bytes were written
    # Eight threads each looking every POLL_SECONDS would have looked about 8x as often.
    polls = elapsed / follow.POLL_SECONDS
    assert growth.looks <= polls + 2 * len(ends), (growth.looks, polls)


def test_a_file_already_written_is_not_waited_for(tmp_path: Path) -> None:
    path = tmp_path / "done.bin"
    path.write_bytes(b"y" * 3 * STEP)
    growth = Growth(os.open(path, os.O_RDONLY), lambda: False)
    before = threading.active_count()
    growth.wait(3 * STEP)
    assert growth.looks == 1
    assert threading.active_count() == before  # no looker was started
    growth.close()


@pytest.mark.parametrize("how", ["stopped", "closed"])
def test_every_waiter_is_stopped_when_the_follower_stops_or_the_file_closes(tmp_path: Path, how: str) -> None:
    path = tmp_path / "stalled.bin"
    path.write_bytes(b"z" * STEP)  # the writer stalls after one step
    stop = threading.Event()
    growth = Growth(os.open(path, os.O_RDONLY), stop.is_set)
    ends = [STEP, 2 * STEP, 5 * STEP, 9 * STEP]
    sizes: dict[int, int] = {}
    threads = _waiters(growth, ends, sizes, path)
    deadline = time.monotonic() + 10
    while STEP not in sizes and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # a few looks of the looker
    assert sizes == {STEP: STEP}  # the bytes that are in were given at once; the rest still waits
    if how == "stopped":
        stop.set()
    else:
        growth.close()
    for t in threads:
        t.join(10)
    assert sizes == {STEP: STEP, 2 * STEP: -1, 5 * STEP: -1, 9 * STEP: -1}
    growth.close()
    with pytest.raises(FollowStopped):
        growth.wait(2 * STEP)  # a closed file is never looked at again
