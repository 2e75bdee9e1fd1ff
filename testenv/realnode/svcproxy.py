"""The apiserver's way into the cluster network: an HTTP CONNECT proxy, its ``cluster`` egress.

The apiserver calls an admission webhook through the webhook's Service: by
default (kube-apiserver 1.20, without ``--enable-aggregator-routing``) it
dials ``https://<clusterIP>:<port>``, as a cluster's kube-proxy would route it.
The test world has no kube-proxy, its service range (``10.0.0.0/24``) is not on
this machine, and the Endpoints controller refuses the pods' loopback-range
IPs (so the Endpoints-based resolver finds none either). What a managed
cluster does for an apiserver outside the cluster network (the Konnectivity
proxy) is done here instead: the apiserver's egress selector
(``--egress-selector-config-file``, :func:`testenv.cluster.egress_selector_config`)
sends its ``cluster`` traffic (webhooks called by Service, the kubelets' logs
and exec, the ``proxy`` subresources) through this proxy, which

- resolves a Service's ClusterIP and port as kube-proxy does: to a pod the
  Service's selector takes, Ready and not terminating, at the target port
  (named ports through the pod's container ports), listed from the apiserver
  at each connection (:func:`backends`; the Endpoints object is not used);
- connects any other destination inside 127.0.0.0/8 (a kubelet, a pod IP of
  the process or real nodes) as it is;
- refuses everything else (403): no connection leaves the machine's loopback.

No address, route or rule is added anywhere: the apiserver dials this proxy
on a unix socket (1.20's egress over TCP always speaks TLS), the proxy dials
loopback addresses (real nodes' pod IPs are
reachable from the host over their set's bridge). It is a service of the
control plane's supervisor, started before the apiserver and stopped after
it (:func:`testenv.cluster.start_control_plane`), for every test world.

    python -m testenv.realnode.svcproxy --socket S --kubeconfig K
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import signal
import socket
import socketserver
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from testenv.processnode.podnet import forward_both_ways  # the process nodes' forwarding, byte for byte
from testenv.realnode.dns import _ready, _selects  # the Endpoints controller's choice, as cluster DNS makes it

log = logging.getLogger("realnode.svcproxy")

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
#: The most a CONNECT request's head may hold.
MAX_HEAD = 8192
ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"

Lister = Callable[[], tuple[list[dict[str, Any]], list[dict[str, Any]]]]


class Refused(Exception):
    """A CONNECT this proxy does not make: ``status`` and ``reason`` are its HTTP answer."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status} {reason}")
        self.status, self.reason = status, reason


def parse_connect(head: bytes) -> tuple[str, int]:
    """Pure: the ``(host, port)`` of a CONNECT request's head (up to its blank line); Refused otherwise."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split()
    if len(parts) != 3 or parts[0] != "CONNECT" or not parts[2].startswith("HTTP/1."):
        raise Refused(405, "only CONNECT")
    host, sep, port = parts[1].rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise Refused(400, f"bad target {parts[1]!r}")
    return host, int(port)


def _target_port(port: dict[str, Any], pod: dict[str, Any]) -> int | None:
    """A Service port's target on ``pod``: a number, or the container port of that name (None: the pod has
    no such port, and the Endpoints controller would leave it out)."""
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    for container in pod.get("spec", {}).get("containers", []):
        for cp in container.get("ports") or []:
            if cp.get("name") == target and cp.get("protocol", "TCP") == "TCP":
                return int(cp["containerPort"])
    return None


def backends(services: list[dict[str, Any]], pods: list[dict[str, Any]], ip: str, port: int) -> list[tuple[str, int]]:
    """Pure: where a connection to the ClusterIP ``ip`` at ``port`` goes: ``(pod IP, target port)`` of each
    pod the Service selects that is Ready, running and not terminating. Refused (404) for an address no
    Service holds or a port it does not serve."""
    for svc in services:
        spec = svc.get("spec", {})
        if ip not in {spec.get("clusterIP"), *(spec.get("clusterIPs") or [])}:
            continue
        name = f"{svc['metadata'].get('namespace')}/{svc['metadata']['name']}"
        ports = [p for p in spec.get("ports") or [] if p.get("port") == port and p.get("protocol", "TCP") == "TCP"]
        if not ports:
            raise Refused(404, f"service {name} has no TCP port {port}")
        found = []
        for pod in pods:
            meta, status = pod.get("metadata", {}), pod.get("status", {})
            if meta.get("namespace") != svc["metadata"].get("namespace") or not _selects(svc, pod):
                continue
            if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
                continue
            if not spec.get("publishNotReadyAddresses") and not _ready(pod):
                continue
            target = _target_port(ports[0], pod)
            if target is not None:
                found.append((str(status["podIP"]), target))
        return sorted(found)
    raise Refused(404, f"no service holds {ip}")


def route(host: str, port: int, lister: Lister) -> list[tuple[str, int]]:
    """Where a CONNECT to ``host:port`` goes, in the order to try: a loopback address as it is, a ClusterIP
    to its Service's pods; Refused for anything else (nothing leaves the machine)."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise Refused(403, f"{host} is not an address (names are not resolved here)") from None
    if addr in LOOPBACK:
        return [(host, port)]
    services, pods = lister()
    found = backends(services, pods, host, port)
    if not found:
        raise Refused(503, f"no ready pod behind {host}:{port}")
    return found


