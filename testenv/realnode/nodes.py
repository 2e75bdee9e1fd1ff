"""Real nodes: a kubelet and a containerd per node, started, lost and torn down.

:meth:`RealNodes.start` brings up ``count`` nodes against a control plane
(:func:`testenv.cluster.start_control_plane`); every process runs under this
set's own :class:`~testenv.cluster.Supervisor` (process group, PDEATHSIG, run
marker) and carries a marker of its node, which containerd hands on to its
shims. :meth:`RealNodes.kill` loses a node the abrupt way (everything of it
SIGKILLed at once, the Node object deleted, as the process node does);
:meth:`RealNodes.stop` leaves nothing behind (see :mod:`testenv.realnode.host`).
Each kubelet talks to the apiserver as its node (``system:node:<name>``, a
client certificate of the control plane's CA); what the set itself writes to
Nodes (their GPUs) goes with the admin kubeconfig it was given.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import yaml

from testenv import pki
from testenv.cluster import Service, Supervisor, bin_dir, cache_dir, free_ports, wait_until
from testenv.processnode.api import ApiError, Kube
from testenv.processnode.control import node_ready
from testenv.processnode.node import SPOT_TAINT, NodeSettings, node_manifest
from testenv.realnode import dns, host, hostnet
from testenv.realnode.cniplugin import plugin_config
from testenv.realnode.config import (
    MAX_SETS,
    NodeAddresses,
    bridge_gateway,
    bridge_name,
    cgroup_root,
    cni_conflist,
    containerd_config,
    kubelet_config,
    node_labels,
    node_taints,
    registry_hosts_toml,
    work_dir,
)
from testenv.realnode.images import busybox_archive, pause_archive

log = logging.getLogger("realnode")

#: The environment entry of every process of a node: ``SPOTGUARD_REALNODE=<run id>/<node ip>``.
NODE_MARKER = "SPOTGUARD_REALNODE"
#: Labels the kubelet sets itself (``--node-labels`` may not).
KUBELET_LABELS = ("kubernetes.io/hostname", "kubernetes.io/os", "kubernetes.io/arch")
GPU = "nvidia.com/gpu"


def kubelet_path() -> Path:
    return bin_dir() / "kubelet"


@dataclass
class RealNode:
    """One node of set ``run_id``: its addresses, state directory and the two services it runs."""

    addr: NodeAddresses
    state: Path
    run_id: str
    services: list[Service] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The Node's name: its kubelet's address (which is also its InternalIP)."""
        return self.addr.node_ip

    @property
    def marker(self) -> tuple[str, str]:
        """The environment entry every process of the node carries (containerd hands it on to its shims)."""
        return NODE_MARKER, f"{self.run_id}/{self.name}"

    @property
    def cgroup_root(self) -> str:
        return cgroup_root(self.run_id, self.name)

    @property
    def socket(self) -> Path:
        return self.state / "containerd.sock"

    @property
    def mount_ns_pid(self) -> int:
        """A process in the node's mount namespace (its containerd), where its mounts are seen."""
        return self.services[0].popen.pid

    def pids(self) -> set[int]:
        """Every live process of the node: kubelet, containerd, shims, runc and the containers."""
        return host.pids_with_env("=".join(self.marker)) | host.cgroup_pids(self.cgroup_root)


