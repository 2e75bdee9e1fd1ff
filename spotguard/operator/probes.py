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
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from types import TracebackType
from typing import Any, Protocol
from urllib.parse import urlsplit

from spotguard.operator.leader import StandbyLiveness

READY_PATH = "/readyz"
#: How long kopf's event loop may take to run a no-op before it counts as hung.
LOOP_TIMEOUT_SECONDS = 5.0
#: How long the server waits for a request's bytes.
REQUEST_TIMEOUT_SECONDS = 10.0

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


class ProbeServer:
    """``/healthz`` (the path of ``url``) and ``/readyz`` on ``url``'s address and port, in a thread;
    and the notice relay's paths when ``relay`` is given.

    ``url`` None or empty: no probes at all (``--liveness ''``), and no relay.
    """

    def __init__(self, url: str | None, health: Health, relay: Relay | None = None) -> None:
        self.url = url
        self.health = health
        self.relay = relay
        self.server: http.server.ThreadingHTTPServer | None = None

    def __enter__(self) -> ProbeServer:
        if not self.url:
            return self
        parts = urlsplit(self.url)
        answers = {parts.path or "/": self.health.live, READY_PATH: self.health.ready}
        relay = self.relay

        class Handler(http.server.BaseHTTPRequestHandler):
            # A client that sends nothing does not hold a thread for ever.
            timeout = REQUEST_TIMEOUT_SECONDS

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self._relayed("GET"):
                    return
                answer = answers.get(urlsplit(self.path).path)
                if answer is None:
                    self.send_error(404)
                    return
                ok, detail = answer()
                self._json(200 if ok else 503, detail)

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                if not self._relayed("POST"):
                    self.send_error(404)

            def _relayed(self, method: str) -> bool:
                """Answer a request for the notice relay; False when it is not one."""
                if relay is None:
                    return False
                path = urlsplit(self.path).path
                if not relay.serves(path):
                    return False
                body = b""
                if method == "POST":
                    try:
                        length = int(self.headers.get("Content-Length") or 0)
                    except ValueError:
                        length = -1
                    if length < 0 or length > relay.max_body:
                        self._json(413, {"error": f"send at most {relay.max_body} bytes, with a Content-Length"})
                        return True
                    body = self.rfile.read(length)
                self._json(*relay.handle(method, path, self.headers.get("Authorization"), body))
                return True

            def _json(self, status: int, detail: dict[str, Any]) -> None:
                body = json.dumps(detail).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base class signature
                pass

        self.server = http.server.ThreadingHTTPServer((parts.hostname or "0.0.0.0", parts.port or 80), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="probes", daemon=True).start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
