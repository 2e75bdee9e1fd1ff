"""The operator keeps the webhook's certificate: a real operator process and the real apiserver.

As the chart installs it: the webhook configurations come without a
``caBundle`` and the operator gets ``--webhook-cert-secret``. It renews the
expiring certificate it finds in the Secret, puts the CA into both
configurations, and the apiserver then calls it over TLS; a certificate that
runs short while it serves is renewed, written and served without a restart.
"""

from __future__ import annotations

import base64
import contextlib
import socket
import ssl
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from spotguard.operator.testing import OperatorProcess, free_ports
from spotguard.operator.webhookcert import Bundle, issue
from testenv.kubetest import (
    GROUP,
    IMAGE,
    PLURAL,
    VERSION,
    create_job,
    delete_jobs,
    job_body,
    new_namespace,
    wait_for,
    wait_status,
)

pytestmark = pytest.mark.integration

RUN = uuid.uuid4().hex[:6]
NAME = f"sg-cert-{RUN}"
SECRET = f"{NAME}-tls"
#: Selects this module's pods and namespace only.
VIA = f"cert-test-{RUN}"
NO_NODE = {"spotguard.dev/test-no-node": "true"}
#: A serving certificate's life here (60 s): renewed 40 s after it was made.
DAYS = 60 / 86400


@dataclass
class Kept:
    ns: str
    port: int
    operator: OperatorProcess
    seeded: Bundle