class RealNodes:
    """A set of real nodes; ``RealNodes.start(...)`` to make one, :meth:`stop` to leave nothing."""

    def __init__(
        self,
        kubeconfig: Path,
        client_ca: Path,
        state_dir: Path,
        registry: str | None = None,
        settings: NodeSettings | None = None,
        host_services: Path | None = None,
    ) -> None:
        self.kubeconfig, self.client_ca, self.registry = kubeconfig, client_ca, registry
        if not pki.ca_key_path(client_ca).exists():
            raise FileNotFoundError(
                f"{pki.ca_key_path(client_ca)} not found: real nodes need the key of the cluster CA "
                "(testenv.cluster's control plane), which signs each kubelet's identity"
            )
        self.settings = settings or NodeSettings(prefix="real-gpu")
        self.state_dir = state_dir.resolve()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.sup = Supervisor(self.state_dir)
        self.kube = Kube(kubeconfig)
        # Host services (testenv.realnode.hostnet): the host ports pods reach (the apiserver's always), and
        # the set's proxy for them, started with the set's first node.
        self.host_services = host_services or self.state_dir / "host-services"
        self.api_port = urlparse(self.kube.server).port or 443
        self.host_proxy: Service | None = None
        # Cluster DNS (testenv.realnode.dns): the pods' stable names, on the set's gateway, started with the proxy.
        self.dns: Service | None = None
        self.nodes: dict[str, RealNode] = {}
        self.set_no: int | None = None
        self._next_index = 1
        self._host_before = host.host_paths_now()
        # Where another set's kubelet runs, the values now are its kubelet's: that set puts them back.
        self._sysctls_before = {} if host.node_program_pids() else host.sysctls_now()
        images = cache_dir() / "testenv" / "realnode"
        self.images = [pause_archive(images), busybox_archive(images)]

    @classmethod
    def start(
        cls,
        kubeconfig: Path,
        client_ca: Path,
        state_dir: Path,
        count: int = 2,
        registry: str | None = None,
        settings: NodeSettings | None = None,
        timeout: float = 120.0,
        host_services: Path | None = None,
    ) -> RealNodes:
        """Start ``count`` nodes and wait until each is Ready with its GPUs; ``registry``
        (``127.0.0.1:PORT``) is a plain-http registry the nodes pull from; pods reach the host
        ports allowed in ``host_services`` (:mod:`testenv.processnode.hostservices`) and the apiserver."""
        if not kubelet_path().exists():
            raise FileNotFoundError(f"{kubelet_path()} not found: run `make setup` (testenv/realnode/provision.sh)")
        nodes = cls(kubeconfig, client_ca, state_dir, registry, settings, host_services)
        try:
            nodes._claim_set()
            started = [nodes.add_node(wait=False) for _ in range(count)]
            for node in started:
                nodes.wait_ready(node, timeout)
        except BaseException:
            nodes.stop()
            raise
        return nodes

    def _claim_set(self) -> None:
        for k in range(MAX_SETS):
            if host.claim_bridge(bridge_name(k), bridge_gateway(k), 16):
                self.set_no = k
                return
        raise RuntimeError(f"no free pod bridge among {bridge_name(0)}..{bridge_name(MAX_SETS - 1)}")

    def node_names(self) -> list[str]:
        """The live nodes' names, oldest first (as a string ``127.0.100.10`` sorts before ``127.0.100.2``)."""
        return sorted(self.nodes, key=lambda name: self.nodes[name].addr.index)

    def node(self, name: str) -> RealNode:
        try:
            return self.nodes[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a live node of this set ({', '.join(self.node_names())})") from None

    # -- one node's life --

    def add_node(self, wait: bool = True, timeout: float = 120.0) -> RealNode:
        """Start one more node (containerd, images, kubelet); with ``wait``, until it is Ready with GPUs."""
        if self.set_no is None:
            self._claim_set()
        assert self.set_no is not None
        if self.host_proxy is None:
            gateway, pods = bridge_gateway(self.set_no), self.state_dir / hostnet.PODS_DIR
            self.host_proxy = hostnet.start_host_proxy(self.sup, gateway, self.api_port, self.host_services, pods)
        if self.dns is None:
            self.dns = dns.start_dns(self.sup, bridge_gateway(self.set_no), self.kubeconfig)
        addr = NodeAddresses(self.set_no, self._next_index)
        self._next_index += 1
        state = work_dir(self.sup.run_id) / str(addr.index)
        shutil.rmtree(state, ignore_errors=True)
        for sub in ("cni", "ipam", "certs.d", "kubelet", "pki", "volume-plugins"):
            (state / sub).mkdir(parents=True, exist_ok=True)
        node = RealNode(addr, state, self.sup.run_id)
        self.nodes[node.name] = node
        self._start_containerd(node)
        self._start_kubelet(node)
        if wait:
            self.wait_ready(node, timeout)
        return node

    def _start_containerd(self, node: RealNode) -> None:
        st = node.state
        if self.registry:
            (st / "certs.d" / self.registry).mkdir(parents=True, exist_ok=True)
            (st / "certs.d" / self.registry / "hosts.toml").write_text(registry_hosts_toml(self.registry))
        # Host services (testenv.realnode.hostnet): the chained plugin, from the node's own plugin directory.
        bin_dir = hostnet.plugin_bin_dir(st / "cni-bin")
        (st / "containerd.toml").write_text(containerd_config(st, st / "certs.d", str(bin_dir)))
        pods = self.state_dir / hostnet.PODS_DIR
        chained = [plugin_config(node.addr.gateway, self.api_port, self.host_services, pods)]
        conflist = cni_conflist(node.addr, st / "ipam", chained)
        (st / "cni" / "10-spotguard.conflist").write_text(json.dumps(conflist, indent=2))
        marker_name, marker_value = node.marker
        svc = self.sup.start(
            f"containerd-{node.name}",
            host.in_node_mounts(st / "private", ["containerd", "--config", str(st / "containerd.toml")]),
            extra_env={marker_name: marker_value},
        )
        node.services.append(svc)
        ctr = ["ctr", "--address", str(node.socket), "--namespace", "k8s.io"]
        wait_until(
            lambda: subprocess.run([*ctr, "version"], capture_output=True).returncode == 0, 30, "containerd", svc
        )
        for archive in self.images:
            host.run([*ctr, "images", "import", str(archive)])

    def _start_kubelet(self, node: RealNode) -> None:
        st = node.state
        port, healthz = free_ports(2)
        host.make_cgroup_root(node.cgroup_root)
        config = kubelet_config(node.addr, port, healthz, self.client_ca, self.sup.run_id)
        (st / "kubelet.yaml").write_text(json.dumps(config, indent=2))
        labels = node_manifest(node.name, self.settings, "v1.20.2")["metadata"]["labels"]
        labels = {k: v for k, v in labels.items() if k not in KUBELET_LABELS}
        marker_name, marker_value = node.marker
        argv = [
            str(kubelet_path()),
            f"--config={st / 'kubelet.yaml'}",
            f"--kubeconfig={self._kubelet_kubeconfig(node)}",
            "--container-runtime=remote",
            f"--container-runtime-endpoint=unix://{node.socket}",
            f"--hostname-override={node.name}",
            f"--root-dir={st / 'kubelet'}",
            f"--cert-dir={st / 'pki'}",
            f"--volume-plugin-dir={st / 'volume-plugins'}",
            f"--node-labels={node_labels(labels)}",
            "--v=1",
        ]
        if self.settings.taint:
            argv.append(f"--register-with-taints={node_taints([SPOT_TAINT])}")
        # In its containerd's mount namespace: both see the node's own kubelet paths (host.PRIVATE_PATHS).
        argv = host.in_mounts_of(node.mount_ns_pid, argv)
        node.services.append(self.sup.start(f"kubelet-{node.name}", argv, extra_env={marker_name: marker_value}))

    def _kubelet_kubeconfig(self, node: RealNode) -> Path:
        """The kubelet's kubeconfig: the cluster of the set's kubeconfig, and a client certificate of the
        cluster CA for ``system:node:<name>`` in ``system:nodes``, as a cluster gives each kubelet. The
        Node authorizer and NodeRestriction then let it write only its own Node and the pods bound to it,
        and read only the Secrets and ConfigMaps they use. What the set does to Nodes (GPUs) stays admin."""
        admin = yaml.safe_load(self.kubeconfig.read_text())
        context = next(c["context"] for c in admin["contexts"] if c["name"] == admin["current-context"])
        cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])
        user = f"system:node:{node.name}"
        cert, key = pki.client_cert(self.client_ca, user, ["system:nodes"])
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [cluster],
            "users": [
                {
                    "name": user,
                    "user": {
                        "client-certificate-data": base64.b64encode(cert).decode(),
                        "client-key-data": base64.b64encode(key).decode(),
                    },
                }
            ],
            "contexts": [{"name": user, "context": {"cluster": cluster["name"], "user": user}}],
            "current-context": user,
        }
        path = node.state / "kubeconfig"
        path.touch(mode=0o600)
        path.write_text(json.dumps(config, indent=2))  # JSON is valid YAML
        return path

    def wait_ready(self, node: RealNode, timeout: float = 120.0) -> None:
        """Wait until the Node is Ready, then give it its GPUs (and wait until the API shows them)."""
        kubelet = node.services[-1]
        wait_until(lambda: node_ready(self.kube, node.name), timeout, f"real node {node.name} Ready", kubelet)
        if self.settings.gpus:
            wait_until(lambda: self._advertise_gpus(node), 30, f"GPUs on real node {node.name}", kubelet)

    def _advertise_gpus(self, node: RealNode) -> bool:
        """``nvidia.com/gpu`` capacity on the Node, as the NVIDIA device plugin makes the kubelet report
        it: an extended resource the kubelet does not own, so its status updates keep it."""
        gpus = str(self.settings.gpus)
        status = {"status": {"capacity": {GPU: gpus}, "allocatable": {GPU: gpus}}}
        self.kube.patch(f"/api/v1/nodes/{node.name}/status", status)
        got = self.kube.get(f"/api/v1/nodes/{node.name}")["status"].get("allocatable", {})
        return bool(got.get(GPU) == gpus)

    def kill(self, name: str, delete: bool = True) -> dict[str, object]:
        """Abrupt loss of a node: its kubelet, containerd, shims and containers SIGKILLed, then
        (``delete``) its Node object deleted, as a cloud controller does for a gone instance.
        Returns ``{"node", "pids"}`` (the pids that were killed).

        A lost machine reports nothing more, so its kubelet dies first and its containerd next, each
        waited for: a shim killed while they live reads to them as its containers' end (exit code 255),
        which the kubelet would report before the node is gone. Then the rest, at once."""
        node = self.nodes.pop(self.node(name).name)
        pids = node.pids()
        for svc in reversed(node.services):  # the kubelet, then containerd
            host.kill_all({svc.popen.pid} & pids)
        host.kill_all(pids)
        host.kill_all(node.pids())  # anything started while the first round was under way
        for svc in node.services:
            svc.popen.wait(10)
            with contextlib.suppress(ValueError):
                self.sup.services.remove(svc)
        self._clean_node(node)
        if delete:
            self._delete_node_object(node.name)
        return {"node": node.name, "pids": sorted(pids)}

    def _clean_node(self, node: RealNode) -> None:
        host.unmount_below(node.state)
        stuck = host.remove_cgroup_root(node.cgroup_root)
        if stuck:
            log.warning("node %s: cgroups still busy: %s", node.name, stuck)
        # Logs stay with the set's logs; the rest (images, snapshots) is large.
        shutil.rmtree(node.state, ignore_errors=True)

    def _delete_node_object(self, name: str) -> None:
        for path in (f"/api/v1/nodes/{name}", f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"):
            try:
                self.kube.delete(path)
            except ApiError as exc:
                if exc.status != 404:
                    log.warning("deleting %s failed: %s", path, exc)

    def stop(self) -> None:
        """Kill every node and undo everything the set changed on the host (:mod:`testenv.realnode.host`)."""
        for name in list(self.nodes):
            with contextlib.suppress(ApiError, OSError, subprocess.TimeoutExpired):
                self.kill(name, delete=True)
        self.sup.stop()  # what escaped: the set's run marker
        self.host_proxy = self.dns = None  # stopped with the supervisor's other services
        if self.set_no is not None:
            owner = host.link_owner(bridge_name(self.set_no))
            if owner == host.me():
                host.delete_bridge(bridge_name(self.set_no))
            self.set_no = None
        if not host.node_program_pids():
            # The kubelet's fixed paths and the shims' sockets: only once no node of any set runs
            # (another set's kubelet still uses them).
            host.restore_host_paths(self._host_before)
        host.restore_sysctls(self._sysctls_before)
        work = work_dir(self.sup.run_id)
        if work.exists():  # nodes that failed to start
            host.unmount_below(work)
            shutil.rmtree(work, ignore_errors=True)
