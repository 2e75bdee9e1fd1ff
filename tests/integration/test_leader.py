"""Leader election between real operator processes on the real apiserver: freeze, takeover, fence, release.

No kubelet runs here: the job's pods stay Pending (no node matches) and a
pod's end is written into its status as kubelet's node shutdown would. The
leader is frozen with SIGSTOP, not killed, so the test sees what a stale
leader does once it is continued: it exits on its own and writes nothing.
Who wrote what, and when, is read from the apiserver's audit log (each
operator process sends its identity in its User-Agent), in the order the
apiserver received the writes.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from spotguard.operator.leader import LOST_EXIT_CODE, pod_of
from spotguard.operator.podbuilder import ANNOTATION_OPERATOR_INSTANCE
from spotguard.operator.testing import OperatorProcess, http_get
from testenv.kubetest import (
    IMAGE,
    audit_writes,
    create_job,
    delete_jobs,
    job_body,
    lease_holder,
    new_namespace,
    wait_for,
    wait_status,
)

pytestmark = pytest.mark.integration

NO_NODE = {"spotguard.dev/test-no-node": "true"}
LEASE = "spotguard-leader"
#: Short durations (client-go's rules: 4 > 2.5 > 1.2 x 0.5), so a failover takes seconds.
LEASE_SECONDS, RENEW_SECONDS, RETRY_SECONDS = 4, 2.5, 0.5
#: What the job's writes are (the operator's own client; kopf's are told apart by neither).
JOB_WRITES = {"pods", "events", "services", "serviceaccounts", "rolebindings", "trainingjobs/status"}


def replica(kube: Any, ns: str, pod: str, log_dir: Path) -> OperatorProcess:
    """An operator replica as the chart runs one: ``--leader-elect``, its pod's name in ``POD_NAME``."""
    args = [
        "-n",
        ns,
        "--image",
        IMAGE,
        "--native-sidecar",
        "off",
        "--resync-seconds",
        "2",
        "--checkpoint-poll-seconds",
        "1",
        "--leader-elect",
        "--leader-elect-resource-namespace",
        ns,
        "--leader-elect-resource-name",
        LEASE,
        "--leader-elect-lease-duration",
        str(LEASE_SECONDS),
        "--leader-elect-renew-deadline",
        str(RENEW_SECONDS),
        "--leader-elect-retry-period",
        str(RETRY_SECONDS),
    ]
    return OperatorProcess(args, env={**kube.env(), "POD_NAME": pod}, log_path=log_dir / f"{pod}.log")


def no_node_job(name: str, storage: str) -> dict[str, Any]:
    trainer = {
        "name": "trainer",
        "image": "trainer:1",
        "command": ["python", "-m", "train"],
        "resources": {"limits": {"nvidia.com/gpu": 1}},
    }
    preemption = {
        "maxPreemptions": 3,
        "backoffLimit": 1,
        "gracePeriodSeconds": 5,
        "backoff": {"initialSeconds": 0},
        "preemptionBackoff": {"initialSeconds": 0},
    }
    return job_body(name, storage, trainer, node_selector=NO_NODE, every_steps=10, preemption=preemption)


def shutdown_pod(core: Any, ns: str, pod: str) -> None:
    """What kubelet's graceful node shutdown leaves (1.26+)."""
    ended = {
        "exitCode": 0,
        "reason": "Completed",
        "startedAt": "2030-01-01T00:00:00Z",
        "finishedAt": "2030-01-01T00:01:00Z",
    }
    core.patch_namespaced_pod_status(
        pod,
        ns,
        {
            "status": {
                "phase": "Failed",
                "reason": "Terminated",
                "message": "Pod was terminated in response to imminent node shutdown.",
                "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}],
                "containerStatuses": [
                    {
                        "name": n,
                        "ready": False,
                        "restartCount": 0,
                        "image": "x",
                        "imageID": "",
                        "state": {"terminated": ended},
                    }
                    for n in ("trainer", "spotguard-sidecar")
                ],
            }
        },
    )


def holder(core: Any, ns: str) -> str | None:
    return lease_holder(core.api_client, ns, LEASE)


@pytest.fixture
def ns(apis: tuple[Any, Any], crd: None) -> Iterator[str]:
    core, _ = apis
    name = new_namespace(core, "leader")
    yield name
    core.delete_namespace(name)


