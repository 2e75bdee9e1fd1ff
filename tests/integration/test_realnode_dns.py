"""Cluster DNS on real nodes (``testenv.realnode.dns``): a gang's pods meet at each other's stable names.

Two pods with ``hostname`` and ``subdomain`` and a headless Service of that
name, as the operator makes a multi-node TrainingJob's, on two real nodes:
each resolves the other's ``<hostname>.<subdomain>.<ns>.svc.cluster.local``
(and the short ``<hostname>.<subdomain>`` through its resolv.conf's search
list) and connects to it over TCP by name; a name nobody has is NXDOMAIN, and
a name outside the cluster domain is refused, not forwarded. And a torchrun
gang of two ranks on two real nodes, from the project's torch image, meets at
rank 0's stable name (``--master-addr``) and all-reduces over gloo.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from testenv.processnode.api import ApiError, Kube
from testenv.pytest_realnodes import ensure_real_nodes, real_node_namespace, wait_for
from testenv.realnode import RealNodes, dns
from testenv.realnode.config import BUSYBOX_IMAGE, bridge_gateway

SERVICE = "peers"
PORT = 7000

#: Each pod serves its hostname on PORT, then reports what it sees, one section per ``@@step``.
SCRIPT = r"""
(while true; do echo "hello from $(hostname)" | nc -l -p 7000; done) &
# The peer's listener takes one connection at a time: try again for a while.
connect() {
  i=0
  until got=$(nc -w 3 "$1" 7000 </dev/null 2>&1) && [ "${got#hello}" != "$got" ]; do
    i=$((i + 1)); [ $i -gt 60 ] && break; sleep 0.5
  done
  echo "$got"
}
echo "@@resolv"; cat /etc/resolv.conf
echo "@@hostname"; hostname
i=0
until busybox nslookup "$PEER" >/tmp/lookup 2>&1; do i=$((i + 1)); [ $i -gt 120 ] && break; sleep 0.5; done
echo "@@lookup"; cat /tmp/lookup
echo "@@connect"; connect "$PEER"
echo "@@short"; connect "$PEER_SHORT"
echo "@@unknown"; busybox nslookup "nobody.$SUBDOMAIN.$NS.svc.cluster.local" 2>&1; echo "rc=$?"
echo "@@outside"; busybox nslookup example.com 2>&1; echo "rc=$?"
echo "@@done"
sleep 120
"""


@pytest.fixture(scope="module")
def api(kube: Any) -> Kube:
    return Kube(kube.kubeconfig)


@pytest.fixture(scope="module")
def namespace(api: Kube) -> Iterator[str]:
    yield from real_node_namespace(api, "rn-dns")


def fqdn(host: str, ns: str) -> str:
    return f"{host}.{SERVICE}.{ns}.svc.cluster.local"


def peer_pod(host: str, peer: str, node: str, ns: str) -> dict[str, Any]:
    env = {"PEER": fqdn(peer, ns), "PEER_SHORT": f"{peer}.{SERVICE}", "SUBDOMAIN": SERVICE, "NS": ns}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": host, "labels": {"app": "dns-peers"}},
        "spec": {
            "nodeName": node,
            "hostname": host,
            "subdomain": SERVICE,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": BUSYBOX_IMAGE,
                    "command": ["sh", "-c", SCRIPT],
                    "env": [{"name": k, "value": v} for k, v in env.items()],
                }
            ],
        },
    }


def sections(api: Kube, ns: str, name: str) -> dict[str, str]:
    try:
        raw = api.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}/log", stream=True).data.decode()
    except ApiError:
        return {}  # not started yet
    out: dict[str, list[str]] = {}
    current = None
    for line in raw.splitlines():
        if line.startswith("@@"):
            current = line[2:]
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def test_peers_resolve_and_connect_by_stable_name(real_nodes: RealNodes, api: Kube, namespace: str) -> None:
    """Pods on two real nodes resolve each other's stable names (full and short) and connect over TCP by them;
    an unknown name in the cluster domain is NXDOMAIN, a name outside it is refused (nothing forwarded)."""
    first, second = real_nodes.node_names()[:2]
    assert real_nodes.set_no is not None
    gateway = bridge_gateway(real_nodes.set_no)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": SERVICE},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"app": "dns-peers"},
            "ports": [{"name": "peer", "port": PORT}],
        },
    }
    api.post(f"/api/v1/namespaces/{namespace}/services", service)
    for host, peer, node in (("a", "b", first), ("b", "a", second)):
        api.post(f"/api/v1/namespaces/{namespace}/pods", peer_pod(host, peer, node, namespace))
    try:
        got = {}
        for host in ("a", "b"):
            try:
                got[host] = wait_for(
                    lambda h=host: (s := sections(api, namespace, h)).get("done") is not None and s,  # type: ignore[misc]
                    180,
                    f"pod {host} done",
                )
            except AssertionError as exc:
                status = api.get(f"/api/v1/namespaces/{namespace}/pods/{host}").get("status")
                dns_log = real_nodes.dns.log_tail() if real_nodes.dns else "(no DNS server)"
                log = sections(api, namespace, host)
                raise AssertionError(f"{exc}\nstatus: {status}\nlog: {log}\nDNS:\n{dns_log}") from None
        ips = {h: api.get(f"/api/v1/namespaces/{namespace}/pods/{h}")["status"]["podIP"] for h in ("a", "b")}
        for host, peer in (("a", "b"), ("b", "a")):
            steps = got[host]
            assert f"nameserver {gateway}" in steps["resolv"], steps["resolv"]
            assert f"search {namespace}.svc.cluster.local svc.cluster.local cluster.local" in steps["resolv"]
            assert steps["hostname"] == host
            assert ips[peer] in steps["lookup"] and fqdn(peer, namespace) in steps["lookup"], steps["lookup"]
            assert steps["connect"] == f"hello from {peer}", steps
            assert steps["short"] == f"hello from {peer}", steps
            assert "NXDOMAIN" in steps["unknown"] and "rc=1" in steps["unknown"], steps["unknown"]
            assert "REFUSED" in steps["outside"] and "rc=1" in steps["outside"], steps["outside"]
        # The server itself, asked from the host over UDP, answers from the pods (and refuses what is not its).
        assert dns.lookup(gateway, fqdn("a", namespace)) == (dns.NOERROR, [ips["a"]])
        assert dns.lookup(gateway, f"{SERVICE}.{namespace}.svc.cluster.local") == (
            dns.NOERROR,
            sorted([ips["a"], ips["b"]]),
        )
        assert dns.lookup(gateway, fqdn("c", namespace))[0] == dns.NXDOMAIN
        assert dns.lookup(gateway, "example.com") == (dns.REFUSED, [])
    finally:
        for host in ("a", "b"):
            api.delete(f"/api/v1/namespaces/{namespace}/pods/{host}", {"gracePeriodSeconds": 0})


#: One rank's work: a gloo all-reduce of ``rank + 1`` across the gang.
ALLREDUCE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item()}", flush=True)
dist.destroy_process_group()
"""