def configurations(admission: Any, port: int) -> None:
    """Both configurations as the chart writes them: no caBundle (the operator puts it in). Fail: only an
    answer over TLS the apiserver trusts lets a request through."""
    common = {"admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail", "timeoutSeconds": 10}
    base = f"https://127.0.0.1:{port}"
    admission.create_mutating_webhook_configuration(
        {
            "metadata": {"name": NAME},
            "webhooks": [
                {
                    "name": f"inject.{VIA}.spotguard.dev",
                    **common,
                    "objectSelector": {"matchLabels": {"spotguard.dev/inject": "true", VIA: "yes"}},
                    "rules": [
                        {"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}
                    ],
                    "clientConfig": {"url": f"{base}/mutate-pods"},
                }
            ],
        }
    )
    admission.create_validating_webhook_configuration(
        {
            "metadata": {"name": NAME},
            "webhooks": [
                {
                    "name": f"updates.{VIA}.spotguard.dev",
                    **common,
                    "namespaceSelector": {"matchLabels": {VIA: "yes"}},
                    "rules": [
                        {"operations": ["UPDATE"], "apiGroups": [GROUP], "apiVersions": ["*"], "resources": [PLURAL]}
                    ],
                    "clientConfig": {"url": f"{base}/validate-trainingjobs"},
                }
            ],
        }
    )


@pytest.fixture(scope="module")
def kept(kube: Any, apis: tuple[Any, Any], crd: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kept]:
    from kubernetes import client

    core, _ = apis
    tmp = tmp_path_factory.mktemp("webhook-cert")
    ns = new_namespace(core, "cert")
    core.patch_namespace(ns, {"metadata": {"labels": {VIA: "yes"}}})
    (port,) = free_ports(1)
    admission = client.AdmissionregistrationV1Api(kube.api_client())
    # An earlier certificate that expires in about 15 minutes: due for renewal.
    seeded = issue(["127.0.0.1"], datetime.now(UTC) - timedelta(days=1), serving_days=1.01)
    core.create_namespaced_secret(
        ns, {"metadata": {"name": SECRET}, "type": "kubernetes.io/tls", "data": seeded.data()}
    )
    configurations(admission, port)
    args = [
        "-n",
        ns,
        "--image",
        IMAGE,
        "--native-sidecar",
        "off",
        "--resync-seconds",
        "2",
        "--no-read-checkpoints",
        "--webhook",
        "--webhook-address",
        "127.0.0.1",
        "--webhook-port",
        str(port),
        "--webhook-host",
        "127.0.0.1",
        "--webhook-cert-secret",
        SECRET,
        "--webhook-configuration",
        NAME,
        "--webhook-cert-days",
        f"{DAYS:.10f}",
        "--webhook-cert",
        str(tmp / "tls.crt"),
        "--webhook-key",
        str(tmp / "tls.key"),
    ]
    operator = OperatorProcess(args, env={**kube.env(), "POD_NAMESPACE": ns}, log_path=tmp / "operator.log")
    try:
        operator.start()
        yield Kept(ns, port, operator, seeded)
    finally:
        with contextlib.suppress(client.exceptions.ApiException):
            admission.delete_mutating_webhook_configuration(NAME)
        with contextlib.suppress(client.exceptions.ApiException):
            admission.delete_validating_webhook_configuration(NAME)
        with contextlib.suppress(Exception):
            delete_jobs(apis, ns, pods=False)
        operator.stop()
        print(f"--- operator log ---\n{operator.log_tail(40)}")
        core.delete_namespace(ns)


def secret_bundle(core: Any, ns: str) -> Bundle:
    bundle = Bundle.from_data(core.read_namespaced_secret(SECRET, ns).data)
    assert bundle is not None
    return bundle


def ca_bundles(admission: Any) -> list[bytes]:
    hooks = [
        *admission.read_mutating_webhook_configuration(NAME).webhooks,
        *admission.read_validating_webhook_configuration(NAME).webhooks,
    ]
    return [base64.b64decode(h.client_config.ca_bundle or "") for h in hooks]


def served_certificate(port: int) -> bytes:
    """The certificate the webhook server presents now (PEM)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return ssl.DER_cert_to_PEM_cert(der).encode()


def same_cert(a: bytes, b: bytes) -> bool:
    return x509.load_pem_x509_certificate(a) == x509.load_pem_x509_certificate(b)


def injected(core: Any, ns: str) -> bool:
    pod = {
        "metadata": {
            "generateName": "cert-",
            "labels": {"spotguard.dev/inject": "true", VIA: "yes", "job-name": "llm"},
            "annotations": {"spotguard.dev/storage": "s3://bucket/runs"},
        },
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": NO_NODE,
            "containers": [{"name": "trainer", "image": "trainer:1"}],
        },
    }
    made = core.create_namespaced_pod(ns, pod, dry_run="All")
    return "spotguard-sidecar" in [c.name for c in made.spec.containers]


def test_the_expiring_certificate_is_renewed_the_ca_put_in_and_the_apiserver_calls_the_webhook(
    kube: Any, apis: tuple[Any, Any], kept: Kept
) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core, custom = apis
    admission = client.AdmissionregistrationV1Api(kube.api_client())
    # Renewed at start, under the CA it had (far from expiry): the caBundle is that CA.
    wait_for(
        lambda: not same_cert(secret_bundle(core, kept.ns).tls_crt, kept.seeded.tls_crt),
        "the expiring certificate to be renewed",
        timeout=60,
    )
    renewed = secret_bundle(core, kept.ns)
    assert renewed.ca_crt == kept.seeded.ca_crt
    x509.load_pem_x509_certificate(renewed.tls_crt).verify_directly_issued_by(
        x509.load_pem_x509_certificate(renewed.ca_crt)
    )
    wait_for(lambda: ca_bundles(admission) == [renewed.ca_crt] * 2, "the CA in both configurations", timeout=60)
    # The apiserver calls both webhooks over TLS and trusts them (Fail: nothing passes otherwise).
    wait_for(lambda: injected(core, kept.ns), "the apiserver to call the mutating webhook", timeout=60)
    trainer = {"name": "trainer", "image": "trainer:1", "command": ["python", "-m", "train"]}
    create_job(apis, kept.ns, job_body("llm", "s3://bucket-a/runs", trainer, node_selector=NO_NODE))
    wait_status(apis, kept.ns, "llm", "attempt 1", lambda s: (s.get("attempt") or 0) >= 1)
    with pytest.raises(ApiException) as err:
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, kept.ns, PLURAL, "llm", {"spec": {"checkpoint": {"storage": "s3://bucket-b/runs"}}}
        )
    assert err.value.status == 422 and "would restart training from nothing" in str(err.value.body)


def test_a_certificate_that_runs_short_while_served_is_renewed_and_served_without_a_restart(
    apis: tuple[Any, Any], kept: Kept
) -> None:
    core, _ = apis
    wait_for(lambda: served_certificate(kept.port), "the webhook to serve", timeout=60)
    before = secret_bundle(core, kept.ns)
    wait_for(lambda: same_cert(served_certificate(kept.port), before.tls_crt), "the kept certificate served")
    pid = kept.operator.proc.pid if kept.operator.proc else None
    # 60 s of life: renewed 40 s after it was made.
    wait_for(
        lambda: not same_cert(secret_bundle(core, kept.ns).tls_crt, before.tls_crt),
        "the certificate to be renewed before it expires",
        timeout=90,
        interval=1,
    )
    after = secret_bundle(core, kept.ns)
    old_end = x509.load_pem_x509_certificate(before.tls_crt).not_valid_after_utc
    assert datetime.now(UTC) < old_end, "renewed before it expired"
    assert after.ca_crt == before.ca_crt
    wait_for(lambda: same_cert(served_certificate(kept.port), after.tls_crt), "the renewed certificate served")
    assert injected(core, kept.ns)
    assert pid is None or (
        kept.operator.proc is not None and kept.operator.proc.pid == pid and kept.operator.proc.poll() is None
    )


def test_two_replicas_that_find_no_or_an_expiring_certificate_at_once_agree_on_one(
    kube: Any, apis: tuple[Any, Any], kept: Kept, tmp_path: Path
) -> None:
    """Every replica keeps the certificate, none elected: writes carry the resourceVersion read, so of two
    that write at once one wins and the other (409) takes what it wrote."""
    import threading

    from kubernetes import client

    from spotguard.operator.webhookcert import CertificateKeeper

    core, _ = apis
    secret = f"{SECRET}-race"

    def keeper(i: int) -> CertificateKeeper:
        api = kube.api_client()
        return CertificateKeeper(
            client.CoreV1Api(api),
            client.AdmissionregistrationV1Api(api),
            kept.ns,
            secret,
            ["127.0.0.1"],
            str(tmp_path / f"{i}.crt"),
            str(tmp_path / f"{i}.key"),
        )

    def race(now: datetime | None = None) -> list[Bundle]:
        keepers, got = [keeper(0), keeper(1)], [None, None]
        start = threading.Barrier(2)

        def run(i: int) -> None:
            start.wait()
            got[i] = keepers[i].sync(now)

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(isinstance(b, Bundle) for b in got), got
        return got  # type: ignore[return-value]

    first = race()  # no Secret yet: both create, one wins
    assert first[0] == first[1] == secret_bundle_named(core, kept.ns, secret)
    assert (tmp_path / "0.crt").read_bytes() == (tmp_path / "1.crt").read_bytes() == first[0].tls_crt
    # A year on, both find it due at once: one renews, the other serves the same renewal.
    renewed = race(datetime.now(UTC) + timedelta(days=300))
    assert renewed[0] == renewed[1] == secret_bundle_named(core, kept.ns, secret)
    assert renewed[0].tls_crt != first[0].tls_crt and renewed[0].ca_crt == first[0].ca_crt


def secret_bundle_named(core: Any, ns: str, name: str) -> Bundle:
    bundle = Bundle.from_data(core.read_namespaced_secret(name, ns).data)
    assert bundle is not None
    return bundle
