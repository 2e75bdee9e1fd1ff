"""Real nodes' configuration, addresses and image archives: pure, no kubelet needed."""

from __future__ import annotations

import io
import json
import tarfile
import tomllib
from pathlib import Path

import pytest

from testenv.realnode.config import (
    MAX_NODES,
    NodeAddresses,
    cni_conflist,
    containerd_config,
    kubelet_config,
    node_labels,
    node_taints,
    registry_hosts_toml,
    to_toml,
    work_dir,
)
from testenv.realnode.images import image_archive


def test_addresses_stay_in_loopback_and_apart() -> None:
    a, b, other_set = NodeAddresses(0, 1), NodeAddresses(0, 2), NodeAddresses(1, 1)
    assert (a.node_ip, b.node_ip, other_set.node_ip) == ("127.0.100.1", "127.0.100.2", "127.0.101.1")
    assert a.bridge == b.bridge != other_set.bridge
    assert (a.subnet, a.gateway) == ("127.80.0.0/16", "127.80.0.1")
    assert a.pod_range == ("127.80.1.1", "127.80.1.254") and b.pod_range[0] == "127.80.2.1"
    # Never the process nodes' 127.64.0.0/16.
    assert not a.subnet.startswith("127.64.")
    with pytest.raises(ValueError, match="node index"):
        NodeAddresses(0, 0)
    with pytest.raises(ValueError, match="set number"):
        NodeAddresses(99, 1)


def test_containerd_config_keeps_everything_under_the_state_dir(tmp_path: Path) -> None:
    parsed = tomllib.loads(containerd_config(tmp_path, tmp_path / "certs.d"))
    cri = parsed["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True and cri["disable_apparmor"] is True
    assert cri["netns_mounts_under_state_dir"] is True
    assert cri["containerd"]["runtimes"]["runc"]["options"] == {"SystemdCgroup": False, "Root": str(tmp_path / "runc")}
    assert cri["registry"]["config_path"] == str(tmp_path / "certs.d")
    paths = [parsed["root"], parsed["state"], parsed["grpc"]["address"], parsed["ttrpc"]["address"]]
    paths.append(parsed["plugins"]["io.containerd.internal.v1.opt"]["path"])
    assert all(p.startswith(str(tmp_path)) for p in paths)


def test_work_dir_leaves_room_for_the_sockets_below_it() -> None:
    # The kubelet's deepest socket: <root-dir>/pod-resources/<10 digits>; a unix socket path has at most 107 bytes.
    deepest = work_dir("0123456789ab") / str(MAX_NODES) / "kubelet" / "pod-resources" / "1234567890"
    assert len(str(deepest)) < 100


def test_registry_hosts_is_plain_http() -> None:
    parsed = tomllib.loads(registry_hosts_toml("127.0.0.1:5000"))
    assert parsed["server"] == "http://127.0.0.1:5000"
    assert parsed["host"]["http://127.0.0.1:5000"]["skip_verify"] is True


def test_to_toml_quotes_dotted_table_names() -> None:
    assert tomllib.loads(to_toml({"a": {"x.y": {"n": 1, "b": True, "l": ["s"]}}})) == {
        "a": {"x.y": {"n": 1, "b": True, "l": ["s"]}}
    }


def test_cni_changes_nothing_host_wide(tmp_path: Path) -> None:
    conf = cni_conflist(NodeAddresses(2, 3), tmp_path)
    bridge, tuning = conf["plugins"]
    assert (bridge["isGateway"], bridge["ipMasq"], bridge["bridge"]) == (False, False, "sgrn2")
    (rng,) = bridge["ipam"]["ranges"][0]
    assert rng == {
        "subnet": "127.82.0.0/16",
        "rangeStart": "127.82.3.1",
        "rangeEnd": "127.82.3.254",
        "gateway": "127.82.0.1",
    }
    assert bridge["ipam"]["dataDir"] == str(tmp_path)
    assert tuning["sysctl"] == {"net.ipv4.conf.eth0.route_localnet": "1"}
    assert [p["type"] for p in conf["plugins"]] == ["bridge", "tuning"]  # no portmap: no iptables


def test_kubelet_config(tmp_path: Path) -> None:
    conf = kubelet_config(NodeAddresses(0, 4), 12345, 12346, tmp_path / "ca.crt", "run1")
    assert (conf["address"], conf["port"], conf["readOnlyPort"]) == ("127.0.100.4", 12345, 0)
    assert conf["cgroupRoot"] == "/spotguard-realnode-run1-127-0-100-4"
    assert conf["authentication"]["webhook"]["enabled"] is False
    assert conf["authentication"]["x509"]["clientCAFile"] == str(tmp_path / "ca.crt")
    assert (conf["failSwapOn"], conf["makeIPTablesUtilChains"], conf["imageGCHighThresholdPercent"]) == (
        False,
        False,
        100,
    )
    assert node_labels({"b": "2", "a": "1"}) == "a=1,b=2"
    assert node_taints([{"key": "k", "value": "v", "effect": "NoSchedule"}]) == "k=v:NoSchedule"


def test_image_archive_is_a_loadable_layout() -> None:
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("hello")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    archive = image_archive("spotguard.local/x:1", layer.getvalue(), ["/hello"])
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        (manifest,) = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        config = json.loads(tar.extractfile(manifest["Config"]).read())  # type: ignore[union-attr]
        assert tar.extractfile("layer.tar").read() == layer.getvalue()  # type: ignore[union-attr]
    assert manifest["RepoTags"] == ["spotguard.local/x:1"]
    assert config["config"]["Entrypoint"] == ["/hello"] and config["rootfs"]["diff_ids"][0].startswith("sha256:")


def test_a_sets_node_names_come_oldest_first_past_nine_nodes() -> None:
    """Modules sharing the session's set pick nodes by position (the first two, the newest two): the order
    is the nodes' start order, also once indices have two digits (a string sort puts .10 before .2)."""
    from testenv.realnode.nodes import RealNode, RealNodes

    nodes = RealNodes.__new__(RealNodes)  # the names only: no kubelet, no host changes
    nodes.nodes = {}
    for index in (10, 2, 1):
        node = RealNode(NodeAddresses(0, index), Path("/nonexistent"), "run")
        nodes.nodes[node.name] = node
    assert nodes.node_names() == ["127.0.100.1", "127.0.100.2", "127.0.100.10"]
