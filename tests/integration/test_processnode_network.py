"""Pod networking on process nodes: a network namespace and IP per pod, cluster DNS names, host services.

Two pods on different nodes bind the same port, find each other by the names of
a headless Service, and see their own hostname and IP; hostNetwork pods share
the host's; a host service registered and started after a pod is reachable from
it at 127.0.0.1, while host listeners that are not the cluster's are not; a
pod's network goes with the pod (deletion, node loss). The host is left as the
agents found it: its own network settings untouched, and links of other live
agents (another test world's) never removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from testenv.processnode import ProcessNodes
from testenv.processnode.podnet import BRIDGE, OWNER_TAG, IpPool, available, veth_name
from testenv.require import require

pytestmark = pytest.mark.integration

require(available(), "pod networks need root and iproute2", "run the tests as root after `make setup`")

WAIT = 90.0
PORT = 29500

# Reports what the pod sees of its network as JSON on its first line of output.
REPORT = """
import json, os, socket, subprocess
addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"], capture_output=True, text=True).stdout.split()
print(json.dumps({"hostname": socket.gethostname(), "eth0": addr[3].split("/")[0] if len(addr) > 3 else None,
                  "pod_ip": os.environ.get("POD_IP"), "hosts": open("/etc/hosts").read()}), flush=True)
"""

SERVER = (
    REPORT
    + f"""
s = socket.socket()
s.bind(("0.0.0.0", {PORT}))
s.listen()
for _ in range(int(os.environ["CONNECTIONS"])):
    c, _ = s.accept()
    c.sendall(("from-" + socket.gethostname()).encode())
    c.close()
"""
)

CLIENT = (
    REPORT
    + f"""
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
# The hosts file as it was when the names resolved (at the start, a Service may have no ready endpoint yet).
print(json.dumps({{"hosts": open("/etc/hosts").read()}}), flush=True)
"""
)


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
    create_pod(
        core, ns, python_pod("server", SERVER, {"CONNECTIONS": "3"}, hostname="w-0", subdomain="w", nodeName=first)
    )
    create_pod(
        core,
        ns,
        python_pod("client", CLIENT, {"TARGETS": f"{fqdn} w-0.w"}, hostname="w-1", subdomain="w", nodeName=second),
    )

    # The host reaches a pod at its IP.
    server_ip = process_nodes.pod_ip(ns, "server")
    got = wait_for(lambda: _fetch(server_ip, PORT), "the server from the host")
    assert got == b"from-w-0"

    client = wait_phase(core, ns, "client", ("Succeeded", "Failed"))
    server = wait_phase(core, ns, "server", ("Succeeded", "Failed"))
    client_lines = output(process_nodes, ns, "client")
    assert client.status.phase == "Succeeded", client_lines
    assert server.status.phase == "Succeeded", output(process_nodes, ns, "server")
    assert client_lines[1:-1] == [f"{fqdn} from-w-0", "w-0.w from-w-0"]

    seen = {name: report(process_nodes, ns, name) for name in ("server", "client")}
    ips = {name: pod.status.pod_ip for name, pod in (("server", server), ("client", client))}
    assert ips["server"] == server_ip and ips["server"] != ips["client"]
    for name, hostname in (("server", "w-0"), ("client", "w-1")):
        assert seen[name]["hostname"] == hostname
        assert seen[name]["eth0"] == ips[name] != "127.0.0.1"
        assert seen[name]["pod_ip"] == ips[name]  # the downward API's status.podIP
        assert ips[name].startswith("127.64.")
    # The client's hosts file: its own names, and the server's by the headless Service's names.
    hosts = json.loads(client_lines[-1])["hosts"]
    assert f"{ips['client']}\tw-1.w.{ns}.svc.cluster.local w-1.w.{ns}.svc w-1.w w-1" in hosts
    assert f"{ips['server']}\t{fqdn} w-0.w.{ns}.svc w-0.w" in hosts.splitlines()
    assert "127.0.0.1\tlocalhost" in hosts


def test_pods_reach_a_service_by_its_name_at_a_ready_endpoint(core: Any, ns: str, process_nodes: ProcessNodes) -> None:
    """No kube-proxy and no cluster DNS: a Service's name leads to a ready endpoint's pod IP (its port is its
    target port), as the notice relay's URL needs."""
    first, second = process_nodes.node_names()[:2]
    core.create_namespaced_service(
        ns,
        {
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": PORT, "targetPort": PORT}]},
        },
    )
    server = python_pod("server", SERVER, {"CONNECTIONS": "2"}, nodeName=first)
    server["metadata"]["labels"] = {"app": "web"}
    create_pod(core, ns, server)
    create_pod(core, ns, python_pod("client", CLIENT, {"TARGETS": f"web.{ns}.svc web"}, nodeName=second))
    client = wait_phase(core, ns, "client", ("Succeeded", "Failed"))
    lines = output(process_nodes, ns, "client")
    assert client.status.phase == "Succeeded", lines
    assert lines[1:-1] == [f"web.{ns}.svc from-server", "web from-server"]
    server_ip = process_nodes.pod_ip(ns, "server")
    hosts = json.loads(lines[-1])["hosts"].splitlines()
    assert f"{server_ip}\tweb.{ns}.svc.cluster.local web.{ns}.svc web" in hosts, hosts


