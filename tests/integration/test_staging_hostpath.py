"""hostPath staging on process nodes: each pod's directory of its node is gone once its attempt ends.

The nodes' directory is a temporary one standing in for local NVMe; the
operator allows hostPath staging under it only (``--staging-host-path-prefix``).
The process node expands ``subPathExpr`` as kubelet does, so each pod gets
``<path>/<namespace>/<pod>`` on the host, where the test can look.

* A run that ends on its own: the sidecar removes its pod's directory at its
  end and says so in its report; no cleanup pod is made.
* A sidecar killed (as an OOM kill would): the operator stops the attempt and
  a cleanup pod on the node removes the directory once the pod's grace
  period is over; then the cleanup pod goes too.
* An operator without a prefix refuses every hostPath staging.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotguard.operator.testing import OperatorProcess
from testenv.kubetest import (
    Env,
    cond,
    create_job,
    fast_preemption,
    job_body,
    operator_namespace,
    pod_names,
    trainer_log,
    wait_event,
    wait_for,
    wait_status,
)

pytestmark = pytest.mark.integration

NS_PREFIX = "hpath"
SIDECAR = "spotguard-sidecar"
#: Saves five steps, then waits for the file ``$STOP`` (or to be killed at the end of its grace period).
TRAINER = r"""
import os, time
import numpy as np
from spotguard.trainer import Checkpointer
ck = Checkpointer.from_env()
for step in range(1, 6):
    ck.save(step, {"model": {"w": np.full(64, step, dtype=np.float32)}}, blocking=True)
print("saved", flush=True)
while not os.path.exists(os.environ["STOP"]):
    time.sleep(0.2)
ck.close()
"""


@pytest.fixture
def nvme(tmp_path: Path) -> Path:
    path = tmp_path / "nvme"
    path.mkdir()
    return path


@pytest.fixture
def env(kube: Any, apis: tuple[Any, Any], crd: None, process_nodes: Any, tmp_path: Path, nvme: Path) -> Iterator[Env]:
    (tmp_path / "logs").mkdir()
    with operator_namespace(
        kube, apis, process_nodes, "hpath", tmp_path / "logs", extra_args=["--staging-host-path-prefix", str(nvme)]
    ) as e:
        yield e


def s3_secret(e: Env, s3_store: Any) -> None:
    e.core.create_namespaced_secret(
        e.ns,
        {
            "metadata": {"name": "s3"},
            "stringData": {
                "AWS_ACCESS_KEY_ID": s3_store.access_key,
                "AWS_SECRET_ACCESS_KEY": s3_store.secret_key,
                "AWS_ENDPOINT_URL": s3_store.endpoint_url,
            },
        },
    )


def hostpath_job(name: str, s3_uri: str, staging: Path, stop: Path) -> dict[str, Any]:
    trainer = {
        "name": "trainer",
        "image": "trainer",
        "command": ["python", "-c", TRAINER],
        "env": [{"name": "STOP", "value": str(stop)}],
    }
    body = job_body(name, s3_uri, trainer, sidecar={"metricsPort": 0}, preemption=fast_preemption(3, 3, 3))
    body["spec"]["checkpoint"]["credentialsSecret"] = {"name": "s3"}
    body["spec"]["checkpoint"]["staging"] = {"hostPath": {"path": str(staging)}}
    return body


def logs(e: Env, pod: str) -> str:
    """The tails of the pod's containers' logs, for a failure's message."""
    out = []
    for container in ("spotguard-restore", "trainer", SIDECAR):
        path = e.nodes.log_path(e.ns, pod, container)
        text = path.read_text(errors="replace") if path.exists() else "(none)"
        out.append(f"--- {container} ---\n{text[-3000:]}")
    return "\n".join(out)


def sidecar_report(e: Env, pod: str) -> dict[str, Any]:
    p = e.core.read_namespaced_pod(pod, e.ns)
    [sidecar] = [c for c in p.status.container_statuses or [] if c.name == SIDECAR]
    report: dict[str, Any] = json.loads(sidecar.state.terminated.message)
    return report