def test_a_frozen_leader_is_replaced_fenced_and_exits_and_a_stopped_one_hands_over(
    kube: Any, apis: tuple[Any, Any], ns: str, tmp_path: Path
) -> None:
    core, _ = apis
    a, b, c = (replica(kube, ns, pod, tmp_path) for pod in ("op-a", "op-b", "op-c"))
    try:
        a.start()
        first = wait_for(lambda: holder(core, ns), "a leader", timeout=30)
        assert pod_of(first) == "op-a"
        b.start()  # a standby answers its liveness endpoint too

        # It answers as soon as it listens; it names the leader once its first look at the Lease is done.
        def naming_the_leader() -> str | None:
            body = http_get(f"http://127.0.0.1:{b.liveness_port}/healthz")
            return body if first in body else None

        standby = wait_for(naming_the_leader, "the standby to name the leader", timeout=30, interval=0.1)
        assert '"standby": true' in standby
        job = create_job(apis, ns, no_node_job("ha", f"file://{tmp_path}/store"))
        pod = wait_for(lambda: core.read_namespaced_pod("ha-a1", ns), "pod ha-a1", timeout=60)
        assert pod.metadata.annotations[ANNOTATION_OPERATOR_INSTANCE] == first
        wait_status(apis, ns, "ha", "attempt 1", lambda s: s.get("attempt") == 1)

        # Freeze the leader (every thread of it), then end its pod: a preemption with nobody acting.
        assert a.proc is not None
        os.killpg(a.proc.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        shutdown_pod(core, ns, "ha-a1")
        second = wait_for(
            lambda: (lambda h: h if h and h != first else None)(holder(core, ns)),
            "the standby to take the Lease",
            timeout=30,
            interval=0.05,
        )
        takeover = time.monotonic() - frozen
        assert pod_of(second) == "op-b"
        pod = wait_for(lambda: core.read_namespaced_pod("ha-a2", ns), "pod ha-a2", timeout=30, interval=0.05)
        next_step = time.monotonic() - frozen
        print(
            f"takeover: Lease to the standby {takeover:.2f} s, next attempt's pod {next_step:.2f} s after SIGSTOP"
            f" (lease {LEASE_SECONDS} s, renew deadline {RENEW_SECONDS} s, retry {RETRY_SECONDS} s)"
        )
        # The standby waited out the lease from the last renewal it saw (at most a retry period before
        # the freeze), and took over within about two retry periods after it expired.
        assert LEASE_SECONDS - 1.2 * RETRY_SECONDS - 0.2 <= takeover <= LEASE_SECONDS + 3 * RETRY_SECONDS + 3
        assert pod.metadata.annotations[ANNOTATION_OPERATOR_INSTANCE] == second
        st = wait_status(apis, ns, "ha", "attempt 2", lambda s: s.get("attempt") == 2)
        assert st["preemptions"] == 1

        # Continue the frozen one: it finds its last renewal too old and exits without writing.
        continued = datetime.now(UTC)
        os.killpg(a.proc.pid, signal.SIGCONT)
        code = a.proc.wait(30)
        a.proc = None
        assert code == LOST_EXIT_CODE, a.log_tail()
        assert "lost the lease" in a.log_path.read_text()
        assert holder(core, ns) == second

        # What the apiserver saw, in its order.
        writes = audit_writes(kube, [ns])
        if writes is not None:
            leases = [w for w in writes if w.resource == "leases" and w.ok]
            takeover_at = next(w.at for w in leases if w.identity == second)
            late = [w for w in writes if w.identity == first and w.at > takeover_at]
            assert not late, late  # not even a refused renewal: it stopped before any request
            early = [w for w in writes if w.identity == second and w.at < takeover_at and w.resource != "leases"]
            assert not early, early
            actors = [w.identity for w in writes if w.resource in JOB_WRITES and w.identity]
            assert [x for i, x in enumerate(actors) if i == 0 or actors[i - 1] != x] == [first, second], actors
            created = [w.name for w in writes if w.resource == "pods" and w.verb == "create" and w.ok]
            assert sorted(created) == ["ha-a1", "ha-a2"], created
        # And from the objects themselves: no Event of the frozen one after it was continued.
        for ev in core.list_namespaced_event(ns, field_selector="involvedObject.name=ha").items:
            if ev.reporting_instance == first:
                assert ev.metadata.creation_timestamp < continued, ev

        # A stopped leader releases the Lease: a standby takes it at its next look, not after the lease.
        c.start()
        sigterm = time.monotonic()
        b.stop()
        exited = time.monotonic()
        third = wait_for(
            lambda: (lambda h: h if h and pod_of(h) == "op-c" else None)(holder(core, ns)),
            "the next standby to take the released Lease",
            timeout=30,
            interval=0.05,
        )
        handover = time.monotonic()
        print(
            f"handover after a stop: the standby led {handover - sigterm:.2f} s after SIGTERM"
            f" ({exited - sigterm:.2f} s for the leader to stop)"
        )
        # It kept renewing until it released: without the release this would take a whole lease duration.
        assert handover - exited < LEASE_SECONDS - 1, handover - exited
        assert "released the Lease" in b.log_path.read_text()
        wait_status(apis, ns, "ha", "a look by the new leader", lambda s: s.get("attempt") == 2)
        assert job["metadata"]["uid"] == core.read_namespaced_pod("ha-a2", ns).metadata.owner_references[0].uid
        assert third != second
        delete_jobs(apis, ns, pods=False)
    finally:
        for op in (a, b, c):
            op.stop()
        for op in (a, b, c):
            print(f"--- {op.log_path.name} ---\n{op.log_tail(30)}")


def test_leader_election_durations_are_checked(kube: Any, tmp_path: Path) -> None:
    args = ["--leader-elect", "--leader-elect-lease-duration", "5", "--leader-elect-renew-deadline", "5"]
    op = OperatorProcess(args, env=kube.env(), log_path=tmp_path / "op.log")
    with pytest.raises(Exception, match="exited with 2"):
        op.start(timeout=30)
    assert "must be longer than the renew deadline" in op.log_path.read_text()
    op = OperatorProcess(["--peering", "x"], env=kube.env(), log_path=tmp_path / "peering.log")
    with pytest.raises(Exception, match="exited with 2"):
        op.start(timeout=30)
    assert "replaced by --leader-elect" in op.log_path.read_text()
