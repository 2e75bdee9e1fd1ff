"""Admission served by every operator replica, the refusal of TrainingJob updates that would throw progress
away, and /readyz: two real operator processes with leader election, called by the real apiserver over TLS.

Each replica serves admission on its own port on 127.0.0.1; the test registers the configurations itself,
one per replica (told apart by a label of the pod), so that the standby is the only one that can answer
for some pods. The configurations select only this module's pods and namespace.
"""

from __future__ import annotations

import base64
import contextlib
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from spotguard.operator.admission import ALLOW_RESTART_ANNOTATION
from spotguard.operator.leader import pod_of
from spotguard.operator.testing import OperatorProcess, free_ports
from testenv.kubetest import (
    GROUP,
    IMAGE,
    PLURAL,
    VERSION,
    create_job,
    delete_jobs,
    get_job,
    job_body,
    kubectl,
    lease_holder,
    new_namespace,
    wait_for,
    wait_status,
)

pytestmark = pytest.mark.integration

NO_NODE = {"spotguard.dev/test-no-node": "true"}
LEASE = "spotguard-leader"
RUN = uuid.uuid4().hex[:6]
#: The label that sends a pod's admission to one replica only.
VIA = f"admission-test-{RUN}"


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (the configurations trust it as its own CA)."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def probe(port: int, path: str) -> tuple[int, str]:
    """GET a probe endpoint: its status and body, a 503 included."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:  # noqa: S310 - loopback
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@dataclass
class Replicas:
    ns: str
    leader: OperatorProcess
    standby: OperatorProcess
    #: Admission ports, by replica.
    ports: dict[str, int]
    #: The standby's probes while its admission port was taken, before it could serve.
    before_serving: dict[str, tuple[int, str]] = field(default_factory=dict)
    #: The standby's own certificate files, and one more the configurations already trust.
    standby_tls: tuple[Path, Path] = (Path(), Path())
    next_tls: tuple[Path, Path] = (Path(), Path())


def replica(kube: Any, ns: str, pod: str, port: int, tls: tuple[Path, Path], log_dir: Path) -> OperatorProcess:
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
        "--leader-elect",
        "--leader-elect-resource-namespace",
        ns,
        "--leader-elect-resource-name",
        LEASE,
        "--leader-elect-lease-duration",
        "4",
        "--leader-elect-renew-deadline",
        "2.5",
        "--leader-elect-retry-period",
        "0.5",
        "--webhook",
        "--webhook-address",
        "127.0.0.1",
        "--webhook-port",
        str(port),
        "--webhook-cert",
        str(tls[0]),
        "--webhook-key",
        str(tls[1]),
    ]
    return OperatorProcess(args, env={**kube.env(), "POD_NAME": pod}, log_path=log_dir / f"{pod}.log")


@pytest.fixture(scope="module")
def replicas(
    kube: Any, apis: tuple[Any, Any], crd: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Replicas]:
    from kubernetes import client

    core, _ = apis
    tmp = tmp_path_factory.mktemp("admission")
    shared, own, nxt = (self_signed(tmp, n) for n in ("shared", "standby", "next"))
    ns = new_namespace(core, "adm")
    core.patch_namespace(ns, {"metadata": {"labels": {VIA: "yes"}}})
    pa, pb = free_ports(2)
    leader = replica(kube, ns, "op-a", pa, shared, tmp)
    standby = replica(kube, ns, "op-b", pb, own, tmp)
    admission = client.AdmissionregistrationV1Api(kube.api_client())
    names: list[str] = []
    try:
        leader.start()
        wait_for(lambda: pod_of(lease_holder(core.api_client, ns, LEASE) or "") == "op-a", "op-a to lead")
        # The standby's admission port is taken: it stands by, alive, but not ready.
        with socket.create_server(("127.0.0.1", pb)) as taken:
            standby.start()
            before = {path: probe(standby.liveness_port, path) for path in ("/healthz", "/readyz")}
            taken.close()
        r = Replicas(ns, leader, standby, {"op-a": pa, "op-b": pb}, before, own, nxt)
        bundle = b"".join(Path(c).read_bytes() for c in (shared[0], own[0], nxt[0]))
        names = register(admission, r, bundle)
        yield r
    finally:
        for name in names:
            with contextlib.suppress(client.exceptions.ApiException):
                admission.delete_mutating_webhook_configuration(name)
            with contextlib.suppress(client.exceptions.ApiException):
                admission.delete_validating_webhook_configuration(name)
        with contextlib.suppress(Exception):
            delete_jobs(apis, ns, pods=False)
        for op in (standby, leader):
            op.stop()
            print(f"--- {op.log_path.name} ---\n{op.log_tail(30)}")
        core.delete_namespace(ns)


def register(admission: Any, r: Replicas, bundle: bytes) -> list[str]:
    """One MutatingWebhookConfiguration per replica (for pods labelled with its name), and the
    ValidatingWebhookConfiguration on the standby, for this namespace only. Fail: an answer is required."""
    ca = base64.b64encode(bundle).decode()
    common = {"admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail", "timeoutSeconds": 10}
    names = []
    for pod, port in r.ports.items():
        name = f"{VIA}-{pod}"
        names.append(name)
        admission.create_mutating_webhook_configuration(
            {
                "metadata": {"name": name},
                "webhooks": [
                    {
                        "name": f"{pod}.{VIA}.spotguard.dev",
                        **common,
                        "objectSelector": {"matchLabels": {"spotguard.dev/inject": "true", VIA: pod}},
                        "rules": [
                            {"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}
                        ],
                        "clientConfig": {"url": f"https://127.0.0.1:{port}/mutate-pods", "caBundle": ca},
                    }
                ],
            }
        )
    admission.create_validating_webhook_configuration(
        {
            "metadata": {"name": names[-1]},
            "webhooks": [
                {
                    "name": f"updates.{VIA}.spotguard.dev",
                    **common,
                    "namespaceSelector": {"matchLabels": {VIA: "yes"}},
                    "rules": [
                        {"operations": ["UPDATE"], "apiGroups": [GROUP], "apiVersions": ["*"], "resources": [PLURAL]}
                    ],
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{r.ports['op-b']}/validate-trainingjobs",
                        "caBundle": ca,
                    },
                }
            ],
        }
    )
    return names


def labelled_pod(via: str) -> dict[str, Any]:
    return {
        "metadata": {
            "generateName": f"{via}-",
            "labels": {"spotguard.dev/inject": "true", VIA: via, "job-name": "llm"},
            "annotations": {"spotguard.dev/storage": "s3://bucket/runs"},
        },
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": NO_NODE,
            "containers": [{"name": "trainer", "image": "trainer:1", "command": ["python", "train.py"]}],
        },
    }


def injected_by(core: Any, ns: str, via: str) -> Any:
    """A pod sent to replica ``via`` only; dry runs until the apiserver uses the configuration."""

    def dry_run() -> Any:
        pod = core.create_namespaced_pod(ns, labelled_pod(via), dry_run="All")
        return pod if "spotguard-sidecar" in [c.name for c in pod.spec.containers] else None

    wait_for(dry_run, f"the apiserver to call {via}'s admission server", timeout=30, interval=0.2)
    return core.create_namespaced_pod(ns, labelled_pod(via))


def test_the_standby_serves_admission_as_the_leader_does(apis: tuple[Any, Any], replicas: Replicas) -> None:
    core, _ = apis
    holder = lease_holder(core.api_client, replicas.ns, LEASE) or ""
    assert pod_of(holder) == "op-a"
    for via in ("op-b", "op-a"):  # the standby first: no one else may answer for its pods
        pod = injected_by(core, replicas.ns, via)
        assert [c.name for c in pod.spec.init_containers] == ["spotguard-restore"], via
        assert [c.name for c in pod.spec.containers] == ["trainer", "spotguard-sidecar"], via
        assert pod.metadata.annotations["spotguard.dev/injected"] == f"s3://bucket/runs/{replicas.ns}/llm"
    # Still the standby: it served admission without leading.
    assert lease_holder(core.api_client, replicas.ns, LEASE) == holder
    assert '"standby": true' in probe(replicas.standby.liveness_port, "/healthz")[1]


def test_readiness_of_the_standby_and_the_leader(replicas: Replicas) -> None:
    healthz, readyz = replicas.before_serving["/healthz"], replicas.before_serving["/readyz"]
    assert healthz[0] == 200 and '"standby": true' in healthz[1]
    assert readyz[0] == 503 and "the admission server is not serving yet" in readyz[1], readyz
    # Once the port was free, the standby serves and is ready; the leader is ready too.
    standby = wait_for(
        lambda: (lambda a: a if a[0] == 200 else None)(probe(replicas.standby.liveness_port, "/readyz")),
        "the standby to be ready",
        timeout=15,
    )
    assert '"role": "standby"' in standby[1] and '"waiting": []' in standby[1]
    leader = probe(replicas.leader.liveness_port, "/readyz")
    assert leader[0] == 200 and '"role": "running"' in leader[1], leader
    assert probe(replicas.leader.liveness_port, "/healthz")[0] == 200


def test_updates_that_would_restart_a_running_job_from_nothing_are_refused(
    kube: Any, apis: tuple[Any, Any], replicas: Replicas, tmp_path: Path
) -> None:
    from kubernetes.client.exceptions import ApiException

    core, custom = apis
    ns = replicas.ns
    trainer = {"name": "trainer", "image": "trainer:1", "command": ["python", "-m", "train"]}
    create_job(apis, ns, job_body("llm", "s3://bucket-a/runs", trainer, node_selector=NO_NODE))
    wait_status(apis, ns, "llm", "attempt 1", lambda s: (s.get("attempt") or 0) >= 1)

    # As a user sees it (kubectl), then through the API.
    out = kubectl(
        kube,
        "patch",
        "trainingjob",
        "llm",
        "-n",
        ns,
        "--type",
        "merge",
        "-p",
        '{"spec": {"checkpoint": {"storage": "s3://bucket-b/runs"}}}',
        check=False,
    )
    assert out.returncode != 0
    assert (
        "changing spec.checkpoint.storage from s3://bucket-a/runs to s3://bucket-b/runs would restart training"
        " from nothing" in out.stderr
    ), out.stderr
    assert f"{ALLOW_RESTART_ANNOTATION}=true" in out.stderr
    with pytest.raises(ApiException) as err:
        custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "llm", {"spec": {"nodes": 2}})
    assert err.value.status == 422 and "would resume at another world size" in str(err.value.body)
    assert get_job(apis, ns, "llm")["spec"]["checkpoint"]["storage"] == "s3://bucket-a/runs"

    # A status update passes (the subresource is the operator's; an admin may write it too).
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, ns, PLURAL, "llm", {"status": {"observedGeneration": 1}}
    )
    # With the annotation in the same update, the change is made on purpose.
    custom.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        ns,
        PLURAL,
        "llm",
        {
            "metadata": {"annotations": {ALLOW_RESTART_ANNOTATION: "true"}},
            "spec": {"checkpoint": {"storage": "s3://bucket-b/runs"}},
        },
    )
    assert get_job(apis, ns, "llm")["spec"]["checkpoint"]["storage"] == "s3://bucket-b/runs"
    assert (get_job(apis, ns, "llm")["status"].get("attempt") or 0) >= 1  # it had started: the check applied


def test_a_renewed_certificate_is_served_without_a_restart(replicas: Replicas) -> None:
    cert, key = replicas.standby_tls
    new_cert, new_key = replicas.next_tls
    port = replicas.ports["op-b"]

    def served() -> bytes:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as tls:
            der = tls.getpeercert(binary_form=True)
        assert der is not None
        return der

    def pem_der(path: Path) -> bytes:
        return ssl.PEM_cert_to_DER_cert(path.read_text())

    assert served() == pem_der(cert)
    # As a Secret volume changes: the key first, then the certificate (a pair that does not match yet).
    key.write_bytes(new_key.read_bytes())
    cert.write_bytes(new_cert.read_bytes())
    wait_for(lambda: served() == pem_der(new_cert), "the standby to serve the renewed certificate", timeout=10)
    assert replicas.standby.proc is not None and replicas.standby.proc.poll() is None
