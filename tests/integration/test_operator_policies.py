"""Failure rules, deadlines, TTL, avoided nodes and the spot -> on-demand fallback, against a real apiserver.

The real scheduler places the pods on node objects without a kubelet (a
"spot" and an "on-demand" pool, by label); each way a pod ends is written
into its status through the apiserver, as kubelet would (see ``test_operator``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotguard.operator.testing import OperatorProcess, metric_value
from testenv.kubetest import (
    GROUP,
    PLURAL,
    VERSION,
    cond,
    create_job,
    events,
    fail_pod,
    fake_node,
    get_job,
    heartbeat,
    no_node_job,
    patch_pod_status,
    pod_names,
    run_pod,
    succeed_pod,
    terminated,
    wait_events,
    wait_for,
    wait_status,
)

pytestmark = pytest.mark.integration


def wait_metric(operator: OperatorProcess, name: str, labels: dict[str, str], value: float) -> None:
    """The operator's metric reaches ``value`` (it is set just after the status write)."""
    wait_for(lambda: metric_value(operator.metrics(), name, labels) == value, f"{name}{labels} == {value}", timeout=30)


#: The namespace of this module (the ``ns`` fixture).
NS_PREFIX = "pol"


@pytest.fixture
def pools(apis: tuple[Any, Any]) -> Iterator[tuple[dict[str, str], dict[str, str], list[str]]]:
    """A spot node and an on-demand node (node objects the scheduler uses), labelled apart from any other test's."""
    core, _ = apis
    tag = uuid.uuid4().hex[:6]
    spot, on_demand = {"test-pool": f"spot-{tag}"}, {"test-pool": f"od-{tag}"}
    names = [f"pol-spot-{tag}", f"pol-od-{tag}"]
    fake_node(core, names[0], spot)
    fake_node(core, names[1], on_demand)
    try:
        yield spot, on_demand, names
    finally:
        for name in names:
            core.delete_node(name)


def node_of(apis: tuple[Any, Any], ns: str, pod: str, nodes: list[str]) -> str:
    core, _ = apis
    for name in nodes:
        heartbeat(core, name)
    return wait_for(lambda: core.read_namespaced_pod(pod, ns).spec.node_name, f"pod {pod} scheduled", timeout=60)


def evict(apis: tuple[Any, Any], ns: str, pod: str) -> None:
    """A drain: the pod is deleted and ends (kubelet would SIGTERM it; the trainer saves and exits 0)."""
    core, _ = apis
    patch_pod_status(
        apis,
        ns,
        pod,
        {
            "phase": "Failed",
            "reason": "Evicted",
            "message": "drained",
            "conditions": [
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "EvictionByEvictionAPI",
                    "message": "Eviction API: evicting",
                }
            ],
            "containerStatuses": [terminated("trainer", 0), terminated("spotguard-sidecar", 0)],
        },
    )


def test_failure_rules_ignore_an_exit_code_and_fail_the_job_on_oom(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    rules = {
        "rules": [
            {"action": "FailJob", "onReasons": ["OOMKilled"]},
            {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "values": [134]}},
        ]
    }
    create_job(apis, ns, no_node_job("rules", f"file://{tmp_path}", failurePolicy=rules))
    for attempt in (1, 2):  # backoffLimit 1: the second counted failure would fail the job
        wait_status(apis, ns, "rules", f"attempt {attempt}", lambda s, a=attempt: s.get("attempt") == a)
        fail_pod(apis, ns, f"rules-a{attempt}", code=134)
    st = wait_status(apis, ns, "rules", "attempt 3", lambda s: s.get("attempt") == 3)
    assert st["failures"] == 0 and st["ignoredFailures"] == 2 and st["phase"] != "Failed"
    # Events and metrics follow the status write (kopf posts Events from a queue): wait for them.
    wait_events(apis, ns, "rules", {"PodFailed"})
    ignored = [m for _, r, m in events(apis, ns, "rules") if r == "PodFailed"]
    assert ignored and all("not counted, spec.failurePolicy.rules[1]" in m for m in ignored), ignored
    wait_metric(operator, "spotguard_job_ignored_failures_total", {"namespace": ns, "trainingjob": "rules"}, 2)
    patch_pod_status(
        apis,
        ns,
        "rules-a3",
        {
            "phase": "Failed",
            "containerStatuses": [terminated("trainer", 137, "OOMKilled"), terminated("spotguard-sidecar", 0)],
        },
    )
    st = wait_status(apis, ns, "rules", "Failed", lambda s: s.get("phase") == "Failed")
    failed = cond(st, "Failed")
    assert failed["reason"] == "FailedByRule" and "rules[0]" in failed["message"], failed
    assert st["failures"] == 0 and st["attempt"] == 3


