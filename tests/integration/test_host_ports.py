"""Host ports of hostNetwork TrainingJobs, allocated by the operator against a real apiserver.

No kubelet runs the pods (a nodeSelector no node matches keeps them Pending);
pod ends are produced by patching pod status, as in ``test_operator``.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from spotguard.operator.testing import OperatorProcess
from testenv.kubetest import (
    cond,
    create_job,
    delete_jobs,
    fast_preemption,
    job_body,
    new_namespace,
    operator_process,
    status,
    wait_event,
    wait_for,
    wait_status,
)

pytestmark = pytest.mark.integration

NO_NODE = {"spotguard.dev/test-no-node": "true"}
NODEPORTS = range(30000, 32768)
JOBS = 20
#: Exactly one pair per job of the fleet: the 21st job finds the range full.
SMALL = (24000, 24000 + 2 * JOBS - 1)


def hostnet_job(name: str, storage: str) -> dict[str, Any]:
    """A hostNetwork job of one node and two processes (torchrun's master port is declared too)."""
    trainer = {"name": "trainer", "image": "trainer:1", "command": ["torchrun", "train.py"]}
    return job_body(
        name,
        storage,
        trainer,
        node_selector=NO_NODE,
        pod_spec={"hostNetwork": True},
        nprocPerNode=2,
        preemption=fast_preemption(3, 2, 5),
    )


def create_all(apis: tuple[Any, Any], ns: str, names: list[str], storage: str) -> None:
    """Create the jobs at once, from several threads."""
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: create_job(apis, ns, hostnet_job(n, storage)), names))


def pod_ports(apis: tuple[Any, Any], ns: str, pod: str) -> tuple[int, int] | None:
    """(master, metrics) a pod declares, or None while it does not exist."""
    core, _ = apis
    pods = core.list_namespaced_pod(ns, field_selector=f"metadata.name={pod}").items
    if not pods:
        return None
    declared = {p.name: p.container_port for c in pods[0].spec.containers for p in c.ports or []}
    return declared["sg-c10d"], declared["sg-metrics"]


def wait_pod_ports(apis: tuple[Any, Any], ns: str, pod: str, timeout: float = 60) -> tuple[int, int]:
    return wait_for(lambda: pod_ports(apis, ns, pod), f"pod {ns}/{pod}", timeout=timeout)


def held(st: dict[str, Any]) -> tuple[int, int] | None:
    hp = st.get("hostPorts") or {}
    return (hp["master"], hp["metrics"]) if hp.get("confirmed") else None


def set_pod_end(apis: tuple[Any, Any], ns: str, pod: str, code: int) -> None:
    core, _ = apis

    def term(name: str, exit_code: int) -> dict[str, Any]:
        return {
            "name": name,
            "ready": False,
            "restartCount": 0,
            "image": "x",
            "imageID": "",
            "state": {
                "terminated": {
                    "exitCode": exit_code,
                    "reason": "Completed" if exit_code == 0 else "Error",
                    "startedAt": "2030-01-01T00:00:00Z",
                    "finishedAt": "2030-01-01T00:01:00Z",
                }
            },
        }

    core.patch_namespaced_pod_status(
        pod,
        ns,
        {
            "status": {
                "phase": "Succeeded" if code == 0 else "Failed",
                "containerStatuses": [term("trainer", code), term("spotguard-sidecar", 0)],
            }
        },
    )


def all_ports(apis: tuple[Any, Any], ns: str, names: list[str]) -> dict[str, tuple[int, int]]:
    """Each job's pair, once every job holds one and its first pod declares it."""
    got = {}
    for name in names:
        st = wait_status(apis, ns, name, "host ports allocated", held, timeout=90)
        ports = held(st)
        assert ports is not None
        assert wait_pod_ports(apis, ns, f"{name}-a1") == ports, name
        got[name] = ports
    return got


def assert_distinct(ports: dict[str, tuple[int, int]], within: tuple[int, int]) -> None:
    flat = [p for pair in ports.values() for p in pair]
    assert len(set(flat)) == len(flat), ports
    assert all(within[0] <= p <= within[1] for p in flat), ports
    assert not set(flat) & set(NODEPORTS), ports


@pytest.fixture
def ns(apis: tuple[Any, Any], crd: None) -> Iterator[str]:
    core, _ = apis
    name = new_namespace(core, "hostports")
    yield name
    core.delete_namespace(name)


