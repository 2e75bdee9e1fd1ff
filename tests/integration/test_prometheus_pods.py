"""The test world's Prometheus finds pods as a PodMonitor does: at their pod IP and the port they
declare by name (``testenv.cluster.start_prometheus(pods=...)``, what the end-to-end tests scrape)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from spotguard.operator.testing import wait_for
from testenv import kubetest

pytestmark = pytest.mark.integration

SERVE = textwrap.dedent(
    """
    import http.server
    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"probe_up 1\\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("0.0.0.0", 9464), Metrics).serve_forever()
    """
)


@pytest.fixture
def namespace(apis: kubetest.Apis, process_nodes: Any) -> Iterator[str]:
    core, _ = apis
    name = kubetest.new_namespace(core, "prom")
    # 1.20 refuses pods until the ServiceAccount's token Secret is made too.
    wait_for(lambda: core.read_namespaced_service_account("default", name).secrets, "the token", timeout=60)
    yield name
    core.delete_namespace(name)


def test_a_pod_is_scraped_at_its_ip_and_named_port(
    kube: Any, apis: kubetest.Apis, namespace: str, prometheus: Callable[..., Any]
) -> None:
    core, _ = apis
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "probe"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": "python:test",
                    "command": ["python", "-c", SERVE],
                    "ports": [{"name": "metrics", "containerPort": 9464}, {"name": "other", "containerPort": 9465}],
                }
            ],
        },
    }
    core.create_namespaced_pod(namespace, pod)
    prom = prometheus({}, pods={"probe": (kube.kubeconfig, namespace, "metrics")})
    ip = wait_for(lambda: core.read_namespaced_pod("probe", namespace).status.pod_ip, "the pod's IP", timeout=120)
    series = wait_for(lambda: prom.query('probe_up{job="probe"}'), "the pod's metrics in Prometheus", timeout=120)
    assert [s["metric"]["instance"] for s in series] == [f"{ip}:9464"], series  # the named port only
    assert series[0]["value"][1] == "1"
