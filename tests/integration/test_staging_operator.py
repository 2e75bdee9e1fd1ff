"""``spec.checkpoint.staging`` against a real kube-apiserver: the pods it makes, the specs it refuses,
and a full checkpoint volume shown on the job.

No kubelet runs here: pods stay Pending (a nodeSelector no node matches), and
an attempt's end is produced by patching its pod's status, as kubelet would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import VersionApi
from kubernetes.client.exceptions import ApiException

from spotguard.operator.testing import OperatorProcess
from testenv.kubetest import (
    cond,
    create_job,
    delete_jobs,
    no_node_job,
    patch_pod_status,
    pod_names,
    run_pod,
    start_operator,
    terminated,
    wait_event,
    wait_events,
    wait_pod,
    wait_status,
)

pytestmark = pytest.mark.integration

NS_PREFIX = "stage"
#: The platform's directory of the nodes that hostPath staging must lie under.
HOST_PATH_PREFIX = "/mnt/nvme"


@pytest.fixture(scope="module")
def operator(kube: Any, ns: str, apis: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The module's operator, allowing hostPath staging under :data:`HOST_PATH_PREFIX`."""
    log_path = tmp_path_factory.mktemp("operator") / f"operator-{ns}.log"
    op = start_operator(kube, ns, log_path, extra_args=["--staging-host-path-prefix", HOST_PATH_PREFIX])
    try:
        yield op
        delete_jobs(apis, ns, pods=False)
    finally:
        op.stop()
        print(f"--- operator log ({op.log_path}) ---\n{op.log_tail(60)}")


def staged(name: str, storage: str, staging: Any) -> dict[str, Any]:
    body = no_node_job(name, storage)
    body["spec"]["checkpoint"]["staging"] = staging
    return body


def generic_ephemeral_volumes(apis: tuple[Any, Any]) -> bool:
    """Whether the server has generic ephemeral volumes on by default (Kubernetes >= 1.21)."""
    core, _ = apis
    info = VersionApi(core.api_client).get_code()
    return (int(info.major), int("".join(ch for ch in info.minor if ch.isdigit()))) >= (1, 21)


def staging_volume(apis: tuple[Any, Any], ns: str, pod: str) -> Any:
    found = wait_pod(apis, ns, pod)
    [volume] = [v for v in found.spec.volumes if v.name == "spotguard"]
    return found, volume


def test_pods_get_the_staging_the_spec_places(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}/store"
    create_job(apis, ns, staged("limited", store, {"emptyDir": {"sizeLimit": "300Gi"}}))
    create_job(apis, ns, staged("claimed", store, {"ephemeral": {"storageClassName": "local-nvme", "size": "400Gi"}}))
    create_job(apis, ns, staged("nvme", store, {"hostPath": {"path": "/mnt/nvme/spotguard"}}))

    _, volume = staging_volume(apis, ns, "limited-a1")
    assert volume.empty_dir.size_limit == "300Gi"

    if generic_ephemeral_volumes(apis):
        _, volume = staging_volume(apis, ns, "claimed-a1")
        claim = volume.ephemeral.volume_claim_template.spec
        assert claim.access_modes == ["ReadWriteOnce"] and claim.storage_class_name == "local-nvme"
        assert claim.resources.requests == {"storage": "400Gi"}
    else:
        # A server without generic ephemeral volumes drops the volume's source: the job says the pod was refused.
        wait_event(
            apis, ns, "claimed", "PodCreateFailed", lambda t, r, m: r == "PodCreateFailed" and "spec.volumes" in m
        )

    pod, volume = staging_volume(apis, ns, "nvme-a1")
    assert (volume.host_path.path, volume.host_path.type) == ("/mnt/nvme/spotguard", "DirectoryOrCreate")
    mounts = [
        (c.name, m.mount_path, m.sub_path_expr)
        for c in [*pod.spec.init_containers, *pod.spec.containers]
        for m in c.volume_mounts
        if m.name == "spotguard"
    ]
    # Each container its pod's own directory; the sidecar also its namespace's, to remove its pod's at its end.
    assert sorted(mounts) == [
        ("spotguard-restore", "/var/lib/spotguard", "$(POD_NAMESPACE)/$(POD_NAME)"),
        ("spotguard-sidecar", "/var/lib/spotguard", "$(POD_NAMESPACE)/$(POD_NAME)"),
        ("spotguard-sidecar", "/var/lib/spotguard-node", "$(POD_NAMESPACE)"),
        ("trainer", "/var/lib/spotguard", "$(POD_NAMESPACE)/$(POD_NAME)"),
    ]


