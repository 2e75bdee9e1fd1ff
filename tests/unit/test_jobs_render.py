"""``spotguard jobs`` output, pure: tables, JSON/YAML, and the history rebuilt from a status and Events."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml

from spotguard.jobs import render

NOW = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
UID = "0b7c-uid"


def ago(seconds: float) -> str:
    return (NOW - timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def job(
    name: str = "llm",
    status: dict[str, Any] | None = None,
    namespace: str = "ml",
    created: float = 3600,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "spotguard.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": UID,
            "creationTimestamp": ago(created),
            "managedFields": [{"manager": "kubectl"}],
        },
        "spec": spec or {"checkpoint": {"storage": "s3://bucket/runs/"}, "preemption": {"maxPreemptions": 5}},
        "status": status or {},
    }


_rv = iter(range(1000, 100000))


def event(
    reason: str,
    message: str,
    seconds_ago: float,
    *,
    type_: str = "Normal",
    name: str = "llm",
    uid: str = UID,
    kind: str = "TrainingJob",
) -> dict[str, Any]:
    t = ago(seconds_ago)
    return {
        "type": type_,
        "reason": reason,
        "message": message,
        "firstTimestamp": t,
        "lastTimestamp": t,
        "count": 1,
        "metadata": {"resourceVersion": str(next(_rv)), "creationTimestamp": t},
        "involvedObject": {"kind": kind, "name": name, "uid": uid, "apiVersion": "spotguard.dev/v1alpha1"},
    }


def pod(
    name: str,
    phase: str,
    node: str | None = None,
    *,
    deleting: bool = False,
    waiting: str | None = None,
    attempt: int | None = None,
    rank: int | None = None,
) -> dict[str, Any]:
    labels = {"spotguard.dev/job": "llm"}
    if attempt is not None:
        labels["spotguard.dev/attempt"] = str(attempt)
    if rank is not None:
        labels["spotguard.dev/node-rank"] = str(rank)
    meta: dict[str, Any] = {"name": name, "labels": labels, "creationTimestamp": ago(30)}
    if deleting:
        meta["deletionTimestamp"] = ago(1)
    st: dict[str, Any] = {"phase": phase}
    if waiting:
        st["containerStatuses"] = [{"name": "trainer", "state": {"waiting": {"reason": waiting}}}]
    return {"metadata": meta, "spec": {"nodeName": node} if node else {}, "status": st}


def cells(line: str) -> list[str]:
    """A table row's cells (columns are at least three spaces apart; a cell has single spaces at most)."""
    return re.split(r" {2,}", line.strip())


# --- small formatting -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-5, "<invalid>"),
        (-1, "0s"),
        (0, "0s"),
        (59, "59s"),
        (119, "119s"),
        (120, "2m"),
        (200, "3m20s"),
        (600, "10m"),
        (3 * 3600 - 1, "179m"),
        (3 * 3600, "3h"),
        (5 * 3600 + 180, "5h3m"),
        (8 * 3600, "8h"),
        (47 * 3600, "47h"),
        (3 * 86400 + 4 * 3600, "3d4h"),
        (9 * 86400, "9d"),
        (800 * 86400, "2y70d"),
        (9 * 365 * 86400, "9y"),
    ],
)
def test_ages_read_like_kubectl(seconds: float, text: str) -> None:
    assert render.human_duration(seconds) == text


def test_when_and_sizes() -> None:
    assert render.when(ago(90), NOW) == f"{ago(90)} (90s ago)"
    assert render.when((NOW + timedelta(minutes=5)).isoformat(), NOW) == "2030-01-01T12:05:00Z (in 5m)"
    assert render.when(None, NOW) == "-" and render.age("not a time", NOW) == "<unknown>"
    assert [render.human_size(n) for n in (512, 1536, 3 * 1024**3, None)] == ["512 B", "1.5 KiB", "3.0 GiB", "-"]


def test_table_aligns_columns_three_spaces_apart_without_trailing_blanks() -> None:
    text = render.table(("NAME", "X"), [("a", "1"), ("longer-name", None)])
    assert text.splitlines() == ["NAME          X", "a             1", "longer-name   -"]