def test_ports_are_distinct_stable_freed_and_wait_when_the_range_is_full(
    apis: tuple[Any, Any], kube: Any, ns: str, tmp_path: Path
) -> None:
    storage = f"file://{tmp_path}/store"
    op = operator_process(
        kube, ns, tmp_path / "operator.log", extra_args=["--host-port-range", f"{SMALL[0]}-{SMALL[1]}"]
    ).start()
    try:
        names = [f"j{i:02d}" for i in range(JOBS)]
        create_all(apis, ns, names, storage)
        ports = all_ports(apis, ns, names)
        assert_distinct(ports, SMALL)
        # Allocation relies on this: a status patch that names an old resourceVersion is refused.
        _, custom = apis
        with pytest.raises(ApiException) as refused:
            custom.patch_namespaced_custom_object_status(
                "spotguard.dev",
                "v1alpha1",
                ns,
                "trainingjobs",
                "j00",
                {"metadata": {"resourceVersion": "1"}, "status": {"hostPorts": None}},
                _content_type="application/merge-patch+json",
            )
        assert refused.value.status == 409

        # A second attempt reuses the job's pair.
        set_pod_end(apis, ns, "j00-a1", 1)
        assert wait_pod_ports(apis, ns, "j00-a2") == ports["j00"]

        # A new operator knows every pair from the jobs' status: the 21st job finds none and waits.
        op.stop()
        op.start()
        create_job(apis, ns, hostnet_job("late", storage))
        st = wait_status(
            apis,
            ns,
            "late",
            "HostPortsAllocated False",
            lambda s: cond(s, "HostPortsAllocated").get("status") == "False",
        )
        c = cond(st, "HostPortsAllocated")
        assert c["reason"] == "HostPortRangeExhausted" and "operator.hostPortRange" in c["message"], c
        assert st.get("phase") == "Pending" and not st.get("attempt") and not st.get("hostPorts"), st
        wait_event(
            apis,
            ns,
            "late",
            "HostPortRangeExhausted",
            lambda t, r, m: t == "Warning" and r == "HostPortRangeExhausted" and f"{SMALL[0]}-" in m,
        )
        assert pod_ports(apis, ns, "late-a1") is None
        assert {n: held(status(apis, ns, n)) for n in names} == ports  # nobody lost its pair

        # A job that finishes frees its pair: the waiting job gets it.
        set_pod_end(apis, ns, "j01-a1", 0)
        st = wait_status(apis, ns, "j01", "Succeeded", lambda s: s.get("phase") == "Succeeded")
        assert "hostPorts" not in st
        assert wait_pod_ports(apis, ns, "late-a1") == ports["j01"]
        st = wait_status(
            apis, ns, "late", "HostPortsAllocated True", lambda s: cond(s, "HostPortsAllocated").get("status") == "True"
        )
        assert held(st) == ports["j01"]

        # So does a job that is deleted.
        create_job(apis, ns, hostnet_job("later", storage))
        wait_status(
            apis,
            ns,
            "later",
            "HostPortsAllocated False",
            lambda s: cond(s, "HostPortsAllocated").get("status") == "False",
        )
        custom.delete_namespaced_custom_object("spotguard.dev", "v1alpha1", ns, "trainingjobs", "j02")
        assert wait_pod_ports(apis, ns, "later-a1") == ports["j02"]
        delete_jobs(apis, ns, pods=False)
    finally:
        op.stop()
        print(f"--- operator log ---\n{op.log_tail(40)}")


def test_two_operators_at_once_never_hand_out_one_port_twice(
    apis: tuple[Any, Any], kube: Any, ns: str, tmp_path: Path
) -> None:
    # Two operators acting on one namespace (as two replicas might for a moment), with exactly one pair per
    # job: their claims meet, and each claim is checked against the others' in the apiserver.
    storage = f"file://{tmp_path}/store"
    tight = (24100, 24100 + 2 * JOBS - 1)
    args = ["--host-port-range", f"{tight[0]}-{tight[1]}"]
    ops: list[OperatorProcess] = []
    try:
        for i in range(2):
            ops.append(operator_process(kube, ns, tmp_path / f"operator-{i}.log", extra_args=args).start())
        names = [f"r{i:02d}" for i in range(JOBS)]
        create_all(apis, ns, names, storage)
        ports = all_ports(apis, ns, names)
        assert_distinct(ports, tight)
        delete_jobs(apis, ns, pods=False)
    finally:
        for op in ops:
            op.stop()
            print(f"--- operator log ({op.log_path.name}) ---\n{op.log_tail(20)}")
