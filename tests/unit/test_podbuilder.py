"""The pod builder: what the user wrote passes through; spotguard's parts are added exactly once."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from spotguard.operator.podbuilder import (
    Injection,
    OperatorConfig,
    build_pod,
    inject,
    server_supports_native_sidecars,
)
from spotguard.operator.spec import parse

AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]}]}
            ]
        }
    }
}
TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def job_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "template": {
            "metadata": {"labels": {"team": "ml"}, "annotations": {"note": "x"}},
            "spec": {
                "serviceAccountName": "trainer-sa",
                "nodeSelector": {"cloud.google.com/gke-spot": "true"},
                "tolerations": TOLERATIONS,
                "affinity": AFFINITY,
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
                "containers": [
                    {
                        "name": "trainer",
                        "image": "trainer:1",
                        "command": ["python", "-m", "train"],
                        "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "8Gi"}},
                        "env": [{"name": "SPOTGUARD_SAVE_EVERY_STEPS", "value": "7"}, {"name": "LR", "value": "0.1"}],
                        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                    }
                ],
            },
        },
        "checkpoint": {
            "storage": "s3://bucket/root",
            "credentialsSecret": {"name": "s3"},
            "everySteps": 50,
            "checksum": "sha256",
        },
        "preemption": {"gracePeriodSeconds": 45},
    }
    spec.update(overrides)
    return spec


def build(native: bool = False, attempt: int = 3, **overrides: Any) -> dict[str, Any]:
    cfg = OperatorConfig(image="spotguard:test", native_sidecar=native)
    return build_pod("demo", "team-a", "uid-123", parse(job_spec(**overrides)), attempt, cfg)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_identity_labels_owner() -> None:
    pod = build()
    meta = pod["metadata"]
    assert meta["name"] == "demo-a3" and meta["namespace"] == "team-a"
    assert meta["labels"] == {
        "team": "ml",
        "spotguard.dev/job": "demo",
        "spotguard.dev/attempt": "3",
        "app.kubernetes.io/managed-by": "spotguard",
    }
    assert meta["annotations"] == {"note": "x"}
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "spotguard.dev/v1alpha1",
            "kind": "TrainingJob",
            "name": "demo",
            "uid": "uid-123",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["terminationGracePeriodSeconds"] == 45


def test_scheduling_fields_pass_through_untouched() -> None:
    spec = build()["spec"]
    assert spec["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert spec["tolerations"] == TOLERATIONS
    assert spec["affinity"] == AFFINITY
    assert spec["serviceAccountName"] == "trainer-sa"
    trainer = spec["containers"][0]
    assert trainer["resources"] == {"limits": {"nvidia.com/gpu": 1, "memory": "8Gi"}}
    assert trainer["image"] == "trainer:1" and trainer["command"] == ["python", "-m", "train"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "data"}} in spec["volumes"]


def test_classic_layout() -> None:
    spec = build(native=False)["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["spotguard-restore"]
    assert [c["name"] for c in spec["containers"]] == ["trainer", "spotguard-sidecar"]
    sidecar = spec["containers"][1]
    assert "restartPolicy" not in sidecar
    assert env_of(sidecar)["SPOTGUARD_SIDECAR_MODE"] == "classic"


def test_native_layout() -> None:
    spec = build(native=True)["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["spotguard-restore", "spotguard-sidecar"]
    assert spec["initContainers"][1]["restartPolicy"] == "Always"
    assert [c["name"] for c in spec["containers"]] == ["trainer"]
    assert env_of(spec["initContainers"][1])["SPOTGUARD_SIDECAR_MODE"] == "native"


def test_restore_command_and_images() -> None:
    spec = build()["spec"]
    restore = spec["initContainers"][0]
    assert restore["command"] == [
        "spotguard",
        "restore",
        "--storage",
        "$(SPOTGUARD_STORAGE_URI)",
        "--dest",
        "/var/lib/spotguard/checkpoints",
    ]
    assert restore["image"] == "spotguard:test"
    assert spec["containers"][1]["command"] == ["spotguard", "sidecar"]
    assert build(sidecar={"image": "custom:1"})["spec"]["containers"][1]["image"] == "custom:1"


def _with_users(pod_user: int | None, *trainer_users: int | None) -> dict[str, Any]:
    """The template's spec with ``runAsUser`` named by the pod (None: not) and by each trainer container."""
    template = job_spec()["template"]
    first = template["spec"]["containers"][0]
    template["spec"]["containers"] = [
        {**copy.deepcopy(first), "name": f"t{i}", **({"securityContext": {"runAsUser": u}} if u is not None else {})}
        for i, u in enumerate(trainer_users)
    ]
    if pod_user is not None:
        template["spec"]["securityContext"] = {"runAsUser": pod_user}
    return template


