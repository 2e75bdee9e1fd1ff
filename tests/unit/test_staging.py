"""Where checkpoints are staged in the pod: ``spec.checkpoint.staging`` parsed, built, and a full volume reported."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from spotguard.contract.env import EMERGENCY_STAGING, STAGING_RESERVE, from_env
from spotguard.operator.classify import PodEnd, classify_pod_end
from spotguard.operator.decide import decide
from spotguard.operator.jobstatus import Observation, condition
from spotguard.operator.podbuilder import (
    EMERGENCY_DIR,
    HOST_PATH_SUBDIR,
    MOUNT_PATH,
    Injection,
    OperatorConfig,
    build_pod,
    inject,
    last_checkpoint_bytes,
)
from spotguard.operator.spec import EMERGENCY_VOLUME, SHARED_VOLUME, SIDECAR_CONTAINER, parse
from spotguard.operator.specfields import SpecError
from spotguard.operator.staging import quantity_bytes

GiB = 2**30
ROOT = Path(__file__).resolve().parents[2]


def raw(staging: Any = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "template": {"spec": {"containers": [{"name": "trainer", "image": "t:1"}]}},
        "checkpoint": {"storage": "s3://bkt/p"},
    }
    if staging is not None:
        spec["checkpoint"]["staging"] = staging
    return spec


# -- the spec ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("200Gi", 200 * GiB),
        ("1.5T", 1_500_000_000_000),
        ("500M", 500_000_000),
        ("0.5Ki", 512),
        (4096, 4096),
        ("1e3", 1000),
        ("+2Mi", 2 * 2**20),
    ],
)
def test_quantities_are_read_like_kubernetes(value: Any, expected: int) -> None:
    assert quantity_bytes(value, "f") == expected


@pytest.mark.parametrize("value", ["200GB", "lots", "-1Gi", "0", 0, "1.2.3Gi", True, 1.5, "Gi"])
def test_bad_quantities_name_the_field(value: Any) -> None:
    with pytest.raises(SpecError) as err:
        parse(raw({"emptyDir": {"sizeLimit": value}}))
    assert err.value.field == "spec.checkpoint.staging.emptyDir.sizeLimit"
    assert "quantity" in err.value.message or "positive" in err.value.message


def test_each_kind_parses() -> None:
    assert parse(raw()).checkpoint.staging is None
    empty = parse(raw({"emptyDir": {"sizeLimit": "300Gi", "medium": "Memory"}})).checkpoint.staging
    assert empty is not None and (empty.kind, empty.size, empty.medium) == ("emptyDir", "300Gi", "Memory")
    eph = parse(raw({"ephemeral": {"storageClassName": "local-nvme", "size": "400Gi"}})).checkpoint.staging
    assert eph is not None and (eph.kind, eph.size, eph.storage_class) == ("ephemeral", "400Gi", "local-nvme")
    host = parse(raw({"hostPath": {"path": "/mnt/nvme/spotguard/"}})).checkpoint.staging
    assert host is not None and (host.kind, host.path, host.size) == ("hostPath", "/mnt/nvme/spotguard", None)
    bare = parse(raw({"emptyDir": {}})).checkpoint.staging
    assert bare is not None and (bare.kind, bare.size, bare.medium) == ("emptyDir", None, "")


@pytest.mark.parametrize(
    ("staging", "field", "words"),
    [
        ({}, "spec.checkpoint.staging", "exactly one"),
        ({"emptyDir": {}, "hostPath": {"path": "/mnt"}}, "spec.checkpoint.staging", "not emptyDir and hostPath"),
        ({"nfs": {}}, "spec.checkpoint.staging.nfs", "not a staging kind"),
        ("emptyDir", "spec.checkpoint.staging", "must be an object"),
        ({"emptyDir": {"medium": "HugePages"}}, "spec.checkpoint.staging.emptyDir.medium", "Memory"),
        ({"ephemeral": {"size": "10Xi"}}, "spec.checkpoint.staging.ephemeral.size", "quantity"),
        (
            {"ephemeral": {"storageClassName": "Local NVMe"}},
            "spec.checkpoint.staging.ephemeral.storageClassName",
            "StorageClass",
        ),
        ({"hostPath": {}}, "spec.checkpoint.staging.hostPath.path", "required"),
        ({"hostPath": {"path": "mnt/nvme"}}, "spec.checkpoint.staging.hostPath.path", "absolute"),
        ({"hostPath": {"path": "/"}}, "spec.checkpoint.staging.hostPath.path", "other than /"),
        ({"hostPath": {"path": "/mnt/../etc"}}, "spec.checkpoint.staging.hostPath.path", "absolute"),
    ],
)
def test_bad_staging_is_refused_naming_the_field(staging: Any, field: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse(raw(staging))
    assert err.value.field == field
    assert words in err.value.message


def test_crd_declares_what_the_parser_reads() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "trainingjob.yaml").read_text())
    version = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    staging = version["properties"]["spec"]["properties"]["checkpoint"]["properties"]["staging"]["properties"]
    assert sorted(staging) == ["emptyDir", "ephemeral", "hostPath"]
    assert sorted(staging["emptyDir"]["properties"]) == ["medium", "sizeLimit"]
    assert staging["emptyDir"]["properties"]["medium"]["enum"] == ["", "Memory"]
    assert sorted(staging["ephemeral"]["properties"]) == ["size", "storageClassName"]
    assert staging["hostPath"]["required"] == ["path"]
    memory = version["properties"]["spec"]["properties"]["checkpoint"]["properties"]["memoryStaging"]
    assert memory["type"] == "boolean" and memory["default"] is True
    last = version["properties"]["status"]["properties"]["lastVerifiedCheckpoint"]["properties"]
    assert last["bytes"]["type"] == "integer"


# -- the pod ----------------------------------------------------------------------


def pod_of(staging: Any, checkpoint_bytes: int | None = None, native: bool = False) -> dict[str, Any]:
    cfg = OperatorConfig(image="sg:1", native_sidecar=native)
    return build_pod("demo", "ns", "uid", parse(raw(staging)), 2, cfg, checkpoint_bytes=checkpoint_bytes)["spec"]


def staging_of(pod_spec: dict[str, Any]) -> dict[str, Any]:
    [volume] = [v for v in pod_spec["volumes"] if v["name"] == SHARED_VOLUME]
    return volume


def shared_mounts(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    containers = [*pod_spec.get("initContainers", []), *pod_spec["containers"]]
    return [m for c in containers for m in c.get("volumeMounts", []) if m["name"] == SHARED_VOLUME]


def test_without_staging_the_volume_is_as_before() -> None:
    assert staging_of(pod_of(None, checkpoint_bytes=10 * GiB)) == {"name": SHARED_VOLUME, "emptyDir": {}}


def test_empty_dir_carries_its_limit_and_medium() -> None:
    volume = staging_of(pod_of({"emptyDir": {"sizeLimit": "300Gi", "medium": "Memory"}}, checkpoint_bytes=GiB))
    assert volume["emptyDir"] == {"sizeLimit": "300Gi", "medium": "Memory"}


def test_a_size_left_out_is_three_checkpoints_rounded_up() -> None:
    assert staging_of(pod_of({"emptyDir": {}}, checkpoint_bytes=int(14.2 * GiB)))["emptyDir"] == {"sizeLimit": "43Gi"}
    # No verified checkpoint yet: an emptyDir stays unlimited.
    assert staging_of(pod_of({"emptyDir": {}}))["emptyDir"] == {}
    claim = staging_of(pod_of({"ephemeral": {}}, checkpoint_bytes=28 * GiB))["ephemeral"]["volumeClaimTemplate"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "84Gi"
    # A claim must ask for something.
    claim = staging_of(pod_of({"ephemeral": {}}))["ephemeral"]["volumeClaimTemplate"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "100Gi"


def test_ephemeral_is_a_read_write_once_claim_per_pod() -> None:
    claim = staging_of(
        pod_of({"ephemeral": {"storageClassName": "local-nvme", "size": "400Gi"}}, checkpoint_bytes=GiB)
    )["ephemeral"]["volumeClaimTemplate"]
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "local-nvme",
        "resources": {"requests": {"storage": "400Gi"}},
    }
    assert claim["metadata"]["labels"]["spotguard.dev/job"] == "demo"


@pytest.mark.parametrize("native", [False, True])
def test_host_path_gives_each_pod_its_own_directory(native: bool) -> None:
    pod_spec = pod_of({"hostPath": {"path": "/mnt/nvme/sg"}}, checkpoint_bytes=GiB, native=native)
    assert staging_of(pod_spec) == {
        "name": SHARED_VOLUME,
        "hostPath": {"path": "/mnt/nvme/sg", "type": "DirectoryOrCreate"},
    }
    mounts = [m for m in shared_mounts(pod_spec) if m["mountPath"] == MOUNT_PATH]
    assert len(mounts) == 3  # restore, trainer, sidecar
    assert all(m == {"name": SHARED_VOLUME, "mountPath": MOUNT_PATH, "subPathExpr": HOST_PATH_SUBDIR} for m in mounts)
    # The sidecar also mounts its namespace's directory, to remove its pod's own at its end.
    node = [m for m in shared_mounts(pod_spec) if m["mountPath"] != MOUNT_PATH]
    assert node == [{"name": SHARED_VOLUME, "mountPath": "/var/lib/spotguard-node", "subPathExpr": "$(POD_NAMESPACE)"}]
    # The subdirectory's variables come from every container's own environment.
    containers = [*pod_spec.get("initContainers", []), *pod_spec["containers"]]
    for c in containers:
        names = {e["name"] for e in c["env"]}
        assert {"POD_NAME", "POD_NAMESPACE"} <= names, c["name"]


def test_other_kinds_mount_the_volume_whole() -> None:
    assert all("subPathExpr" not in m for m in shared_mounts(pod_of({"emptyDir": {"sizeLimit": "1Gi"}})))


def test_injection_is_idempotent_with_staging() -> None:
    ck = parse(raw({"hostPath": {"path": "/mnt/nvme"}})).checkpoint
    inj = Injection(job="j", namespace="ns", storage_uri="s3://bkt/p/ns/j", checkpoint=ck, grace_period_seconds=30)
    once = inject({"containers": [{"name": "trainer", "image": "t:1"}]}, inj)
    assert inject(copy.deepcopy(once), inj) == once


# -- the memory volume of a preemption's checkpoint (checkpoint.memoryStaging) -----------


def memory_of(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in pod_spec["volumes"] if v["name"] == EMERGENCY_VOLUME]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.mark.parametrize("native", [False, True])
def test_a_preemptions_checkpoint_has_a_memory_volume_in_the_trainer_and_the_sidecar(native: bool) -> None:
    pod_spec = pod_of(None, checkpoint_bytes=4 * GiB, native=native)
    # Sized from the last checkpoint: the kubelet sizes the tmpfs to it; a larger one goes to the disk.
    assert memory_of(pod_spec) == [{"name": EMERGENCY_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "5120Mi"}}]
    containers = {c["name"]: c for c in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]}
    for name in ("trainer", SIDECAR_CONTAINER):
        c = containers[name]
        # The same path in both: the trainer commits a link to it that the sidecar follows.
        assert {"name": EMERGENCY_VOLUME, "mountPath": EMERGENCY_DIR} in c["volumeMounts"], name
        assert env_of(c)[EMERGENCY_STAGING.name] == EMERGENCY_DIR, name
    # No checkpoint verified yet: no limit.
    assert memory_of(pod_of(None, native=native))[0]["emptyDir"] == {"medium": "Memory"}


@pytest.mark.parametrize(
    "checkpoint",
    [
        {"storage": "s3://bkt/p", "memoryStaging": False},  # switched off
        {"storage": "s3://bkt/p", "staging": {"emptyDir": {"medium": "Memory"}}},  # the staging is memory already
    ],
)
def test_no_memory_volume_when_off_or_when_staging_is_in_memory(checkpoint: dict[str, Any]) -> None:
    spec = raw()
    spec["checkpoint"] = checkpoint
    cfg = OperatorConfig(image="sg:1")
    pod_spec = build_pod("demo", "ns", "uid", parse(spec), 2, cfg, checkpoint_bytes=GiB)["spec"]
    assert memory_of(pod_spec) == []
    for c in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]:
        assert EMERGENCY_STAGING.name not in env_of(c)
        assert all(m["name"] != EMERGENCY_VOLUME for m in c.get("volumeMounts", []))


@pytest.mark.parametrize("field", ["memoryStaging", "reserveStaging"])
def test_memory_staging_must_be_a_boolean(field: str) -> None:
    spec = raw()
    spec["checkpoint"][field] = "sometimes"
    with pytest.raises(SpecError, match=field):
        parse(spec)


@pytest.mark.parametrize(
    ("checkpoint", "reserved"),
    [
        ({"storage": "s3://bkt/p"}, False),  # off by default: it holds a checkpoint's size of memory
        ({"storage": "s3://bkt/p", "reserveStaging": True}, True),
        ({"storage": "s3://bkt/p", "reserveStaging": True, "memoryStaging": False}, False),  # nowhere to set it aside
    ],
)
def test_the_trainer_sets_memory_aside_in_the_memory_volume_when_asked(
    checkpoint: dict[str, Any], reserved: bool
) -> None:
    spec = raw()
    spec["checkpoint"] = checkpoint
    pod_spec = build_pod("demo", "ns", "uid", parse(spec), 2, OperatorConfig(image="sg:1"), checkpoint_bytes=GiB)[
        "spec"
    ]
    [trainer] = [c for c in pod_spec["containers"] if c["name"] == "trainer"]
    assert env_of(trainer).get(STAGING_RESERVE.name) == ("true" if reserved else None)
    assert from_env(STAGING_RESERVE, {k: v for k, v in env_of(trainer).items() if v is not None}) is reserved


def test_the_size_comes_from_the_status() -> None:
    assert last_checkpoint_bytes(None) is None
    assert last_checkpoint_bytes({"lastVerifiedCheckpoint": {"step": 3}}) is None
    assert last_checkpoint_bytes({"lastVerifiedCheckpoint": {"step": 3, "bytes": True}}) is None
    assert last_checkpoint_bytes({"lastVerifiedCheckpoint": {"step": 3, "bytes": 1234}}) == 1234


# -- a full volume, as the operator sees it ------------------------------------------


FULL = {
    "step": 70,
    "free_bytes": 4096,
    "time": 1.0,
    "error": "checkpoint of step 70 not written: the checkpoint volume at /x is full",
}


def ended(report: dict[str, Any]) -> dict[str, Any]:
    term = {"exitCode": 0, "reason": "Completed", "finishedAt": "2030-01-01T00:00:10Z", "message": json.dumps(report)}
    return {
        "metadata": {"name": "job-a1", "namespace": "ns"},
        "spec": {"nodeName": "n1", "containers": [{"name": "trainer"}]},
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [
                {"name": "trainer", "state": {"terminated": {**term, "message": ""}}},
                {"name": SIDECAR_CONTAINER, "state": {"terminated": term}},
            ],
        },
    }


def test_classify_reads_the_sidecars_staging_report() -> None:
    end = classify_pod_end(ended({"preempted": True, "reason": "sigterm", "step": 60, "stagingFull": FULL}))
    assert end.kind == "preempted" and end.staging_full == FULL["error"]
    assert classify_pod_end(ended({"preempted": True, "reason": "sigterm", "step": 60})).staging_full is None
    # Without the trainer's words the operator still says what to do.
    bare = classify_pod_end(ended({"preempted": True, "reason": "sigterm", "stagingFull": {"step": 70}}))
    assert bare.staging_full is not None and "step 70" in bare.staging_full
    assert "spec.checkpoint.staging" in bare.staging_full


def test_the_job_shows_a_full_volume_and_clears_it() -> None:
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    sp = parse(raw({"emptyDir": {"sizeLimit": "1Gi"}}))
    running = PodEnd("running", "Running")
    s = decide("job", None, sp, Observation(), t0, 1).status
    s = decide("job", s, sp, Observation(pod_end=running), t0, 1).status
    full = PodEnd("preempted", "sigterm", "the trainer stopped early", step=60, staging_full=FULL["error"])
    d = decide("job", s, sp, Observation(pod_end=full), t0, 1)
    cond = condition(d.status, "StagingFull") or {}
    assert (cond.get("status"), cond.get("reason")) == ("True", "StagingFull")
    assert "pod job-a1" in cond["message"] and FULL["error"] in cond["message"]
    [event] = [e for e in d.events if e.reason == "StagingFull"]
    assert event.type == "Warning" and event.message == cond["message"]
    # The next attempt ends with room: the condition turns False, without another Warning.
    s = decide("job", d.status, sp, Observation(pod_end=running), t0, 1).status
    d = decide("job", s, sp, Observation(pod_end=PodEnd("preempted", "sigterm", "", step=80)), t0, 1)
    cond = condition(d.status, "StagingFull") or {}
    assert (cond.get("status"), cond.get("reason")) == ("False", "StagingHadRoom")
    assert not [e for e in d.events if e.reason == "StagingFull"]
