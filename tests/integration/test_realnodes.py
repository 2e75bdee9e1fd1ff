"""Real nodes (kubelet + containerd + runc + CNI) against the test control plane.

What only a real kubelet shows: a pod scheduled for its GPU and run from an
image, its log read through the API (apiserver -> kubelet), its termination
message, pod-to-pod TCP between nodes (torchrun's rendezvous), SIGTERM with the
pod's grace on eviction, and a node lost the abrupt way. The first test stands
up and tears down a node set of its own and checks that nothing is left.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from testenv.processnode.api import ApiError, Kube
from testenv.pytest_realnodes import ensure_real_nodes, real_node_namespace, require_real_nodes, sa_token, wait_for
from testenv.realnode import GPU, RealNode, RealNodes
from testenv.realnode import host as realhost
from testenv.realnode.config import BUSYBOX_IMAGE, work_dir

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


@pytest.fixture(scope="module")
def api(kube: Any) -> Kube:
    return Kube(kube.kubeconfig)


@pytest.fixture(scope="module")
def namespace(api: Kube) -> Iterator[str]:
    yield from real_node_namespace(api, "realnodes")


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


def host_wide() -> dict[str, Any]:
    """The machine's own settings, which no set of real nodes may change."""
    return {
        "sysctls": {p: Path(p).read_text().strip() for p in SYSCTLS},
        # The host's whole netfilter ruleset (iptables-nft and nft rules alike; this machine has only nft).
        "nft ruleset": subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, check=True).stdout,
    }


def shared_state() -> dict[str, Any]:
    """What every set of real nodes uses: the kubelet's fixed paths, the kernel settings it tunes."""
    return {
        "host paths": {str(p): sorted(e) for p, e in realhost.host_paths_now().items()},
        "mounts": realhost.mounts_below(*realhost.HOST_PATHS),
        "kubelet sysctls": {str(p): v for p, v in realhost.sysctls_now().items()},
    }


def leftovers_of(nodes: RealNodes, state: Path, pids: set[int], links: set[str], ns_pid: int) -> dict[str, Any]:
    """What is left of the set ``nodes`` (its processes ``pids``, its bridge and veths ``links``, the
    mounts seen from the host and from its node's mount namespace, which ``ns_pid`` is in)."""
    run_id = nodes.sup.run_id
    pids = pids | realhost.pids_with_env(f"SPOTGUARD_TESTENV_RUN={run_id}")
    roots = (state, work_dir(run_id))
    return {
        "processes": sorted(p for p in pids if realhost.alive(p)),
        "mounts": realhost.mounts_below(*roots)
        + (realhost.mounts_below(*roots, pid=ns_pid) if realhost.alive(ns_pid) else []),
        "cgroups": sorted(
            str(d)
            for h in Path("/sys/fs/cgroup").iterdir()
            if h.is_dir() and not h.is_symlink()
            for d in h.iterdir()
            if run_id in d.name
        ),
        "links": sorted(n for n in links if realhost.link_exists(n)),
        "work dir": work_dir(run_id).exists(),
    }


def test_realnodes_teardown(kube: Any, api: Kube, namespace: str, tmp_path: Path) -> None:
    """A node set that ran a pod and was stopped leaves nothing of its own on the machine, changes no
    host-wide setting, and, where no other set runs, leaves the paths and settings all sets share as it
    found them."""
    require_real_nodes()
    state = tmp_path / "set"
    alone = not realhost.node_program_pids()
    host_before, shared_before = host_wide(), shared_state()
    nodes = RealNodes.start(kube.kubeconfig, kube.kubelet_client_ca, state, count=1)
    try:
        (node,) = nodes.node_names()
        api.post(f"/api/v1/namespaces/{namespace}/pods", pod("left", "sleep 3600", nodeName=node))
        wait_phase(api, namespace, "left", {"Running"})
        assert nodes.set_no is not None
        bridge = f"sgrn{nodes.set_no}"
        links = {bridge, *realhost.bridge_ports(bridge)}
        pids, ns_pid = nodes.node(node).pids(), nodes.node(node).mount_ns_pid
        during = leftovers_of(nodes, state, pids, links, ns_pid)
        assert during["processes"] and during["mounts"] and during["cgroups"], "the set ran nothing to leave"
        assert len(during["links"]) == 2, f"the set's bridge and its pod's veth: {during['links']}"
        assert host_wide() == host_before, "a running set changed a host-wide setting"
        # The pod's log lives in the node's own /var/log/pods, not the machine's.
        assert not [d for d in os.listdir("/var/log/pods") if "_left_" in d]
    finally:
        nodes.stop()
    after = leftovers_of(nodes, state, pids, links, ns_pid)
    assert after == {"processes": [], "mounts": [], "cgroups": [], "links": [], "work dir": False}
    assert host_wide() == host_before
    if alone and not realhost.node_program_pids():
        assert shared_state() == shared_before, "the kubelet's fixed paths or its kernel settings left changed"
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


