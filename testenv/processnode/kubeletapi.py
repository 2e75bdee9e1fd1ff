"""The kubelet's HTTPS endpoint of a process node: container logs, for ``kubectl logs``.

The apiserver answers ``GET pods/{name}/log`` by calling the pod's node at
``status.addresses`` (InternalIP 127.0.0.1 here) and
``status.daemonEndpoints.kubeletEndpoint.Port``:
``GET /containerLogs/{namespace}/{pod}/{container}``. Served here, per node, as
kubelet does: ``follow`` (until the run ends or the client goes), ``tailLines``,
``limitBytes`` and ``previous`` (the run before the current one). Not
emulated: ``timestamps``, ``sinceSeconds`` and ``sinceTime`` are ignored,
because the logs are plain files without a time per line.

With a client CA (``--client-ca-file``, set up by ``testenv.cluster`` together
with the apiserver's ``--kubelet-client-certificate``), only a client with a
certificate from that CA is served, as on a kubelet with x509 authentication.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlparse

from testenv.processnode.common import LOOPBACK, log

if TYPE_CHECKING:
    from testenv.processnode.roles import NodeRole, RunnerRole

FOLLOW_POLL_SECONDS = 0.2
MAX_TAIL_READ = 16 << 20  # tailLines looks at most this far back in a run's log


class LogError(Exception):
    """A log request that cannot be served: an HTTP status and kubelet's kind of message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class LogQuery:
    """The options of a ``containerLogs`` request that the process node honours."""

    follow: bool = False
    previous: bool = False
    tail_lines: int | None = None
    limit_bytes: int | None = None


def parse_log_path(path: str) -> tuple[str, str, str]:
    """``/containerLogs/{namespace}/{pod}/{container}`` -> (namespace, pod, container)."""
    parts = [unquote(p) for p in urlparse(path).path.split("/")]
    if len(parts) != 5 or parts[1] != "containerLogs" or not all(parts[2:]):
        raise LogError(404, f"no such endpoint {urlparse(path).path}")
    return parts[2], parts[3], parts[4]


def parse_log_query(path: str) -> LogQuery:
    """The query options kubectl sends, as the apiserver passes them on."""
    query = {k: v[-1] for k, v in parse_qs(urlparse(path).query).items()}

    def flag(name: str) -> bool:
        return query.get(name, "false").lower() in ("true", "1")

    def number(name: str) -> int | None:
        if name not in query:
            return None
        try:
            value = int(query[name])
        except ValueError:
            raise LogError(400, f"{name}: {query[name]!r} is not a number") from None
        if value < 0:
            raise LogError(400, f"{name}: must be 0 or more")
        return value

    return LogQuery(flag("follow"), flag("previous"), number("tailLines"), number("limitBytes"))


def tail_lines(data: bytes, lines: int) -> bytes:
    """The last ``lines`` lines of ``data`` (a last line without a newline counts)."""
    if lines == 0:
        return b""
    end = len(data) - 1 if data.endswith(b"\n") else len(data)
    start = end
    for _ in range(lines):
        start = data.rfind(b"\n", 0, start)
        if start < 0:
            return data
    return data[start + 1 :]


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A serving certificate for 127.0.0.1 (made once per state dir), as kubelet makes its own."""
    cert, key = directory / "kubelet.crt", directory / "kubelet.key"
    if not (cert.exists() and key.exists()):
        directory.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "365",
                "-subj",
                "/CN=processnode",
                "-addext",
                f"subjectAltName=IP:{LOOPBACK}",
                "-keyout",
                str(key),
                "-out",
                str(cert),
            ],
            check=True,
            capture_output=True,
        )
        key.chmod(0o600)
    return cert, key


@dataclass(frozen=True)
class LogRange:
    """A part of a container's log: ``start`` to ``end`` (None: to the end, and on with ``follow``)."""

    runner: RunnerRole
    container: Any  # pod.Container
    path: Path
    start: int
    end: int | None
    follow: bool


