"""The apiserver's cluster egress (testenv/realnode/svcproxy.py): what a CONNECT is routed to, without I/O."""

from __future__ import annotations

from typing import Any

import pytest

from testenv.cluster import egress_selector_config
from testenv.realnode.svcproxy import Refused, backends, parse_connect, route


def service(ip: str = "10.0.0.7", port: int = 443, target: Any = "webhook", **spec: Any) -> dict[str, Any]:
    ports = [{"name": "webhook", "port": port, "targetPort": target, "protocol": "TCP"}]
    return {
        "metadata": {"namespace": "ops", "name": "hook"},
        "spec": {"clusterIP": ip, "clusterIPs": [ip], "selector": {"app": "hook"}, "ports": ports, **spec},
    }


def pod(ip: str, ready: bool = True, ns: str = "ops", app: str = "hook", **extra: Any) -> dict[str, Any]:
    containers = [{"name": "op", "ports": [{"name": "webhook", "containerPort": 9443}]}]
    return {
        "metadata": {"namespace": ns, "name": f"p-{ip}", "labels": {"app": app}, **extra},
        "spec": {"containers": containers},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_a_connect_request_names_its_target() -> None:
    assert parse_connect(b"CONNECT 10.0.0.7:443 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n") == ("10.0.0.7", 443)
    assert parse_connect(b"CONNECT [::1]:80 HTTP/1.1\r\n\r\n") == ("::1", 80)
    for bad in (b"GET / HTTP/1.1\r\n\r\n", b"CONNECT 10.0.0.7 HTTP/1.1\r\n\r\n", b"CONNECT a:99999 HTTP/1.1\r\n\r\n"):
        with pytest.raises(Refused):
            parse_connect(bad)


def test_a_cluster_ip_goes_to_the_ready_pods_the_service_selects_at_the_named_target_port() -> None:
    pods = [
        pod("127.80.1.2"),
        pod("127.80.2.2"),
        pod("127.80.1.3", ready=False),  # not Ready: the Endpoints controller leaves it out
        pod("127.80.1.4", deletionTimestamp="2026-01-01T00:00:00Z"),  # terminating
        pod("127.80.1.5", ns="other"),  # another namespace
        pod("127.80.1.6", app="other"),  # not selected
    ]
    assert backends([service()], pods, "10.0.0.7", 443) == [("127.80.1.2", 9443), ("127.80.2.2", 9443)]
    assert backends([service(target=8443)], pods[:1], "10.0.0.7", 443) == [("127.80.1.2", 8443)]
    published = service(publishNotReadyAddresses=True)
    assert ("127.80.1.3", 9443) in backends([published], pods, "10.0.0.7", 443)


def test_what_no_service_holds_is_refused_and_loopback_goes_as_it_is() -> None:
    def lister() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return [service()], [pod("127.80.1.3", ready=False)]

    # A kubelet or a pod: on the machine's loopback, connected as it is (nothing listed).
    assert route("127.0.100.2", 10250, lambda: pytest.fail("listed")) == [("127.0.100.2", 10250)]
    for host, port, status in (
        ("10.0.0.7", 443, 503),  # the service's only pod is not ready
        ("10.0.0.7", 80, 404),  # a port the service does not serve
        ("10.0.0.8", 443, 404),  # an address no service holds
        ("192.0.2.1", 443, 404),  # off the machine: never connected
        ("example.com", 443, 403),
    ):
        with pytest.raises(Refused) as caught:
            route(host, port, lister)
        assert caught.value.status == status, (host, port, caught.value)


def test_the_apiservers_cluster_traffic_goes_through_the_proxy_socket(tmp_path: Any) -> None:
    config = egress_selector_config(tmp_path / "egress.sock")
    assert config["kind"] == "EgressSelectorConfiguration"
    [selection] = config["egressSelections"]
    assert selection["name"] == "cluster"
    assert selection["connection"] == {
        "proxyProtocol": "HTTPConnect",
        "transport": {"uds": {"udsName": str(tmp_path / "egress.sock")}},
    }