# --- ls ---------------------------------------------------------------------------------


def test_ls_table_columns_and_values() -> None:
    running = job(
        "llm",
        {
            "phase": "Running",
            "attempt": 3,
            "preemptions": 2,
            "failures": 1,
            "lastVerifiedCheckpoint": {"step": 1200, "uri": "s3://b/x", "time": ago(60)},
            "placement": {"pool": "fallback", "since": ago(100), "reason": "Preemptions"},
        },
    )
    fresh = job("a-new", {}, created=5)
    lines = render.ls_table([running, fresh], NOW).splitlines()
    assert cells(lines[0]) == [
        "NAME",
        "PHASE",
        "ATTEMPT",
        "PREEMPTIONS",
        "FAILURES",
        "VERIFIED STEP",
        "PLACEMENT",
        "AGE",
    ]
    assert cells(lines[1]) == ["a-new", "-", "0", "0", "0", "-", "-", "5s"]
    assert cells(lines[2]) == ["llm", "Running", "3", "2", "1", "1200", "fallback", "60m"]
    # Each column starts where its header does.
    assert [lines[2].index(c) for c in ("Running", "1200", "fallback")] == [
        lines[0].index(h) for h in ("PHASE", "VERIFIED STEP", "PLACEMENT")
    ]


def test_ls_all_namespaces_sorts_by_namespace_and_adds_its_column() -> None:
    text = render.ls_table(
        [job("b", namespace="zz"), job("a", namespace="zz"), job("c", namespace="aa")], NOW, all_namespaces=True
    )
    rows = [line.split()[:2] for line in text.splitlines()]
    assert rows == [["NAMESPACE", "NAME"], ["aa", "c"], ["zz", "a"], ["zz", "b"]]


def test_ls_json_and_yaml_are_a_kubectl_list_of_whole_objects_without_managed_fields() -> None:
    jobs = [job("llm", {"phase": "Running", "attempt": 1})]
    listed = render.job_list(jobs)
    from_json = json.loads(render.dump(listed, "json"))
    from_yaml = yaml.safe_load(render.dump(listed, "yaml"))
    assert from_json == from_yaml
    assert from_json["kind"] == "List" and from_json["apiVersion"] == "v1"
    item = from_json["items"][0]
    assert item["status"] == {"phase": "Running", "attempt": 1} and item["spec"] == jobs[0]["spec"]
    assert "managedFields" not in item["metadata"] and item["metadata"]["uid"] == UID
    assert "managedFields" in jobs[0]["metadata"]  # the caller's object is untouched
    with pytest.raises(ValueError, match="json or yaml"):
        render.dump(listed, "xml")


# --- the history ---------------------------------------------------------------------------


