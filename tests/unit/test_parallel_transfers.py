"""The backends' parallel transfers: a failure (or a stop) ends them at once, not in list order."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from spotguard.storage.base import before_part, wait_all


class Stopped(Exception):
    pass


def test_a_later_failure_is_raised_while_an_earlier_transfer_still_runs() -> None:
    release = threading.Event()
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        slow = pool.submit(release.wait, 30)

        def fail() -> None:
            raise Stopped("the second transfer failed")

        failing = pool.submit(fail)
        queued = pool.submit(time.sleep, 0)  # waits for a worker: cancelled, never run
        t0 = time.monotonic()
        with pytest.raises(Stopped):
            wait_all([slow, failing, queued])
        # Raised before the first transfer ended (it waits for the release), not after it.
        assert not slow.done()
        assert time.monotonic() - t0 < 20
        assert queued.cancelled()
    finally:
        release.set()
        pool.shutdown(wait=True)


def test_every_transfer_is_waited_for_when_none_fails() -> None:
    pool = ThreadPoolExecutor(max_workers=2)
    ended: list[int] = []
    try:
        futures = [pool.submit(lambda i=i: (time.sleep(0.01 * (3 - i)), ended.append(i))) for i in range(3)]
        wait_all(futures)
        assert sorted(ended) == [0, 1, 2]
    finally:
        pool.shutdown(wait=True)


def test_a_part_asks_its_progress_callback_before_it_starts() -> None:
    asked: list[int] = []
    before_part(asked.append)
    assert asked == [0]
    before_part(None)  # no callback: nothing to ask

    def stopped(n: int) -> None:
        raise Stopped

    with pytest.raises(Stopped):
        before_part(stopped)
