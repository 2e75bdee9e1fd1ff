"""Cluster DNS for real nodes' pods: the stable names of pods with a ``hostname`` and a ``subdomain``.

A multi-node TrainingJob's pods get ``hostname: <job>-<i>`` and ``subdomain:
<service>`` with a headless Service of that name, and torchrun meets at
``<job>-0.<service>.<ns>.svc.cluster.local``. There is no CoreDNS here, and the
Endpoints controller refuses pod IPs in 127.0.0.0/8, so the records come from
the pods themselves, as the Kubernetes DNS spec defines them:

- ``<hostname>.<subdomain>.<ns>.svc.<domain>`` -> the pod's IP, for a pod with
  both fields set in a namespace with a headless Service named ``<subdomain>``
  that selects it (a Service without ``publishNotReadyAddresses`` only once
  the pod is Ready);
- ``<service>.<ns>.svc.<domain>`` -> the IPs of every such pod of a headless Service.

Other names in the cluster domain are NXDOMAIN; names outside it are REFUSED:
nothing is forwarded, nothing leaves the machine. :class:`ClusterDns`
(``python -m testenv.realnode.dns``, a service of the set's supervisor like
the host proxy, stopped with it) answers on UDP and TCP port 53 of the set's
bridge gateway, which every node's kubelet names as ``clusterDNS``
(:func:`testenv.realnode.config.kubelet_config`), so a pod's
``/etc/resolv.conf`` points there. Pods and Services are listed from the
apiserver at most every :data:`MAX_AGE` seconds, when a query comes.

The packet functions are pure (standard library only) and unit-tested.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testenv.cluster import Service, Supervisor, wait_until
from testenv.realnode.config import CLUSTER_DOMAIN

log = logging.getLogger("realnode.dns")

DOMAIN = CLUSTER_DOMAIN
PORT = 53
#: Seconds a listing of pods and Services answers queries (a pod's name resolves at most this long after its IP).
MAX_AGE = 1.0
#: The answers' TTL: short, since a pod's IP changes when the operator replaces it.
TTL = 5

TYPE_A, TYPE_ANY, CLASS_IN = 1, 255, 1
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
_HEADER = struct.Struct("!HHHHHH")

Records = dict[str, tuple[str, ...]]


class FormatError(ValueError):
    """A packet that is not a DNS query this server can read."""


@dataclass(frozen=True)
class Query:
    """The header and the (first) question of a query; ``question`` is its wire form, echoed back."""

    id: int
    flags: int
    name: str  # lower case, no trailing dot
    qtype: int
    qclass: int
    question: bytes


def encode_name(name: str) -> bytes:
    """A name's wire form: length-prefixed labels, then the root's empty label."""
    out = b""
    for label in name.rstrip(".").split(".") if name.strip(".") else []:
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise ValueError(f"bad DNS label {label!r} in {name!r}")
        out += bytes([len(raw)]) + raw
    return out + b"\0"


def encode_query(name: str, qtype: int = TYPE_A, query_id: int = 0) -> bytes:
    """A recursive query for ``name`` (what a stub resolver sends)."""
    return _HEADER.pack(query_id, 0x0100, 1, 0, 0, 0) + encode_name(name) + struct.pack("!HH", qtype, CLASS_IN)


def parse_query(data: bytes) -> Query:
    """The query in ``data``; FormatError for anything else (a response, no question, a broken name)."""
    if len(data) < _HEADER.size:
        raise FormatError("shorter than a DNS header")
    query_id, flags, qdcount, _an, _ns, _ar = _HEADER.unpack_from(data)
    if flags & 0x8000:
        raise FormatError("a response, not a query")
    if qdcount < 1:
        raise FormatError("no question")
    labels, pos = [], _HEADER.size
    while True:
        if pos >= len(data):
            raise FormatError("name runs past the packet")
        length = data[pos]
        pos += 1
        if length == 0:
            break
        if length >= 64:  # a compression pointer has no place in a question's first name
            raise FormatError("compressed or bad label in the question")
        if pos + length > len(data):
            raise FormatError("label runs past the packet")
        labels.append(data[pos : pos + length].decode("ascii", "replace").lower())
        pos += length
    if pos + 4 > len(data):
        raise FormatError("question without type and class")
    qtype, qclass = struct.unpack_from("!HH", data, pos)
    return Query(query_id, flags, ".".join(labels), qtype, qclass, data[_HEADER.size : pos + 4])


def encode_response(query: Query, rcode: int, addresses: Sequence[str] = (), ttl: int = TTL) -> bytes:
    """The answer to ``query``: ``rcode`` and an A record per address (authoritative unless REFUSED)."""
    flags = 0x8000 | (query.flags & 0x7900) | rcode  # QR, the query's opcode and RD
    if rcode != REFUSED:
        flags |= 0x0400  # AA: this server is the cluster domain's authority
    out = _HEADER.pack(query.id, flags, 1, len(addresses), 0, 0) + query.question
    for address in addresses:
        # The name: a pointer to the question's (at offset 12).
        out += struct.pack("!HHHIH", 0xC000 | _HEADER.size, TYPE_A, CLASS_IN, ttl, 4) + socket.inet_aton(address)
    return out


def parse_response(data: bytes) -> tuple[int, list[str]]:
    """The rcode and A addresses of a response to :func:`encode_query` (for checks and tests)."""
    _id, flags, qdcount, ancount, _ns, _ar = _HEADER.unpack_from(data)
    pos = _HEADER.size
    for _ in range(qdcount):
        while data[pos]:
            pos += 1 + data[pos]
        pos += 5
    addresses = []
    for _ in range(ancount):
        pos += 2 if data[pos] >= 0xC0 else data.index(b"\0", pos) + 1 - pos
        rtype, _cls, _ttl, length = struct.unpack_from("!HHIH", data, pos)
        pos += 10
        if rtype == TYPE_A and length == 4:
            addresses.append(socket.inet_ntoa(data[pos : pos + 4]))
        pos += length
    return flags & 0xF, addresses


def answer(query: Query, records: Records, domain: str = DOMAIN) -> bytes:
    """The response to ``query`` from ``records`` (:func:`records`)."""
    if (query.flags >> 11) & 0xF:
        return encode_response(query, NOTIMP)
    if query.name != domain and not query.name.endswith("." + domain):
        return encode_response(query, REFUSED)  # nothing is forwarded
    if query.name not in records:
        return encode_response(query, NXDOMAIN)
    # A name that exists has no other types: NOERROR without answers (what a resolver asking AAAA expects).
    wanted = query.qclass == CLASS_IN and query.qtype in (TYPE_A, TYPE_ANY)
    return encode_response(query, NOERROR, records[query.name] if wanted else ())


def _selects(service: dict[str, Any], pod: dict[str, Any]) -> bool:
    selector = service.get("spec", {}).get("selector") or {}
    labels = pod.get("metadata", {}).get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in pod["status"].get("conditions", []))


def records(pods: list[dict[str, Any]], services: list[dict[str, Any]], domain: str = DOMAIN) -> Records:
    """The names of the Kubernetes DNS spec for headless Services and their pods (see the module docstring).
    Every suffix of a name is a name too (a resolver walking down gets NOERROR, not NXDOMAIN)."""
    headless = {
        (s["metadata"]["namespace"], s["metadata"]["name"]): s
        for s in services
        if s.get("spec", {}).get("clusterIP") == "None"
    }
    found: dict[str, list[str]] = {}
    for pod in pods:
        meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
        ip = status.get("podIP")
        if not ip or meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
            continue
        ns = meta.get("namespace", "")
        for (svc_ns, svc_name), svc in headless.items():
            if svc_ns != ns or not _selects(svc, pod):
                continue
            if not svc["spec"].get("publishNotReadyAddresses") and not _ready(pod):
                continue
            service_name = f"{svc_name}.{ns}.svc.{domain}"
            found.setdefault(service_name, []).append(ip)
            if spec.get("hostname") and spec.get("subdomain") == svc_name:
                found.setdefault(f"{spec['hostname']}.{service_name}", []).append(ip)
    out: Records = {name: tuple(sorted(set(ips))) for name, ips in found.items()}
    out.setdefault(domain, ())
    out.setdefault(f"svc.{domain}", ())
    for name in list(out):
        labels = name.split(".")
        for i in range(1, len(labels) - domain.count(".")):
            out.setdefault(".".join(labels[i:]), ())
    return out


class ClusterDns:
    """The records, listed from the apiserver when a query finds them older than :data:`MAX_AGE`."""

    def __init__(
        self,
        list_objects: Callable[[], tuple[list[dict[str, Any]], list[dict[str, Any]]]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.list_objects, self.clock = list_objects, clock
        self.lock = threading.Lock()
        self.records: Records | None = None
        self.listed = 0.0

    def current(self) -> Records | None:
        with self.lock:
            if self.records is None or self.clock() - self.listed > MAX_AGE:
                try:
                    self.records = records(*self.list_objects())
                    self.listed = self.clock()
                except Exception as exc:  # noqa: BLE001 - any failure of the apiserver: answer from the last listing
                    log.warning("listing pods and services failed: %s", exc)
            return self.records

    def respond(self, data: bytes) -> bytes | None:
        try:
            query = parse_query(data)
        except FormatError as exc:
            log.info("unreadable query: %s", exc)
            return None
        current = self.current()
        if current is None:
            return encode_response(query, SERVFAIL)
        reply = answer(query, current)
        log.info("%s type %d -> %s", query.name, query.qtype, parse_response(reply))
        return reply


def kube_lister(kubeconfig: Path) -> Callable[[], tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    from testenv.processnode.api import Kube  # the kubernetes client: only in the server's process

    kube = Kube(kubeconfig)

    def list_objects() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return kube.get("/api/v1/pods")["items"], kube.get("/api/v1/services")["items"]

    return list_objects


def serve(dns: ClusterDns, address: str, port: int, stop: threading.Event) -> None:
    """Answer on UDP and TCP ``address:port`` until ``stop``."""

    class Udp(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            data, sock = self.request
            reply = dns.respond(data)
            if reply is not None:
                sock.sendto(reply, self.client_address)

    class Tcp(socketserver.StreamRequestHandler):
        timeout = 10

        def handle(self) -> None:
            while head := self.rfile.read(2):
                (length,) = struct.unpack("!H", head)
                reply = dns.respond(self.rfile.read(length))
                if reply is None:
                    return
                self.wfile.write(struct.pack("!H", len(reply)) + reply)

    socketserver.ThreadingUDPServer.allow_reuse_address = True
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    servers: list[socketserver.BaseServer] = [
        socketserver.ThreadingUDPServer((address, port), Udp),
        socketserver.ThreadingTCPServer((address, port), Tcp),
    ]
    for server in servers:
        server.daemon_threads = True  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, args=(0.5,), daemon=True).start()
    log.info("cluster DNS for %s on %s:%d", DOMAIN, address, port)
    stop.wait()
    for server in servers:
        server.shutdown()
        server.server_close()


def lookup(address: str, name: str, port: int = PORT, timeout: float = 2.0) -> tuple[int, list[str]]:
    """Ask the server at ``address`` for ``name``'s A records over UDP: (rcode, addresses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.sendto(encode_query(name, query_id=0x5347), (address, port))
        return parse_response(sock.recv(4096))


def start_dns(sup: Supervisor, gateway: str, kubeconfig: Path) -> Service:
    """Start the set's cluster DNS under ``sup`` and wait until it answers on the gateway."""
    argv = [sys.executable, "-m", "testenv.realnode.dns", "--address", gateway, "--kubeconfig", str(kubeconfig)]
    root = str(Path(__file__).resolve().parents[2])
    svc = sup.start(f"dns-{gateway}", argv, extra_env={"PYTHONPATH": root}, stop_timeout=5.0)

    def answers() -> bool:
        try:
            return lookup(gateway, DOMAIN, timeout=0.5)[0] == NOERROR
        except OSError:
            return False

    wait_until(answers, 30, "the cluster DNS", svc)
    return svc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testenv.realnode.dns", description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the set's bridge gateway address")
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--kubeconfig", required=True, type=Path, help="read pods and Services with it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    serve(ClusterDns(kube_lister(args.kubeconfig)), args.address, args.port, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
