"""The mutating webhook, called by the real apiserver over TLS on 127.0.0.1 (the operator's own admission
server, registered by ``--webhook-manage``)."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotguard.operator.testing import OperatorProcess, free_port, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NO_NODE = {"spotguard.dev/test-no-node": "true"}


@pytest.fixture(scope="module")
def core(kube: Any) -> Any:
    from kubernetes import client

    return client.CoreV1Api(kube.api_client())


@pytest.fixture(scope="module")
def webhook(kube: Any, core: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An operator serving the webhook; yields the namespace to create pods in."""
    from kubernetes import client

    subprocess.run(
        [
            str(kube.bin_dir / "kubectl"),
            "--kubeconfig",
            str(kube.kubeconfig),
            "apply",
            "-f",
            str(ROOT / "crds" / "trainingjob.yaml"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    tmp = tmp_path_factory.mktemp("webhook")
    cert, key = tmp / "tls.crt", tmp / "tls.key"
    # A self-signed certificate for 127.0.0.1: the configuration trusts it as its own CA.
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
    ns = f"wh-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    config_name = f"t{uuid.uuid4().hex[:6]}.test.spotguard.dev"
    op = OperatorProcess(
        [
            "-n",
            ns,
            "--image",
            "spotguard:test",
            "--native-sidecar",
            "off",
            "--webhook",
            "--webhook-address",
            "127.0.0.1",
            "--webhook-port",
            str(free_port()),
            "--webhook-host",
            "127.0.0.1",
            "--webhook-cert",
            str(cert),
            "--webhook-key",
            str(key),
            "--webhook-manage",
            config_name,
        ],
        env=kube.env(),
        log_path=tmp / "operator.log",
    ).start()
    admission = client.AdmissionregistrationV1Api(kube.api_client())
    try:
        # The operator registers the configurations once its server listens.
        wait_for(
            lambda: admission.read_mutating_webhook_configuration(config_name).webhooks,
            "the webhook configuration with its webhooks",
        )
        yield ns
    finally:
        op.stop()
        print(f"--- operator log ---\n{op.log_tail(40)}")
        with contextlib.suppress(client.exceptions.ApiException):
            admission.delete_mutating_webhook_configuration(config_name)
        with contextlib.suppress(client.exceptions.ApiException):
            admission.delete_validating_webhook_configuration(config_name)
        core.delete_namespace(ns)


def pod(name: str, labels: dict[str, str], annotations: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": NO_NODE,
            "terminationGracePeriodSeconds": 20,
            "containers": [{"name": "trainer", "image": "trainer:1", "command": ["python", "train.py"]}],
        },
    }


def create_until_admitted(core: Any, ns: str, body: dict[str, Any]) -> Any:
    """Create a pod; the first attempts may race the webhook server's start-up."""
    from kubernetes.client.exceptions import ApiException

    def attempt() -> Any:
        try:
            return core.create_namespaced_pod(ns, body)
        except ApiException as exc:
            if exc.status == 500 and "failed calling webhook" in str(exc.body):
                return None
            raise

    return wait_for(attempt, "the webhook to answer", timeout=30)


def test_labelled_pod_gets_the_sidecar(core: Any, webhook: str) -> None:
    ns = webhook
    created = create_until_admitted(
        core,
        ns,
        pod(
            "injected",
            {"spotguard.dev/inject": "true", "job-name": "my-job"},
            {
                "spotguard.dev/storage": "s3://bucket/runs",
                "spotguard.dev/credentials-secret": "s3",
                "spotguard.dev/save-every-steps": "25",
            },
        ),
    )
    assert [c.name for c in created.spec.init_containers] == ["spotguard-restore"]
    assert [c.name for c in created.spec.containers] == ["trainer", "spotguard-sidecar"]
    env = {e.name: (e.value, e.value_from) for e in created.spec.containers[0].env}
    assert env["SPOTGUARD_SAVE_EVERY_STEPS"][0] == "25"
    # The storage and its credentials are the sidecar's business (the namespace came from the request).
    assert "AWS_SECRET_ACCESS_KEY" not in env and "SPOTGUARD_STORAGE_URI" not in env
    sidecar = {e.name: (e.value, e.value_from) for e in created.spec.containers[1].env}
    assert sidecar["SPOTGUARD_STORAGE_URI"][0] == f"s3://bucket/runs/{ns}/my-job"
    assert sidecar["AWS_SECRET_ACCESS_KEY"][1].secret_key_ref.name == "s3"
    assert created.spec.termination_grace_period_seconds == 20
    assert any(v.name == "spotguard" for v in created.spec.volumes)
    assert created.metadata.annotations["spotguard.dev/injected"] == f"s3://bucket/runs/{ns}/my-job"


def test_labelled_pod_without_storage_is_refused(core: Any, webhook: str) -> None:
    from kubernetes.client.exceptions import ApiException

    create_until_admitted(core, webhook, pod("warmup", {}, {}))
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod(webhook, pod("nostorage", {"spotguard.dev/inject": "true", "job-name": "j"}, {}))
    assert err.value.status == 400
    assert "metadata.annotations[spotguard.dev/storage]" in str(err.value.body)


def test_unlabelled_pod_is_untouched(core: Any, webhook: str) -> None:
    created = create_until_admitted(core, webhook, pod("plain", {"app": "x"}, {"spotguard.dev/storage": "s3://b/x"}))
    assert [c.name for c in created.spec.containers] == ["trainer"]
    assert not created.spec.init_containers


def test_pods_of_one_jobset_share_the_checkpoint_prefix(core: Any, webhook: str) -> None:
    """Two nodes of one JobSet (different child Jobs, indexes and names): one prefix, one attempt."""
    ns = webhook
    envs = []
    for job_index in (0, 1):
        child = f"llm-workers-{job_index}"
        labels = {
            "spotguard.dev/inject": "true",
            "jobset.sigs.k8s.io/jobset-name": "llm",
            "jobset.sigs.k8s.io/replicatedjob-name": "workers",
            "jobset.sigs.k8s.io/job-index": str(job_index),
            "jobset.sigs.k8s.io/restart-attempt": "2",
            "batch.kubernetes.io/job-name": child,
            "job-name": child,
            "batch.kubernetes.io/job-completion-index": "0",
        }
        body = pod(f"{child}-0-{uuid.uuid4().hex[:5]}", labels, {"spotguard.dev/storage": "s3://bucket/runs"})
        created = create_until_admitted(core, ns, body)
        by_name = {c.name: c for c in [*created.spec.init_containers, *created.spec.containers]}
        envs.append({name: {e.name: e.value for e in c.env} for name, c in by_name.items()})
        assert created.metadata.annotations["spotguard.dev/injected"] == f"s3://bucket/runs/{ns}/llm"
    for env in envs:
        # No credentials Secret: the trainer keeps the URI too (node or workload identity).
        for name in ("spotguard-restore", "spotguard-sidecar", "trainer"):
            assert env[name]["SPOTGUARD_STORAGE_URI"] == f"s3://bucket/runs/{ns}/llm"
            assert env[name]["SPOTGUARD_ATTEMPT"] == "2"
        assert env["trainer"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "20"