def test_active_deadline_stops_the_pod_and_fails_the_job(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    create_job(apis, ns, no_node_job("deadline", f"file://{tmp_path}", activeDeadlineSeconds=4))
    wait_status(apis, ns, "deadline", "attempt 1", lambda s: s.get("attempt") == 1)
    run_pod(apis, ns, "deadline-a1")
    st = wait_status(apis, ns, "deadline", "Failed", lambda s: s.get("phase") == "Failed", timeout=30)
    assert cond(st, "Failed")["reason"] == "DeadlineExceeded", st
    assert "activeDeadlineSeconds" in cond(st, "Failed")["message"]
    wait_for(lambda: pod_names(apis, ns, "deadline") == [], "the pod to be stopped", timeout=30)
    assert st["attempt"] == 1


def test_ttl_deletes_the_finished_job_object_and_keeps_its_checkpoints(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    _, custom = apis
    kept = tmp_path / ns / "ttl" / "ckpt-00000010" / "manifest.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("{}")
    create_job(apis, ns, no_node_job("ttl", f"file://{tmp_path}", ttlSecondsAfterFinished=2))
    wait_status(apis, ns, "ttl", "attempt 1", lambda s: s.get("attempt") == 1)
    succeed_pod(apis, ns, "ttl-a1")
    wait_status(apis, ns, "ttl", "Succeeded", lambda s: s.get("phase") == "Succeeded")

    def gone() -> bool:
        listed = custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
        return all(j["metadata"]["name"] != "ttl" for j in listed)

    wait_for(gone, "the finished job to be deleted", timeout=30)
    assert kept.exists(), "the job's checkpoints must stay"


def test_a_node_that_ended_the_job_twice_is_avoided(
    apis: tuple[Any, Any],
    ns: str,
    operator: OperatorProcess,
    tmp_path: Path,
    pools: tuple[dict[str, str], dict[str, str], list[str]],
) -> None:
    core, _ = apis
    spot, _, names = pools
    body = no_node_job(
        "avoid",
        f"file://{tmp_path}",
        avoidNodes={"afterEnds": 2, "forSeconds": 600},
        preemption={"maxPreemptions": 5, "backoffLimit": 5, "gracePeriodSeconds": 5, "backoff": {"initialSeconds": 0}},
    )
    body["spec"]["template"]["spec"]["nodeSelector"] = spot
    create_job(apis, ns, body)
    for attempt in (1, 2):
        wait_status(apis, ns, "avoid", f"attempt {attempt}", lambda s, a=attempt: s.get("attempt") == a)
        assert node_of(apis, ns, f"avoid-a{attempt}", names) == names[0]
        fail_pod(apis, ns, f"avoid-a{attempt}")
    st = wait_status(apis, ns, "avoid", "attempt 3", lambda s: s.get("attempt") == 3)
    assert st["avoidedNodes"][0]["node"] == names[0] and st["avoidedNodes"][0]["ends"] == 2
    wait_events(apis, ns, "avoid", {"NodeAvoided"})
    assert any(r == "NodeAvoided" and names[0] in m for _, r, m in events(apis, ns, "avoid"))
    pod = core.read_namespaced_pod("avoid-a3", ns)
    terms = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    assert [(f.key, f.operator, f.values) for f in terms[0].match_fields] == [("metadata.name", "NotIn", [names[0]])]
    # The only spot node is avoided: the scheduler says so, and the job says the pod cannot be placed.
    wait_for(
        lambda: any(
            c.type == "PodScheduled" and c.status == "False"
            for c in core.read_namespaced_pod("avoid-a3", ns).status.conditions or []
        ),
        "the pod to be unschedulable",
        timeout=30,
    )


def test_repeated_preemptions_move_the_job_to_on_demand_and_the_cooldown_brings_it_back(
    apis: tuple[Any, Any],
    ns: str,
    operator: OperatorProcess,
    tmp_path: Path,
    pools: tuple[dict[str, str], dict[str, str], list[str]],
) -> None:
    spot, on_demand, names = pools
    fallback = {
        "nodeSelector": on_demand,
        "afterPreemptions": 2,
        "preemptionWindowSeconds": 600,
        "afterUnschedulableSeconds": 0,
        "cooldownSeconds": 6,
    }
    body = no_node_job("fb", f"file://{tmp_path}", fallback=fallback)
    body["spec"]["template"]["spec"]["nodeSelector"] = spot
    create_job(apis, ns, body)
    for attempt in (1, 2):
        wait_status(apis, ns, "fb", f"attempt {attempt}", lambda s, a=attempt: s.get("attempt") == a)
        assert node_of(apis, ns, f"fb-a{attempt}", names) == names[0]
        run_pod(apis, ns, f"fb-a{attempt}")
        evict(apis, ns, f"fb-a{attempt}")
    st = wait_status(apis, ns, "fb", "attempt 3", lambda s: s.get("attempt") == 3)
    assert st["placement"]["pool"] == "fallback" and cond(st, "OnFallback")["status"] == "True", st
    assert st["preemptions"] == 2
    assert node_of(apis, ns, "fb-a3", names) == names[1], "attempt 3 runs on the on-demand node"
    run_pod(apis, ns, "fb-a3")
    labels = {"namespace": ns, "trainingjob": "fb"}
    wait_metric(operator, "spotguard_job_on_fallback", labels, 1)
    wait_metric(operator, "spotguard_job_placement_moves_total", {**labels, "to": "fallback"}, 1)
    # The cool-down is over: the operator stops attempt 3 (after its checkpoint) and attempt 4 runs on spot.
    started = time.monotonic()
    core, _ = apis
    wait_for(
        lambda: (
            core.read_namespaced_pod("fb-a3", ns).metadata.deletion_timestamp is not None
            or "fb-a3" not in pod_names(apis, ns, "fb")
        ),
        "attempt 3 to be stopped",
        timeout=60,
    )
    assert time.monotonic() - started < 30
    evict(apis, ns, "fb-a3")  # kubelet's SIGTERM: the trainer saved and exited
    st = wait_status(apis, ns, "fb", "attempt 4", lambda s: s.get("attempt") == 4, timeout=60)
    assert st["placement"]["pool"] == "primary" and cond(st, "OnFallback")["status"] == "False", st
    assert st["preemptions"] == 2 and st["failures"] == 0 and st["lastPodEnd"]["kind"] == "moved"
    assert node_of(apis, ns, "fb-a4", names) == names[0], "attempt 4 is back on the spot node"
    wait_events(apis, ns, "fb", {"FallbackPlacement", "ReturningToPrimary", "PrimaryPlacement"})
    wait_metric(operator, "spotguard_job_placement_moves_total", {**labels, "to": "primary"}, 1)
    assert get_job(apis, ns, "fb")["status"]["attempt"] == 4


def test_a_job_unschedulable_on_spot_moves_to_on_demand(
    apis: tuple[Any, Any],
    ns: str,
    operator: OperatorProcess,
    tmp_path: Path,
    pools: tuple[dict[str, str], dict[str, str], list[str]],
) -> None:
    _, on_demand, names = pools
    fallback = {"nodeSelector": on_demand, "afterUnschedulableSeconds": 2, "cooldownSeconds": 3600}
    body = no_node_job("nospot", f"file://{tmp_path}", fallback=fallback)
    body["spec"]["template"]["spec"]["nodeSelector"] = {"test-pool": "no-such-spot-pool"}
    create_job(apis, ns, body)
    st = wait_status(apis, ns, "nospot", "attempt 2", lambda s: s.get("attempt") == 2, timeout=60)
    assert st["placement"] == {**st["placement"], "pool": "fallback", "reason": "Unschedulable"}
    assert st["preemptions"] == 0 and st["failures"] == 0 and st["lastPodEnd"]["kind"] == "moved"
    assert node_of(apis, ns, "nospot-a2", names) == names[1]
