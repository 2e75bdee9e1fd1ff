"""The operator process's liveness and readiness endpoints: one small server, one port, start to exit.

``--liveness URL`` (default ``http://0.0.0.0:8081/healthz``) names where
liveness is answered; readiness is ``/readyz`` on the same port. The server
runs in a thread of its own for the whole life of the process, whatever its
role, so the port never changes hands when a standby becomes the leader
(kopf's own liveness endpoint is not used: it serves only its one path, and
only while kopf runs).

=======================  ======================================  ==================================================
this process             ``/healthz`` (liveness)                 ``/readyz`` (readiness)
=======================  ======================================  ==================================================
standing by              the election loop looked at the Lease   alive, and its last look reached the apiserver
                         lately (it is not hung)
starting kopf            503 (as before: kopf's endpoint was     503
                         not up yet either)
leading, or alone        kopf started and its loop answers       the same
=======================  ======================================  ==================================================

With ``--webhook``, readiness also needs this replica's admission server to
be serving: every replica serves admission (:mod:`spotguard.operator.admission`),
so the webhook Service sends requests to every ready replica, and a
PodDisruptionBudget counts the replicas that really work. Each answer is JSON
saying what it waits for.

The same server serves the notice relay (``/notices/v1/...``,
:mod:`spotguard.operator.notices`): like the probes, every replica must
answer it whatever its role, from start to exit; ``--liveness ''`` turns it
off with the probes.

The port is open to whatever reaches the pod, so nothing a client does may
stop liveness answering (a liveness that does not answer gets the operator
restarted). The server is one thread with a selector, not a thread per
connection: an idle connection costs a socket and no thread. At most
:data:`MAX_CONNECTIONS` are held; past that a new one drops the oldest that
is still sending its request, so a flood of idle connections never holds
the port nor the process's file descriptors. A request must arrive whole
within :data:`REQUEST_TIMEOUT_SECONDS` (one request per connection, as
kubelet's probes send). The answers are computed in worker threads: one
liveness and one readiness evaluation at a time, shared by every request
that arrives meanwhile, and the relay's on threads of their own, at most
:data:`MAX_RELAY_REQUESTS` at once (more are told 503 at once), so a busy
relay never delays the probes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import http
import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol
from urllib.parse import urlsplit

from spotguard.operator.leader import StandbyLiveness

log = logging.getLogger("spotguard.operator")

READY_PATH = "/readyz"
#: How long kopf's event loop may take to run a no-op before it counts as hung.
LOOP_TIMEOUT_SECONDS = 5.0
#: How long a client may take to send its whole request (line, headers, body), and to take the answer.
REQUEST_TIMEOUT_SECONDS = 5.0
#: Connections held at once, at most (well below a container's usual file limit).
MAX_CONNECTIONS = 256
#: The longest request line and headers read.
MAX_HEAD_BYTES = 16384
#: Relay requests being answered or waiting for a worker at once, at most.
MAX_RELAY_REQUESTS = 32
#: Threads answering the relay (each may wait for the apiserver).
RELAY_WORKERS = 8

Answer = tuple[bool, dict[str, Any]]
#: An HTTP status and a JSON body.
HttpAnswer = tuple[int, dict[str, Any]]


class Serving(Protocol):
    """What readiness asks of the admission server."""

    def serving(self) -> bool: ...


class Relay(Protocol):
    """What the server asks of the notice relay (:class:`spotguard.operator.notices.NoticeRelay`)."""

    #: The largest request body read.
    max_body: int

    def serves(self, path: str) -> bool:
        """Whether ``path`` is the relay's."""
        ...

    def handle(self, method: str, path: str, authorization: str | None, body: bytes = b"") -> HttpAnswer:
        """The HTTP status and JSON answer to a request for one of the relay's paths."""
        ...


def loop_answers(loop: asyncio.AbstractEventLoop | None, timeout: float = LOOP_TIMEOUT_SECONDS) -> bool:
    """Whether ``loop`` (running in another thread) runs a no-op within ``timeout``."""
    if loop is None or loop.is_closed():
        return False
    try:
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout)
    except Exception:  # noqa: BLE001 - closed meanwhile, or hung: either way the loop does not answer
        return False
    return True


