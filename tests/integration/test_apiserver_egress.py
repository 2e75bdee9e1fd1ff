"""The test control plane calls a webhook through its Service, as a cluster's apiserver does.

A webhook configured by ``clientConfig.service`` is dialled at the Service's
ClusterIP; the test world has no kube-proxy, so the apiserver's ``cluster``
egress (``testenv/realnode/svcproxy.py``) routes it to a Ready pod the Service
selects, at the pod's IP and the target port. Here the "pod" is an object
whose status says Running and Ready at a loopback address where this test
serves the webhook (no node needed): the apiserver reaches that address only
by the Service.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import random
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from spotguard.operator.testing import wait_for
from spotguard.operator.webhookcert import host_names, issue

pytestmark = pytest.mark.integration

SERVICE = "echo-hook"


class Hook(http.server.BaseHTTPRequestHandler):
    """A mutating webhook that annotates what it admits with the address it was reached at."""

    def do_POST(self) -> None:  # noqa: N802 - the handler's name in http.server
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        address = self.connection.getsockname()[0]
        patch = [{"op": "add", "path": "/metadata/annotations", "value": {"served-by": address}}]
        response = {
            "uid": review["request"]["uid"],
            "allowed": True,
            "patchType": "JSONPatch",
            "patch": base64.b64encode(json.dumps(patch).encode()).decode(),
        }
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass


@pytest.fixture
def served(kube: Any, tmp_path: Any) -> Iterator[tuple[Any, str, str, bytes]]:
    """A namespace, and the webhook served over TLS for its Service's name at a loopback address no
    node uses (127.77.x.y): (core API, namespace, that address, the CA)."""
    from kubernetes import client

    core = client.CoreV1Api(kube.api_client())
    ns = f"egress-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    # Kubernetes 1.20 refuses a namespace's pods until its default ServiceAccount has a token.
    wait_for(lambda: core.read_namespaced_service_account("default", ns).secrets, "the default token of " + ns)
    bundle = issue(host_names(f"{SERVICE}.{ns}.svc"), datetime.now(UTC))
    (tmp_path / "tls.crt").write_bytes(bundle.tls_crt)
    (tmp_path / "tls.key").write_bytes(bundle.tls_key)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    address = f"127.77.{random.randrange(1, 255)}.{random.randrange(1, 255)}"
    server = http.server.ThreadingHTTPServer((address, 0), Hook)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield core, ns, f"{address}:{server.server_address[1]}", bundle.ca_crt
    finally:
        server.shutdown()
        server.server_close()
        core.delete_namespace(ns)


def pod_at(core: Any, ns: str, ip: str, port: int, ready: bool) -> None:
    """A pod object of the Service's, bound to no node, whose status says Running at ``ip`` (Ready or not)."""
    container = {"name": "hook", "image": "none", "ports": [{"name": "https", "containerPort": port}]}
    # A scheduler of no one: nothing but this test writes the pod's status.
    spec = {"schedulerName": "spotguard-test-nobody", "containers": [container]}
    core.create_namespaced_pod(ns, {"metadata": {"name": "hook", "labels": {"app": SERVICE}}, "spec": spec})
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "conditions": [condition]}
    core.patch_namespaced_pod_status("hook", ns, {"status": status})


def webhook_configuration(name: str, ns: str, ca: bytes) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "echo.test.spotguard.dev",
                "clientConfig": {
                    "service": {"namespace": ns, "name": SERVICE, "path": "/mutate", "port": 443},
                    "caBundle": base64.b64encode(ca).decode(),
                },
                "rules": [
                    {"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"]}
                ],
                "objectSelector": {"matchLabels": {"egress-test": ns}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 5,
            }
        ],
    }


def test_the_apiserver_calls_a_webhook_by_its_service_at_a_ready_pods_ip(
    kube: Any, served: tuple[Any, str, str, bytes]
) -> None:
    """Not Ready, the pod gets no call (the configmap is refused: failurePolicy Fail); Ready, the webhook
    is reached at the pod's IP and target port through the Service's ClusterIP on port 443."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core, ns, where, ca = served
    ip, port = where.rsplit(":", 1)
    core.create_namespaced_service(
        ns,
        {
            "metadata": {"name": SERVICE},
            "spec": {"selector": {"app": SERVICE}, "ports": [{"port": 443, "targetPort": "https"}]},
        },
    )
    pod_at(core, ns, ip, int(port), ready=False)
    hooks = client.AdmissionregistrationV1Api(core.api_client)
    config = webhook_configuration(f"egress-{ns}", ns, ca)
    hooks.create_mutating_webhook_configuration(config)
    try:

        def create(name: str) -> Any:
            body = {"metadata": {"name": name, "labels": {"egress-test": ns}}, "data": {"x": "1"}}
            return core.create_namespaced_config_map(ns, body)

        # The configuration is in force within a moment: until then a configmap goes through unmutated.
        def refused() -> str | None:
            try:
                create(f"n{uuid.uuid4().hex[:6]}")
            except ApiException as exc:
                return str(exc.body)
            return None

        why = wait_for(refused, "a configmap refused while the pod is not Ready", timeout=30, interval=0.5)
        assert "echo.test.spotguard.dev" in why, why

        condition = {"type": "Ready", "status": "True"}
        core.patch_namespaced_pod_status("hook", ns, {"status": {"conditions": [condition]}})
        made = None
        for i in range(20):
            with contextlib.suppress(ApiException):
                made = create(f"a{i}")
                break
            time.sleep(0.5)
        assert made is not None, "no configmap admitted once the pod is Ready"
        assert (made.metadata.annotations or {}).get("served-by") == ip, made.metadata
    finally:
        hooks.delete_mutating_webhook_configuration(config["metadata"]["name"])
