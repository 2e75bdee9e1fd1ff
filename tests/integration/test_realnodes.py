"""Real nodes (kubelet + containerd + runc + CNI) against the test control plane.

What only a real kubelet shows: a pod scheduled for its GPU and run from an
image, its log read through the API (apiserver -> kubelet), its termination
message, pod-to-pod TCP between nodes (torchrun's rendezvous), SIGTERM with the
pod's grace on eviction, and a node lost the abrupt way. The first test stands
up and tears down a node set of its own and checks that nothing is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from testenv.processnode.api import ApiError, Kube
from testenv.pytest_realnodes import require_real_nodes
from testenv.realnode import GPU, RealNodes
from testenv.realnode import host as realhost
from testenv.realnode.config import BUSYBOX_IMAGE, WORK_ROOT

SYSCTLS = [
    f"/proc/sys/net/ipv4/{name}"
    for name in (
        "ip_forward",
        "conf/all/route_localnet",
        "conf/default/route_localnet",
        "conf/all/forwarding",
        "conf/default/forwarding",
    )
]


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f} s")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def api(kube: Any) -> Kube:
    return Kube(kube.kubeconfig)


def sa_token(api: Kube, namespace: str) -> bool:
    try:
        return bool(api.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/default").get("secrets"))
    except ApiError as exc:
        if exc.status == 404:
            return False
        raise


@pytest.fixture(scope="module")
def namespace(api: Kube) -> Iterator[str]:
    name = f"realnodes-{uuid.uuid4().hex[:6]}"
    api.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    wait_for(lambda: sa_token(api, name), 60, "the default ServiceAccount's token (pods are refused without it)")
    yield name
    api.delete(f"/api/v1/namespaces/{name}")


def pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": BUSYBOX_IMAGE, "command": ["sh", "-c", script]}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


def get_pod(api: Kube, ns: str, name: str) -> dict[str, Any]:
    return api.get(f"/api/v1/namespaces/{ns}/pods/{name}")


def wait_phase(api: Kube, ns: str, name: str, want: set[str], timeout: float = 90) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        got = get_pod(api, ns, name)
        return got if got.get("status", {}).get("phase") in want else None

    return wait_for(reached, timeout, f"pod {ns}/{name} {sorted(want)}")


def gone(api: Kube, path: str) -> bool:
    try:
        api.get(path)
    except ApiError as exc:
        if exc.status == 404:
            return True
        raise
    return False


def machine_state(state_dir: Path, cgroup_prefix: str) -> dict[str, Any]:
    """What a set of real nodes could leave on the machine."""
    # The set's bridge and the CNI bridge plugin's veths (process nodes of other sessions make and remove
    # their own, "sgpod0" and "sgv...", at any time).
    links = sorted(n for n in os.listdir("/sys/class/net") if n.startswith(("sgrn", "veth")))
    cgroups = sorted(
        str(d)
        for h in Path("/sys/fs/cgroup").iterdir()
        if h.is_dir() and not h.is_symlink()
        for d in h.iterdir()
        if d.name.startswith(cgroup_prefix)
    )
    iptables = {
        table: subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True).stdout
        for table in ("filter", "nat")
    }
    return {
        "processes": sorted(realhost.node_program_pids()),
        "mounts": realhost.mounts_below(state_dir, WORK_ROOT, *realhost.HOST_PATHS),
        "cgroups": cgroups,
        "links": links,
        "work dirs": sorted(n for n in os.listdir(WORK_ROOT) if n.startswith("spotguard-realnode-")),
        "netns": sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else [],
        "host paths": {str(p): sorted(e) for p, e in realhost.host_paths_now().items()},
        "sysctls": {p: Path(p).read_text().strip() for p in [*SYSCTLS, *map(str, realhost.KUBELET_SYSCTLS)]},
        "iptables": iptables,
    }


def test_realnodes_teardown(kube: Any, api: Kube, namespace: str, tmp_path: Path) -> None:
    """A node set that ran a pod and was stopped leaves the machine as it found it."""
    require_real_nodes()
    state = tmp_path / "set"
    before = machine_state(state, "spotguard-realnode-")
    assert not before["processes"], f"kubelet/containerd already running: {before['processes']}"
    nodes = RealNodes.start(kube.kubeconfig, kube.kubelet_client_ca, state, count=1)
    try:
        (node,) = nodes.node_names()
        api.post(f"/api/v1/namespaces/{namespace}/pods", pod("left", "sleep 3600", nodeName=node))
        wait_phase(api, namespace, "left", {"Running"})
        during = machine_state(state, "spotguard-realnode-")
        assert during["processes"] and during["mounts"] and during["cgroups"], "the set ran nothing to leave behind"
        assert set(during["links"]) - set(before["links"]), "no pod bridge or veth made"
    finally:
        nodes.stop()
    after = machine_state(state, "spotguard-realnode-")
    for key in before:
        assert after[key] == before[key], f"{key} left behind by the stopped node set"
    assert wait_for(lambda: gone(api, f"/api/v1/nodes/{node}"), 10, "Node object deleted")
    api.delete(f"/api/v1/namespaces/{namespace}/pods/left", {"gracePeriodSeconds": 0})


def test_gpu_pod_runs_with_logs_and_termination_message(real_nodes: RealNodes, api: Kube, namespace: str) -> None:
    """The scheduler binds a GPU pod to a real node; its log is read through the API; its message is in status."""
    for name in real_nodes.node_names():
        node = api.get(f"/api/v1/nodes/{name}")
        assert node["status"]["capacity"][GPU] == "1"
        assert node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
        assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    script = "echo hello from a real node; echo done > /dev/termination-log; exit 3"
    body = pod("gpu", script, container={"resources": {"limits": {GPU: "1"}}})
    api.post(f"/api/v1/namespaces/{namespace}/pods", body)
    done = wait_phase(api, namespace, "gpu", {"Failed", "Succeeded"})
    assert done["spec"]["nodeName"] in real_nodes.node_names()
    terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["message"].strip()) == (3, "done")
    logs = api.request("GET", f"/api/v1/namespaces/{namespace}/pods/gpu/log", stream=True).data.decode()
    assert "hello from a real node" in logs
    # The kubelet posts its status every few seconds: the GPUs stay through several of those.
    time.sleep(10)
    for name in real_nodes.node_names():
        assert api.get(f"/api/v1/nodes/{name}")["status"]["allocatable"][GPU] == "1"


def test_pod_to_pod_tcp_across_nodes(real_nodes: RealNodes, api: Kube, namespace: str) -> None:
    """A server pod on one node, a client pod on the other: TCP between their pod IPs, as torchrun's rendezvous."""
    first, second = real_nodes.node_names()[:2]
    api.post(
        f"/api/v1/namespaces/{namespace}/pods",
        pod("server", "echo ready; nc -l -p 29500 > /tmp/got; cat /tmp/got", nodeName=first),
    )
    server = wait_for(
        lambda: (p := get_pod(api, namespace, "server")).get("status", {}).get("podIP") and p, 90, "server pod IP"
    )
    wait_phase(api, namespace, "server", {"Running"})
    ip = server["status"]["podIP"]
    assert ip.startswith("127.") and ip != "127.0.0.1"
    client = (
        "for i in 1 2 3 4 5 6 7 8 9 10; do echo rendezvous | nc -w 2 $SERVER 29500 && exit 0; sleep 1; done; exit 1"
    )
    api.post(
        f"/api/v1/namespaces/{namespace}/pods",
        pod("client", client, nodeName=second, container={"env": [{"name": "SERVER", "value": ip}]}),
    )
    assert wait_phase(api, namespace, "client", {"Succeeded", "Failed"})["status"]["phase"] == "Succeeded"
    wait_phase(api, namespace, "server", {"Succeeded"})
    logs = api.request("GET", f"/api/v1/namespaces/{namespace}/pods/server/log", stream=True).data.decode()
    assert "rendezvous" in logs
    assert get_pod(api, namespace, "client")["status"]["podIP"] != ip


