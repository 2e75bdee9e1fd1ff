"""A part of the operator that works in a daemon thread of its own: started, stopped, or used with ``with``.

The admission server (:mod:`~spotguard.operator.admission`) and the webhook
certificate's keeper (:mod:`~spotguard.operator.webhookcert`) are such parts:
each says what its thread does (``_run``, which ends once ``_stop`` is set)
and, where its thread waits on something else than ``_stop``, how to wake it
(``_wake``).
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import ClassVar, Self


class BackgroundThread:
    """Runs :meth:`_run` in a daemon thread named :attr:`thread_name`, from :meth:`start` to :meth:`stop`."""

    #: The thread's name, as logs and stack dumps show it.
    thread_name: ClassVar[str]

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Self:
        """Start the thread (returns at once)."""
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to end and wait for it, at most ``timeout`` seconds."""
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _run(self) -> None:
        """The thread's work; returns once ``_stop`` is set."""
        raise NotImplementedError

    def _wake(self) -> None:
        """Make the thread see ``_stop`` now (nothing to do for a thread that waits on ``_stop`` itself)."""
