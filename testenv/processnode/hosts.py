"""Per-pod ``/etc/hosts`` files: the pod's own names, and a stand-in for cluster DNS (and kube-proxy).

Kubelet writes one hosts file per pod and bind-mounts it into every container;
the process node does the same. The test world has no cluster DNS, so the
file also carries what CoreDNS would answer for headless Services: every pod
on the cluster with ``spec.hostname`` H, ``spec.subdomain`` S and a pod IP,
in namespace NS, is ``H.S.NS.svc.cluster.local`` and ``H.S.NS.svc``, and
inside NS also ``H.S``. A name appears as soon as its pod has an IP and until
the pod has ended or is gone (``publishNotReadyAddresses`` semantics).

Nor is there a kube-proxy: a Service's ClusterIP leads nowhere here. So a
Service SVC in namespace NS with a ready endpoint is ``SVC.NS.svc.cluster.local``
and ``SVC.NS.svc``, and inside NS also ``SVC``, at the pod IP of one ready
endpoint (the lowest): what DNS and kube-proxy together give a client, without
the port translation, so a client reaches it only where the Service's port is
its target port (the chart's notice relay port is). No ready endpoint, no name.
The endpoints are read from EndpointSlices, as kube-proxy reads them (the
endpoint slice controller keeps them; ``discovery.k8s.io/v1``, or ``v1beta1``
on 1.20): the older Endpoints objects cannot carry these pods at all, their
validation refuses the loopback range that process-node pod IPs come from.

The agent watches every pod and every EndpointSlice of the cluster and
rewrites the files *in place* (a rename would leave the containers' bind
mounts on the old file).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from testenv.processnode.common import JSON

CLUSTER_DOMAIN = "cluster.local"
HEADER = "# Kubernetes-managed hosts file (process node).\n"
LOCALHOST = (
    "127.0.0.1\tlocalhost\n"
    "::1\tlocalhost ip6-localhost ip6-loopback\n"
    "fe00::0\tip6-localnet\n"
    "fe00::0\tip6-mcastprefix\n"
    "fe00::1\tip6-allnodes\n"
    "fe00::2\tip6-allrouters\n"
)


@dataclass(frozen=True)
class Peer:
    """A pod that a headless Service's DNS would name."""

    namespace: str
    hostname: str
    subdomain: str
    ip: str
    created: str
    deleting: bool

    def names(self, namespace: str) -> list[str]:
        base = f"{self.hostname}.{self.subdomain}"
        names = [f"{base}.{self.namespace}.svc.{CLUSTER_DOMAIN}", f"{base}.{self.namespace}.svc"]
        return [*names, base] if namespace == self.namespace else names


@dataclass
class HostsFile:
    """One pod's hosts file on the host."""

    path: Path
    namespace: str
    ip: str
    hostname: str
    subdomain: str
    host_network: bool
    written: str | None = None


@dataclass(frozen=True)
class ServiceAddress:
    """A Service as DNS plus kube-proxy would make it reachable: its name and one ready endpoint's IP."""

    namespace: str
    name: str
    ip: str

    def names(self, namespace: str) -> list[str]:
        names = [f"{self.name}.{self.namespace}.svc.{CLUSTER_DOMAIN}", f"{self.name}.{self.namespace}.svc"]
        return [*names, self.name] if namespace == self.namespace else names


#: The label naming the Service of an EndpointSlice.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def service_of(endpoint_slice: JSON) -> ServiceAddress | None:
    """Where a Service's name leads by one EndpointSlice (its lowest ready address), if it has a ready one.

    An endpoint without a ``ready`` condition counts as ready (the API's rule).
    """
    md = endpoint_slice["metadata"]
    service = (md.get("labels") or {}).get(SERVICE_NAME_LABEL)
    endpoints = endpoint_slice.get("endpoints") or []
    ready = [ep for ep in endpoints if (ep.get("conditions") or {}).get("ready") is not False]
    ips = sorted(ip for ep in ready for ip in ep.get("addresses") or [])
    return ServiceAddress(md["namespace"], service, ips[0]) if service and ips else None


def peer_of(pod: JSON) -> Peer | None:
    """What cluster DNS knows of ``pod``, if anything (hostname + subdomain + IP, not ended)."""
    md, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    hostname, subdomain, ip = spec.get("hostname"), spec.get("subdomain"), status.get("podIP")
    if not (hostname and subdomain and ip) or status.get("phase") in ("Succeeded", "Failed"):
        return None
    deleting = md.get("deletionTimestamp") is not None
    return Peer(md["namespace"], hostname, subdomain, ip, str(md.get("creationTimestamp", "")), deleting)