def test_torchrun_gang_meets_at_rank0_stable_name(
    real_nodes: RealNodes, image_registry: Any, api: Kube, namespace: str
) -> None:
    """``torchrun --nnodes 2 --master-addr <job>-0.<service>.<ns>.svc.cluster.local``, one rank per real node, as
    the operator starts a gang: both ranks rendezvous at rank 0's name and all-reduce (1 + 2 = 3)."""
    job, svc = "gang", "gang-workers"
    master = f"{job}-0.{svc}.{namespace}.svc.cluster.local"
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": svc},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"app": job},
            "ports": [{"name": "c10d", "port": 29500}],
        },
    }
    api.post(f"/api/v1/namespaces/{namespace}/services", service)
    launch = (
        'printf "%s" "$SCRIPT" > /tmp/allreduce.py && exec torchrun --nnodes 2 --node-rank "$RANK_OF_NODE" '
        '--nproc-per-node 1 --master-addr "$MASTER" --master-port 29500 /tmp/allreduce.py'
    )
    names = [f"{job}-{rank}" for rank in range(2)]
    # The newest nodes of the session's set: those most likely to hold the torch image already.
    for rank, node in enumerate(ensure_real_nodes(real_nodes, 2)[-2:]):
        env = {"SCRIPT": ALLREDUCE, "MASTER": master, "RANK_OF_NODE": str(rank), "GLOO_SOCKET_IFNAME": "eth0"}
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": names[rank], "labels": {"app": job}},
            "spec": {
                "nodeName": node,
                "hostname": names[rank],
                "subdomain": svc,
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "main",
                        "image": image_registry.refs["spotguard-torch"],
                        "command": ["sh", "-c", launch],
                        "env": [{"name": k, "value": v} for k, v in env.items()],
                    }
                ],
            },
        }
        api.post(f"/api/v1/namespaces/{namespace}/pods", body)

    def phases() -> dict[str, str]:
        return {
            n: api.get(f"/api/v1/namespaces/{namespace}/pods/{n}").get("status", {}).get("phase", "") for n in names
        }

    def log(name: str) -> str:
        try:
            return str(api.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}/log", stream=True).data.decode())
        except ApiError as exc:
            return f"(no log: {exc})"

    try:
        # Pulling the torch image onto each node takes most of it.
        def ended() -> dict[str, str] | None:
            got = phases()
            return got if all(p in ("Succeeded", "Failed") for p in got.values()) else None

        assert wait_for(ended, 420, "both ranks ended") is not None
        final = phases()
        logs = {n: log(n) for n in names}
        assert final == dict.fromkeys(names, "Succeeded"), logs
        assert "rank 0 of 2 sum 3.0" in logs[names[0]], logs
        assert "rank 1 of 2 sum 3.0" in logs[names[1]], logs
    except AssertionError as exc:
        dns_log = real_nodes.dns.log_tail(60) if real_nodes.dns else "(no DNS server)"
        raise AssertionError(f"{exc}\nlogs: { {n: log(n)[-3000:] for n in names} }\nDNS:\n{dns_log}") from None
    finally:
        for name in names:
            api.delete(f"/api/v1/namespaces/{namespace}/pods/{name}", {"gracePeriodSeconds": 0})