@pytest.mark.parametrize(
    ("pod_user", "trainer_users", "grants"),
    [
        (None, (None,), False),  # the trainer runs as its image's user, maybe not the grant's writer
        (1000, (None,), True),  # the pod names it: the restore container runs as it too
        (None, (1000,), True),
        (1000, (1000, None), True),
        (1000, (1000, 2000), False),  # a second trainer of another user could not read the grant
        (None, (1000, None), False),
        (0, (None,), False),  # root in the template: spotguard's containers run as the image's user
        (1000, (0,), False),
    ],
)
def test_the_restore_container_grants_only_where_the_trainers_can_read_the_grant(
    pod_user: int | None, trainer_users: tuple[int | None, ...], grants: bool
) -> None:
    """``--grant`` with ``checkpoint.restoreGrant``: the restore grant is a file of mode 0600, written
    by the restore container's user."""
    checkpoint = {**job_spec()["checkpoint"], "restoreGrant": True}
    spec = build(native=True, template=_with_users(pod_user, *trainer_users), checkpoint=checkpoint)["spec"]
    restore = spec["initContainers"][0]
    base = ["spotguard", "restore", "--storage", "$(SPOTGUARD_STORAGE_URI)", "--dest", "/var/lib/spotguard/checkpoints"]
    assert restore["command"] == ([*base, "--grant"] if grants else base)
    if grants:
        assert restore["securityContext"]["runAsUser"] == 1000
    # Off by default: a trainer that knows no grant would find no local copy.
    unasked = build(native=True, template=_with_users(pod_user, *trainer_users))["spec"]
    assert unasked["initContainers"][0]["command"] == base


