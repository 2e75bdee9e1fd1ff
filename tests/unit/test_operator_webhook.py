"""The webhook's pure part: annotations to an injection, errors naming the annotation."""

from __future__ import annotations

from typing import Any

import pytest

from spotguard.operator.podbuilder import OperatorConfig
from spotguard.operator.spec import SpecError
from spotguard.operator.webhook import injection_for_pod, job_name_of, mutated_pod

CFG = OperatorConfig(image="sg:test")


def pod(annotations: dict[str, str], labels: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    return {"metadata": {"annotations": annotations, "labels": labels or {"job-name": "train"}, **meta},
            "spec": {"containers": [{"name": "main", "image": "x"}], "terminationGracePeriodSeconds": 45}}


def test_injection_from_annotations() -> None:
    inj = injection_for_pod(pod({
        "spotguard.dev/storage": "s3://bucket/runs", "spotguard.dev/credentials-secret": "creds",
        "spotguard.dev/save-every-steps": "10", "spotguard.dev/save-every-seconds": "90",
        "spotguard.dev/checksum": "sha256", "spotguard.dev/keep-last": "5",
        "spotguard.dev/endpoint": "http://127.0.0.1:9000"}), "team", CFG)
    assert inj.storage_uri == "s3://bucket/runs/team/train" and inj.job == "train"
    assert inj.checkpoint.every_steps == 10 and inj.checkpoint.every_seconds == 90.0
    assert inj.checkpoint.checksum == "sha256" and inj.checkpoint.retention.keep_last == 5
    assert inj.checkpoint.credentials_secret is not None and inj.checkpoint.credentials_secret.name == "creds"
    assert inj.grace_period_seconds == 45 and inj.image == "sg:test"


@pytest.mark.parametrize(("annotations", "field"), [
    ({}, "metadata.annotations[spotguard.dev/storage]"),
    ({"spotguard.dev/storage": "gs://x"}, "metadata.annotations[spotguard.dev/storage]"),
    ({"spotguard.dev/storage": "s3://bucket/x", "spotguard.dev/save-every-steps": "often"},
     "metadata.annotations[spotguard.dev/save-every-steps]"),
    ({"spotguard.dev/storage": "s3://bucket/x", "spotguard.dev/save-every-steps": "0"},
     "metadata.annotations[spotguard.dev/save-every-steps]"),
    ({"spotguard.dev/storage": "s3://bucket/x", "spotguard.dev/checksum": "md5"},
     "metadata.annotations[spotguard.dev/checksum]"),
])
def test_errors_name_the_annotation(annotations: dict[str, str], field: str) -> None:
    with pytest.raises(SpecError) as err:
        injection_for_pod(pod(annotations), "ns", CFG)
    assert err.value.field == field


@pytest.mark.parametrize(("meta", "name"), [
    ({"annotations": {"spotguard.dev/job-name": "explicit"}, "labels": {"job-name": "j"}}, "explicit"),
    ({"labels": {"job-name": "batch-job"}}, "batch-job"),
    ({"labels": {"batch.kubernetes.io/job-name": "new-label"}}, "new-label"),
    ({"labels": {"jobset.sigs.k8s.io/jobset-name": "js"}}, "js"),
    ({"labels": {}, "ownerReferences": [{"kind": "ReplicaSet", "name": "rs-1", "controller": True}]}, "rs-1"),
    ({"labels": {}}, None),
])
def test_job_name(meta: dict[str, Any], name: str | None) -> None:
    assert job_name_of({"metadata": meta}) == name


def test_mutated_pod_is_injected_once() -> None:
    p = pod({"spotguard.dev/storage": "file:///mnt/ckpt"})
    spec, uri = mutated_pod(p, "ns", CFG)
    assert uri == "file:///mnt/ckpt/ns/train"
    assert [c["name"] for c in spec["containers"]] == ["main", "spotguard-sidecar"]
    again, _ = mutated_pod({**p, "spec": spec}, "ns", CFG)
    assert again == spec


@pytest.mark.parametrize(("value", "exposed"), [("true", True), ("false", False), (None, False)])
def test_trainer_credentials_by_annotation(value: str | None, exposed: bool) -> None:
    ann = {"spotguard.dev/storage": "s3://bkt/p", "spotguard.dev/credentials-secret": "s3"}
    if value is not None:
        ann["spotguard.dev/expose-credentials-to-trainer"] = value
    spec, _uri = mutated_pod(pod(ann), "ns", CFG)
    main = {e["name"] for e in spec["containers"][0]["env"]}
    assert ("AWS_SECRET_ACCESS_KEY" in main) is exposed
    sidecar = next(c for c in spec["containers"] if c["name"] == "spotguard-sidecar")
    assert "AWS_SECRET_ACCESS_KEY" in {e["name"] for e in sidecar["env"]}


def test_trainer_credentials_annotation_must_be_a_boolean() -> None:
    ann = {"spotguard.dev/storage": "s3://bkt/p", "spotguard.dev/expose-credentials-to-trainer": "yes"}
    with pytest.raises(SpecError) as err:
        injection_for_pod(pod(ann), "ns", CFG)
    assert err.value.field == "metadata.annotations[spotguard.dev/expose-credentials-to-trainer]"


def test_webhook_server_adds_the_request_namespace_through_the_public_protocol() -> None:
    import asyncio

    import kopf

    from spotguard.operator.handlers import NamespaceAwareWebhookServer

    seen: list[Any] = []

    async def fn(request: Any, **kwargs: Any) -> Any:
        seen.append((request["request"]["object"]["metadata"].get("namespace"), kwargs))
        return {"ok": True}

    async def inner(webhookfn: Any) -> Any:
        # A kopf server is called with the webhook function and yields client configs.
        answer = await webhookfn({"request": {"namespace": "team-a", "object": {"metadata": {}}}},
                                 webhook="inject-sidecar", headers={})
        yield {"url": "https://127.0.0.1:1", "answer": answer}

    async def main() -> list[Any]:
        return [c async for c in NamespaceAwareWebhookServer(inner)(fn)]

    configs = asyncio.run(main())
    assert configs == [{"url": "https://127.0.0.1:1", "answer": {"ok": True}}]
    assert seen == [("team-a", {"webhook": "inject-sidecar", "headers": {}})]
    # kopf's own server is used as it is, through the same protocol (no private method overridden).
    server = NamespaceAwareWebhookServer(kopf.WebhookServer(addr="127.0.0.1", port=1))
    assert callable(server.inner) and type(server.inner) is kopf.WebhookServer
    assert "_serve" not in NamespaceAwareWebhookServer.__dict__
