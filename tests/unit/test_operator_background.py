"""The operator's parts that work in a daemon thread of their own (BackgroundThread)."""

from __future__ import annotations

import threading

from spotguard.operator.admission import AdmissionServer
from spotguard.operator.background import BackgroundThread
from spotguard.operator.webhookcert import CertificateKeeper


class Waiter(BackgroundThread):
    """Waits on an event of its own, not on ``_stop``: only ``_wake`` ends it."""

    thread_name = "test-waiter"

    def __init__(self) -> None:
        super().__init__()
        self.poke = threading.Event()
        self.ran_in = ""

    def _run(self) -> None:
        self.ran_in = threading.current_thread().name
        while not self._stop.is_set():
            self.poke.wait()

    def _wake(self) -> None:
        self.poke.set()


def test_with_starts_a_named_daemon_thread_and_stop_wakes_and_joins_it() -> None:
    with Waiter() as waiter:
        thread = waiter._thread
        assert thread is not None and thread.daemon and thread.name == "test-waiter"
        assert thread.is_alive()
    thread.join(0)
    assert not thread.is_alive() and waiter.ran_in == "test-waiter"


def test_stop_before_start_returns() -> None:
    waiter = Waiter()
    waiter.stop(timeout=0.1)
    assert waiter._thread is None and waiter._stop.is_set()


def test_the_admission_server_and_the_certificate_keeper_name_their_threads() -> None:
    assert (AdmissionServer.thread_name, CertificateKeeper.thread_name) == ("admission", "webhook-certificate")
