"""The host-service rules of a real node's pod and the plugin's place in the node's config, without I/O."""

from __future__ import annotations

import tomllib
from pathlib import Path

from testenv.realnode.cniplugin import (
    PLUGIN_TYPE,
    PORTS_SET,
    SERVICE_IP,
    SERVICE_PORT,
    TABLE,
    plugin_config,
    pod_ruleset,
    ports_update,
)
from testenv.realnode.config import CNI_BIN_DIR, NodeAddresses, cni_conflist, containerd_config


def test_pod_ruleset_sends_the_service_ip_and_allowed_ports_to_the_gateway() -> None:
    rules = pod_ruleset("127.82.0.1", "127.82.1.7", "eth0", 6443, {9000, 6443})
    assert f"table ip {TABLE} " in rules
    assert "elements = { 6443, 9000 }" in rules
    assert f"ip daddr {SERVICE_IP} tcp dport {SERVICE_PORT} dnat to 127.82.0.1:6443" in rules
    assert f"ip daddr 127.0.0.1 tcp dport @{PORTS_SET} dnat to 127.82.0.1" in rules
    # Only what was rewritten, and only toward the gateway, leaves with the pod's IP: pod-to-pod stays as it is.
    assert 'oifname "eth0" ip daddr 127.82.0.1 ct status dnat snat to 127.82.1.7' in rules


def test_pod_ruleset_with_no_allowed_port_has_an_empty_set() -> None:
    rules = pod_ruleset("127.82.0.1", "127.82.1.7", "eth0", 6443, set())
    assert "elements" not in rules


def test_ports_update_replaces_the_whole_set_in_one_script() -> None:
    assert ports_update([9000, 6443]) == (
        f"flush set ip {TABLE} {PORTS_SET}\nadd element ip {TABLE} {PORTS_SET} {{ 6443, 9000 }}\n"
    )
    assert ports_update([]) == f"flush set ip {TABLE} {PORTS_SET}\n"


def test_conflist_chains_the_plugin_after_the_network_plugins(tmp_path: Path) -> None:
    plugin = plugin_config("127.82.0.1", 6443, tmp_path / "hs", tmp_path / "pods")
    conf = cni_conflist(NodeAddresses(2, 3), tmp_path, [plugin])
    assert [p["type"] for p in conf["plugins"]] == ["bridge", "tuning", PLUGIN_TYPE]
    assert conf["plugins"][-1] == {
        "type": PLUGIN_TYPE,
        "gateway": "127.82.0.1",
        "apiserverPort": 6443,
        "hostServices": str(tmp_path / "hs"),
        "podsDir": str(tmp_path / "pods"),
    }


def test_containerd_takes_plugins_from_the_node_directory(tmp_path: Path) -> None:
    cri = tomllib.loads(containerd_config(tmp_path, tmp_path / "certs.d", str(tmp_path / "cni-bin")))
    assert cri["plugins"]["io.containerd.grpc.v1.cri"]["cni"]["bin_dir"] == str(tmp_path / "cni-bin")
    default = tomllib.loads(containerd_config(tmp_path, tmp_path / "certs.d"))
    assert default["plugins"]["io.containerd.grpc.v1.cri"]["cni"]["bin_dir"] == CNI_BIN_DIR