def test_eviction_sigterm_then_kill_after_grace(
    real_nodes: RealNodes, api: Kube, namespace: str, tmp_path: Path
) -> None:
    """Eviction: the container gets SIGTERM, and SIGKILL only once its grace period has passed."""
    tmp_path.chmod(0o777)
    script = "trap 'echo TERM > /out/term' TERM; echo up > /out/up; while true; do sleep 0.2; done"
    body = pod(
        "evictee",
        script,
        nodeName=real_nodes.node_names()[0],
        terminationGracePeriodSeconds=4,
        volumes=[{"name": "out", "hostPath": {"path": str(tmp_path)}}],
        container={"volumeMounts": [{"name": "out", "mountPath": "/out"}]},
    )
    api.post(f"/api/v1/namespaces/{namespace}/pods", body)
    wait_for(lambda: (tmp_path / "up").exists(), 90, "evictee running")
    eviction = {"apiVersion": "policy/v1beta1", "kind": "Eviction", "metadata": {"name": "evictee"}}
    api.post(f"/api/v1/namespaces/{namespace}/pods/evictee/eviction", eviction)
    # A busy machine's kubelet can take a while to act on the deletion; then the grace runs from its SIGTERM.
    wait_for(lambda: (tmp_path / "term").exists(), 60, "SIGTERM in the container")
    termed = time.monotonic()
    wait_for(lambda: gone(api, f"/api/v1/namespaces/{namespace}/pods/evictee"), 60, "evicted pod gone")
    took = time.monotonic() - termed
    # The container ignores SIGTERM: the kubelet waits out the grace period before SIGKILL.
    assert 3 <= took < 30, f"the pod went {took:.1f} s after its SIGTERM, its grace is 4 s"


