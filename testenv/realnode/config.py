"""Pure: the configuration files of a real node (containerd, CNI, kubelet) and its addresses.

A *set* of real nodes (one :class:`~testenv.realnode.nodes.RealNodes`) owns a
set number ``k``: its pod bridge ``sgrn<k>`` with the gateway
``127.<80+k>.0.1/16``, and node ``i`` of the set gets the kubelet address
``127.0.<100+k>.<i>`` (its node name and InternalIP) and the pod IP range
``127.<80+k>.<i>.1-254``. Every address stays inside 127.0.0.0/8: no packet
leaves the machine, and nothing collides with the process nodes' 127.64.0.0/16.

All nodes of a set share one bridge, as instances of one cloud subnet whose
pods take addresses of that subnet (the AWS VPC CNI's way): pod-to-pod traffic
between nodes is switched by the bridge and needs no forwarding on the host.
(Per-node bridges would need the host to forward between them, and a pod's
route through a gateway then has no usable source address: the kernel never
picks a loopback-range address for a route beyond the link.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Where Debian's containernetworking-plugins live.
CNI_BIN_DIR = "/usr/lib/cni"
#: The images every node has without a registry (imported from archives the test world builds).
PAUSE_IMAGE = "spotguard.local/pause:1"
BUSYBOX_IMAGE = "spotguard.local/busybox:1"
BRIDGE_PREFIX = "sgrn"
#: The DNS domain of the cluster's Services and pods (``<pod>.<service>.<ns>.svc.cluster.local``).
CLUSTER_DOMAIN = "cluster.local"
MAX_SETS = 20
MAX_NODES = 200


@dataclass(frozen=True)
class NodeAddresses:
    """Where node ``index`` (1-based) of set ``set_no`` lives on the machine's loopback."""

    set_no: int
    index: int

    def __post_init__(self) -> None:
        if not 0 <= self.set_no < MAX_SETS:
            raise ValueError(f"set number {self.set_no} outside 0..{MAX_SETS - 1}")
        if not 1 <= self.index <= MAX_NODES:
            raise ValueError(f"node index {self.index} outside 1..{MAX_NODES}")

    @property
    def node_ip(self) -> str:
        """The kubelet's address: the node's name and InternalIP."""
        return f"127.0.{100 + self.set_no}.{self.index}"

    @property
    def bridge(self) -> str:
        return bridge_name(self.set_no)

    @property
    def subnet(self) -> str:
        return pod_subnet(self.set_no)

    @property
    def gateway(self) -> str:
        return bridge_gateway(self.set_no)

    @property
    def pod_range(self) -> tuple[str, str]:
        """First and last pod IP of this node."""
        base = f"127.{80 + self.set_no}.{self.index}"
        return f"{base}.1", f"{base}.254"


def bridge_name(set_no: int) -> str:
    return f"{BRIDGE_PREFIX}{set_no}"


def pod_subnet(set_no: int) -> str:
    return f"127.{80 + set_no}.0.0/16"


def bridge_gateway(set_no: int) -> str:
    return f"127.{80 + set_no}.0.1"


def cgroup_root(run_id: str, node_ip: str) -> str:
    """The node's cgroupRoot (in every v1 hierarchy): its pods and nothing else below it."""
    return f"/spotguard-realnode-{run_id}-{node_ip.replace('.', '-')}"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string is a JSON string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def to_toml(table: dict[str, Any], prefix: str = "") -> str:
    """TOML of nested dicts (tables) of strings, ints, bools and lists: enough for containerd's config."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    out = "\n".join(lines) + ("\n" if lines else "")
    for k, v in table.items():
        if isinstance(v, dict):
            name = f"{prefix}.{json.dumps(k) if '.' in k else k}" if prefix else (json.dumps(k) if "." in k else k)
            out += f"\n[{name}]\n" + to_toml(v, name)
    return out


#: Where the nodes' working directories go (containerd's root and state, the kubelet's root): a unix
#: socket's path has at most 107 bytes, and the kubelet and containerd make sockets deep below
#: them, so a test's state directory (often long already) cannot hold them.
WORK_ROOT = Path("/var/tmp")


def work_dir(run_id: str) -> Path:
    """The set's working directory: node ``i`` works in ``work_dir(run_id) / str(i)``."""
    return WORK_ROOT / f"spotguard-realnode-{run_id}"