def sidecar_runs(e: Env, pod: str) -> bool:
    try:
        e.nodes.container_pid(e.ns, pod, SIDECAR)
    except ProcessLookupError:
        return False
    return True


def test_the_sidecar_removes_its_pods_directory_at_its_end(
    env: Env, s3_store: Any, s3_uri: str, nvme: Path, tmp_path: Path
) -> None:
    e = env
    s3_secret(e, s3_store)
    staging = nvme / "spotguard"
    e.create_job(hostpath_job("done", s3_uri, staging, tmp_path / "stop"))
    pod_dir = staging / e.ns / "done-a1"
    # The pod's own directory of the node holds its checkpoints while it runs.
    wait_for(lambda: "saved" in trainer_log(e, "done-a1"), "the trainer to save", timeout=90)
    assert (pod_dir / "checkpoints").is_dir(), sorted(p.name for p in staging.rglob("*"))
    (tmp_path / "stop").touch()
    try:
        st = e.wait_status("done", "Succeeded", lambda s: s.get("phase") in ("Succeeded", "Failed"), timeout=90)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{logs(e, 'done-a1')}") from None
    assert st["phase"] == "Succeeded", (st, logs(e, "done-a1"))
    assert not pod_dir.exists()
    assert (staging / e.ns).is_dir()  # only the pod's own directory goes
    assert sidecar_report(e, "done-a1").get("podDirRemoved") is True
    assert pod_names(e.apis, e.ns, "done") == ["done-a1"]  # and no cleanup pod was needed


def test_a_killed_sidecars_directory_is_removed_by_the_operator(
    env: Env, s3_store: Any, s3_uri: str, nvme: Path, tmp_path: Path
) -> None:
    e = env
    s3_secret(e, s3_store)
    staging = nvme / "spotguard"
    e.create_job(hostpath_job("lost", s3_uri, staging, tmp_path / "never"))
    pod_dir = staging / e.ns / "lost-a1"
    wait_for(lambda: "saved" in trainer_log(e, "lost-a1"), "the trainer to save", timeout=90)
    assert pod_dir.is_dir()
    # The node starts the pod's containers one after another: the trainer can save before the sidecar runs.
    wait_for(lambda: sidecar_runs(e, "lost-a1"), "the sidecar to run")
    # What the kernel's OOM killer does: the sidecar's end never runs.
    e.nodes.signal_container(e.ns, "lost-a1", SIDECAR, signal.SIGKILL)
    st = e.wait_status("lost", "the sidecar's death", lambda s: cond(s, "SidecarHealthy").get("status") == "False")
    assert st["failures"] == 1
    # The operator stops attempt 1; its cleanup pod waits out the grace period, then removes the directory.
    wait_for(lambda: not pod_dir.exists(), "lost-a1's directory to be removed", timeout=60)
    assert (staging / e.ns).is_dir()
    # The cleanup pod goes once it is done and attempt 1's pod has gone.
    wait_for(
        lambda: (
            "lost-a1-staging-cleanup" not in pod_names(e.apis, e.ns, "lost")
            and "lost-a1" not in pod_names(e.apis, e.ns, "lost")
        ),
        "the cleanup pod to go",
        timeout=60,
    )
    events = [r for _t, r, _m in e.events("lost")]
    assert "StagingCleanupFailed" not in events


def test_without_a_prefix_host_path_staging_is_refused(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    body = job_body("nvme", f"file://{tmp_path}/store", {"name": "trainer", "image": "t", "command": ["true"]})
    body["spec"]["checkpoint"]["staging"] = {"hostPath": {"path": "/mnt/nvme/spotguard"}}
    create_job(apis, ns, body)
    st = wait_status(apis, ns, "nvme", "Invalid", lambda s: cond(s, "Invalid").get("status") == "True")
    assert "hostPath staging is off in this cluster" in cond(st, "Invalid")["message"]
    wait_event(apis, ns, "nvme", "InvalidSpec", lambda t, r, m: "staging.hostPathPrefix" in m)
    assert pod_names(apis, ns, "nvme") == []
