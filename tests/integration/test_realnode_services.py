"""Pods on real nodes reach the test world's host services, and only those (``testenv.realnode.hostnet``).

A pod on a real node (kubelet + containerd, its own network namespace) reads
the apiserver through the ``kubernetes`` Service's ``10.0.0.1:443`` with its
ServiceAccount token, TLS verified against the token's ``ca.crt``; lists the
object store's buckets at ``127.0.0.1:<port>`` with boto3 (as the sidecar's
``AWS_ENDPOINT_URL`` says); reaches a test's own server once the test
registers its port, while the pod already runs, and not before nor after the
test removes it again; and its own
127.0.0.1 listener still answers. A set that stopped leaves no proxy, and at
no time a host-wide nft rule or sysctl change.

The pods run the host's ``python3`` from the busybox image with the host's
``/usr`` mounted (hostPath): no image build for a network test.
"""

from __future__ import annotations

import json
import socket
import socketserver
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from testenv.cluster import S3Store, Supervisor
from testenv.processnode.api import ApiError, Kube
from testenv.pytest_realnodes import real_node_namespace, require_real_nodes, wait_for
from testenv.realnode import RealNodes
from testenv.realnode import host as realhost
from testenv.realnode.cniplugin import SERVICE_IP, SERVICE_PORT
from testenv.realnode.config import BUSYBOX_IMAGE, bridge_gateway

#: The host's sysctls a set must never change (it sets route_localnet on its own bridge and in pods only).
HOST_SYSCTLS = [
    f"/proc/sys/net/ipv4/{name}"
    for name in (
        "ip_forward",
        "conf/all/route_localnet",
        "conf/default/route_localnet",
        "conf/lo/route_localnet",
        "conf/all/forwarding",
    )
]

#: What the pod does, one JSON line per step (the test reads them from its log, through the API).
POD_SCRIPT = r"""
import json, os, socket, ssl, sys, time, urllib.error, urllib.request

def say(**kv):
    print(json.dumps(kv), flush=True)

def reach(host, port):
    try:
        with socket.create_connection((host, port), timeout=3) as s:
            return s.recv(100).decode()
    except OSError as exc:
        return "error: " + type(exc).__name__

sa = "/var/run/secrets/kubernetes.io/serviceaccount"
host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
ctx = ssl.create_default_context(cafile=sa + "/ca.crt")
token = open(sa + "/token").read().strip()

def api(path):
    req = urllib.request.Request(f"https://{host}:{port}{path}", headers={"Authorization": "Bearer " + token})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()

say(step="env", host=host, port=port)
code, body = api("/version")
say(step="version", code=code, gitVersion=json.loads(body).get("gitVersion") if code == 200 else body[:200])
code, body = api("/api/v1/namespaces/" + os.environ["NS"] + "/pods")
say(step="whoami", code=code, body=body[:400])

sys.path.insert(0, "/site")
import boto3
s3 = boto3.client(
    "s3",
    endpoint_url="http://127.0.0.1:" + os.environ["S3_PORT"],
    aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
    aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
    region_name=os.environ["AWS_REGION"],
)
say(step="s3", buckets=[b["Name"] for b in s3.list_buckets()["Buckets"]])

own = socket.socket()
own.bind(("127.0.0.1", 0))
own.listen()
c = socket.create_connection(("127.0.0.1", own.getsockname()[1]), timeout=5)
own.accept()[0].sendall(b"own listener")
say(step="own", got=c.recv(100).decode())

late = int(os.environ["LATE_PORT"])
say(step="unregistered", loopback=reach("127.0.0.1", late), gateway=reach(os.environ["GATEWAY"], late))
deadline = time.monotonic() + 60
while True:
    got = reach("127.0.0.1", late)
    if not got.startswith("error") or time.monotonic() > deadline:
        break
    time.sleep(0.3)
say(step="registered", got=got)
deadline = time.monotonic() + 60
while True:
    got = reach("127.0.0.1", late)
    if got.startswith("error") or time.monotonic() > deadline:
        break
    time.sleep(0.3)
say(step="removed", got=got)
"""