def kubelet_kubeconfig(node: RealNode) -> Path:
    """The kubeconfig the node's kubelet runs with, from its command line."""
    kubelet = node.services[-1]
    (arg,) = [a for a in kubelet.popen.args if str(a).startswith("--kubeconfig=")]  # type: ignore[union-attr]
    return Path(str(arg).removeprefix("--kubeconfig="))


def status_code(call: Callable[[], object]) -> int:
    """200 where ``call`` goes through, else the apiserver's answer (403: forbidden)."""
    try:
        call()
    except ApiError as exc:
        return exc.status
    return 200


def test_kubelet_is_its_node(real_nodes: RealNodes, api: Kube, namespace: str) -> None:
    """Each kubelet talks to the apiserver as its node, with a client certificate of the cluster CA
    (``system:node:<name>`` in ``system:nodes``), no token; the Node authorizer and NodeRestriction hold
    it to its own: its Node's status may be patched, another node's not; a Secret one of its pods uses
    may be read, one no pod of its uses not."""
    me, other = ensure_real_nodes(real_nodes, 2)[:2]
    mine, theirs = (Kube(kubelet_kubeconfig(real_nodes.node(name))) for name in (me, other))
    # The GPUs each node has: a patch that changes nothing, so only who may write it is seen.
    gpus = {name: api.get(f"/api/v1/nodes/{name}")["status"]["capacity"][GPU] for name in (me, other)}

    def patch_status(kube: Kube, name: str) -> None:
        kube.patch(f"/api/v1/nodes/{name}/status", {"status": {"capacity": {GPU: gpus[name]}}})

    assert status_code(lambda: patch_status(mine, other)) == 403, "a kubelet patched another node's status"
    assert status_code(lambda: patch_status(mine, me)) == 200, "a kubelet could not patch its own node's status"

    secrets = f"/api/v1/namespaces/{namespace}/secrets"
    for name in ("used", "unused"):
        api.post(secrets, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": {"k": name}})
    body = pod(
        "uses-secret",
        "cat /s/k; sleep 3600",
        nodeName=me,
        volumes=[{"name": "s", "secret": {"secretName": "used"}}],
        container={"volumeMounts": [{"name": "s", "mountPath": "/s"}]},
    )
    api.post(f"/api/v1/namespaces/{namespace}/pods", body)
    try:
        wait_phase(api, namespace, "uses-secret", {"Running"})  # its kubelet has read the Secret to mount it
        assert status_code(lambda: mine.get(f"{secrets}/used")) == 200
        assert status_code(lambda: mine.get(f"{secrets}/unused")) == 403, "a kubelet read a Secret no pod of its uses"
        assert status_code(lambda: theirs.get(f"{secrets}/used")) == 403, "a kubelet read another node's pod's Secret"
    finally:
        api.delete(f"/api/v1/namespaces/{namespace}/pods/uses-secret", {"gracePeriodSeconds": 0})

    for name in (me, other):
        config = yaml.safe_load(kubelet_kubeconfig(real_nodes.node(name)).read_text())
        (user,) = [u["user"] for u in config["users"] if u["name"] == config["contexts"][0]["context"]["user"]]
        assert "token" not in user
        cert = x509.load_pem_x509_certificate(base64.b64decode(user["client-certificate-data"]))
        assert [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)] == [f"system:node:{name}"]
        assert [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)] == ["system:nodes"]