def test_contract_env() -> None:
    spec = build()["spec"]
    env = env_of(spec["containers"][0])
    assert env["SPOTGUARD_CHECKPOINT_DIR"] == "/var/lib/spotguard/checkpoints"
    assert env["SPOTGUARD_CONTROL_DIR"] == "/var/lib/spotguard/checkpoints/.control"
    assert "SPOTGUARD_STORAGE_URI" not in env  # the restore init container staged the checkpoint
    assert env_of(spec["containers"][1])["SPOTGUARD_STORAGE_URI"] == "s3://bucket/root/team-a/demo"
    assert env["SPOTGUARD_JOB"] == "demo" and env["SPOTGUARD_ATTEMPT"] == "3"
    assert env["SPOTGUARD_CHECKSUM"] == "sha256"
    assert env["SPOTGUARD_GRACE_SECONDS"] == "45"
    assert env["SPOTGUARD_SAVE_EVERY_STEPS"] == "7"  # the user's explicit value wins
    assert env["LR"] == "0.1"
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    # Storage credentials go to spotguard's containers only (see test_trainer_gets_credentials_only_on_request).
    sidecar = env_of(spec["containers"][1])
    assert sidecar["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "s3", "key": "AWS_ACCESS_KEY_ID"}}
    assert sidecar["AWS_SECRET_ACCESS_KEY"] == {"secretKeyRef": {"name": "s3", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert sidecar["AWS_ENDPOINT_URL_S3"] == {
        "secretKeyRef": {"name": "s3", "key": "AWS_ENDPOINT_URL", "optional": True}
    }
    names = [e["name"] for e in spec["containers"][0]["env"]]
    assert len(names) == len(set(names))
    # The sidecar gets the operator's interval, the trainer's override is the trainer's business.
    assert env_of(spec["containers"][1])["SPOTGUARD_SAVE_EVERY_STEPS"] == "50"


def test_explicit_endpoint_and_region() -> None:
    spec = job_spec()
    spec["checkpoint"].update({"endpoint": "http://127.0.0.1:8333", "region": "us-west-2"})
    pod = build_pod("demo", "ns", "u", parse(spec), 1, OperatorConfig())
    env = env_of(pod["spec"]["containers"][0])
    assert env["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:8333"
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:8333"
    assert env["AWS_DEFAULT_REGION"] == "us-west-2"


def test_credentials_never_inline() -> None:
    pod = build()
    for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
        for e in c["env"]:
            if e["name"].startswith("AWS_") and e["name"] not in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
                assert "value" not in e and "secretKeyRef" in e["valueFrom"]


def test_shared_volume_everywhere() -> None:
    spec = build()["spec"]
    assert spec["volumes"].count({"name": "spotguard", "emptyDir": {}}) == 1
    for c in spec["initContainers"] + spec["containers"]:
        mounts = [m for m in c["volumeMounts"] if m["name"] == "spotguard"]
        assert mounts == [{"name": "spotguard", "mountPath": "/var/lib/spotguard"}], c["name"]
    assert {"name": "data", "mountPath": "/data"} in spec["containers"][0]["volumeMounts"]


def test_user_init_containers_after_restore() -> None:
    spec = job_spec()
    spec["template"]["spec"]["initContainers"] = [{"name": "fetch", "image": "busybox"}]
    pod = build_pod("demo", "ns", "u", parse(spec), 1, OperatorConfig(native_sidecar=True))
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["spotguard-restore", "spotguard-sidecar", "fetch"]


def test_template_not_mutated() -> None:
    parsed = parse(job_spec())
    before = copy.deepcopy(parsed.template.spec)
    build_pod("demo", "ns", "u", parsed, 1, OperatorConfig())
    assert parsed.template.spec == before


@pytest.mark.parametrize("native", [False, True])
def test_inject_is_idempotent(native: bool) -> None:
    parsed = parse(job_spec())
    inj = Injection(
        job="demo",
        namespace="ns",
        storage_uri="s3://b/ns/demo",
        checkpoint=parsed.checkpoint,
        grace_period_seconds=30,
        native_sidecar=native,
    )
    once = inject(parsed.template.spec, inj)
    assert inject(once, inj) == once


@pytest.mark.parametrize(
    ("major", "minor", "native"),
    [
        ("1", "20", False),
        ("1", "28", False),
        ("1", "29", True),
        ("1", "30+", True),
        ("1", "29-gke.1", True),
        ("2", "0", True),
        ("", "", False),
        ("1", "x", False),
    ],
)
def test_native_sidecar_detection(major: str, minor: str, native: bool) -> None:
    assert server_supports_native_sidecars(major, minor) is native


CREDENTIALS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"}


@pytest.mark.parametrize("native", [False, True])
def test_trainer_gets_credentials_only_on_request(native: bool) -> None:
    def by_name(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {c["name"]: env_of(c) for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]}

    envs = by_name(build(native=native))
    assert not CREDENTIALS & set(envs["trainer"]), envs["trainer"]
    for name in ("spotguard-restore", "spotguard-sidecar"):
        assert set(envs[name]) >= CREDENTIALS, name
    # Without credentials the trainer is not sent to the store either (its Checkpointer would try it
    # when nothing was restored, and fail): the restore init container staged the checkpoint.
    assert "SPOTGUARD_STORAGE_URI" not in envs["trainer"]
    assert envs["spotguard-restore"]["SPOTGUARD_STORAGE_URI"] == "s3://bucket/root/team-a/demo"

    spec = job_spec()
    spec["checkpoint"]["exposeCredentialsToTrainer"] = True
    pod = build_pod("demo", "team-a", "uid-123", parse(spec), 1, OperatorConfig(native_sidecar=native))
    trainer = by_name(pod)["trainer"]
    assert trainer["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "s3", "key": "AWS_ACCESS_KEY_ID"}}
    assert set(trainer) >= CREDENTIALS
    assert trainer["SPOTGUARD_STORAGE_URI"] == "s3://bucket/root/team-a/demo"


def test_trainer_keeps_the_storage_uri_without_a_credentials_secret() -> None:
    # Node or workload identity: nothing to withhold.
    spec = job_spec()
    del spec["checkpoint"]["credentialsSecret"]
    env = env_of(build_pod("demo", "ns", "u", parse(spec), 1, OperatorConfig())["spec"]["containers"][0])
    assert env["SPOTGUARD_STORAGE_URI"] == "s3://bucket/root/ns/demo"


def test_explicit_endpoint_reaches_the_trainer_without_credentials() -> None:
    spec = job_spec()
    spec["checkpoint"].update({"endpoint": "http://127.0.0.1:8333", "region": "us-west-2"})
    env = env_of(build_pod("demo", "ns", "u", parse(spec), 1, OperatorConfig())["spec"]["containers"][0])
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:8333" and env["AWS_REGION"] == "us-west-2"
    assert "AWS_ACCESS_KEY_ID" not in env and "AWS_SECRET_ACCESS_KEY" not in env


def sidecar_of(pod: dict[str, Any]) -> dict[str, Any]:
    return next(
        c for c in pod["spec"]["initContainers"] + pod["spec"]["containers"] if c["name"] == "spotguard-sidecar"
    )


def test_notices_reach_the_sidecar_only() -> None:
    pod = build(preemption={"gracePeriodSeconds": 45, "notices": ["aws", "gce"]})
    assert env_of(sidecar_of(pod))["SPOTGUARD_NOTICES"] == "aws,gce"
    assert "SPOTGUARD_NOTICES" not in env_of(pod["spec"]["containers"][0])
    assert "SPOTGUARD_NOTICES" not in env_of(sidecar_of(build()))
    # The pod keeps the template's account (spotguard makes none; see test_notice_relay_unit.py for k8s).
    assert pod["spec"]["serviceAccountName"] == "trainer-sa"


@pytest.mark.parametrize("native", [False, True])
def test_incremental_reaches_the_sidecar_only(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from spotguard.sidecar import args, cli

    ck = {**job_spec()["checkpoint"], "incremental": False}
    pod = build(native=native, checkpoint=ck)
    value = env_of(sidecar_of(pod))["SPOTGUARD_INCREMENTAL"]
    restore = pod["spec"]["initContainers"][0]
    assert restore["name"] == "spotguard-restore" and "SPOTGUARD_INCREMENTAL" not in env_of(restore)
    assert "SPOTGUARD_INCREMENTAL" not in env_of(pod["spec"]["containers"][0])
    # On (the default): no variable at all, the sidecar's own default.
    assert "SPOTGUARD_INCREMENTAL" not in env_of(sidecar_of(build(native=native)))
    on = build(native=native, checkpoint={**ck, "incremental": True})
    assert "SPOTGUARD_INCREMENTAL" not in env_of(sidecar_of(on))

    def sidecar_incremental() -> bool:
        p = argparse.ArgumentParser()
        cli.register(p.add_subparsers())
        return args.incremental_from_args(p.parse_args(["sidecar"]))

    monkeypatch.delenv("SPOTGUARD_INCREMENTAL", raising=False)
    assert sidecar_incremental() is True
    # The sidecar reads the value the operator writes as off.
    monkeypatch.setenv("SPOTGUARD_INCREMENTAL", value)
    assert sidecar_incremental() is False


@pytest.mark.parametrize("native", [False, True])
def test_a_trainingjobs_sidecar_exits_0_after_a_preemption(native: bool) -> None:
    """The operator reads a preemption from the sidecar's report: its pods keep the sidecar's default status."""
    assert "SPOTGUARD_PREEMPTED_EXIT_CODE" not in env_of(sidecar_of(build(native=native)))