def test_a_services_name_needs_a_ready_endpoint() -> None:
    from testenv.processnode.hosts import ServiceAddress, service_of

    def endpoint_slice(*endpoints: dict[str, Any], service: str | None = "op") -> dict[str, Any]:
        labels = {"kubernetes.io/service-name": service} if service else {}
        return {
            "metadata": {"name": "op-x1", "namespace": "sys", "uid": "u", "labels": labels},
            "addressType": "IPv4",
            "endpoints": list(endpoints),
        }

    assert service_of(endpoint_slice()) is None
    assert service_of(endpoint_slice({"addresses": ["127.64.1.9"], "conditions": {"ready": False}})) is None
    assert service_of(endpoint_slice({"addresses": ["127.64.1.9"]}, service=None)) is None
    ready = endpoint_slice(
        {"addresses": ["127.64.1.9"], "conditions": {"ready": True}},
        {"addresses": ["127.64.1.3"]},
        {"addresses": ["127.64.1.1"], "conditions": {"ready": False}},
    )
    assert service_of(ready) == ServiceAddress("sys", "op", "127.64.1.3")
    assert ServiceAddress("sys", "op", "127.64.1.3").names("ml") == ["op.sys.svc.cluster.local", "op.sys.svc"]


def _fetch(ip: str, port: int) -> bytes | None:
    try:
        with socket.create_connection((ip, port), timeout=5) as c:
            return c.recv(100)
    except OSError:
        return None


def test_host_network_pod_shares_the_hosts_network(core: Any, ns: str, process_nodes: ProcessNodes) -> None:
    port = free_port()
    script = (
        REPORT
        + f"""
s = socket.socket()
s.bind(("127.0.0.1", {port}))
s.listen()
c, _ = s.accept()
c.sendall(b"host network")
c.close()
"""
    )
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
    """Registered host services on 127.0.0.1 are mirrored into pods, also ones registered and started later."""
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
    # Registered after the pod started, like a service the test world adds late.
    process_nodes.host_services.add(port, "a test's server")
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
        process_nodes.host_services.remove(port)
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
    def pidfile() -> Path:  # the pod's directory is made when the pod first runs
        return nodes.pod_dir(namespace, pod) / "_network.pid"

    pid = int(wait_for(lambda: pidfile().exists() and pidfile().read_text().split()[0], "the pod's sandbox"))
    inode = _netns_inode(pid)
    assert inode is not None and inode != os.stat("/proc/self/ns/net").st_ino
    return inode


