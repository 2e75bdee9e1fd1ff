"""A fault-injecting HTTP proxy for the storage tests.

A small threaded HTTP/1.1 proxy on a free 127.0.0.1 port in front of an S3
endpoint (SeaweedFS in the tests). Clients talk to :attr:`FaultProxy.url`
instead of the store; rules added at runtime decide what happens to each
request:

- ``latency(seconds)``: forward after a pause;
- ``reset()``: read the request, then reset the connection (RST), nothing
  forwarded;
- ``status(503, "SlowDown")``: answer with an S3 error document, nothing
  forwarded;
- ``truncate(keep)``: forward, then send the response headers with the full
  ``Content-Length`` but only ``keep`` bytes of the body, and close;
- ``corrupt()``: flip one byte of the request body on the way to the store;
- ``hold()``: park the request and tell the test (:class:`Hold`); the test
  then forwards or drops it. Used to stop a client at an exact protocol stage;
- ``flood(size)``: answer 200 with ``size`` zero bytes, nothing forwarded (a
  store that sends gigabytes where a small object was asked for), announced
  in ``Content-Length`` or, with ``announce=False``, sent chunked without one.

Each rule can be limited to a method and a regular expression over the
request target (``/bucket/key?query``), to the next ``times`` matching
requests, and to a time window (``seconds``). The first live rule that
matches a request applies. Every request is logged (:attr:`FaultProxy.log`)
with what was done to it, so tests can assert which stage a fault hit.

SigV4 signatures stay valid: the ``Host`` header and the body are forwarded
unchanged (except with ``corrupt``, on purpose).

    with FaultProxy(store.endpoint_url) as proxy:
        proxy.add(status(503, "SlowDown"), method="PUT", times=3)
        ... open_storage(uri, endpoint_url=proxy.url, ...) ...
"""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "expect",
}
#: Request bodies up to this size are kept in the log (multi-object delete lists, manifests).
LOG_BODY_MAX = 64 << 10


# -- actions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """What a rule does to a request: ``kind`` and its parameters."""

    kind: str
    seconds: float = 0.0
    status: int = 0
    code: str = ""
    keep: int = 0


def latency(seconds: float) -> Action:
    """Forward the request after ``seconds``."""
    return Action("latency", seconds=seconds)


def reset() -> Action:
    """Reset the connection once the request has been read."""
    return Action("reset")


def status(code: int = 503, error: str = "SlowDown") -> Action:
    """Answer with HTTP ``code`` and an S3 error document naming ``error``."""
    return Action("status", status=code, code=error)


def truncate(keep: int = 0) -> Action:
    """Forward, then cut the response body after ``keep`` bytes and close."""
    return Action("truncate", keep=keep)


def corrupt() -> Action:
    """Flip one byte in the middle of the request body before forwarding."""
    return Action("corrupt")


def flood(size: int, *, announce: bool = True) -> Action:
    """Answer with ``size`` zero bytes (``Content-Length`` only with ``announce``); nothing forwarded."""
    return Action("flood", keep=size, code="announce" if announce else "")


def hold() -> Action:
    """Park the request until the test releases it (see :meth:`FaultProxy.hold`)."""
    return Action("hold")


# -- rules (pure) --------------------------------------------------------------------------


@dataclass
class Rule:
    """An action for matching requests, optionally limited in count and time."""

    action: Action
    method: str | None = None
    path: str | None = None
    times: int | None = None
    until: float | None = None
    skip: int = 0
    hits: int = 0

    def live(self, now: float) -> bool:
        """Whether the rule can still apply."""
        if self.until is not None and now >= self.until:
            return False
        return self.times is None or self.hits < self.times

    def matches(self, method: str, target: str) -> bool:
        """Whether a request (method, ``/bucket/key?query``) is one the rule is about."""
        if self.method is not None and method.upper() != self.method.upper():
            return False
        return self.path is None or re.search(self.path, target) is not None


def pick_rule(rules: list[Rule], method: str, target: str, now: float) -> Rule | None:
    """The first live rule matching the request, with its hit counted; None if none."""
    for rule in rules:
        if rule.live(now) and rule.matches(method, target):
            if rule.skip > 0:
                rule.skip -= 1  # let this one pass untouched
                continue
            rule.hits += 1
            return rule
    return None


