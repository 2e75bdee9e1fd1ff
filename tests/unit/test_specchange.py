"""Spec changes a running TrainingJob must not take: the operator's own refusal, and its agreement with the webhook."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest

from spotguard.operator.spec import parse
from spotguard.operator.specchange import (
    ALLOW_RESTART_ANNOTATION,
    COND_SPEC_CHANGE_REFUSED,
    R_SPEC_CHANGE_APPLIED,
    R_SPEC_CHANGE_REFUSED,
    R_SPEC_CHANGE_REVERTED,
    STATUS_FIELD,
    hold,
    pinned,
    restart_refusal,
)

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def job(*, storage: str = "s3://bkt-a/runs", attempt: int = 1, phase: str = "Running", **spec: Any) -> dict[str, Any]:
    trainer = {"name": "trainer", "image": "t:1", "resources": {"limits": {"nvidia.com/gpu": spec.pop("gpus", 1)}}}
    return {
        "metadata": {"name": "llm", "namespace": "team", "annotations": {}},
        "spec": {"template": {"spec": {"containers": [trainer]}}, "checkpoint": {"storage": storage}, **spec},
        "status": {"phase": phase, "attempt": attempt},
    }


def running_with(body: dict[str, Any]) -> dict[str, Any]:
    """The status after the operator's first look at ``body``: it records what the job runs with."""
    _, status, events = hold(body, parse(body["spec"]), body["status"], NOW, 1)
    assert events == () and COND_SPEC_CHANGE_REFUSED not in str(status)
    return status


def cond(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == COND_SPEC_CHANGE_REFUSED)


def test_the_first_look_records_what_the_job_runs_with() -> None:
    body = job()
    body["spec"]["checkpoint"]["endpoint"] = "http://s3.local"
    status = running_with(body)
    assert status[STATUS_FIELD] == {
        "storage": "s3://bkt-a/runs",
        "endpoint": "http://s3.local",
        "nodes": 1,
        "nprocPerNode": 1,
    }


def test_a_storage_change_of_a_running_job_is_not_acted_on_and_said_so() -> None:
    old = job()
    status = running_with(old)
    new = copy.deepcopy(old)
    new["spec"]["checkpoint"]["storage"] = "s3://bkt-b/runs"
    spec, held, events = hold(new, parse(new["spec"]), status, NOW, 2)
    # The job keeps running with the storage that holds its checkpoints.
    assert spec.checkpoint.storage == "s3://bkt-a/runs"
    assert held[STATUS_FIELD]["storage"] == "s3://bkt-a/runs"
    c = cond(held)
    assert c["status"] == "True" and c["reason"] == R_SPEC_CHANGE_REFUSED and c["observedGeneration"] == 2
    assert "spec.checkpoint.storage from s3://bkt-a/runs to s3://bkt-b/runs" in c["message"]
    assert f"{ALLOW_RESTART_ANNOTATION}=true" in c["message"] and "Revert the change" in c["message"]
    assert [(e.type, e.reason) for e in events] == [("Warning", R_SPEC_CHANGE_REFUSED)]
    # The next look finds the same refusal: no second Event.
    _, again, events = hold(new, parse(new["spec"]), held, NOW, 2)
    assert events == () and cond(again) == c
    # Reverted: the condition turns False, and the job runs on as before.
    spec, back, events = hold(old, parse(old["spec"]), again, NOW, 3)
    assert spec.checkpoint.storage == "s3://bkt-a/runs"
    assert cond(back)["status"] == "False" and cond(back)["reason"] == R_SPEC_CHANGE_REVERTED
    assert [e.reason for e in events] == [R_SPEC_CHANGE_REVERTED]


def test_the_annotation_lets_the_change_apply() -> None:
    old = job(nodes=2)
    status = running_with(old)
    new = copy.deepcopy(old)
    new["spec"]["nodes"] = 3
    spec, held, _ = hold(new, parse(new["spec"]), status, NOW, 2)
    assert spec.nodes == 2 and "spec.nodes from 2 to 3" in cond(held)["message"]
    new["metadata"]["annotations"][ALLOW_RESTART_ANNOTATION] = "true"
    spec, applied, events = hold(new, parse(new["spec"]), held, NOW, 2)
    assert spec.nodes == 3 and applied[STATUS_FIELD]["nodes"] == 3
    assert cond(applied)["status"] == "False" and cond(applied)["reason"] == R_SPEC_CHANGE_APPLIED
    assert [e.reason for e in events] == [R_SPEC_CHANGE_APPLIED]


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_finished_job_takes_any_change(phase: str) -> None:
    old = job()
    status = {**running_with(old), "phase": phase}
    new = copy.deepcopy(old)
    new["spec"]["checkpoint"]["storage"] = "s3://bkt-b/runs"
    spec, held, events = hold(new, parse(new["spec"]), status, NOW, 2)
    assert spec.checkpoint.storage == "s3://bkt-b/runs" and held[STATUS_FIELD]["storage"] == "s3://bkt-b/runs"
    assert events == ()


# One definition for both: the operator refuses exactly what the webhook refuses.
CHANGES: list[tuple[str, dict[str, Any], dict[str, Any], bool]] = [
    ("storage", {}, {"checkpoint": {"storage": "s3://other/runs"}}, True),
    ("storage, trailing slash", {}, {"checkpoint": {"storage": "s3://bkt-a/runs/"}}, False),
    ("endpoint added", {}, {"checkpoint": {"storage": "s3://bkt-a/runs", "endpoint": "http://x"}}, True),
    ("checksum", {}, {"checkpoint": {"storage": "s3://bkt-a/runs", "checksum": "sha256"}}, False),
    ("nodes", {"nodes": 2}, {"nodes": 4}, True),
    ("same world, other layout", {"nodes": 2, "nprocPerNode": 4}, {"nodes": 1, "nprocPerNode": 8}, False),
    ("GPU limit (implicit nprocPerNode)", {"gpus": 2}, {"gpus": 4}, True),
    ("suspend", {}, {"suspend": True}, False),
]


@pytest.mark.parametrize(("what", "before", "after", "refused"), CHANGES, ids=[c[0] for c in CHANGES])
def test_the_operator_and_the_webhook_refuse_the_same_changes(
    what: str, before: dict[str, Any], after: dict[str, Any], refused: bool
) -> None:
    old = job(**before)
    new = copy.deepcopy(old)
    gpus = after.pop("gpus", None)
    new["spec"].update(copy.deepcopy(after))
    if gpus is not None:
        new["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = gpus
    by_webhook = restart_refusal(old, new)
    _, held, _ = hold(new, parse(new["spec"]), running_with(old), NOW, 2)
    by_operator = any(c["type"] == COND_SPEC_CHANGE_REFUSED for c in held.get("conditions") or [])
    assert (by_webhook is not None) is refused, by_webhook
    assert by_operator is refused
    if refused:
        # The same sentences: what the change would do.
        assert by_webhook is not None and by_webhook.split(". To do it")[0] in cond(held)["message"]


def test_pinned_reads_a_spec_that_does_not_parse() -> None:
    assert pinned({"nodes": "two", "checkpoint": []}) == {
        "storage": None,
        "endpoint": None,
        "nodes": None,
        "nprocPerNode": 1,
    }