class ClusterHosts:
    """The hosts files of an agent's pods, kept current from the agent's watch of every pod."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._services: dict[str, ServiceAddress] = {}
        self._files: dict[str, HostsFile] = {}

    def observe(self, kind: str, pod: JSON) -> None:
        """A pod event of the cluster (``ADDED``/``MODIFIED``/``DELETED``)."""
        uid = pod["metadata"]["uid"]
        peer = None if kind == "DELETED" else peer_of(pod)
        with self._lock:
            if self._peers.get(uid) == peer:
                return
            if peer is None:
                del self._peers[uid]
            else:
                self._peers[uid] = peer
            self._rewrite()

    def resync(self, pods: list[JSON]) -> None:
        """A fresh listing of every pod: forget the ones that went while the watch was down."""
        peers = {p["metadata"]["uid"]: peer for p in pods if (peer := peer_of(p)) is not None}
        with self._lock:
            if peers != self._peers:
                self._peers = peers
                self._rewrite()

    def observe_endpoint_slice(self, kind: str, endpoint_slice: JSON) -> None:
        """An EndpointSlice event of the cluster (``ADDED``/``MODIFIED``/``DELETED``)."""
        uid = endpoint_slice["metadata"]["uid"]
        service = None if kind == "DELETED" else service_of(endpoint_slice)
        with self._lock:
            if self._services.get(uid) == service:
                return
            if service is None:
                del self._services[uid]
            else:
                self._services[uid] = service
            self._rewrite()

    def resync_endpoint_slices(self, items: list[JSON]) -> None:
        """A fresh listing of every EndpointSlice."""
        services = {e["metadata"]["uid"]: s for e in items if (s := service_of(e)) is not None}
        with self._lock:
            if services != self._services:
                self._services = services
                self._rewrite()

    def attach(self, uid: str, hosts: HostsFile) -> None:
        """Start keeping ``hosts`` (the file of pod ``uid``) current; writes it now."""
        with self._lock:
            self._files[uid] = hosts
            self._write(uid, hosts)

    def detach(self, uid: str) -> None:
        with self._lock:
            hosts = self._files.pop(uid, None)
        if hosts is not None:
            with contextlib.suppress(OSError):
                hosts.path.unlink()

    def render(self, uid: str, hosts: HostsFile) -> str:
        if hosts.host_network:  # the node's own file, as kubelet gives hostNetwork pods
            try:
                head = Path("/etc/hosts").read_text()
            except OSError:
                head = LOCALHOST
            lines = [head.rstrip("\n") + "\n", "# Cluster DNS of Services (process node).\n"]
            if hosts.subdomain:
                # Its own name too: a gang's rank 0 connects to its own MASTER_ADDR.
                base = f"{hosts.hostname}.{hosts.subdomain}"
                own_names = f"{base}.{hosts.namespace}.svc.{CLUSTER_DOMAIN} {base}.{hosts.namespace}.svc {base}"
                lines.append(f"{hosts.ip}\t{own_names}\n")
        else:
            own = [hosts.hostname]
            if hosts.subdomain:
                base = f"{hosts.hostname}.{hosts.subdomain}"
                own = [
                    f"{base}.{hosts.namespace}.svc.{CLUSTER_DOMAIN}",
                    f"{base}.{hosts.namespace}.svc",
                    base,
                    hosts.hostname,
                ]
            lines = [HEADER, LOCALHOST, f"{hosts.ip}\t{' '.join(own)}\n"]
        seen: set[str] = set()
        # A name held by two pods (an old attempt still terminating): the live, newest one first.
        ordered = sorted(
            ((u, p) for u, p in self._peers.items() if u != uid),
            key=lambda item: (item[1].deleting, _desc(item[1].created)),
        )
        for _, peer in ordered:
            names = [n for n in peer.names(hosts.namespace) if n not in seen]
            if names:
                seen.update(names)
                lines.append(f"{peer.ip}\t{' '.join(names)}\n")
        services = sorted(self._services.values(), key=lambda s: (s.namespace, s.name, s.ip))
        if services:
            lines.append("# Services at a ready endpoint's pod IP (no kube-proxy; process node).\n")
        for service in services:
            service_names = [n for n in service.names(hosts.namespace) if n not in seen]
            if service_names:
                seen.update(service_names)
                lines.append(f"{service.ip}\t{' '.join(service_names)}\n")
        return "".join(lines)

    def _rewrite(self) -> None:
        for uid, hosts in self._files.items():
            self._write(uid, hosts)

    def _write(self, uid: str, hosts: HostsFile) -> None:
        text = self.render(uid, hosts)
        if text == hosts.written:
            return
        data = text.encode()
        # In place: write over the old content, then cut what is left of it (never an empty file to read).
        fd = os.open(hosts.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)
        hosts.written = text


def _desc(timestamp: str) -> tuple[int, ...]:
    """Sort key putting later RFC 3339 timestamps first."""
    return tuple(-ord(c) for c in timestamp)