def containerd_config(state: Path, registry_hosts: Path, cni_bin_dir: str = CNI_BIN_DIR) -> str:
    """containerd 1.6's config for one node: everything it keeps under ``state``.

    The CRI settings are what a root without CAP_SYS_RESOURCE, without AppArmor
    and without systemd needs; images that no registry serves stay (the kubelet
    never collects them), and registries are looked up in ``registry_hosts``
    (``<host:port>/hosts.toml``, see :func:`registry_hosts_toml`).
    """
    cri = {
        "sandbox_image": PAUSE_IMAGE,
        # Without CAP_SYS_RESOURCE runc cannot lower oom_score_adj: every sandbox would fail to start.
        "restrict_oom_score_adj": True,
        "disable_apparmor": True,
        "netns_mounts_under_state_dir": True,
        "stream_server_address": "127.0.0.1",
        "stream_server_port": "0",
        "enable_selinux": False,
        "containerd": {
            "snapshotter": "overlayfs",
            "default_runtime_name": "runc",
            "runtimes": {
                "runc": {
                    "runtime_type": "io.containerd.runc.v2",
                    "options": {"SystemdCgroup": False, "Root": str(state / "runc")},
                }
            },
        },
        # Host services (testenv.realnode.hostnet): a node's own plugin directory adds the chained plugin.
        "cni": {"bin_dir": cni_bin_dir, "conf_dir": str(state / "cni"), "max_conf_num": 1},
        "registry": {"config_path": str(registry_hosts)},
    }
    config = {
        "version": 2,
        "root": str(state / "root"),
        "state": str(state / "state"),
        "disabled_plugins": [
            "io.containerd.snapshotter.v1.aufs",
            "io.containerd.snapshotter.v1.btrfs",
            "io.containerd.snapshotter.v1.zfs",
            "io.containerd.snapshotter.v1.devmapper",
            "io.containerd.tracing.processor.v1.otlp",
        ],
        "grpc": {"address": str(state / "containerd.sock")},
        "ttrpc": {"address": str(state / "containerd.sock.ttrpc")},
        "plugins": {
            "io.containerd.grpc.v1.cri": cri,
            # Its default is /opt/containerd.
            "io.containerd.internal.v1.opt": {"path": str(state / "opt")},
        },
    }
    return to_toml(config)


def registry_hosts_toml(registry: str) -> str:
    """containerd's ``hosts.toml`` for a plain-http registry at ``registry`` (``127.0.0.1:PORT``)."""
    return (
        f'server = "http://{registry}"\n\n'
        f'[host."http://{registry}"]\n'
        '  capabilities = ["pull", "resolve"]\n'
        "  skip_verify = true\n"
    )


def cni_conflist(addr: NodeAddresses, ipam_dir: Path, chained: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The node's CNI network: a veth into the set's bridge, an IP of the node's range.

    No gateway, no masquerading, no port maps: nothing changes the host's
    forwarding or iptables. ``route_localnet`` is set inside each pod (the
    tuning plugin), so 127.x addresses may travel over the pod's ``eth0``.
    """
    first, last = addr.pod_range
    return {
        "cniVersion": "0.4.0",
        "name": f"spotguard-{addr.node_ip.replace('.', '-')}",
        "plugins": [
            {
                "type": "bridge",
                "bridge": addr.bridge,
                "isGateway": False,
                "isDefaultGateway": False,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [
                        [{"subnet": addr.subnet, "rangeStart": first, "rangeEnd": last, "gateway": addr.gateway}]
                    ],
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "tuning", "sysctl": {"net.ipv4.conf.eth0.route_localnet": "1"}},
            # Host services (testenv.realnode.hostnet): plugins chained after these, e.g. the host services one.
            *(chained or []),
        ],
    }


def kubelet_config(addr: NodeAddresses, port: int, healthz_port: int, client_ca: Path, run_id: str) -> dict[str, Any]:
    """The kubelet's KubeletConfiguration (as JSON, which is YAML)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": addr.node_ip,
        "port": port,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "readOnlyPort": 0,
        # The apiserver calls in (logs, exec) with its kubelet client certificate.
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(client_ca)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root(run_id, addr.node_ip),
        "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"],
        "failSwapOn": False,
        "makeIPTablesUtilChains": False,
        # Images come from archives or a local registry that may be gone: never collect them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # A busy test machine's disk or memory must not evict the test's pods.
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "serializeImagePulls": False,
        "nodeStatusUpdateFrequency": "4s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "resolvConf": "/etc/resolv.conf",
        # Cluster DNS (testenv.realnode.dns): the set's server on its bridge gateway, in every pod's resolv.conf.
        "clusterDNS": [addr.gateway],
        "clusterDomain": CLUSTER_DOMAIN,
    }


def node_labels(labels: dict[str, str]) -> str:
    """``--node-labels``: what the kubelet sets on its Node at registration."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def node_taints(taints: list[dict[str, str]]) -> str:
    """``--register-with-taints``."""
    return ",".join(f"{t['key']}={t.get('value', '')}:{t['effect']}" for t in taints)