def test_node_loss_kills_everything_at_once(real_nodes: RealNodes, api: Kube, namespace: str) -> None:
    """Node loss: kubelet, containerd, shims and containers die together; the Node goes."""
    name = real_nodes.node_names()[-1]
    api.post(f"/api/v1/namespaces/{namespace}/pods", pod("doomed", "sleep 3600", nodeName=name))
    wait_phase(api, namespace, "doomed", {"Running"})
    node = real_nodes.node(name)
    pids = node.pids()
    programs = {Path(os.readlink(f"/proc/{p}/exe")).name for p in pids if os.path.exists(f"/proc/{p}/exe")}
    assert {"kubelet", "containerd", "containerd-shim-runc-v2", "busybox", "pause"} <= programs
    killed = real_nodes.kill(name)
    assert set(killed["pids"]) >= pids
    assert not [p for p in pids if realhost.alive(p)], "processes of the lost node still alive"
    assert wait_for(lambda: gone(api, f"/api/v1/nodes/{name}"), 10, "Node object deleted")
    # The set goes on: a fresh node joins, as a spot pool replaces a lost instance.
    fresh = real_nodes.add_node()
    assert fresh.name != name and fresh.name in real_nodes.node_names()


def test_dev_cluster_with_real_nodes(tmp_path: Path) -> None:
    """``make dev-cluster REAL=1``: ``testenv.cluster up --nodes-kind real`` brings the cluster up with
    real nodes that run a pod, and ``down`` takes them away with the rest."""
    require_real_nodes()
    state = tmp_path / "dev"
    cli = [sys.executable, "-m", "testenv.cluster"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    before = realhost.node_program_pids()  # the session's own real nodes, if they run
    cgroups_before = set(os.listdir("/sys/fs/cgroup/memory"))
    up = subprocess.run(
        [*cli, "up", "--state-dir", str(state), "--nodes", "1", "--nodes-kind", "real"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        api = Kube(state / "kubeconfig")
        wait_for(lambda: sa_token(api, "default"), 60, "the default ServiceAccount's token")
        (node,) = api.get("/api/v1/nodes")["items"]
        assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
        assert node["status"]["allocatable"][GPU] == "1"
        api.post("/api/v1/namespaces/default/pods", pod("hello", "echo hello"))
        assert wait_phase(api, "default", "hello", {"Succeeded", "Failed"})["status"]["phase"] == "Succeeded"
        programs = realhost.node_program_pids() - before
        assert programs
    finally:
        down = subprocess.run([*cli, "down", "--state-dir", str(state)], capture_output=True, text=True, env=env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not [p for p in programs if realhost.alive(p)], "real nodes' processes outlived the dev cluster"
    assert set(os.listdir("/sys/fs/cgroup/memory")) - cgroups_before == set(), "the dev cluster left cgroups"
