"""A signal handler sets the latch's event without taking its lock (spotguard.signalsafe).

``threading.Event.set()`` in a handler that runs while its own thread holds the
event's lock (inside ``Event.wait()``) waits forever: the supervisor's and the
sidecar's main loops wait on the latch's event, so some SIGTERMs were never
handled. Each test here fails on a handler that calls ``set()``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

from spotguard.signalsafe import SignalEvent, SignalLatch


def _eventually(check: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.001)
    return False


def test_the_handler_returns_while_its_own_thread_holds_the_events_lock() -> None:
    # What a signal arriving inside Event.wait() looks like to the handler: the lock is held by the
    # very thread it runs on. The handler must return, and the event be set once the lock is free.
    latch = SignalLatch()
    latch.event.open()
    try:
        returned = threading.Event()

        def waiting_thread_gets_the_signal() -> None:
            with latch.event._cond:  # as Event.wait() holds it around its check and after waking
                latch._handle(signal.SIGTERM, None)
                returned.set()

        worker = threading.Thread(target=waiting_thread_gets_the_signal, daemon=True)
        worker.start()
        assert returned.wait(5), "the handler waited for a lock its own thread holds"
        worker.join(5)
        assert _eventually(latch.event.is_set)
        assert latch.source == "sigterm" and latch.received_at > 0
    finally:
        latch.event.close()


def test_only_the_first_signal_is_recorded() -> None:
    latch = SignalLatch()
    latch.event.open()
    try:
        latch._handle(signal.SIGINT, None)
        first = latch.received_at
        latch._handle(signal.SIGTERM, None)
        assert latch.source == "sigint" and latch.received_at == first
        assert _eventually(latch.event.is_set)
    finally:
        latch.event.close()


def test_a_closed_event_is_set_directly_and_its_relay_ends() -> None:
    event = SignalEvent()
    event.open()
    relays = [t for t in threading.enumerate() if t.name == "spotguard-signal"]
    event.close()
    assert _eventually(lambda: not any(t.is_alive() for t in relays))
    event.set_soon()
    assert event.is_set()


PROGRAM = """
import signal, sys
from spotguard.signalsafe import SignalLatch
latch = SignalLatch()
latch.install()
print("ready", flush=True)
while not latch.event.is_set():
    latch.event.wait(0.0002)  # the main loop's wait, as short as it gets
latch.restore()
print(latch.source, flush=True)
"""


def test_a_process_polling_its_latch_as_fast_as_it_can_sees_every_sigterm() -> None:
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", PROGRAM], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
            assert out.strip() == "sigterm" and proc.returncode == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