def _network_gone(ip: str, inode: int) -> bool:
    return (
        not Path("/sys/class/net", veth_name(ip)).exists()
        and ip not in IpPool().held()
        and not (_processes_in_netns(inode))
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


# --- what a pod reaches of the host, and what the agents leave on it ---------------------------

# Connects to 127.0.0.1 at each WHAT=PORT of $PORTS and reports what happened, as JSON.
REACH = """
import json, os, socket
seen = {}
for item in os.environ["PORTS"].split():
    what, _, port = item.partition("=")
    try:
        c = socket.create_connection(("127.0.0.1", int(port)), timeout=10)
    except OSError as exc:
        seen[what] = type(exc).__name__
        continue
    with c:
        c.settimeout(3)
        try:
            greeting = c.recv(100).decode(errors="replace")[:20]
        except OSError:  # an HTTP server waits for the request
            greeting = ""
        seen[what] = "reached: " + greeting
print(json.dumps(seen), flush=True)
"""


class Banner:
    """A host service on 127.0.0.1 that greets every connection with ``text``."""

    def __init__(self, text: bytes) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = int(self.sock.getsockname()[1])
        self.text = text
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(self.text)

    def close(self) -> None:
        self.sock.close()


def test_pod_reaches_the_clusters_services_and_no_other_host_listener(
    core: Any, ns: str, kube: Any, s3_store: Any, process_nodes: ProcessNodes
) -> None:
    """Like a pod on a real node: the apiserver and the object store, not etcd-like internals of the host."""
    private = Banner(b"private")  # a host listener nobody registered (a test's own server, say)
    registered = Banner(b"registered")
    control = json.loads((process_nodes.state_dir / "control.json").read_text())["port"]
    ports = {
        "apiserver": urlparse(kube.server).port,
        "store": urlparse(s3_store.endpoint_url).port,
        "private": private.port,
        "agent-control": control,  # the agent's own control API: preempting nodes is not a pod's business
        "registered": registered.port,
    }
    try:
        with process_nodes.host_services.exposed(registered.port, "a test's server"):
            env = {"PORTS": " ".join(f"{k}={v}" for k, v in ports.items())}
            create_pod(core, ns, python_pod("reach", REACH, env))
            done = wait_phase(core, ns, "reach", ("Succeeded", "Failed"))
    finally:
        private.close()
        registered.close()
    lines = output(process_nodes, ns, "reach")
    assert done.status.phase == "Succeeded", lines
    seen = json.loads(lines[-1])
    assert seen["apiserver"].startswith("reached") and seen["store"].startswith("reached"), seen
    assert seen["registered"] == "reached: registered", seen
    assert seen["private"] == "ConnectionRefusedError", seen
    assert seen["agent-control"] == "ConnectionRefusedError", seen


def _route_localnet() -> dict[str, str]:
    return {c: Path(f"/proc/sys/net/ipv4/conf/{c}/route_localnet").read_text().strip() for c in ("all", "default")}


def test_agent_leaves_the_hosts_network_settings_as_it_found_them(
    core: Any, ns: str, kube: Any, tmp_path: Path
) -> None:
    """route_localnet goes on the pod bridge only, never on the host's all/default, while pods run and after."""
    before = _route_localnet()
    agent = ProcessNodes.start(
        kube.kubeconfig, tmp_path / "agent", count=1, extra_args=["--taint", "--name-prefix", "sysctl"]
    )
    try:
        (node,) = agent.node_names()
        create_pod(
            core,
            ns,
            python_pod("sleeper", "import time; time.sleep(600)", nodeName=node, tolerations=[{"operator": "Exists"}]),
        )
        wait_phase(core, ns, "sleeper", ("Running",))
        ip = agent.pod_ip(ns, "sleeper")
        wait_for(lambda: _fetch_refused(ip), f"the pod at {ip} from the host")  # pod networking works
        assert Path(f"/proc/sys/net/ipv4/conf/{BRIDGE}/route_localnet").read_text().strip() == "1"
        assert _route_localnet() == before
    finally:
        agent.stop()
    assert _route_localnet() == before


def _fetch_refused(ip: str) -> bool:
    """Whether ``ip`` answers (a refused connection is an answer: the pod's kernel sent it)."""
    try:
        with socket.create_connection((ip, 1), timeout=5):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def _start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _alias(name: str) -> str:
    return Path("/sys/class/net", name, "ifalias").read_text().strip()


@pytest.fixture
def fake_links() -> Iterator[list[str]]:
    """Names for links made by a test; whatever is left of them is deleted afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        if Path("/sys/class/net", name).exists():
            subprocess.run(["ip", "link", "del", name], check=False)
    IpPool().sweep()  # the bridge, if the test made it and no agent is left


def test_an_agent_removes_only_links_whose_owner_is_gone(tmp_path: Path, fake_links: list[str]) -> None:
    """Another test world's veth (its agent alive, its IPs in another table) survives an agent's start and stop."""
    live = subprocess.Popen(["sleep", "600"])
    dead = subprocess.Popen(["true"])
    dead_owner = f"{dead.pid} {_start_time(dead.pid)}"  # taken before it exits: zombie until waited for
    dead.wait()
    try:
        links = {
            "sgvfefe": f"{OWNER_TAG} {live.pid} {_start_time(live.pid)}",  # another world's, its agent alive
            "sgvfefd": f"{OWNER_TAG} {dead_owner}",  # left by an agent that is gone
            "sgvfefc": "",  # not made by an agent at all
        }
        for name, alias in links.items():
            fake_links.append(name)
            # A veth pair, as an agent makes (its peer outside the sgv names, not a pod's end).
            subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", f"sgt{name[3:]}"], check=True)
            if alias:
                subprocess.run(["ip", "link", "set", "dev", name, "alias", alias], check=True)
        pool = IpPool(tmp_path / "table")  # an agent with its own table: it knows none of these links
        pool.register()
        try:
            present = {name for name in links if Path("/sys/class/net", name).exists()}
            assert present == {"sgvfefe", "sgvfefc"}
            assert _alias("sgvfefe") == links["sgvfefe"]
            # The other world's pod is plugged into the bridge: the last agent of this table leaves it.
            subprocess.run(["ip", "link", "set", "sgvfefe", "master", BRIDGE], check=True)
        finally:
            pool.unregister()
        assert Path("/sys/class/net", BRIDGE).exists()
        assert Path("/sys/class/net", "sgvfefe").exists() and Path("/sys/class/net", "sgvfefc").exists()
        assert not (tmp_path / "table").exists()  # the table's files went with its last agent
    finally:
        live.kill()
        live.wait()
