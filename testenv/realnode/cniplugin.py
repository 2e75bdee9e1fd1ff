#!/usr/bin/env python3
"""A chained CNI plugin: a real node's pod reaches the test world's host services.

Run by containerd after ``bridge``, ``host-local`` and ``tuning`` (the node's
conflist, :func:`testenv.realnode.config.cni_conflist`), as the executable
``spotguard-hostservices`` of the node's CNI plugin directory. Inside the pod's
network namespace only (never the host's) it adds:

- a route to the ``kubernetes`` Service's ClusterIP (:data:`SERVICE_IP`) over
  the pod's interface, and nft rules (table :data:`TABLE`) that send
  ``10.0.0.1:443`` to the host proxy on the set's bridge gateway at the
  apiserver's port, and ``127.0.0.1:<p>`` for every allowed host port ``p``
  (the set :data:`PORTS_SET`) to the gateway at ``p``; the rewritten
  connections leave with the pod's IP as their source, so the replies come
  back over the bridge (a 127.0.0.1 source never leaves the pod);
- ``route_localnet`` on the pod's interface (set by the ``tuning`` plugin
  already: checked, set if not), without which loopback-range addresses
  never travel over it.

Connections to any other 127.0.0.1 port stay in the pod: its own listeners
(torchrun's rendezvous, the sidecar's control port) work as before, and a host
port nobody allowed is refused. The allowed ports are those of the
host-services directory (:mod:`testenv.processnode.hostservices`) and the
apiserver's; the host proxy (:mod:`testenv.realnode.hostnet`) keeps every
pod's set current as ports are registered, from the pod files this plugin
writes (``<podsDir>/<container id>``: the path of the pod's network namespace as
seen through its containerd's root, ``/proc/<pid>/root/...``).

Only the standard library and :mod:`testenv.processnode.hostservices`: it is
started once per pod, by path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run by path: the repository, not this directory, is where imports start
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from testenv.processnode.hostservices import allowed_ports  # noqa: E402

PLUGIN_TYPE = "spotguard-hostservices"
#: The ``kubernetes`` Service's ClusterIP (the first of the apiserver's --service-cluster-ip-range) and port:
#: what the kubelet puts into every pod's KUBERNETES_SERVICE_HOST/PORT.
SERVICE_IP = "10.0.0.1"
SERVICE_PORT = 443
TABLE = "spotguard-hostservices"
PORTS_SET = "hostports"
CNI_VERSIONS = ["0.3.0", "0.3.1", "0.4.0"]


def plugin_config(gateway: str, api_port: int, host_services: Path, pods_dir: Path) -> dict[str, Any]:
    """Pure: this plugin's entry in a node's conflist."""
    return {
        "type": PLUGIN_TYPE,
        "gateway": gateway,
        "apiserverPort": api_port,
        "hostServices": str(host_services),
        "podsDir": str(pods_dir),
    }


def _elements(ports: Collection[int]) -> str:
    return ", ".join(str(p) for p in sorted(ports))


def pod_ruleset(gateway: str, pod_ip: str, ifname: str, api_port: int, ports: Collection[int]) -> str:
    """Pure: the nft script of one pod's namespace (see the module docstring)."""
    elements = f" elements = {{ {_elements(ports)} }};" if ports else ""
    return f"""table ip {TABLE} {{
  set {PORTS_SET} {{ type inet_service;{elements} }}
  chain output {{
    type nat hook output priority -100; policy accept;
    ip daddr {SERVICE_IP} tcp dport {SERVICE_PORT} dnat to {gateway}:{api_port}
    ip daddr 127.0.0.1 tcp dport @{PORTS_SET} dnat to {gateway}
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept;
    # Masquerade would drop these: the pod's address is of host scope (127.0.0.0/8), none of universe scope.
    oifname "{ifname}" ip daddr {gateway} ct status dnat snat to {pod_ip}
  }}
}}
"""


