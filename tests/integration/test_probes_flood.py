"""The operator's probes port under a steady flood of connections that never send a byte: liveness keeps
answering, and a client that trickles its request is dropped.

A real operator process on the real apiserver. Its file limit is lowered to
512 (a container's limit may be as low as 1024; the lower one keeps the flood
small): a server that held every idle connection until it timed out would
run out of descriptors and leave the liveness probe unanswered, and the
operator would be restarted for a flood it could not help.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from spotguard import notice_relay
from spotguard.operator.probes import MAX_CONNECTIONS, REQUEST_TIMEOUT_SECONDS
from spotguard.operator.testing import OperatorProcess
from testenv import kubetest

pytestmark = pytest.mark.integration

NS_PREFIX = "flood"
FILE_LIMIT = 512
#: A steady flood: a server that held each idle connection for its request timeout would need thousands of files.
FLOOD_PER_SECOND = 500
FLOOD_MOST = 4000
#: What a kubelet probe allows by default is 1 s; 2 s leaves room for a busy test machine.
PROMPT_SECONDS = 2.0


@pytest.fixture(scope="module")
def limited_operator(kube: Any, ns: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """An operator process that may hold at most :data:`FILE_LIMIT` files."""
    op = kubetest.operator_process(kube, ns, tmp_path_factory.mktemp("operator") / "operator.log")
    op.argv = ["prlimit", f"--nofile={FILE_LIMIT}:{FILE_LIMIT}", "--", *op.argv]
    op.start()
    try:
        yield op
    finally:
        op.stop()
        print(f"--- operator log ---\n{op.log_tail(40)}")


def ask(port: int, path: str, timeout: float) -> tuple[int, float]:
    """GET ``path`` on a new connection: the status and how long the answer took."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1]), time.monotonic() - start


@contextlib.contextmanager
def idle_flood(port: int, per_second: int, most: int) -> Iterator[list[socket.socket]]:
    """Connections opened at ``per_second`` (up to ``most`` held) that never send a byte, from a
    thread, until the block ends. Connects are left to the kernel (non-blocking): a flood does not
    wait for the server."""
    held: list[socket.socket] = []
    stop = threading.Event()

    def flood() -> None:
        start, opened = time.monotonic(), 0
        while not stop.is_set():
            due = min(int((time.monotonic() - start) * per_second), most)
            while opened < due:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setblocking(False)
                code = s.connect_ex(("127.0.0.1", port))
                assert code in (0, errno.EINPROGRESS), os.strerror(code)
                held.append(s)
                opened += 1
            stop.wait(0.01)

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        yield held
    finally:
        stop.set()
        thread.join()
        for s in held:
            s.close()


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def operator_pid(op: OperatorProcess) -> int:
    """The operator's own pid (prlimit execs it, so it is the process started)."""
    assert op.proc is not None
    return op.proc.pid


def test_liveness_answers_promptly_through_a_flood_of_idle_connections(limited_operator: OperatorProcess) -> None:
    op = limited_operator
    port = op.liveness_port
    assert ask(port, "/healthz", 5)[0] == 200
    with idle_flood(port, FLOOD_PER_SECOND, FLOOD_MOST) as held:
        time.sleep(2.0)  # far more than the server may hold by now
        for _ in range(5):
            status, took = ask(port, "/healthz", 15)
            assert status == 200 and took < PROMPT_SECONDS, f"/healthz took {took:.1f} s (answered {status})"
            time.sleep(0.3)
        assert ask(port, "/readyz", 15)[0] == 200
        # The relay on the same port answers too (here: no token, refused as such).
        assert ask(port, notice_relay.POD_PATH, 15)[0] == 401
        # The idle connections past the cap were dropped: the process holds far fewer files than the flood.
        assert len(held) > FILE_LIMIT
        assert open_files(operator_pid(op)) < MAX_CONNECTIONS + 150
    assert ask(port, "/healthz", 5)[0] == 200


def test_a_client_that_trickles_its_request_is_dropped_in_time(limited_operator: OperatorProcess) -> None:
    """A byte a second never completes a request: the connection is closed once its time is up."""
    port = limited_operator.liveness_port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        start = time.monotonic()
        closed_after = None
        for byte in b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"a" * 60:
            try:
                s.sendall(bytes([byte]))
                s.settimeout(1.0)
                if s.recv(1) == b"":
                    closed_after = time.monotonic() - start
                    break
            except TimeoutError:
                continue  # still open: the next byte
            except ConnectionError:
                closed_after = time.monotonic() - start
                break
            if time.monotonic() - start > REQUEST_TIMEOUT_SECONDS + 10:
                break
    assert closed_after is not None, "the server kept a trickling client for ever"
    assert closed_after < REQUEST_TIMEOUT_SECONDS + 3, closed_after
    assert ask(port, "/healthz", 5)[0] == 200
