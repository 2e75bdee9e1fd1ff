"""A TCP link to a server that can go silent the way a dead network path does.

:class:`SilentLink` listens on a free 127.0.0.1 port and forwards each
connection to ``upstream`` (the test apiserver, TLS and all: bytes are passed
as they are). :meth:`SilentLink.silence` makes every connection open then, and
every one accepted while silent, a dead one for good: what the client sends is
read and dropped, nothing comes back, and the connection is neither closed nor
reset. That is what a client sees of a half-open connection after a network
fault, or of an apiserver restarted behind a load balancer that kept the
client's side: only a timeout of its own ends such a request.
:meth:`SilentLink.speak` ends the silence for the connections made from then
on; the dead ones stay dead until the client gives up on them.

    with SilentLink(("127.0.0.1", api_port)) as link:
        ... a client of link.port ...
        link.silence(); ...; link.speak()
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


class _Conn:
    """One client connection and, while it lives, its upstream one."""

    def __init__(self, client: socket.socket, upstream: socket.socket | None) -> None:
        self.client, self.upstream = client, upstream
        self.dead = upstream is None

    def close(self) -> None:
        for s in (self.client, self.upstream):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()


class SilentLink:
    """A forwarder on 127.0.0.1 to ``upstream`` whose connections can be made dead (module docstring)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
        self._silent = False
        self._closed = False
        #: Connections accepted while silent (each is dead from its start).
        self.accepted_silent = 0
        self._thread = threading.Thread(target=self._accept, name="silentlink", daemon=True)

    def start(self) -> SilentLink:
        self._thread.start()
        return self

    def silence(self) -> None:
        """Every open connection, and every one accepted from now on, is dead for good."""
        with self._lock:
            self._silent = True
            for c in self._conns:
                c.dead = True

    def speak(self) -> None:
        """Connections accepted from now on are forwarded again."""
        with self._lock:
            self._silent = False

    def stop(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        with contextlib.suppress(OSError):
            self._listener.close()
        for c in conns:
            c.close()

    def __enter__(self) -> SilentLink:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # stopped
            with self._lock:
                silent = self._silent
            upstream = None
            if not silent:
                try:
                    upstream = socket.create_connection(self.upstream, timeout=10)
                    upstream.settimeout(None)
                except OSError:
                    client.close()
                    continue
            conn = _Conn(client, upstream)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if silent:
                    self.accepted_silent += 1
                self._conns.append(conn)
            threading.Thread(target=self._pump, args=(conn, client, upstream), daemon=True).start()
            if upstream is not None:
                threading.Thread(target=self._pump, args=(conn, upstream, client), daemon=True).start()

    def _pump(self, conn: _Conn, src: socket.socket, dst: socket.socket | None) -> None:
        """Copy ``src`` to ``dst`` while the connection lives; once dead, read and drop (never close)."""
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if not conn.dead and dst is not None:
                    dst.sendall(data)
        except OSError:
            pass
        if not conn.dead and dst is not None:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