def single_pod_story() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Attempt 1 preempted on a node at step 300, attempt 2 failed (OOM), attempt 3 running."""
    status = {
        "phase": "Running",
        "attempt": 3,
        "preemptions": 1,
        "failures": 1,
        "currentPod": "llm-a3",
        "lastPodEnd": {
            "attempt": 2,
            "kind": "failed",
            "reason": "OOMKilled",
            "step": 400,
            "message": "container trainer was OOMKilled (exit code 137)",
            "time": ago(100),
        },
        "lastVerifiedCheckpoint": {"step": 400, "uri": "s3://bucket/runs/ml/llm/ckpt-000000000400", "time": ago(120)},
    }
    events = [
        event("PodCreated", "created pod llm-a1 (attempt 1)", 1000),
        event("PodRunning", "pod llm-a1 is running (attempt 1)", 990),
        event(
            "Preempted",
            "pod llm-a1 preempted (TerminationByKubelet) at step 300; restarting (1/5 preemptions)",
            500,
            type_="Warning",
        ),
        event("PodCreated", "created pod llm-a2 (attempt 2)", 499),
        event("PodRunning", "pod llm-a2 is running (attempt 2)", 450),
        event("PodFailed", "pod llm-a2 failed (OOMKilled): container trainer was OOMKilled", 100, type_="Warning"),
        event("PodCreated", "created pod llm-a3 (attempt 3)", 90),
        event("PodRunning", "pod llm-a3 is running (attempt 3)", 60),
    ]
    return status, events


def test_history_of_a_preemption_a_failure_and_the_running_attempt() -> None:
    status, events = single_pod_story()
    attempts = render.attempt_history("llm", status, render.job_events(job(status=status), events))
    assert [a.attempt for a in attempts] == [1, 2, 3]
    first, second, third = attempts
    assert first.created == ago(1000) and first.running == ago(990)
    assert first.end is not None
    assert (first.end.kind, first.end.reason, first.end.step, first.end.time, first.end.pod, first.end.source) == (
        "preempted",
        "TerminationByKubelet",
        300,
        ago(500),
        "llm-a1",
        "event",
    )
    # The status's record of attempt 2 wins over its Event (the step, the whole message).
    assert second.end is not None
    assert (second.end.kind, second.end.reason, second.end.step, second.end.source) == (
        "failed",
        "OOMKilled",
        400,
        "status",
    )
    assert second.end.message == "container trainer was OOMKilled (exit code 137)"
    assert third.current and third.end is None and third.running == ago(60)
    assert not first.current and not second.current
    assert render.history_gaps(status, attempts) == []


def test_events_of_another_object_or_an_earlier_job_of_the_same_name_are_ignored_and_duplicates_once() -> None:
    status, events = single_pod_story()
    noise = [
        event("Preempted", "pod llm-a1 preempted (NodeLost); restarting (1/5 preemptions)", 400, uid="old-uid"),
        event("Preempted", "pod other-a1 preempted (NodeLost); restarting (1/5 preemptions)", 400, name="other"),
        event("Scheduled", "pod llm-a3 scheduled", 400, kind="Pod"),
        dict(events[2]),  # the same Event listed twice
    ]
    evs = render.job_events(job(status=status), list(reversed(events + noise)))
    assert [e.reason for e in evs] == [
        "PodCreated",
        "PodRunning",
        "Preempted",
        "PodCreated",
        "PodRunning",
        "PodFailed",
        "PodCreated",
        "PodRunning",
    ]
    first = render.attempt_history("llm", status, evs)[0]
    assert first.end is not None and first.end.reason == "TerminationByKubelet"


def test_events_within_one_second_keep_the_apiservers_order() -> None:
    same = [
        event("PodCreated", "created pod llm-a2 (attempt 2)", 10),
        event("Preempted", "pod llm-a1 preempted (PodDeleted); restarting (1/5 preemptions)", 10),
    ]
    same[0]["metadata"]["resourceVersion"], same[1]["metadata"]["resourceVersion"] = "90", "89"
    assert [e.reason for e in render.job_events(job(), same)] == ["Preempted", "PodCreated"]


def test_a_gangs_end_takes_its_cause_from_the_stopping_event() -> None:
    status = {
        "phase": "Pending",
        "attempt": 2,
        "preemptions": 1,
        "nodes": 2,
        "currentPod": "llm-a2-0",
        "lastPodEnd": {
            "attempt": 1,
            "kind": "preempted",
            "reason": "NodeShutdown",
            "time": ago(50),
            "message": "",
            "pod": "llm-a1-1",
        },
    }
    events = [
        event("PodCreated", "created 2 pods (attempt 1): llm-a1-0, llm-a1-1", 300),
        event("PodRunning", "all 2 pods are running (attempt 1)", 280),
        event(
            "StoppingGang",
            "pod llm-a1-1 on node spot-7 preempted (NodeShutdown): node spot-7 is shutting down;"
            " stopping 1 other pod(s) of attempt 1: llm-a1-0",
            60,
            type_="Warning",
        ),
        event(
            "Preempted",
            "pod llm-a1-1 on node spot-7 (rank 1) preempted (NodeShutdown) at step 80; restarting (1/5 preemptions)",
            50,
            type_="Warning",
        ),
        event("PodCreated", "created 2 pods (attempt 2): llm-a2-0, llm-a2-1", 50),
    ]
    first, second = render.attempt_history("llm", status, render.job_events(job(status=status), events))
    assert first.end is not None
    assert (first.end.kind, first.end.reason, first.end.node, first.end.pod, first.end.step) == (
        "preempted",
        "NodeShutdown",
        "spot-7",
        "llm-a1-1",
        80,
    )
    assert first.end.message == "node spot-7 is shutting down"
    assert second.current and second.created == ago(50) and second.end is None


def test_a_sidecar_that_stopped_and_the_jobs_end_are_recorded() -> None:
    status = {
        "phase": "Failed",
        "attempt": 2,
        "failures": 2,
        "lastPodEnd": {
            "attempt": 2,
            "kind": "failed",
            "reason": "SidecarExited",
            "time": ago(10),
            "message": "container spotguard-sidecar exited with code 1",
        },
    }
    events = [
        event(
            "SidecarExited",
            "pod llm-a1: container spotguard-sidecar exited with code 1. Checkpoints were no"
            " longer uploaded: stopping the pod (the trainer has 60s to save a checkpoint); attempt 2 starts now"
            " (failure 1 of backoffLimit 1)",
            100,
            type_="Warning",
        ),
        event("PodCreated", "created pod llm-a2 (attempt 2)", 99),
        event(
            "BackoffLimitExceeded",
            "2 failures (backoffLimit 1); last: SidecarExited: container spotguard-sidecar exited with code 1",
            10,
            type_="Warning",
        ),
    ]
    first, second = render.attempt_history("llm", status, render.job_events(job(status=status), events))
    assert first.end is not None and (first.end.kind, first.end.reason) == ("failed", "SidecarExited")
    assert first.end.message == "container spotguard-sidecar exited with code 1"
    assert second.end is not None and second.end.source == "status"
    assert second.notes == [
        "BackoffLimitExceeded: 2 failures (backoffLimit 1); last: SidecarExited: container"
        " spotguard-sidecar exited with code 1"
    ]


def test_attempts_whose_events_expired_are_listed_and_the_gap_is_said() -> None:
    status = {
        "phase": "Running",
        "attempt": 4,
        "preemptions": 3,
        "failures": 0,
        "lastPodEnd": {"attempt": 3, "kind": "preempted", "reason": "NodeLost", "time": ago(30)},
    }
    attempts = render.attempt_history("llm", status, [])
    assert [(a.attempt, a.end is not None, a.current) for a in attempts] == [
        (1, False, False),
        (2, False, False),
        (3, True, False),
        (4, False, True),
    ]
    assert render.history_gaps(status, attempts) == [
        "2 of 3 preemptions have no record left: the Events of older attempts have expired (most clusters keep"
        " Events for an hour)"
    ]


def test_a_job_name_that_looks_like_a_pod_name_is_read_right() -> None:
    assert render.pod_attempt("data-a1", "data-a1-a2") == 2
    assert render.pod_attempt("data-a1", "data-a1-a2-3") == 2
    assert render.pod_attempt("data", "data-a1-a2") is None


# --- pods and describe ---------------------------------------------------------------------------


def test_pod_status_reads_like_kubectls_status_column() -> None:
    assert render.pod_status(pod("p", "Running", deleting=True)) == "Terminating"
    assert render.pod_status(pod("p", "Pending", waiting="ImagePullBackOff")) == "ImagePullBackOff"
    assert render.pod_status(pod("p", "Pending", waiting="PodInitializing")) == "Pending"
    assert render.pod_status({"status": {"phase": "Failed", "reason": "Evicted"}}) == "Evicted"
    assert render.pod_status({}) == "Unknown"


def test_describe_shows_phase_attempts_causes_checkpoint_placement_avoided_nodes_and_pods() -> None:
    status, events = single_pod_story()
    status["placement"] = {"pool": "fallback", "since": ago(90), "reason": "Preemptions", "returnAt": ago(-1800)}
    status["avoidedNodes"] = [{"node": "spot-7", "ends": 2, "until": ago(-600)}, {"node": "spot-9", "ends": 1}]
    status["conditions"] = [
        {
            "type": "Running",
            "status": "True",
            "reason": "PodRunning",
            "message": "pod llm-a3 is running",
            "lastTransitionTime": ago(60),
        }
    ]
    pods = [
        pod("llm-a3", "Running", "gpu-1", attempt=3),
        pod("llm-a2", "Failed", "gpu-2", attempt=2),
        pod("llm-a1", "Running", "spot-7", attempt=1, deleting=True),
    ]
    desc = render.describe(job(status=status), events, pods, NOW)
    assert desc["storage"] == "s3://bucket/runs/ml/llm"
    assert desc["preemptions"] == {"count": 1, "limit": 5} and desc["failures"] == {"count": 1, "limit": 3}
    assert [p["name"] for p in desc["pods"]] == ["llm-a3", "llm-a1"]  # current, and one still stopping
    assert json.loads(render.to_json(desc)) == yaml.safe_load(render.to_yaml(desc))

    text = render.render_describe(desc, NOW)
    assert "Phase:        Running" in text
    assert "Attempt:      3 (pod llm-a3)" in text
    assert "Preemptions:  1 (maxPreemptions 5)" in text
    assert "Storage:      s3://bucket/runs/ml/llm" in text
    assert "  Step:  400\n  URI:   s3://bucket/runs/ml/llm/ckpt-000000000400" in text
    assert f"Placement:    fallback since {ago(90)} (90s ago), reason Preemptions; back to primary at" in text
    assert "spot-7   2      " in text and "spot-9   1      not avoided yet" in text
    assert f"  #1: created 16m ago; running 16m ago; preempted (TerminationByKubelet) at step 300, {ago(500)}" in text
    assert f"  #2: created 8m19s ago; running 7m30s ago; failed (OOMKilled) at step 400, {ago(100)}" in text
    assert "      cause: container trainer was OOMKilled (exit code 137)" in text
    assert "  #3 (current): created 90s ago; running 60s ago\n" in text
    assert "llm-a3   Running       gpu-1" in text and "llm-a1   Terminating   spot-7" in text
    assert ["Warning", "PodFailed", "100s", "pod llm-a2 failed (OOMKilled): container trainer was OOMKilled"] in [
        cells(line) for line in text.splitlines()
    ]


def test_describe_of_a_new_job_says_what_it_lacks() -> None:
    desc = render.describe(job(status={}, spec={"preemption": {}}), [], [], NOW)
    text = render.render_describe(desc, NOW)
    assert desc["storage"] is None and desc["preemptions"]["limit"] == 20
    assert "Last verified checkpoint: none yet" in text and "Attempts:\n  none yet" in text
    assert "Pods: none" in text and "Events:       <none>" in text


# --- checkpoints -------------------------------------------------------------------------------


def test_checkpoints_table_marks_latest_and_says_why_one_is_not_verified() -> None:
    rows = [
        {"step": 100, "created": ago(7200) + "", "size": 3 * 1024**2, "verified": True, "latest": False},
        {
            "step": 200,
            "created": ago(60),
            "size": 4096,
            "verified": False,
            "problems": ["model.safetensors: size"],
            "latest": False,
        },
        {"step": 150, "created": None, "size": None, "verified": True, "latest": True},
    ]
    lines = render.checkpoints_table(rows, NOW).splitlines()
    assert cells(lines[0]) == ["STEP", "CREATED", "SIZE", "VERIFIED"]
    assert cells(lines[1]) == ["100", f"{ago(7200)[:19].replace('T', ' ')} (120m ago)", "3.0 MiB", "yes"]
    assert lines[2].endswith("no: model.safetensors: size")
    assert lines[3].split()[:2] == ["150*", "-"]
    assert render.checkpoints_table(rows[:1], NOW, quick=True).splitlines()[1].endswith("yes (sizes only)")
