"""Pod networking on process nodes: a network namespace and IP per pod, cluster DNS names, host services.

Two pods on different nodes bind the same port, find each other by the names of
a headless Service, and see their own hostname and IP; hostNetwork pods share
the host's; a host service started after a pod is reachable from it at
127.0.0.1; a pod's network goes with the pod (deletion, node loss).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from testenv.processnode import ProcessNodes
from testenv.processnode.podnet import IpPool, available, veth_name

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not available(), reason="pod networks need root and iproute2"),
]

WAIT = 90.0
PORT = 29500

# Reports what the pod sees of its network as JSON on its first line of output.
REPORT = """
import json, os, socket, subprocess
addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"], capture_output=True, text=True).stdout.split()
print(json.dumps({"hostname": socket.gethostname(), "eth0": addr[3].split("/")[0] if len(addr) > 3 else None,
                  "pod_ip": os.environ.get("POD_IP"), "hosts": open("/etc/hosts").read()}), flush=True)
"""

SERVER = REPORT + f"""
s = socket.socket()
s.bind(("0.0.0.0", {PORT}))
s.listen()
for _ in range(int(os.environ["CONNECTIONS"])):
    c, _ = s.accept()
    c.sendall(("from-" + socket.gethostname()).encode())
    c.close()
"""

CLIENT = REPORT + f"""
import time
s = socket.socket()
s.bind(("0.0.0.0", {PORT}))  # the same port as the server, on another node: no collision
s.listen()
for name in os.environ["TARGETS"].split():
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection((name, {PORT}), timeout=5) as c:
                print(name, c.recv(100).decode(), flush=True)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                print(name, "failed", exc, flush=True)
                raise SystemExit(3)
            time.sleep(0.2)
"""


def wait_for(check: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def core(kube: Any) -> Any:
    from kubernetes import client

    return client.CoreV1Api(kube.api_client())


@pytest.fixture
def ns(core: Any) -> Iterator[str]:
    name = f"pnet-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


def create_pod(core: Any, namespace: str, pod: dict[str, Any]) -> None:
    from kubernetes.client.exceptions import ApiException

    deadline = time.monotonic() + WAIT
    while True:
        try:
            core.create_namespaced_pod(namespace, pod)
            return
        except ApiException as exc:
            if "service account" not in str(exc.body).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def python_pod(name: str, script: str, env: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    variables: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in (env or {}).items()]
    variables.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    main = {"name": "main", "image": "python:test", "command": ["python", "-c", script], "env": variables}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [main], **spec},
    }


def wait_phase(core: Any, namespace: str, name: str, phases: tuple[str, ...]) -> Any:
    def check() -> Any:
        pod = core.read_namespaced_pod(name, namespace)
        return pod if pod.status.phase in phases else None

    return wait_for(check, f"pod {namespace}/{name} in {phases}")


def output(nodes: ProcessNodes, namespace: str, pod: str) -> list[str]:
    path = nodes.log_path(namespace, pod, "main")
    return path.read_text().splitlines() if path.exists() else []


def report(nodes: ProcessNodes, namespace: str, pod: str) -> dict[str, Any]:
    lines = wait_for(lambda: output(nodes, namespace, pod), f"{pod}'s report")
    seen: dict[str, Any] = json.loads(lines[0])
    return seen


def pod_gone(core: Any, namespace: str, name: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        core.read_namespaced_pod(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_pods_on_two_nodes_bind_one_port_and_find_each_other_by_cluster_dns_names(
    core: Any, ns: str, process_nodes: ProcessNodes
) -> None:
    first, second = process_nodes.node_names()[:2]
    fqdn = f"w-0.w.{ns}.svc.cluster.local"
    create_pod(core, ns, python_pod("server", SERVER, {"CONNECTIONS": "3"}, hostname="w-0", subdomain="w",
                                    nodeName=first))  # fmt: skip
    create_pod(core, ns, python_pod("client", CLIENT, {"TARGETS": f"{fqdn} w-0.w"}, hostname="w-1", subdomain="w",
                                    nodeName=second))  # fmt: skip

    # The host reaches a pod at its IP.
    server_ip = process_nodes.pod_ip(ns, "server")
    got = wait_for(lambda: _fetch(server_ip, PORT), "the server from the host")
    assert got == b"from-w-0"

    client = wait_phase(core, ns, "client", ("Succeeded", "Failed"))
    server = wait_phase(core, ns, "server", ("Succeeded", "Failed"))
    client_lines = output(process_nodes, ns, "client")
    assert client.status.phase == "Succeeded", client_lines
    assert server.status.phase == "Succeeded", output(process_nodes, ns, "server")
    assert client_lines[1:] == [f"{fqdn} from-w-0", "w-0.w from-w-0"]

    seen = {name: report(process_nodes, ns, name) for name in ("server", "client")}
    ips = {name: pod.status.pod_ip for name, pod in (("server", server), ("client", client))}
    assert ips["server"] == server_ip and ips["server"] != ips["client"]
    for name, hostname in (("server", "w-0"), ("client", "w-1")):
        assert seen[name]["hostname"] == hostname
        assert seen[name]["eth0"] == ips[name] != "127.0.0.1"
        assert seen[name]["pod_ip"] == ips[name]  # the downward API's status.podIP
        assert ips[name].startswith("127.64.")
    # The client's hosts file: its own names, and the server's by the headless Service's names.
    hosts = seen["client"]["hosts"]
    assert f"{ips['client']}\tw-1.w.{ns}.svc.cluster.local w-1.w.{ns}.svc w-1.w w-1" in hosts
    assert f"{ips['server']}\t{fqdn} w-0.w.{ns}.svc w-0.w" in hosts.splitlines()
    assert "127.0.0.1\tlocalhost" in hosts


def _fetch(ip: str, port: int) -> bytes | None:
    try:
        with socket.create_connection((ip, port), timeout=5) as c:
            return c.recv(100)
    except OSError:
        return None


def test_host_network_pod_shares_the_hosts_network(core: Any, ns: str, process_nodes: ProcessNodes) -> None:
    port = free_port()
    script = REPORT + f"""
