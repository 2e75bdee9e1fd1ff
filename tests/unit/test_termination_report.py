"""The sidecar's termination report: one schema, written by the sidecar and read by the operator."""

from __future__ import annotations

import json
from typing import Any

import pytest

from spotguard.contract.report import TERMINATION_MESSAGE_MAX_BYTES, StagingFull, TerminationReport
from spotguard.operator.classify import classify_pod_end, sidecar_report
from spotguard.operator.spec import SIDECAR_CONTAINER
from spotguard.operator.stagingdirs import sidecar_removed_dir
from spotguard.sidecar.mainloop import termination_report

FULL = StagingFull(error="no space left on device", step=70, time=1700000000.5, free_bytes=0)
EVERYTHING = TerminationReport(
    preempted=True,
    reason="notice:aws",
    step=60,
    trainer_step=64,
    metrics_error="127.0.0.1:9400: Address already in use",
    staging_full=FULL,
    pod_dir_removed=True,
)


def pod_with(message: str) -> dict[str, Any]:
    term = {"exitCode": 0, "message": message, "finishedAt": "2030-01-01T00:00:10Z"}
    return {
        "metadata": {"name": "job-a1", "namespace": "ns"},
        "spec": {"containers": [{"name": "trainer"}], "nodeName": "n1"},
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [
                {"name": "trainer", "state": {"terminated": {"exitCode": 0}}},
                {"name": SIDECAR_CONTAINER, "state": {"terminated": term}},
            ],
        },
    }


@pytest.mark.parametrize(
    "report",
    [
        EVERYTHING,
        TerminationReport(preempted=False, reason="finished"),
        TerminationReport(preempted=False, reason="finished", step=0, trainer_step=0),
        TerminationReport(preempted=True, reason="sigterm", staging_full=StagingFull(step=3)),
    ],
)
def test_round_trip(report: TerminationReport) -> None:
    text = report.to_text()
    assert TerminationReport.parse(text) == report
    assert json.loads(text) == report.to_json()


def test_the_wire_keys() -> None:
    # The keys documented in docs/sidecar.md and docs/operator.md; operators of older versions read these.
    assert EVERYTHING.to_json() == {
        "preempted": True,
        "reason": "notice:aws",
        "step": 60,
        "trainerStep": 64,
        "metricsError": "127.0.0.1:9400: Address already in use",
        "stagingFull": {"step": 70, "time": 1700000000.5, "free_bytes": 0, "error": "no space left on device"},
        "podDirRemoved": True,
    }
    # Optional keys only when they say something.
    bare = TerminationReport(False, "finished", metrics_error="")
    assert bare.to_json() == {"preempted": False, "reason": "finished"}


def test_unknown_keys_are_ignored() -> None:
    text = json.dumps({"preempted": True, "reason": "sigterm", "step": 5, "fromTheFuture": {"x": 1}})
    assert TerminationReport.parse(text) == TerminationReport(True, "sigterm", step=5)


@pytest.mark.parametrize(
    ("doc", "want"),
    [
        ({"preempted": "yes", "reason": "sigterm"}, TerminationReport(None, "sigterm")),
        ({"preempted": True, "reason": 7}, TerminationReport(True, None)),
        ({"preempted": True, "reason": "sigterm", "step": "12"}, TerminationReport(True, "sigterm")),
        ({"preempted": True, "reason": "sigterm", "step": True}, TerminationReport(True, "sigterm")),
        ({"preempted": True, "reason": "sigterm", "step": -1}, TerminationReport(True, "sigterm")),
        ({"preempted": True, "reason": "sigterm", "trainerStep": 1.5}, TerminationReport(True, "sigterm")),
        ({"preempted": True, "reason": "sigterm", "stagingFull": "full"}, TerminationReport(True, "sigterm")),
        ({"preempted": False, "reason": "finished", "podDirRemoved": "true"}, TerminationReport(False, "finished")),
        (
            {"preempted": True, "reason": "x", "stagingFull": {"step": "a", "time": "b", "error": 3}},
            TerminationReport(True, "x", staging_full=StagingFull()),
        ),
        ({}, TerminationReport(None, None)),
    ],
)
def test_bad_values_read_as_absent(doc: dict[str, Any], want: TerminationReport) -> None:
    assert TerminationReport.parse(json.dumps(doc)) == want


@pytest.mark.parametrize("text", ["", "not json", "{broken", "[1, 2]", '"text"', "null", "12"])
def test_what_is_not_a_json_object_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        TerminationReport.parse(text)


@pytest.mark.parametrize(
    "kwargs",
    [{"step": -1}, {"step": True}, {"trainer_step": "3"}],
)
def test_bad_values_are_refused_when_written(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        TerminationReport(preempted=True, reason="sigterm", **kwargs)


@pytest.mark.parametrize("kwargs", [{"step": -2}, {"free_bytes": True}])
def test_bad_staging_full_values_are_refused_when_written(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        StagingFull(error="full", **kwargs)


@pytest.mark.parametrize("char", ["x", "é", "\u2603", "\U0001f600", '"', "\n"])
def test_the_report_fits_the_kubelets_termination_message(char: str) -> None:
    huge = char * 20000
    report = TerminationReport(
        preempted=True,
        reason=huge,
        step=2**62,
        trainer_step=2**62,
        metrics_error=huge,
        staging_full=StagingFull(error=huge, step=2**62, time=1e300, free_bytes=2**62),
        pod_dir_removed=True,
    )
    text = report.to_text()
    assert len(text.encode()) <= TERMINATION_MESSAGE_MAX_BYTES
    back = TerminationReport.parse(text)
    assert back.preempted is True and back.step == 2**62 and back.pod_dir_removed
    assert back.metrics_error is not None and back.metrics_error.startswith(char * 10)
    assert back.metrics_error.endswith("...")


def test_what_the_sidecar_writes_the_operator_reads() -> None:
    written = termination_report(True, "notice:gce", 100, 104, "port taken")
    pod = pod_with(written.to_text())
    assert sidecar_report(pod) == written
    end = classify_pod_end(pod)
    assert (end.kind, end.reason, end.step, end.lost_steps) == ("preempted", "notice:gce", 100, 4)
    assert not sidecar_removed_dir(pod)
    removed = pod_with(TerminationReport(False, "finished", pod_dir_removed=True).to_text())
    assert sidecar_removed_dir(removed)
    full = pod_with(TerminationReport(True, "sigterm", 60, staging_full=StagingFull(step=70)).to_text())
    assert "checkpoint of step 70 was not written" in (classify_pod_end(full).staging_full or "")