@pytest.fixture(scope="module")
def api(kube: Any) -> Kube:
    return Kube(kube.kubeconfig)


@pytest.fixture(scope="module")
def namespace(api: Kube) -> Iterator[str]:
    yield from real_node_namespace(api, "rn-services")


class _Greeter(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def host_server() -> Iterator[int]:
    """A test's own server on the host's 127.0.0.1 (not registered): greets and closes."""

    class Greet(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.sendall(b"hello from the test's server")

    server = _Greeter(("127.0.0.1", 0), Greet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def pod_log(api: Kube, ns: str, name: str) -> str:
    try:
        return str(api.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}/log", stream=True).data.decode())
    except ApiError:
        return ""  # not started yet


def wait_step(api: Kube, ns: str, name: str, step: str, timeout: float) -> dict[str, dict[str, Any]]:
    """The pod's steps once ``step`` is among them (the pod's status and log in the failure)."""
    try:
        return wait_for(lambda: (s := pod_steps(api, ns, name)).get(step) and s, timeout, f"step {step!r}")  # type: ignore[no-any-return]
    except AssertionError as exc:
        status = api.get(f"/api/v1/namespaces/{ns}/pods/{name}").get("status")
        raise AssertionError(f"{exc}\nstatus: {json.dumps(status)}\nlog:\n{pod_log(api, ns, name)}") from None


def pod_steps(api: Kube, ns: str, name: str) -> dict[str, dict[str, Any]]:
    raw = pod_log(api, ns, name)
    steps = {}
    for line in raw.splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            steps[entry.pop("step")] = entry
    return steps


def host_pod(name: str, node: str, script: str, env: dict[str, str], site: Path) -> dict[str, Any]:
    """A busybox pod that runs the host's python3 (its /usr mounted) and the venv's boto3 at /site."""
    mounts = {"usr": ("/usr", "/usr"), "lib": ("/usr/lib", "/lib"), "lib64": ("/usr/lib64", "/lib64")}
    mounts["site"] = (str(site), "/site")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": BUSYBOX_IMAGE,
                    "command": ["/usr/bin/python3", "-I", "-c", script],
                    "env": [{"name": k, "value": v} for k, v in env.items()],
                    "volumeMounts": [{"name": k, "mountPath": m, "readOnly": True} for k, (_, m) in mounts.items()],
                }
            ],
            "volumes": [{"name": k, "hostPath": {"path": p}} for k, (p, _) in mounts.items()],
        },
    }