def test_bad_staging_is_refused_naming_the_field(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}/store"
    # What the schema says, the apiserver refuses.
    with pytest.raises(ApiException) as err:
        create_job(apis, ns, staged("badsize", store, {"emptyDir": {"sizeLimit": "lots"}}))
    assert err.value.status == 422 and "spec.checkpoint.staging.emptyDir.sizeLimit" in err.value.body
    # Exactly one kind: the operator's rule, as a condition and an Event, and no pod.
    create_job(apis, ns, staged("both", store, {"emptyDir": {}, "hostPath": {"path": "/mnt/nvme"}}))
    st = wait_status(apis, ns, "both", "Invalid", lambda s: cond(s, "Invalid").get("status") == "True")
    assert st["phase"] == "Failed"
    message = cond(st, "Invalid")["message"]
    assert "spec.checkpoint.staging" in message and "exactly one" in message
    wait_events(apis, ns, "both", {"InvalidSpec"})
    assert pod_names(apis, ns, "both") == []


@pytest.mark.parametrize(
    ("job", "path"),
    [("beside", "/mnt/nvme2/spotguard"), ("system", "/var/lib/kubelet"), ("above", "/mnt")],
)
def test_a_host_path_outside_the_platforms_prefix_is_refused(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path, job: str, path: str
) -> None:
    create_job(apis, ns, staged(job, f"file://{tmp_path}/store", {"hostPath": {"path": path}}))
    st = wait_status(apis, ns, job, "Invalid", lambda s: cond(s, "Invalid").get("status") == "True")
    assert st["phase"] == "Failed"
    message = cond(st, "Invalid")["message"]
    assert "spec.checkpoint.staging.hostPath.path" in message and f"under {HOST_PATH_PREFIX}/" in message, message
    assert path in message
    wait_event(apis, ns, job, "InvalidSpec", lambda t, r, m: t == "Warning" and HOST_PATH_PREFIX in m)
    assert pod_names(apis, ns, job) == []


def test_a_full_staging_volume_is_shown_on_the_job(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    create_job(apis, ns, staged("full", f"file://{tmp_path}/store", {"emptyDir": {"sizeLimit": "1Gi"}}))
    wait_pod(apis, ns, "full-a1")
    run_pod(apis, ns, "full-a1")
    wait_status(apis, ns, "full", "Running", lambda s: s.get("phase") == "Running")
    # What the sidecar leaves when the trainer's last save found the volume full.
    report = {
        "preempted": True,
        "reason": "sigterm",
        "step": 10,
        "trainerStep": 14,
        "stagingFull": {
            "step": 14,
            "free_bytes": 0,
            "error": "checkpoint of step 14 not written: the"
            " checkpoint volume at /var/lib/spotguard/checkpoints is full",
        },
    }
    sidecar = terminated("spotguard-sidecar", 0)
    sidecar["state"]["terminated"]["message"] = json.dumps(report)
    patch_pod_status(
        apis, ns, "full-a1", {"phase": "Succeeded", "containerStatuses": [terminated("trainer", 0), sidecar]}
    )
    st = wait_status(apis, ns, "full", "StagingFull", lambda s: cond(s, "StagingFull").get("status") == "True")
    assert cond(st, "StagingFull")["reason"] == "StagingFull"
    assert "checkpoint of step 14 not written" in cond(st, "StagingFull")["message"]
    assert st["preemptions"] == 1
    wait_event(apis, ns, "full", "StagingFull", lambda t, r, m: t == "Warning" and r == "StagingFull" and "14" in m)


def test_a_size_left_out_follows_the_newest_checkpoint(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    from spotguard.checkpoint import snapshot_state, upload_checkpoint, write_checkpoint
    from spotguard.storage import open_storage

    create_job(apis, ns, staged("derived", f"file://{tmp_path}/store", {"emptyDir": {}}))
    _, volume = staging_volume(apis, ns, "derived-a1")
    assert volume.empty_dir.size_limit is None  # no checkpoint yet: no limit
    local = write_checkpoint(tmp_path / "local", 30, snapshot_state({"step": 30, "blob": b"x" * 4096}))
    upload_checkpoint(local, open_storage(f"file://{tmp_path}/store/{ns}/derived"))
    st = wait_status(
        apis, ns, "derived", "the checkpoint's size", lambda s: (s.get("lastVerifiedCheckpoint") or {}).get("bytes")
    )
    assert st["lastVerifiedCheckpoint"]["step"] == 30 and st["lastVerifiedCheckpoint"]["bytes"] > 4096
    run_pod(apis, ns, "derived-a1")
    patch_pod_status(
        apis,
        ns,
        "derived-a1",
        {
            "phase": "Failed",
            "reason": "Terminated",
            "containerStatuses": [terminated("trainer", 0), terminated("spotguard-sidecar", 0)],
        },
    )
    _, volume = staging_volume(apis, ns, "derived-a2")
    assert volume.empty_dir.size_limit == "1Gi"  # 3 x a few KiB, rounded up to whole GiB