#: Reads one line from the first connection (nc's ``-e``: with no stdin, a plain ``nc -l`` may leave before the data).
SERVER = "echo ready; nc -l -p 29500 -e sh -c 'read line; echo \"$line\" > /tmp/got'; cat /tmp/got"


def test_pod_to_pod_tcp_across_nodes(real_nodes: RealNodes, api: Kube, namespace: str) -> None:
    """A server pod on one node, a client pod on the other: TCP between their pod IPs, as torchrun's rendezvous."""
    first, second = real_nodes.node_names()[:2]
    api.post(
        f"/api/v1/namespaces/{namespace}/pods",
        pod("server", SERVER, nodeName=first),
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
    """Eviction: the container gets SIGTERM, and SIGKILL only once its grace period has passed.

    Both moments are read inside the container, on the host's clock (/proc/uptime): the SIGTERM trap
    writes its time, and the loop appends a beat every 0.2 s until the kill stops it. How long the
    kubelet then takes to report the pod's end (and the API to drop it) is a busy machine's pace, not
    the grace, so it is only waited for.
    """
    tmp_path.chmod(0o777)
    now = "cut -d' ' -f1 /proc/uptime"
    script = f'trap "{now} > /out/term" TERM; echo up > /out/up; while true; do {now} >> /out/beats; sleep 0.2; done'
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
    # The container ignores SIGTERM: only a SIGKILL ends it, and the pod leaves the API once it did.
    wait_for(lambda: gone(api, f"/api/v1/namespaces/{namespace}/pods/evictee"), 120, "evicted pod gone")
    termed = float((tmp_path / "term").read_text().split()[0])
    beats = [float(line) for line in (tmp_path / "beats").read_text().split("\n")[:-1] if line.strip()]
    lived = max(beats) - termed
    # The kubelet waited out the grace period before the kill: the loop went on beating for its 4 s,
    # and the kill came with the grace's end (containerd's own timer), not whenever the kubelet got to it.
    assert 3 <= lived < 15, f"the container beat {lived:.1f} s after its SIGTERM, its grace is 4 s"


def program_names(pids: set[int]) -> set[str]:
    """The programs ``pids`` run, leaving out those that exited since they were listed."""
    names = set()
    for pid in pids:
        try:
            names.add(Path(os.readlink(f"/proc/{pid}/exe")).name)
        except OSError:  # gone between the listing and now
            continue
    return names


def test_node_loss_kills_everything_at_once(real_nodes: RealNodes, api: Kube, namespace: str) -> None:
    """Node loss: kubelet, containerd, shims and containers die together; the Node goes."""
    name = real_nodes.node_names()[-1]
    api.post(f"/api/v1/namespaces/{namespace}/pods", pod("doomed", "sleep 3600", nodeName=name))
    wait_phase(api, namespace, "doomed", {"Running"})
    node = real_nodes.node(name)
    pids = node.pids()
    programs = program_names(pids)
    assert {"kubelet", "containerd", "containerd-shim-runc-v2", "busybox", "pause"} <= programs
    killed = real_nodes.kill(name)
    assert set(killed["pids"]) >= pids
    assert not [p for p in pids if realhost.alive(p)], "processes of the lost node still alive"
    # A lost machine tells nothing: the API still has the container running (its kubelet died before
    # it could hear of, and report, its containers' end).
    states = [s["state"] for s in api.get(f"/api/v1/namespaces/{namespace}/pods/doomed")["status"]["containerStatuses"]]
    assert [list(s) for s in states] == [["running"]], states
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
        # The dev cluster's node set, by its run marker (other sets may run beside it).
        run_id = json.loads((state / "realnodes" / "pids.json").read_text())["run_id"]
        programs = realhost.pids_with_env(f"SPOTGUARD_TESTENV_RUN={run_id}")
        assert program_names(programs) >= {"kubelet", "containerd"}
    finally:
        down = subprocess.run([*cli, "down", "--state-dir", str(state)], capture_output=True, text=True, env=env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not [p for p in programs if realhost.alive(p)], "real nodes' processes outlived the dev cluster"
    assert not [d for d in os.listdir("/sys/fs/cgroup/memory") if run_id in d], "the dev cluster left cgroups"
    assert not work_dir(run_id).exists()