def flip_middle_byte(body: bytes) -> bytes:
    """``body`` with its middle byte inverted (unchanged when empty)."""
    if not body:
        return body
    mid = len(body) // 2
    return body[:mid] + bytes([body[mid] ^ 0xFF]) + body[mid + 1 :]


def s3_error(code: str, status_code: int) -> bytes:
    """An S3 error document."""
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>injected by the fault proxy ({status_code})</Message></Error>"
    ).encode()


# -- log -----------------------------------------------------------------------------------


@dataclass
class Record:
    """One request seen by the proxy."""

    when: float
    method: str
    target: str
    fault: str | None
    status: int | None = None
    body: bytes | None = None

    @property
    def key(self) -> str:
        """The object key (path after the bucket), without the query."""
        path = self.target.split("?", 1)[0]
        parts = path.lstrip("/").split("/", 1)
        return parts[1] if len(parts) > 1 else ""

    @property
    def query(self) -> str:
        """The query string ("" when none)."""
        return self.target.split("?", 1)[1] if "?" in self.target else ""


@dataclass
class Hold:
    """A request parked by a ``hold`` rule: :attr:`arrived` is set when it comes;
    :meth:`release` lets it go on (``forward=True``) or resets it."""

    rule: Rule
    arrived: threading.Event = field(default_factory=threading.Event)
    record: Record | None = None
    _released: threading.Event = field(default_factory=threading.Event)
    _forward: bool = False

    def wait(self, timeout: float) -> bool:
        """Wait for a request to be parked; whether one was."""
        return self.arrived.wait(timeout)

    def release(self, forward: bool = False) -> None:
        """Forward the parked request, or (default) reset its connection."""
        self._forward = forward
        self._released.set()


# -- the proxy -----------------------------------------------------------------------------


