"""Failure rules, deadlines, TTL, avoided nodes and the spot -> on-demand fallback, decided without a cluster."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from spotguard.operator import policy
from spotguard.operator.classify import PodEnd, classify_pod_end
from spotguard.operator.decide import decide
from spotguard.operator.jobstatus import Decision, Member, Observation, condition
from spotguard.operator.spec import TrainingJobSpec, parse
from spotguard.operator.specfields import SpecError

T0 = datetime(2030, 1, 1, tzinfo=UTC)
RUN = PodEnd("running", "Running")
CRASH_137 = PodEnd(
    "failed", "Error", "container trainer exited with code 137", container="trainer", exit_code=137, node="spot-1"
)
CRASH_1 = PodEnd(
    "failed", "Error", "container trainer exited with code 1", container="trainer", exit_code=1, node="spot-1"
)
OOM = PodEnd("failed", "OOMKilled", "container trainer was killed (OOMKilled)", container="trainer", exit_code=137)
DRAIN = PodEnd("preempted", "PodDeleted", "the pod was deleted (drain or eviction)", node="spot-1")


def spec(**extra: Any) -> TrainingJobSpec:
    raw: dict[str, Any] = {
        "template": {"spec": {"nodeSelector": {"pool": "spot"}, "containers": [{"name": "trainer", "image": "t"}]}},
        "checkpoint": {"storage": "s3://bkt/p"},
        "preemption": {"maxPreemptions": 10, "backoffLimit": 1, "backoff": {"initialSeconds": 0}},
        **extra,
    }
    return parse(raw)


def step(
    status: dict[str, Any] | None,
    end: PodEnd | None,
    sp: TrainingJobSpec,
    now: datetime = T0,
    members: tuple[Member, ...] = (),
) -> Decision:
    return decide("job", status, sp, Observation(pod_end=end, members=members), now, 1)


def started(sp: TrainingJobSpec, now: datetime = T0) -> dict[str, Any]:
    d = step(None, None, sp, now)
    assert d.create_attempt == 1
    return step(d.status, RUN, sp, now).status


# --- failure rules ---------------------------------------------------------------------


RULES = {
    "rules": [
        {"action": "FailJob", "onReasons": ["OOMKilled"]},
        {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [137, 143]}},
    ]
}


def test_an_ignored_exit_code_restarts_without_counting_against_the_backoff_limit() -> None:
    sp = spec(failurePolicy=RULES)
    st = started(sp)
    for attempt in (1, 2, 3):  # backoffLimit 1 would have failed the job at the second counted failure
        d = step(st, CRASH_137, sp)
        assert d.create_attempt == attempt + 1, d.events
        assert d.status["failures"] == 0 and d.status["ignoredFailures"] == attempt
        assert any("not counted, spec.failurePolicy.rules[1]" in e.message for e in d.events)
        st = step(d.status, RUN, sp).status


def test_a_fail_job_rule_fails_at_once_and_an_unmatched_failure_counts() -> None:
    sp = spec(failurePolicy=RULES)
    d = step(started(sp), OOM, sp)
    assert d.status["phase"] == "Failed" and d.status["failures"] == 0
    failed = condition(d.status, "Failed") or {}
    assert failed.get("reason") == "FailedByRule" and "spec.failurePolicy.rules[0]" in str(failed.get("message"))
    d = step(started(sp), CRASH_1, sp)
    assert d.status["failures"] == 1 and d.create_attempt == 2


def test_without_rules_every_failure_counts_as_before() -> None:
    sp = spec()
    d = step(started(sp), CRASH_137, sp)
    assert d.status["failures"] == 1 and "ignoredFailures" not in d.status


@pytest.mark.parametrize(
    ("rule", "end", "matches"),
    [
        ({"action": "Ignore", "onExitCodes": {"values": [137]}}, CRASH_137, True),
        ({"action": "Ignore", "onExitCodes": {"operator": "NotIn", "values": [137]}}, CRASH_137, False),
        ({"action": "Ignore", "onExitCodes": {"operator": "NotIn", "values": [137]}}, CRASH_1, True),
        ({"action": "Ignore", "onExitCodes": {"containerName": "other", "values": [137]}}, CRASH_137, False),
        ({"action": "Ignore", "onReasons": ["OOMKilled"], "onExitCodes": {"values": [1]}}, OOM, False),
        ({"action": "Ignore", "onReasons": ["OOMKilled"]}, OOM, True),
        ({"action": "Ignore", "onExitCodes": {"values": [137]}}, DRAIN, False),  # never a preemption
    ],
)
def test_rule_matching(rule: dict[str, Any], end: PodEnd, matches: bool) -> None:
    rules = spec(failurePolicy={"rules": [rule]}).failure_rules
    assert policy.rule_matches(rules[0], end) is matches


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"rules": [{"action": "Retry", "onReasons": ["OOMKilled"]}]}, "spec.failurePolicy.rules[0].action"),
        ({"rules": [{"action": "Ignore"}]}, "spec.failurePolicy.rules[0]"),
        (
            {"rules": [{"action": "Ignore", "onExitCodes": {"values": []}}]},
            "spec.failurePolicy.rules[0].onExitCodes.values",
        ),
    ],
)
def test_bad_rules_are_refused_naming_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        spec(failurePolicy=raw)
    assert err.value.field == field


def test_the_blamed_container_and_its_exit_code_are_classified() -> None:
    pod = {
        "spec": {"nodeName": "spot-7"},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {"name": "trainer", "state": {"terminated": {"exitCode": 134, "finishedAt": "2030-01-01T00:00:00Z"}}}
            ],
        },
    }
    end = classify_pod_end(pod)
    assert (end.kind, end.container, end.exit_code, end.node) == ("failed", "trainer", 134, "spot-7")


# --- deadline and TTL ---------------------------------------------------------------------


def test_the_deadline_stops_the_pod_and_fails_the_job_keeping_checkpoints() -> None:
    sp = spec(activeDeadlineSeconds=3600)
    st = started(sp)
    d = step(st, RUN, sp, T0 + timedelta(seconds=1800))
    assert d.status["phase"] == "Running" and d.requeue_after == pytest.approx(1800)
    d = step(st, RUN, sp, T0 + timedelta(seconds=3600))
    assert d.status["phase"] == "Failed" and d.delete_pod == "job-a1" and not d.force_delete
    assert (condition(d.status, "Failed") or {}).get("reason") == "DeadlineExceeded"
    assert "checkpoints are kept" in d.events[-1].message


def test_the_deadline_stops_every_pod_of_a_gang() -> None:
    sp = spec(activeDeadlineSeconds=60, nodes=2)
    st = step(None, None, sp).status
    members = tuple(Member(r, f"job-a1-{r}", RUN, node=f"n{r}") for r in range(2))
    d = step(st, None, sp, T0 + timedelta(seconds=61), members)
    assert d.status["phase"] == "Failed" and {p for p, _ in d.delete_pods} == {"job-a1-0", "job-a1-1"}


def test_time_suspended_is_not_counted() -> None:
    sp = spec(activeDeadlineSeconds=3600)
    st = {
        **started(sp),
        "lastPodEnd": {"attempt": 1, "kind": "suspended"},
        "phase": "Suspended",
        "conditions": [{"type": "Suspended", "status": "True"}],
    }
    d = step(st, None, sp, T0 + timedelta(seconds=5000))
    assert d.create_attempt == 2 and d.status["startTime"] == "2030-01-01T01:23:20Z"


def test_ttl_counts_from_the_completion_time() -> None:
    sp = spec(ttlSecondsAfterFinished=300)
    assert policy.ttl_expires_at(sp, {"completionTime": "2030-01-01T00:00:00Z"}) == T0 + timedelta(seconds=300)
    assert policy.ttl_expires_at(sp, {"phase": "Running"}) is None
    assert policy.ttl_expires_at(spec(), {"completionTime": "2030-01-01T00:00:00Z"}) is None


# --- avoided nodes ---------------------------------------------------------------------------


def test_a_node_that_ended_the_job_twice_is_avoided_for_a_while() -> None:
    sp = spec(avoidNodes={"afterEnds": 2, "forSeconds": 600})
    st = started(sp)
    d = step(st, DRAIN, sp)
    assert policy.avoided_nodes(d.status, T0) == [] and d.status["avoidedNodes"][0]["ends"] == 1
    st = step(d.status, RUN, sp).status
    d = step(st, CRASH_1, sp, T0 + timedelta(seconds=10))
    assert policy.avoided_nodes(d.status, T0 + timedelta(seconds=10)) == ["spot-1"]
    assert any(e.reason == "NodeAvoided" for e in d.events)
    pod = policy.placed({"nodeSelector": {"pool": "spot"}}, sp, d.status, T0 + timedelta(seconds=20))
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["spot-1"]}]}]
    assert policy.avoided_nodes(d.status, T0 + timedelta(seconds=611)) == []


def test_avoiding_keeps_the_templates_own_node_affinity_terms() -> None:
    sp = spec(avoidNodes={"afterEnds": 1})
    status = {"avoidedNodes": [{"node": "a", "ends": 1, "until": "2030-01-02T00:00:00Z"}]}
    term = {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
    pod = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term, dict(term)]}
            }
        }
    }
    out = policy.placed(pod, sp, status, T0)
    terms = out["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == 2 and all(t["matchExpressions"] == term["matchExpressions"] for t in terms)
    assert all(t["matchFields"][0]["values"] == ["a"] for t in terms)
    assert (
        "matchFields"
        not in pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    )


# --- fallback ------------------------------------------------------------------------------


FALLBACK = {
    "nodeSelector": {"pool": "on-demand"},
    "tolerations": [],
    "afterPreemptions": 2,
    "preemptionWindowSeconds": 600,
    "afterUnschedulableSeconds": 120,
    "cooldownSeconds": 900,
}


def test_repeated_preemptions_move_the_job_to_its_fallback_and_the_cooldown_brings_it_back() -> None:
    sp = spec(fallback=FALLBACK)
    st = started(sp)
    d = step(st, DRAIN, sp)
    assert policy.pool(d.status) == "primary" and d.create_attempt == 2
    st = step(d.status, RUN, sp, T0 + timedelta(seconds=60)).status
    d = step(st, DRAIN, sp, T0 + timedelta(seconds=120))
    assert d.status["preemptions"] == 2 and d.create_attempt == 3
    assert policy.pool(d.status) == "fallback" and d.status["placement"]["returnAt"] == "2030-01-01T00:17:00Z"
    assert (condition(d.status, "OnFallback") or {}).get("status") == "True"
    assert any(e.reason == "FallbackPlacement" for e in d.events)
    pod = policy.placed({"nodeSelector": {"pool": "spot"}, "tolerations": [{"key": "spot"}]}, sp, d.status, T0)
    assert pod["nodeSelector"] == {"pool": "on-demand"} and pod["tolerations"] == []

    st = step(d.status, RUN, sp, T0 + timedelta(seconds=130)).status
    d = step(st, RUN, sp, T0 + timedelta(seconds=500))
    assert d.delete_pod is None and d.requeue_after == pytest.approx(520)
    d = step(st, RUN, sp, T0 + timedelta(seconds=1020))  # cool-down over: stop after a checkpoint
    assert d.delete_pod == "job-a3" and d.create_attempt is None and d.status["placement"]["returning"] == 3
    stopped = PodEnd("preempted", "PodDeleted", "the pod was deleted (drain or eviction)", step=70, node="od-1")
    d = step(d.status, stopped, sp, T0 + timedelta(seconds=1050))
    assert d.create_attempt == 4 and d.status["preemptions"] == 2 and d.status["failures"] == 0
    assert policy.pool(d.status) == "primary" and "returning" not in d.status["placement"]
    assert d.status["lastPodEnd"]["kind"] == "moved"
    assert (condition(d.status, "OnFallback") or {}).get("status") == "False"


def test_preemptions_outside_the_window_do_not_move_the_job() -> None:
    sp = spec(fallback=FALLBACK)
    st = started(sp)
    st = step(step(st, DRAIN, sp).status, RUN, sp).status
    d = step(st, DRAIN, sp, T0 + timedelta(seconds=700))
    assert policy.pool(d.status) == "primary" and len(d.status["placement"]["recentPreemptions"]) == 1


def test_a_pod_unschedulable_on_the_primary_placement_moves_to_the_fallback_without_counting() -> None:
    sp = spec(fallback=FALLBACK)
    st = step(None, None, sp).status
    unsched = PodEnd(
        "running",
        "Unschedulable",
        "0/2 nodes are available",
        start_problem="unschedulable",
        since="2030-01-01T00:00:00Z",
    )
    d = step(st, unsched, sp, T0 + timedelta(seconds=100))
    assert d.create_attempt is None and d.requeue_after == pytest.approx(20)
    d = step(st, unsched, sp, T0 + timedelta(seconds=121))
    assert d.delete_pod == "job-a1" and d.create_attempt == 2
    assert d.status["preemptions"] == 0 and d.status["failures"] == 0 and policy.pool(d.status) == "fallback"
    assert d.status["placement"]["reason"] == "Unschedulable"


def test_a_gang_unschedulable_on_the_primary_placement_moves_once_all_its_pods_are_gone() -> None:
    sp = spec(fallback=FALLBACK, nodes=2)
    st = step(None, None, sp).status
    unsched = PodEnd(
        "running",
        "Unschedulable",
        "0/2 nodes are available",
        start_problem="unschedulable",
        since="2030-01-01T00:00:00Z",
    )
    members = (Member(0, "job-a1-0", RUN, node="n0"), Member(1, "job-a1-1", unsched))
    d = step(st, None, sp, T0 + timedelta(seconds=130), members)
    assert d.status["teardown"]["kind"] == "moved"
    gone = tuple(
        Member(r, f"job-a1-{r}", PodEnd("preempted", "PodDeleted"), present=False, settled=True) for r in range(2)
    )
    d = step(d.status, None, sp, T0 + timedelta(seconds=140), gone)
    assert d.create_attempt == 2 and d.status["preemptions"] == 0 and policy.pool(d.status) == "fallback"


def test_fallback_placement_needs_a_place() -> None:
    with pytest.raises(SpecError) as err:
        spec(fallback={"afterPreemptions": 2})
    assert err.value.field == "spec.fallback"
