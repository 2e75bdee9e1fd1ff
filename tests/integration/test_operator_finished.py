"""A finished job is never run again (the operator against a real kube-apiserver).

The pod's end is written through the apiserver as kubelet would leave it: the
trainer exited 0, the classic sidecar gave up on the last checkpoint (exit 1)
and reported that the training finished. The job succeeds, with a Warning,
and no second attempt is made.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from spotguard.operator.testing import OperatorProcess
from testenv.kubetest import (
    cond,
    create_job,
    events,
    no_node_job,
    patch_pod_status,
    pod_names,
    run_pod,
    terminated,
    wait_events,
    wait_pod,
    wait_status,
)

pytestmark = pytest.mark.integration

#: The namespace of this module (the ``ns`` fixture).
NS_PREFIX = "fin"


def sidecar_gave_up(name: str) -> dict[str, Any]:
    """The classic sidecar's container after it gave up on the finished trainer's last checkpoint."""
    sidecar = terminated(name, 1)
    report = {"preempted": False, "reason": "finished", "step": 30, "trainerStep": 40}
    sidecar["state"]["terminated"]["message"] = json.dumps(report)
    return sidecar


def test_a_finished_job_whose_last_checkpoint_was_not_verified_is_not_run_again(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    create_job(apis, ns, no_node_job("done", f"file://{tmp_path}/store"))
    wait_pod(apis, ns, "done-a1")
    run_pod(apis, ns, "done-a1")
    wait_status(apis, ns, "done", "Running", lambda s: s.get("phase") == "Running")
    patch_pod_status(
        apis,
        ns,
        "done-a1",
        {"phase": "Failed", "containerStatuses": [terminated("trainer", 0), sidecar_gave_up("spotguard-sidecar")]},
    )
    st = wait_status(apis, ns, "done", "Succeeded", lambda s: s.get("phase") in ("Succeeded", "Restarting", "Failed"))
    assert st["phase"] == "Succeeded", st
    assert st["attempt"] == 1 and st["failures"] == 0 and st["preemptions"] == 0
    assert cond(st, "Succeeded")["status"] == "True"
    assert st["lastPodEnd"]["reason"] == "FinalCheckpointUnverified" and st["lastPodEnd"]["step"] == 30
    wait_events(apis, ns, "done", {"Completed", "FinalCheckpointUnverified"})
    warning = next(e for e in events(apis, ns, "done") if e[1] == "FinalCheckpointUnverified")
    assert warning[0] == "Warning" and "newest verified: step 30" in warning[2]
    time.sleep(2)  # a second attempt would be created at once (backoff 0): none comes
    assert pod_names(apis, ns, "done") == ["done-a1"]