def kube_lister(kubeconfig: Path) -> Lister:
    """Services and pods from the apiserver (its client made at the first call: the kubeconfig is written
    once the apiserver is up, after this proxy started)."""
    kube: Any = None
    lock = threading.Lock()

    def list_objects() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        nonlocal kube
        with lock:
            if kube is None:
                from testenv.processnode.api import Kube  # the kubernetes client: only in the proxy's process

                kube = Kube(kubeconfig)
        return kube.get("/api/v1/services")["items"], kube.get("/api/v1/pods")["items"]

    return list_objects


def _read_head(conn: socket.socket) -> bytes:
    """The request's head; empty when the client closed without a word (a check that the proxy listens)."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = conn.recv(1024)
        if not chunk and not head:
            return b""
        if not chunk:
            raise Refused(400, "closed before the request's end")
        head += chunk
        if len(head) > MAX_HEAD:
            raise Refused(431, "request head too large")
    end = head.index(b"\r\n\r\n") + 4
    if head[end:]:  # the client speaks (TLS) only after our answer
        raise Refused(400, "data before the tunnel was established")
    return head


def _answer(conn: socket.socket, exc: Refused) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(f"HTTP/1.1 {exc.status} {exc.reason}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())


def handle(conn: socket.socket, lister: Lister) -> None:
    """One CONNECT: answered 200 and joined to its destination, or refused with why."""
    conn.settimeout(30)
    try:
        head = _read_head(conn)
        if not head:
            conn.close()
            return
        host, port = parse_connect(head)
        targets = route(host, port, lister)
    except Refused as exc:
        log.warning("refused: %s", exc)
        _answer(conn, exc)
        conn.close()
        return
    except OSError as exc:  # the client went, or listing from the apiserver failed
        log.warning("CONNECT failed: %s", exc)
        _answer(conn, Refused(502, "no route"))
        conn.close()
        return
    upstream = None
    for target in targets:
        try:
            upstream = socket.create_connection(target, timeout=10)
            break
        except OSError as exc:
            log.info("%s:%d -> %s:%d: %s", host, port, *target, exc)
    if upstream is None:
        _answer(conn, Refused(502, f"no pod behind {host}:{port} answered"))
        conn.close()
        return
    if (host, port) != targets[0] or len(targets) > 1:
        log.info("%s:%d -> %s:%d", host, port, *upstream.getpeername())
    try:
        conn.sendall(ESTABLISHED)
    except OSError:  # the apiserver gave up meanwhile (its dial timed out)
        for s in (conn, upstream):
            s.close()
        return
    for s in (conn, upstream):
        s.settimeout(None)
    forward_both_ways(conn, upstream)


def serve(path: Path, lister: Lister, stop: threading.Event) -> None:
    """Accept CONNECTs on the unix socket ``path`` until ``stop``; the socket is removed then."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            handle(self.request, lister)

        def finish(self) -> None:  # handle() closes (or resets) the connection itself
            pass

    class Server(socketserver.ThreadingUnixStreamServer):
        daemon_threads = True

        def shutdown_request(self, request: Any) -> None:  # the handler owns the socket
            pass

    path.unlink(missing_ok=True)  # a run that was killed left it
    try:
        with Server(str(path), Handler) as server:
            threading.Thread(target=server.serve_forever, args=(0.5,), daemon=True).start()
            log.info("cluster egress on %s", path)
            stop.wait()
            server.shutdown()
    finally:
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testenv.realnode.svcproxy", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, type=Path, help="where the apiserver's egress selector dials")
    parser.add_argument("--kubeconfig", required=True, type=Path, help="lists Services and pods with it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    serve(args.socket, kube_lister(args.kubeconfig), stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
