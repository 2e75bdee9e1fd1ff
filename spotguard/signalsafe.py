"""An event a signal handler may set (:class:`SignalEvent`), and the latch of the first SIGTERM/SIGINT
(:class:`SignalLatch`).

``threading.Event.set()`` takes the event's lock. A Python signal handler
runs on the main thread between two bytecodes, which may be while that very
thread holds the same lock inside ``Event.wait()`` (on the way in, before the
wait releases it, or on the way out, once it took it back). The handler's
``set()`` then waits for a lock its own thread holds: forever. A supervisor
whose main loop polls with ``event.wait(poll)`` meets that window at some
SIGTERMs, and the preemption is never handled.

:meth:`SignalEvent.set_soon` takes no lock: it writes one byte to a pipe,
and a thread of the event's own (started by :meth:`SignalEvent.open`, from
ordinary code) reads it and calls ``set()`` there, where waiting for the
lock is harmless. Waiters wake as from any ``set()``, microseconds later.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any


class SignalEvent(threading.Event):
    """A ``threading.Event`` with :meth:`set_soon`, safe in a signal handler once :meth:`open`."""

    def __init__(self) -> None:
        super().__init__()
        self._write = -1

    def open(self) -> None:
        """Start the relay (ordinary code, before the handler is installed; a second call changes nothing)."""
        if self._write >= 0:
            return
        read, write = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(write, False)
        self._write = write
        threading.Thread(target=self._relay, args=(read,), name="spotguard-signal", daemon=True).start()

    def close(self) -> None:
        """Stop the relay (after the handler is gone); :meth:`set_soon` then sets the event directly."""
        write, self._write = self._write, -1
        if write >= 0:
            os.close(write)

    def set_soon(self) -> None:
        """Set the event without taking its lock on this thread (see the module's docstring)."""
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:
            pass  # the pipe holds bytes the relay has not read yet: it sets the event anyway
        except OSError:
            self.set()  # not opened (or closed): no handler can be running on a waiter's thread

    def _relay(self, read: int) -> None:
        try:
            while os.read(read, 64):
                self.set()
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                os.close(read)


class SignalLatch:
    """Records the first SIGTERM/SIGINT and when it came; handlers only set flags.

    The handler sets :attr:`event` without taking its lock
    (:class:`SignalEvent`): the main loop waits on it,
    and a handler that ran while that wait held the lock would wait for its
    own thread forever, the preemption never handled.
    """

    def __init__(self, on_signal: Callable[[str], None] | None = None) -> None:
        self.event = SignalEvent()
        self.source: str | None = None
        self.received_at = 0.0
        # Called once, from the handler, with the source: only for what must
        # not wait for the main loop (and is safe in a signal handler: no lock).
        self.on_signal = on_signal
        self._previous: dict[int, Any] = {}
        self._fired = False

    @property
    def installed(self) -> bool:
        """Whether this latch's handlers are in place."""
        return bool(self._previous)

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        """Install handlers (main thread only; a second call changes nothing)."""
        if self.installed:
            return
        self.event.open()
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self.event.close()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if not self._fired:
            self._fired = True
            self.received_at = time.time()
            self.source = "sigint" if signum == signal.SIGINT else "sigterm"
            self.event.set_soon()
            if self.on_signal is not None:
                self.on_signal(self.source)
