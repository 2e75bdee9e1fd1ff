"""gs:// jobs' pods: a service account key as a file (never an env value), or the pod's own identity."""

from __future__ import annotations

from typing import Any

import pytest

from spotguard.operator.podbuilder import GCS_KEY_FILE, OperatorConfig, build_pod
from spotguard.operator.probe import scrub
from spotguard.operator.spec import parse
from spotguard.operator.specfields import SpecError


def pod(checkpoint: dict[str, Any], native: bool = False) -> dict[str, Any]:
    spec = parse({"template": {"spec": {"containers": [{"name": "trainer", "image": "t"}]}}, "checkpoint": checkpoint})
    return build_pod("job", "ns", "uid", spec, 1, OperatorConfig(image="sg:1", native_sidecar=native))["spec"]


def containers(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env") or []}


@pytest.mark.parametrize("native", [False, True])
def test_a_key_secret_is_mounted_into_spotguards_containers_only(native: bool) -> None:
    spec = pod({"storage": "gs://bkt/runs", "credentialsSecret": {"name": "gcp", "keyFileKey": "sa.json"}}, native)
    volume = next(v for v in spec["volumes"] if v["name"] == "spotguard-gcs-key")
    assert volume["secret"] == {
        "secretName": "gcp",
        "items": [{"key": "sa.json", "path": "key.json"}],
        "defaultMode": 0o440,
    }
    by_name = containers(spec)
    for name in ("spotguard-restore", "spotguard-sidecar"):
        c = by_name[name]
        assert env(c)["GOOGLE_APPLICATION_CREDENTIALS"] == GCS_KEY_FILE
        assert env(c)["SPOTGUARD_STORAGE_URI"] == "gs://bkt/runs/ns/job"
        assert {"name": "spotguard-gcs-key", "mountPath": "/var/run/spotguard/gcs", "readOnly": True} in c[
            "volumeMounts"
        ]
        assert not any(k.startswith("AWS_") for k in env(c))
    trainer = by_name["trainer"]
    assert "GOOGLE_APPLICATION_CREDENTIALS" not in env(trainer)
    assert all(m["name"] != "spotguard-gcs-key" for m in trainer.get("volumeMounts") or [])


def test_exposed_credentials_reach_the_trainer_too() -> None:
    spec = pod({"storage": "gs://bkt", "credentialsSecret": "gcp", "exposeCredentialsToTrainer": True})
    trainer = containers(spec)["trainer"]
    assert env(trainer)["GOOGLE_APPLICATION_CREDENTIALS"] == GCS_KEY_FILE
    assert any(m["name"] == "spotguard-gcs-key" for m in trainer["volumeMounts"])


def test_without_a_secret_the_pods_own_identity_is_used_and_an_endpoint_is_an_emulators() -> None:
    spec = pod({"storage": "gs://bkt", "endpoint": "http://127.0.0.1:4443"})
    assert all(v["name"] != "spotguard-gcs-key" for v in spec["volumes"])
    sidecar = env(containers(spec)["spotguard-sidecar"])
    assert sidecar["STORAGE_EMULATOR_HOST"] == "http://127.0.0.1:4443"
    assert "GOOGLE_APPLICATION_CREDENTIALS" not in sidecar and "AWS_ENDPOINT_URL" not in sidecar
    # No Secret: the trainer keeps the URI (it may read storage with the pod's identity).
    assert env(containers(spec)["trainer"])["SPOTGUARD_STORAGE_URI"] == "gs://bkt/ns/job"


@pytest.mark.parametrize("storage", ["gs://my_bucket.v2/p", "gs://bkt"])
def test_gs_storage_is_accepted(storage: str) -> None:
    assert pod({"storage": storage})


def test_the_key_volume_name_is_reserved() -> None:
    with pytest.raises(SpecError, match="reserved"):
        parse(
            {
                "template": {
                    "spec": {
                        "containers": [{"name": "t", "image": "t"}],
                        "volumes": [{"name": "spotguard-gcs-key", "emptyDir": {}}],
                    }
                },
                "checkpoint": {"storage": "gs://bkt"},
            }
        )


def test_a_service_account_key_never_shows_in_a_probe_error() -> None:
    info = {"private_key": "MIIEvQIBADANBgkqhkiG9w0B", "private_key_id": "k123"}
    text = scrub("RefreshError: bad key MIIEvQIBADANBgkqhkiG9w0B (id k123)", {"credentials_info": info})
    assert "MIIEvQ" not in text and "k123" not in text and text.startswith("RefreshError")
