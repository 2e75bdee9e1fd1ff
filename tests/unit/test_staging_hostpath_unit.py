"""hostPath staging: only under the platform's prefix; each pod's directory of its node removed when it ends."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from spotguard.contract.report import TerminationReport
from spotguard.operator.podbuilder import OperatorConfig, build_pod
from spotguard.operator.spec import parse
from spotguard.operator.specfields import SpecError
from spotguard.operator.staging import StagingSpec, check_host_path, parse_host_path_prefix
from spotguard.operator.stagingdirs import CleanupTarget, cleanup_pod, plan_cleanup
from spotguard.sidecar.mainloop import SidecarOptions, _remove_pod_dir

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("path", "prefix", "refused"),
    [
        # No prefix set by the platform: every hostPath is refused, saying how to allow it.
        ("/mnt/nvme/spotguard", None, "hostPath staging is off in this cluster"),
        ("/mnt/nvme", None, "staging.hostPathPrefix"),
        # Under the prefix, or the prefix itself.
        ("/mnt/nvme/spotguard", "/mnt/nvme", None),
        ("/mnt/nvme/a/b/c", "/mnt/nvme", None),
        ("/mnt/nvme", "/mnt/nvme", None),
        # Beside it, above it, a name that merely starts with it.
        ("/mnt/nvme2/spotguard", "/mnt/nvme", "under /mnt/nvme/"),
        ("/mnt", "/mnt/nvme", "under /mnt/nvme/"),
        ("/var/lib/kubelet", "/mnt/nvme", "under /mnt/nvme/"),
        ("/etc", "/mnt/nvme", "under /mnt/nvme/"),
        # Out of it by a detour.
        ("/mnt/nvme/./x", "/mnt/nvme", "normalized"),
        ("/mnt/nvme//x", "/mnt/nvme", "normalized"),
    ],
)
def test_a_host_path_must_lie_under_the_platforms_prefix(path: str, prefix: str | None, refused: str | None) -> None:
    staging = StagingSpec("hostPath", path=path)
    if refused is None:
        check_host_path(staging, prefix)
        return
    with pytest.raises(SpecError) as err:
        check_host_path(staging, prefix)
    assert err.value.field == "spec.checkpoint.staging.hostPath.path"
    assert refused in str(err.value)


@pytest.mark.parametrize("staging", [None, StagingSpec("emptyDir"), StagingSpec("ephemeral", size="10Gi")])
def test_other_staging_needs_no_prefix(staging: StagingSpec | None) -> None:
    check_host_path(staging, None)


def test_parsing_refuses_what_the_prefix_check_refuses_first() -> None:
    """`..` never reaches the prefix check: parsing refuses it already."""
    raw = {
        "template": {"spec": {"containers": [{"name": "t", "image": "i"}]}},
        "checkpoint": {"storage": "s3://bucket"},
    }
    raw["checkpoint"]["staging"] = {"hostPath": {"path": "/mnt/nvme/../../etc"}}
    with pytest.raises(SpecError, match="hostPath.path"):
        parse(raw)


@pytest.mark.parametrize(
    ("text", "prefix", "error"),
    [
        (None, None, None),
        ("", None, None),
        ("/mnt/nvme", "/mnt/nvme", None),
        ("/mnt/nvme/", "/mnt/nvme", None),
        ("/", None, "other than /"),
        ("///", None, "other than /"),
        ("mnt/nvme", None, "absolute"),
        ("/mnt/../etc", None, "normalized"),
        ("/mnt/./nvme", None, "normalized"),
    ],
)
def test_the_operators_prefix(text: str | None, prefix: str | None, error: str | None) -> None:
    if error is None:
        assert parse_host_path_prefix(text) == prefix
        return
    with pytest.raises(ValueError, match=error):
        parse_host_path_prefix(text)


def hostpath_spec(path: str = "/mnt/nvme/spotguard", **pod: Any) -> Any:
    containers = [{"name": "trainer", "image": "t", "command": ["python"]}]
    return parse(
        {
            "template": {"spec": {"containers": containers, **pod}},
            "checkpoint": {"storage": "s3://bucket/r", "staging": {"hostPath": {"path": path}}},
        }
    )


def test_the_sidecar_mounts_its_namespaces_directory_and_knows_its_own() -> None:
    pod = build_pod("demo", "ns", "uid", hostpath_spec(), 2, OperatorConfig())
    by_name = {c["name"]: c for c in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]}
    sidecar = by_name["spotguard-sidecar"]
    assert {"name": "spotguard", "mountPath": "/var/lib/spotguard-node", "subPathExpr": "$(POD_NAMESPACE)"} in sidecar[
        "volumeMounts"
    ]
    env = [e["name"] for e in sidecar["env"]]
    assert {"name": "SPOTGUARD_STAGING_POD_DIR", "value": "/var/lib/spotguard-node/$(POD_NAME)"} in sidecar["env"]
    # kubelet expands $(POD_NAME) only from a variable defined before.
    assert env.index("POD_NAME") < env.index("SPOTGUARD_STAGING_POD_DIR")
    for name in ("trainer", "spotguard-restore"):
        assert all(m["mountPath"] != "/var/lib/spotguard-node" for m in by_name[name]["volumeMounts"]), name
        assert all(e["name"] != "SPOTGUARD_STAGING_POD_DIR" for e in by_name[name]["env"]), name


def test_without_host_path_the_sidecar_has_no_pod_directory() -> None:
    spec = parse(
        {"template": {"spec": {"containers": [{"name": "t", "image": "i"}]}}, "checkpoint": {"storage": "s3://bucket"}}
    )
    sidecar = build_pod("demo", "ns", "uid", spec, 1, OperatorConfig())["spec"]["containers"][-1]
    assert all(e["name"] != "SPOTGUARD_STAGING_POD_DIR" for e in sidecar["env"])
    assert all(m["mountPath"] != "/var/lib/spotguard-node" for m in sidecar["volumeMounts"])


def attempt_pod(
    name: str, phase: str = "Running", node: str | None = "n1", deleting: datetime | None = None, report: Any = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"spotguard.dev/job": "demo", "spotguard.dev/attempt": "1"}}
    if deleting is not None:
        meta["deletionTimestamp"] = deleting.strftime("%Y-%m-%dT%H:%M:%SZ")
    statuses = []
    if report is not None:
        message = report if isinstance(report, str) else json.dumps(report)
        statuses.append({"name": "spotguard-sidecar", "state": {"terminated": {"exitCode": 0, "message": message}}})
    return {"metadata": meta, "spec": {"nodeName": node}, "status": {"phase": phase, "containerStatuses": statuses}}


def cleanup(target: str, phase: str = "Running", message: str = "") -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if phase == "Failed":
        status["containerStatuses"] = [
            {"name": "cleanup", "state": {"terminated": {"exitCode": 1, "message": message}}}
        ]
    labels = {"spotguard.dev/job": "demo", "spotguard.dev/staging-cleanup-of": target}
    return {"metadata": {"name": f"{target}-staging-cleanup", "labels": labels}, "status": status}


REMOVED = {"preempted": False, "reason": "completed", "podDirRemoved": True}


@pytest.mark.parametrize(
    ("pods", "create", "delete", "failed"),
    [
        # A pod that runs: its sidecar will remove its directory.
        ([attempt_pod("demo-a1")], [], [], []),
        # Ended, and its sidecar removed the directory: nothing to do.
        ([attempt_pod("demo-a1", "Succeeded", report=REMOVED)], [], [], []),
        ([attempt_pod("demo-a1", "Failed", report=REMOVED)], [], [], []),
        # Ended without that word (a sidecar killed, a report without it, none at all).
        ([attempt_pod("demo-a1", "Failed")], [CleanupTarget("demo-a1", "n1")], [], []),
        ([attempt_pod("demo-a1", "Failed", report={"reason": "x"})], [CleanupTarget("demo-a1", "n1")], [], []),
        ([attempt_pod("demo-a1", "Failed", report="not json")], [CleanupTarget("demo-a1", "n1")], [], []),
        # Being deleted: after what is left of its grace period, plus the margin.
        ([attempt_pod("demo-a1", deleting=NOW + timedelta(seconds=30))], [CleanupTarget("demo-a1", "n1", 35)], [], []),
        ([attempt_pod("demo-a1", deleting=NOW - timedelta(seconds=9))], [CleanupTarget("demo-a1", "n1", 5)], [], []),
        # Never bound to a node: it never had a directory.
        ([attempt_pod("demo-a1", "Failed", node=None)], [], [], []),
        # A cleanup pod exists already (whatever its phase): not again.
        ([attempt_pod("demo-a1", "Failed"), cleanup("demo-a1")], [], [], []),
        ([attempt_pod("demo-a1", "Failed"), cleanup("demo-a1", "Succeeded")], [], [], []),
        # Done, and its pod has gone: the record goes too.
        ([cleanup("demo-a1", "Succeeded")], [], ["demo-a1-staging-cleanup"], []),
        # Still waiting for the grace period of a pod that has gone: kept.
        ([cleanup("demo-a1", "Running")], [], [], []),
        # Failed: reported (and dropped once its pod has gone).
        (
            [attempt_pod("demo-a1", "Failed"), cleanup("demo-a1", "Failed", "rm: cannot remove: Permission denied")],
            [],
            [],
            [("demo-a1-staging-cleanup", "exit code 1: rm: cannot remove: Permission denied")],
        ),
        (
            [cleanup("demo-a1", "Failed")],
            [],
            ["demo-a1-staging-cleanup"],
            [("demo-a1-staging-cleanup", "exit code 1")],
        ),
    ],
)
def test_the_cleanup_plan(
    pods: list[dict[str, Any]], create: list[CleanupTarget], delete: list[str], failed: list[tuple[str, str]]
) -> None:
    plan = plan_cleanup(pods, NOW)
    assert (list(plan.create), list(plan.delete), list(plan.failed)) == (create, delete, failed)


def test_a_cleanup_pod_removes_one_directory_on_its_node_as_spotguards_containers_run() -> None:
    spec = hostpath_spec(securityContext={"runAsUser": 1000})
    pod = cleanup_pod("demo", "team", "uid-1", spec, CleanupTarget("demo-a1", "node-7", 35), "sg:1", "IfNotPresent")
    assert pod["metadata"]["name"] == "demo-a1-staging-cleanup"
    assert pod["metadata"]["labels"]["spotguard.dev/job"] == "demo"
    assert "spotguard.dev/attempt" not in pod["metadata"]["labels"]  # never taken for an attempt's pod
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    ps = pod["spec"]
    assert ps["nodeName"] == "node-7" and ps["restartPolicy"] == "Never"
    assert ps["tolerations"] == [{"operator": "Exists"}]
    assert ps["activeDeadlineSeconds"] == 335
    assert ps["volumes"] == [
        {"name": "spotguard", "hostPath": {"path": "/mnt/nvme/spotguard", "type": "DirectoryOrCreate"}}
    ]
    [c] = ps["containers"]
    assert c["image"] == "sg:1" and c["imagePullPolicy"] == "IfNotPresent"
    assert c["volumeMounts"] == [{"name": "spotguard", "mountPath": "/staging", "subPath": "team"}]
    assert c["command"][-2:] == ["35", "/staging/demo-a1"]
    context = c["securityContext"]
    assert context["runAsUser"] == 1000 and context["readOnlyRootFilesystem"] is True
    assert context["capabilities"] == {"drop": ["ALL"]} and context["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize(("value", "why"), [("/", "other than /"), ("relative/dir", "absolute")])
def test_the_operator_refuses_a_prefix_that_allows_anything(value: str, why: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "spotguard.cli", "operator", "--staging-host-path-prefix", value],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("spotguard operator: --staging-host-path-prefix:") and why in result.stderr
    assert "Traceback" not in result.stderr


class _Agent:
    def __init__(self, state: str) -> None:
        self.state = state

    def trainer_state(self) -> str:
        return self.state


@pytest.mark.parametrize(("trainer", "removed"), [("gone", True), ("running", False), ("unknown", False)])
def test_the_sidecar_removes_its_pods_directory_only_once_the_trainer_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trainer: str, removed: bool
) -> None:
    pod_dir = tmp_path / "node" / "ns" / "demo-a1"
    (pod_dir / "checkpoints" / ".control").mkdir(parents=True)
    (pod_dir / "checkpoints" / "ckpt-000000000005").mkdir()
    monkeypatch.setenv("SPOTGUARD_STAGING_POD_DIR", str(pod_dir))
    log = tmp_path / "termination-log"
    report = TerminationReport(preempted=False, reason="finished", step=5)
    _remove_pod_dir(_Agent(trainer), SidecarOptions(termination_log=log), report)  # type: ignore[arg-type]
    assert pod_dir.exists() is not removed
    assert (tmp_path / "node" / "ns").is_dir()  # only the pod's own directory goes
    if removed:
        assert json.loads(log.read_text()) == {
            "preempted": False,
            "reason": "finished",
            "step": 5,
            "podDirRemoved": True,
        }
        assert TerminationReport.parse(log.read_text()).pod_dir_removed
    else:
        assert not log.exists()


def test_without_host_path_staging_the_sidecar_removes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTGUARD_STAGING_POD_DIR", raising=False)
    report = TerminationReport(preempted=False, reason="finished")
    _remove_pod_dir(_Agent("gone"), SidecarOptions(termination_log=tmp_path / "log"), report)  # type: ignore[arg-type]
    assert not (tmp_path / "log").exists()