s = socket.socket()
s.bind(("127.0.0.1", {port}))
s.listen()
c, _ = s.accept()
c.sendall(b"host network")
c.close()
"""
    create_pod(core, ns, python_pod("hostnet", script, hostNetwork=True))
    got = wait_for(lambda: _fetch("127.0.0.1", port), "the hostNetwork pod at the host's 127.0.0.1")
    assert got == b"host network"
    done = wait_phase(core, ns, "hostnet", ("Succeeded", "Failed"))
    assert done.status.phase == "Succeeded", output(process_nodes, ns, "hostnet")
    assert done.status.pod_ip == "127.0.0.1"
    seen = report(process_nodes, ns, "hostnet")
    assert seen["hostname"] == socket.gethostname()
    assert seen["pod_ip"] == "127.0.0.1"
    assert seen["eth0"] != "127.0.0.1" and not str(seen["eth0"]).startswith("127.64.")


def test_pod_reaches_a_host_service_started_after_it(core: Any, ns: str, process_nodes: ProcessNodes) -> None:
    """Host services on 127.0.0.1:<ephemeral port> are mirrored into pods, also ones that start later."""
    port = free_port()
    size = 32 << 20
    script = f"""
import hashlib, socket, time
deadline = time.monotonic() + 60
while True:
    try:
        c = socket.create_connection(("127.0.0.1", {port}), timeout=5)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
payload = bytes(range(256)) * ({size} // 256)
c.sendall(payload)
c.shutdown(socket.SHUT_WR)
answer = b""
while chunk := c.recv(1 << 16):
    answer += chunk
print(answer.decode() == hashlib.sha256(payload).hexdigest() + ":" + str(len(payload)), len(answer), flush=True)
"""
    create_pod(core, ns, python_pod("outbound", script))
    wait_phase(core, ns, "outbound", ("Running",))
    time.sleep(1.5)  # connections are refused for a while: nothing listens yet

    digests: list[str] = []
    server = socket.socket()
    server.bind(("127.0.0.1", port))
    server.listen()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            h, n = hashlib.sha256(), 0
            while chunk := conn.recv(1 << 20):
                h.update(chunk)
                n += len(chunk)
            digests.append(h.hexdigest())
            conn.sendall(f"{h.hexdigest()}:{n}".encode())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        done = wait_phase(core, ns, "outbound", ("Succeeded", "Failed"))
    finally:
        server.close()
    lines = output(process_nodes, ns, "outbound")
    assert done.status.phase == "Succeeded", lines
    assert lines[-1].startswith("True"), lines
    assert digests, "the host service saw no connection"


def _netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _processes_in_netns(inode: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _netns_inode(int(entry.name)) == inode:
            found.append(int(entry.name))
    return found


def _sandbox_netns(nodes: ProcessNodes, namespace: str, pod: str) -> int:
    pidfile = nodes.state_dir / "pods" / f"{namespace}_{pod}" / "_network.pid"
    pid = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().split()[0], "the pod's sandbox"))
    inode = _netns_inode(pid)
    assert inode is not None and inode != os.stat("/proc/self/ns/net").st_ino
    return inode


def _network_gone(ip: str, inode: int) -> bool:
    return not Path("/sys/class/net", veth_name(ip)).exists() and ip not in IpPool().held() and not (
        _processes_in_netns(inode)
    )


@pytest.mark.parametrize("how", ["delete", "kill"])
def test_pod_network_is_released_with_the_pod(core: Any, ns: str, process_nodes: ProcessNodes, how: str) -> None:
    name = f"sleeper-{how}"
    create_pod(core, ns, python_pod(name, "import time; time.sleep(600)"))
    wait_phase(core, ns, name, ("Running",))
    ip = process_nodes.pod_ip(ns, name)
    inode = _sandbox_netns(process_nodes, ns, name)
    assert Path("/sys/class/net", veth_name(ip)).exists()
    assert IpPool().held().get(ip) == f"{ns}/{name}"
    assert len(_processes_in_netns(inode)) >= 2  # the sandbox and the container

    if how == "delete":
        core.delete_namespaced_pod(name, ns)
        wait_for(lambda: pod_gone(core, ns, name), f"pod {name} gone")
    else:
        with contextlib.suppress(Exception):
            process_nodes.preempt(name, ns, "kill")
    wait_for(lambda: _network_gone(ip, inode), f"the network of {name} ({ip}) released", timeout=30)