class Health:
    """What this process's probes answer, as its role changes: standing by, starting kopf, running it.

    ``run`` sets ``standby`` while the replica waits for the Lease, ``leading``
    once it holds it, and ``kopf_loop`` while kopf runs; kopf raises
    ``kopf_started`` once its startup handlers are done.
    """

    def __init__(self, admission: Serving | None = None, identity: str | None = None) -> None:
        self.admission = admission
        self.identity = identity
        self.standby: StandbyLiveness | None = None
        self.leading = False
        self.kopf_started = threading.Event()
        self.kopf_loop: asyncio.AbstractEventLoop | None = None

    def role(self) -> str:
        if self.standby is not None:
            return "standby"
        return "running" if self.kopf_started.is_set() and self.kopf_loop is not None else "starting"

    def _kopf_runs(self) -> bool:
        return self.kopf_started.is_set() and loop_answers(self.kopf_loop)

    def live(self) -> Answer:
        """Liveness: 200 unless the process is hung (or not up yet)."""
        standby = self.standby
        if standby is not None:
            return standby.healthy(), standby.body()
        return self._kopf_runs(), {"standby": False, "leader": self.identity if self.leading else None}

    def ready(self) -> Answer:
        """Readiness: this replica serves admission (with ``--webhook``) and does its part of the rest."""
        waiting: list[str] = []
        if self.admission is not None and not self.admission.serving():
            waiting.append("the admission server is not serving yet")
        standby = self.standby
        if standby is not None:
            if not standby.healthy():
                waiting.append("the leader election loop has not looked at the Lease lately")
            elif not standby.reached:
                waiting.append("the last look at the Lease did not reach the apiserver")
        elif not self._kopf_runs():
            waiting.append("the controller is not running yet")
        return not waiting, {"ready": not waiting, "role": self.role(), "waiting": waiting}