def ports_update(ports: Collection[int]) -> str:
    """Pure: the nft script that makes a pod's set of allowed ports exactly ``ports`` (one transaction)."""
    script = f"flush set ip {TABLE} {PORTS_SET}\n"
    if ports:
        script += f"add element ip {TABLE} {PORTS_SET} {{ {_elements(ports)} }}\n"
    return script


def allowed(api_port: int, host_services: str | os.PathLike[str] | None) -> set[int]:
    """The host ports pods may reach: the apiserver's and those registered in ``host_services``."""
    return {api_port} | allowed_ports(host_services)


def in_netns(netns: str, argv: list[str], stdin: str | None = None) -> None:
    """Run ``argv`` in the network namespace at ``netns``; OSError if it fails."""
    proc = subprocess.run(
        ["nsenter", f"--net={netns}", *argv], input=stdin, capture_output=True, text=True, timeout=30, check=False
    )
    if proc.returncode != 0:
        raise OSError(0, f"{' '.join(argv)} in {netns}: {(proc.stderr or proc.stdout).strip()}")


def _pod_ip(prev: dict[str, Any]) -> str:
    for ip in prev.get("ips", []):
        if ip.get("version", "4") == "4":
            return str(ip["address"]).split("/")[0]
    raise ValueError("the previous plugins gave the pod no IPv4 address")


def add(conf: dict[str, Any], netns: str, ifname: str, container: str) -> dict[str, Any]:
    """CNI ADD: route, route_localnet and rules in the pod's namespace, then its pod file. Returns the result."""
    prev = conf.get("prevResult") or {}
    pod_ip, gateway, api_port = _pod_ip(prev), conf["gateway"], int(conf["apiserverPort"])
    localnet = f"net.ipv4.conf.{ifname}.route_localnet"
    # The tuning plugin sets it; a conflist without it still gets it here (in the pod only).
    in_netns(netns, ["sh", "-c", f'[ "$(sysctl -n {localnet})" = 1 ] || sysctl -qw {localnet}=1'])
    in_netns(netns, ["ip", "route", "replace", f"{SERVICE_IP}/32", "dev", ifname, "src", pod_ip])
    ports = allowed(api_port, conf.get("hostServices"))
    in_netns(netns, ["nft", "-f", "-"], stdin=pod_ruleset(gateway, pod_ip, ifname, api_port, ports))
    pods = Path(conf["podsDir"])
    pods.mkdir(parents=True, exist_ok=True)
    tmp = pods / f".{container}.tmp"
    # The node's containerd (our parent) may keep its mounts, the namespace's among them, in a mount
    # namespace of its own: the host proxy reaches the namespace through containerd's root.
    tmp.write_text(f"/proc/{os.getppid()}/root{netns}")
    tmp.replace(pods / container)
    return {**prev, "cniVersion": conf.get("cniVersion", "0.4.0")}


def delete(conf: dict[str, Any], container: str) -> None:
    """CNI DEL: the rules go with the namespace; only the pod file is left to remove."""
    (Path(conf["podsDir"]) / container).unlink(missing_ok=True)


def main() -> int:
    command = os.environ.get("CNI_COMMAND", "")
    if command == "VERSION":
        print(json.dumps({"cniVersion": "0.4.0", "supportedVersions": CNI_VERSIONS}))
        return 0
    conf = json.loads(sys.stdin.read() or "{}")
    container = os.environ.get("CNI_CONTAINERID", "")
    try:
        if command == "ADD":
            result = add(conf, os.environ["CNI_NETNS"], os.environ.get("CNI_IFNAME", "eth0"), container)
            print(json.dumps(result))
        elif command == "DEL":
            delete(conf, container)
        elif command != "CHECK":
            raise ValueError(f"unknown CNI_COMMAND {command!r}")
    except (OSError, ValueError, KeyError) as exc:
        print(json.dumps({"cniVersion": conf.get("cniVersion", "0.4.0"), "code": 999, "msg": str(exc)}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