def test_pod_reaches_apiserver_store_and_registered_server_only(
    real_nodes: RealNodes,
    api: Kube,
    namespace: str,
    s3_store: S3Store,
    testenv_supervisor: Supervisor,
    host_server: int,
) -> None:
    """The apiserver through 10.0.0.1:443 (token + ca.crt), the store at 127.0.0.1:<port> (boto3), a test's server
    registered while the pod runs (and not before, nor after it is removed), the pod's own listener; an unregistered
    port is refused."""
    node = real_nodes.node_names()[0]
    s3_port = s3_store.endpoint_url.rsplit(":", 1)[1].rstrip("/")
    assert real_nodes.set_no is not None
    gateway = bridge_gateway(real_nodes.set_no)
    env = {
        "NS": namespace,
        "S3_PORT": s3_port,
        "AWS_ACCESS_KEY_ID": s3_store.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_store.secret_key,
        "AWS_REGION": s3_store.region,
        "LATE_PORT": str(host_server),
        "GATEWAY": gateway,
    }
    site = Path(boto3.__file__).resolve().parents[1]
    api.post(f"/api/v1/namespaces/{namespace}/pods", host_pod("client", node, POD_SCRIPT, env, site))
    steps = wait_step(api, namespace, "client", "unregistered", 120)
    # Only now may pods reach the test's server: the pod already runs and tries it until it answers.
    with testenv_supervisor.host_services.exposed(host_server, "a test's server"):
        steps = wait_step(api, namespace, "client", "registered", 90)
    # And once the port is taken off the list, the pod is refused again.
    steps = wait_step(api, namespace, "client", "removed", 90)
    pod = api.get(f"/api/v1/namespaces/{namespace}/pods/client")
    assert pod["status"]["podIP"].startswith(gateway.rsplit(".", 2)[0] + ".")
    assert steps["env"] == {"host": SERVICE_IP, "port": str(SERVICE_PORT)}
    assert steps["version"]["code"] == 200 and steps["version"]["gitVersion"].startswith("v1."), steps["version"]
    # The token is the pod's own: the apiserver names its ServiceAccount when it refuses.
    assert steps["whoami"]["code"] == 403
    assert f"system:serviceaccount:{namespace}:default" in steps["whoami"]["body"]
    assert s3_store.bucket in steps["s3"]["buckets"]
    assert steps["own"] == {"got": "own listener"}
    assert steps["unregistered"] == {
        "loopback": "error: ConnectionRefusedError",
        "gateway": "error: ConnectionRefusedError",
    }
    proxy = real_nodes.host_proxy.log_tail() if real_nodes.host_proxy else "(no proxy)"
    assert steps["registered"] == {"got": "hello from the test's server"}, f"the set's proxy:\n{proxy}"
    assert steps["removed"] == {"got": "error: ConnectionRefusedError"}


def nft_ruleset() -> str:
    return subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, check=True).stdout


def listeners_on(address: str) -> list[int]:
    """Ports with a TCP listener on ``address`` in the host's namespace."""
    hexaddr = socket.inet_aton(address)[::-1].hex().upper()
    ports = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        addr, _, port = fields[1].partition(":")
        if addr == hexaddr and fields[3] == "0A":
            ports.append(int(port, 16))
    return ports


def test_host_proxy_gone_and_host_untouched_after_stop(kube: Any, api: Kube, namespace: str, tmp_path: Path) -> None:
    """The set's proxy listens on its gateway while it runs and is gone after stop; the pods' rules live in their
    namespaces only: the host's nft ruleset and sysctls are the same before, during and after."""
    require_real_nodes()
    before = (nft_ruleset(), {p: Path(p).read_text() for p in HOST_SYSCTLS})
    nodes = RealNodes.start(kube.kubeconfig, kube.kubelet_client_ca, tmp_path / "set", count=1)
    try:
        (node,) = nodes.node_names()
        assert nodes.set_no is not None
        gateway = bridge_gateway(nodes.set_no)
        assert nodes.host_proxy is not None
        proxy = nodes.host_proxy.popen.pid
        assert nodes.api_port in listeners_on(gateway)
        # busybox's nc: the apiserver's TLS port answers a connection through the ClusterIP.
        script = f"nc -w 3 {SERVICE_IP} {SERVICE_PORT} </dev/null && echo connected"
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "probe"},
            "spec": {
                "nodeName": node,
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": BUSYBOX_IMAGE, "command": ["sh", "-c", script]}],
            },
        }
        api.post(f"/api/v1/namespaces/{namespace}/pods", body)

        def ended() -> str | None:
            phase = api.get(f"/api/v1/namespaces/{namespace}/pods/probe").get("status", {}).get("phase")
            return phase if phase in ("Succeeded", "Failed") else None

        assert wait_for(ended, 90, "probe pod") == "Succeeded"
        assert (nft_ruleset(), {p: Path(p).read_text() for p in HOST_SYSCTLS}) == before
    finally:
        nodes.stop()
    assert not realhost.alive(proxy), "the host services proxy outlived its set"
    assert listeners_on(gateway) == []
    assert (nft_ruleset(), {p: Path(p).read_text() for p in HOST_SYSCTLS}) == before
    api.delete(f"/api/v1/namespaces/{namespace}/pods/probe", {"gracePeriodSeconds": 0})