class KubeletServer:
    """One node's kubelet endpoint on 127.0.0.1 (a free port), over TLS."""

    def __init__(self, node: NodeRole, cert: Path, key: Path, client_ca: Path | None) -> None:
        self.node = node
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        if client_ca is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(client_ca)
        self._server = http.server.ThreadingHTTPServer((LOOPBACK, 0), _LogHandler, bind_and_activate=True)
        self._server.daemon_threads = True
        # The handshake happens in the handler's thread: a slow client does not hold up the others.
        self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True, do_handshake_on_connect=False)
        self._server.kubelet = self  # type: ignore[attr-defined]
        self.port: int = self._server.server_port
        self._stopped = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._server.serve_forever, name=f"kubelet {self.node.name}", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        self._server.shutdown()
        self._server.server_close()

    def container(self, namespace: str, pod: str, name: str) -> tuple[RunnerRole, Any]:
        """The runner of a pod on this node and one of its containers."""
        runner = self.node.agent.runner_of(self.node, namespace, pod)
        if runner is None:
            raise LogError(404, f'pod "{pod}" in namespace "{namespace}" not found on node "{self.node.name}"')
        for c in (*runner.init, *runner.main):
            if c.name == name:
                return runner, c
        raise LogError(404, f'container "{name}" in pod "{pod}" is not valid')

    def log_range(self, namespace: str, pod: str, name: str, query: LogQuery) -> LogRange:
        """Which part of which log a request asks for; LogError (before any answer) if there is none."""
        runner, c = self.container(namespace, pod, name)
        if query.previous:
            if c.prev_log_offset is None:
                raise LogError(400, f'previous terminated container "{name}" in pod "{pod}" not found')
            start, end = c.prev_log_offset, c.log_offset
            follow = False
        else:
            if c.started_at is None:
                reason = (c.state.get("waiting") or {}).get("reason", "ContainerCreating")
                raise LogError(400, f'container "{name}" in pod "{pod}" is waiting to start: {reason}')
            start, end, follow = c.log_offset, None, query.follow
        return LogRange(runner, c, runner.dir / f"{name}.log", start, end, follow)

    def write_log(self, out: Any, where: LogRange, query: LogQuery) -> None:
        """Write the requested part of a container's log to ``out``; with ``follow``, until the run ends."""
        runner, c, path, start, end = where.runner, where.container, where.path, where.start, where.end
        budget = query.limit_bytes
        with contextlib.ExitStack() as stack:
            f: Any = None
            offset, tailed = start, query.tail_lines is None
            while budget is None or budget > 0:
                if f is None:
                    with contextlib.suppress(FileNotFoundError):  # nothing printed yet
                        f = stack.enter_context(path.open("rb"))
                if f is not None and not tailed:
                    assert query.tail_lines is not None
                    stop = end if end is not None else os.fstat(f.fileno()).st_size
                    f.seek(max(start, stop - MAX_TAIL_READ))
                    budget = self._send(out, tail_lines(f.read(max(0, stop - f.tell())), query.tail_lines), budget)
                    offset, tailed = max(offset, stop), True
                    continue
                chunk = b""
                if f is not None:
                    f.seek(offset)
                    chunk = f.read(max(0, 65536 if end is None else min(65536, end - offset)))
                if chunk:
                    offset += len(chunk)
                    budget = self._send(out, chunk, budget)
                    continue
                running = c.proc is not None and c.log_offset == start  # a restart ends a follow
                if not where.follow or not running or self._stopped.is_set() or runner.closed:
                    break
                time.sleep(FOLLOW_POLL_SECONDS)

    @staticmethod
    def _send(out: Any, data: bytes, budget: int | None) -> int | None:
        if budget is not None:
            data = data[:budget]
            budget -= len(data)
        if data:
            out.write(data)
            out.flush()
        return budget


class _LogHandler(http.server.BaseHTTPRequestHandler):
    """``GET /containerLogs/...``; the body ends when the connection closes (HTTP/1.0)."""

    server: Any

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        kubelet: KubeletServer = self.server.kubelet
        try:
            namespace, pod, name = parse_log_path(self.path)
            query = parse_log_query(self.path)
            where = kubelet.log_range(namespace, pod, name, query)  # errors go before the 200
        except LogError as exc:
            self._error(exc)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLError):  # the client went
            kubelet.write_log(self.wfile, where, query)

    def _error(self, exc: LogError) -> None:
        body = f"{exc}\n".encode()
        self.send_response(exc.status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base class signature
        log.debug("kubelet: " + format, *args)