@dataclass(frozen=True, slots=True)
class Request:
    """One HTTP request as read from a client."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""


class BadRequest(Exception):
    """A request the server cannot read: the HTTP status and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_head(head: bytes) -> Request:
    """Pure: the request line and headers (up to the blank line) as a :class:`Request` without a body."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise BadRequest(400, "not an HTTP request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise BadRequest(400, "a malformed header line")
        headers[name.strip().lower()] = value.strip()
    return Request(parts[0], urlsplit(parts[1]).path, headers)


def render(status: int, detail: dict[str, Any]) -> bytes:
    """Pure: an HTTP/1.1 answer with a JSON body, closing the connection."""
    body = json.dumps(detail).encode()
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    head = (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


@dataclass(eq=False)
class _Connection:
    """One client connection: what it sent so far, and the answer still to send."""

    sock: socket.socket
    deadline: float | None
    received: bytes = b""
    reading: bool = True
    unsent: bytes = b""
    closed: bool = False


class ProbeServer:
    """``/healthz`` (the path of ``url``) and ``/readyz`` on ``url``'s address and port, in a thread;
    and the notice relay's paths when ``relay`` is given (see the module's doc for its limits).

    ``url`` None or empty: no probes at all (``--liveness ''``), and no relay.
    """

    def __init__(self, url: str | None, health: Health, relay: Relay | None = None) -> None:
        self.url = url
        self.health = health
        self.relay = relay
        #: The address and port served (None until entered).
        self.address: tuple[str, int] | None = None
        self._answers: dict[str, Callable[[], Answer]] = {}
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._probe_pool: ThreadPoolExecutor | None = None
        self._relay_pool: ThreadPoolExecutor | None = None
        # Every open connection, oldest first (a dict as an ordered set).
        self._open: dict[_Connection, None] = {}
        # Connections waiting for an evaluation of a probe path (one evaluation per path at a time).
        self._waiting: dict[str, list[_Connection]] = {}
        self._relay_requests = 0
        # Answers computed by the workers, handed to the server's thread.
        self._finished: collections.deque[tuple[Callable[[], None]]] = collections.deque()
        self._accept_paused_until: float | None = None
        self._told_out_of_files = False

    def __enter__(self) -> ProbeServer:
        if not self.url:
            return self
        parts = urlsplit(self.url)
        self._answers = {parts.path or "/": self.health.live, READY_PATH: self.health.ready}
        host = parts.hostname or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # Bound here, so that a port in use fails the start as it always did.
        listener = socket.create_server((host, parts.port or 80), family=family, backlog=128)
        listener.setblocking(False)
        self._listener = listener
        self.address = (host, int(listener.getsockname()[1]))
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._probe_pool = ThreadPoolExecutor(len(self._answers), thread_name_prefix="probes")
        self._relay_pool = ThreadPoolExecutor(RELAY_WORKERS, thread_name_prefix="notice-relay")
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="probes", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self._thread is None:
            return
        self._stop = True
        self._wake()
        self._thread.join(5)
        self._thread = None
        for pool in (self._probe_pool, self._relay_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    # -- the server's thread

    def _run(self) -> None:
        selector = self._selector
        assert selector is not None
        try:
            while not self._stop:
                for key, events in selector.select(self._timeout()):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    elif key.data.closed:
                        continue  # closed earlier in this round (its number may be a new connection's)
                    elif events & selectors.EVENT_READ:
                        self._receive(key.data)
                    elif events & selectors.EVENT_WRITE:
                        self._send(key.data)
                self._take_finished()
                self._expire()
        except Exception:  # noqa: BLE001 - logged whatever stopped the server; its connections closed below
            log.exception("the probes server stopped")
        finally:
            for conn in list(self._open):
                self._close(conn)
            for sock in (self._listener, self._wake_r, self._wake_w):
                if sock is not None:
                    sock.close()
            selector.close()

    def _timeout(self) -> float:
        """Until the next deadline (at most half a second)."""
        now = time.monotonic()
        deadlines = [c.deadline for c in self._open if c.deadline is not None]
        if self._accept_paused_until is not None:
            deadlines.append(self._accept_paused_until)
        return max(0.0, min([now + 0.5, *deadlines]) - now)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake is pending anyway; closed: stopping
            if self._wake_w is not None:
                self._wake_w.send(b"\0")

    def _drain_wake(self) -> None:
        assert self._wake_r is not None
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass

    def _accept(self) -> None:
        assert self._listener is not None and self._selector is not None
        for _ in range(64):  # then the others get their turn
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                # Out of files (the rest of the process holds them): make room, or stop accepting a moment.
                if not self._told_out_of_files:
                    self._told_out_of_files = True
                    log.warning("probes: cannot accept a connection (%s); dropping the idlest ones", exc.strerror)
                if not self._drop_oldest_reading():
                    self._selector.unregister(self._listener)
                    self._accept_paused_until = time.monotonic() + 0.1
                    return
                continue
            sock.setblocking(False)
            if len(self._open) >= MAX_CONNECTIONS and not self._drop_oldest_reading():
                sock.close()  # every connection is being answered: they end within their time
                continue
            conn = _Connection(sock, time.monotonic() + REQUEST_TIMEOUT_SECONDS)
            self._open[conn] = None
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _drop_oldest_reading(self) -> bool:
        """Close the oldest connection still sending its request; False when there is none."""
        oldest = next((c for c in self._open if c.reading), None)
        if oldest is None:
            return False
        self._close(oldest)
        return True

    def _close(self, conn: _Connection) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._open.pop(conn, None)
        if self._selector is not None:
            with contextlib.suppress(KeyError, ValueError):  # not registered (being answered)
                self._selector.unregister(conn.sock)
        conn.sock.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._open if c.deadline is not None and c.deadline <= now]:
            self._close(conn)  # too slow to send its request, or to take its answer
        if self._accept_paused_until is not None and self._accept_paused_until <= now:
            self._accept_paused_until = None
            assert self._selector is not None and self._listener is not None
            self._selector.register(self._listener, selectors.EVENT_READ, "accept")

    def _receive(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.received += data
        try:
            request = self._request(conn.received)
        except BadRequest as exc:
            self._respond(conn, exc.status, {"error": exc.message})
            return
        if request is not None:
            assert self._selector is not None
            self._selector.unregister(conn.sock)
            conn.reading, conn.deadline = False, None  # the answer's own work is bounded
            self._dispatch(conn, request)

    def _request(self, received: bytes) -> Request | None:
        """The request once it is all there (None: not yet)."""
        end = received.find(b"\r\n\r\n")
        if end < 0:
            if len(received) > MAX_HEAD_BYTES:
                raise BadRequest(431, f"the request line and headers are longer than {MAX_HEAD_BYTES} bytes")
            return None
        request = parse_head(received[: end + 4])
        relay = self.relay
        if request.method != "POST" or relay is None or not relay.serves(request.path):
            return request
        try:
            length = int(request.headers.get("content-length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > relay.max_body:
            raise BadRequest(413, f"send at most {relay.max_body} bytes, with a Content-Length")
        body = received[end + 4 : end + 4 + length]
        return Request(request.method, request.path, request.headers, body) if len(body) == length else None

    def _dispatch(self, conn: _Connection, request: Request) -> None:
        relay = self.relay
        if relay is not None and relay.serves(request.path):
            if self._relay_requests >= MAX_RELAY_REQUESTS:
                self._respond(conn, 503, {"error": "the operator is busy answering other sidecars; try again"})
                return
            self._relay_requests += 1
            assert self._relay_pool is not None
            auth = request.headers.get("authorization")
            future = self._relay_pool.submit(relay.handle, request.method, request.path, auth, request.body)
            future.add_done_callback(lambda done: self._hand_over(lambda: self._relayed(conn, request, done)))
            return
        answer = self._answers.get(request.path)
        if answer is None:
            self._respond(conn, 404, {"error": f"nothing at {request.path}"})
            return
        if request.method != "GET":
            self._respond(conn, 405, {"error": f"{request.path} takes GET"})
            return
        waiting = self._waiting.setdefault(request.path, [])
        waiting.append(conn)
        if len(waiting) == 1:  # else it shares the evaluation under way
            assert self._probe_pool is not None
            evaluation = self._probe_pool.submit(answer)
            evaluation.add_done_callback(lambda done: self._hand_over(lambda: self._evaluated(request.path, done)))

    def _hand_over(self, then: Callable[[], None]) -> None:
        """From a worker thread: run ``then`` in the server's thread."""
        self._finished.append((then,))
        self._wake()

    def _take_finished(self) -> None:
        while self._finished:
            (then,) = self._finished.popleft()
            then()

    def _evaluated(self, path: str, done: Future[Answer]) -> None:
        try:
            ok, detail = done.result()
            status = 200 if ok else 503
        except Exception as exc:  # noqa: BLE001 - a failing check is a failing probe, not a dead server
            status, detail = 503, {"error": f"the check failed: {exc}"}
        for conn in self._waiting.pop(path, []):
            self._respond(conn, status, detail)

    def _relayed(self, conn: _Connection, request: Request, done: Future[HttpAnswer]) -> None:
        self._relay_requests -= 1
        try:
            status, detail = done.result()
        except Exception:  # noqa: BLE001 - a bug in the relay costs that one request, not the server
            log.exception("notice relay: %s %s failed", request.method, request.path)
            status, detail = 500, {"error": "the operator failed to answer; the sidecar tries again"}
        self._respond(conn, status, detail)

    def _respond(self, conn: _Connection, status: int, detail: dict[str, Any]) -> None:
        if conn.closed:
            return
        conn.reading = False
        conn.unsent = render(status, detail)
        conn.deadline = time.monotonic() + REQUEST_TIMEOUT_SECONDS
        self._send(conn)
        if not conn.closed:
            assert self._selector is not None
            with contextlib.suppress(KeyError):
                self._selector.unregister(conn.sock)
            self._selector.register(conn.sock, selectors.EVENT_WRITE, conn)

    def _send(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.unsent = conn.unsent[sent:]
        if not conn.unsent:
            self._close(conn)