class FaultProxy:
    """A programmable fault-injecting proxy in front of ``upstream`` (``http://host:port``)."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://HOST:PORT, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._holds: dict[int, Hold] = {}
        self.log: list[Record] = []
        self._server = _Server((host, port), _Handler)
        self._server.proxy = self
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Where clients connect: ``http://127.0.0.1:PORT``."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultProxy:
        """Serve in a daemon thread."""
        self._thread = threading.Thread(target=self._server.serve_forever, name="faultproxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; parked requests are reset."""
        with self._lock:
            for h in self._holds.values():
                h.release(forward=False)
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- programming ---------------------------------------------------------------------
    def add(
        self,
        action: Action,
        *,
        method: str | None = None,
        path: str | None = None,
        times: int | None = None,
        seconds: float | None = None,
        skip: int = 0,
    ) -> Rule:
        """Apply ``action`` to matching requests (``path``: regex over ``/bucket/key?query``),
        for the next ``times`` of them and/or for ``seconds`` from now, after letting
        the first ``skip`` pass. Rules added first take precedence."""
        until = None if seconds is None else time.monotonic() + seconds
        rule = Rule(action, method, path, times, until, skip)
        with self._lock:
            self._rules.append(rule)
        return rule

    def hold(self, *, method: str | None = None, path: str | None = None, skip: int = 0) -> Hold:
        """Park the next matching request (after ``skip`` of them); see :class:`Hold`."""
        rule = self.add(hold(), method=method, path=path, times=1, skip=skip)
        h = Hold(rule)
        with self._lock:
            self._holds[id(rule)] = h
        return h

    def remove(self, rule: Rule) -> None:
        """Drop one rule."""
        with self._lock, contextlib.suppress(ValueError):
            self._rules.remove(rule)

    def clear(self) -> None:
        """Drop every rule (parked requests stay parked until released)."""
        with self._lock:
            self._rules.clear()

    def requests(self, method: str | None = None, path: str | None = None) -> list[Record]:
        """Logged requests, optionally filtered like a rule."""
        probe = Rule(Action("log"), method, path)
        with self._lock:
            return [r for r in self.log if probe.matches(r.method, r.target)]

    def faults(self) -> list[Record]:
        """Logged requests a rule acted on."""
        with self._lock:
            return [r for r in self.log if r.fault is not None]

    # -- used by the handler -------------------------------------------------------------
    def _decide(self, method: str, target: str, body: bytes) -> tuple[Rule | None, Record]:
        with self._lock:
            rule = pick_rule(self._rules, method, target, time.monotonic())
            keep = body if (len(body) <= LOG_BODY_MAX and method in ("POST", "PUT")) else None
            record = Record(time.time(), method, target, rule.action.kind if rule else None, body=keep)
            self.log.append(record)
            held = self._holds.get(id(rule)) if rule is not None else None
        if held is not None:
            held.record = record
        return rule, record

    def _hold_for(self, rule: Rule) -> Hold | None:
        with self._lock:
            return self._holds.get(id(rule))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that vanish mid-request (killed on purpose by crash trials) are normal here.
        import sys

        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # the proxy's own log is FaultProxy.log

    # Every method goes through one path.
    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self._proxy()

    do_PUT = do_POST = do_HEAD = do_DELETE = do_GET  # noqa: N815

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is not None:
            return self.rfile.read(int(length)) if int(length) else b""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return b""

    def _reset(self) -> None:
        """Abort the client connection with an RST."""
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.close()

    def _proxy(self) -> None:
        proxy = self.server.proxy
        body = self._read_body()
        rule, record = proxy._decide(self.command, self.path, body)  # noqa: SLF001 - our own class
        kind = rule.action.kind if rule is not None else None
        if rule is not None and kind == "hold":
            parked = proxy._hold_for(rule)  # noqa: SLF001
            if parked is not None:
                parked.arrived.set()
                parked._released.wait()  # noqa: SLF001
                if not parked._forward:  # noqa: SLF001
                    self._reset()
                    return
        elif rule is not None and kind == "latency":
            time.sleep(rule.action.seconds)
        elif rule is not None and kind == "reset":
            self._reset()
            return
        elif rule is not None and kind == "status":
            doc = s3_error(rule.action.code, rule.action.status)
            record.status = rule.action.status
            self.send_response(rule.action.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(doc) if self.command != "HEAD" else 0))
            if rule.action.status == 503:
                self.send_header("Retry-After", "1")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(doc)
            return
        elif rule is not None and kind == "flood":
            record.status = 200
            self._flood(rule.action.keep, rule.action.code == "announce")
            return
        elif rule is not None and kind == "corrupt":
            body = flip_middle_byte(body)
        try:
            status_code, reason, headers, data = self._forward(body)
        except OSError:
            # The store is down or dropped us: so does the proxy, as a network would.
            record.status = None
            self._drop_upstream()
            self._reset()
            return
        record.status = status_code
        self.send_response(status_code, reason)
        length = str(len(data))
        for name, value in headers:
            if name.lower() == "content-length" and self.command == "HEAD":
                length = value  # a HEAD answer has no body but tells the object's size
            elif name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command == "HEAD":
            return
        if kind == "truncate":
            with contextlib.suppress(OSError):
                self.wfile.write(data[: rule.action.keep] if rule else data)
                self.wfile.flush()
            self._reset()
            return
        self.wfile.write(data)

    def _flood(self, size: int, announce: bool) -> None:
        """Send ``size`` zero bytes as a 200 answer, until done or the client goes away."""
        self.send_response(200)
        self.send_header("ETag", '"flood"')
        self.send_header("Content-Type", "application/octet-stream")
        if announce:
            self.send_header("Content-Length", str(size))
        else:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        piece = bytes(1 << 20)
        sent = 0
        with contextlib.suppress(OSError):
            while sent < size:
                n = min(len(piece), size - sent)
                self.wfile.write(piece[:n] if announce else b"%x\r\n%s\r\n" % (n, piece[:n]))
                sent += n
            if not announce:
                self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        if self._upstream is None:
            self._upstream = http.client.HTTPConnection(*self.server.proxy.upstream, timeout=120)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        conn = self._upstream
        conn.request(self.command, self.path, body=body or None, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        if resp.will_close:
            self._drop_upstream()
        return resp.status, resp.reason, resp.getheaders(), data

    def _drop_upstream(self) -> None:
        if self._upstream is not None:
            with contextlib.suppress(OSError):
                self._upstream.close()
            self._upstream = None

    def finish(self) -> None:
        self._drop_upstream()
        with contextlib.suppress(OSError):
            super().finish()


@contextlib.contextmanager
def running(upstream: str) -> Iterator[FaultProxy]:
    """A started proxy in front of ``upstream``, stopped on exit."""
    proxy = FaultProxy(upstream).start()
    try:
        yield proxy
    finally:
        proxy.stop()
