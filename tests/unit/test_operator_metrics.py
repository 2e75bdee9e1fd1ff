"""Operator metrics: values after a known sequence, and a deleted job's series removed."""

from __future__ import annotations

from prometheus_client import generate_latest

from spotguard.operator.metrics import OperatorMetrics
from spotguard.operator.testing import metric_value


def text(m: OperatorMetrics) -> str:
    return generate_latest(m.registry).decode()


def test_known_sequence() -> None:
    m = OperatorMetrics()
    m.preempted("ns", "a", lost_steps=3)
    m.preempted("ns", "a", lost_steps=None)
    m.failed("ns", "a")
    m.restarted("ns", "a", 1.5)
    m.restarted("ns", "a", None)
    m.observe_job("ns", "a", {"phase": "Running", "attempt": 4, "lastVerifiedCheckpoint": {"step": 120}})
    m.observe_job("ns", "b", {"phase": "Succeeded", "attempt": 1})
    t = text(m)
    a = {"namespace": "ns", "trainingjob": "a"}
    assert metric_value(t, "spotguard_job_preemptions_total", a) == 2.0
    assert metric_value(t, "spotguard_job_lost_steps_total", a) == 3.0
    assert metric_value(t, "spotguard_job_failures_total", a) == 1.0
    assert metric_value(t, "spotguard_job_restarts_total", a) == 2.0
    assert metric_value(t, "spotguard_job_attempt", a) == 4.0
    assert metric_value(t, "spotguard_job_last_verified_step", a) == 120.0
    assert metric_value(t, "spotguard_reschedule_latency_seconds_count") == 1.0
    assert metric_value(t, "spotguard_reschedule_latency_seconds_sum") == 1.5
    assert metric_value(t, "spotguard_jobs", {"phase": "Running"}) == 1.0
    assert metric_value(t, "spotguard_jobs", {"phase": "Succeeded"}) == 1.0
    assert metric_value(t, "spotguard_jobs", {"phase": "Failed"}) == 0.0


def test_phase_moves_and_deleted_job_is_forgotten() -> None:
    m = OperatorMetrics()
    m.observe_job("ns", "a", {"phase": "Running", "attempt": 1})
    m.observe_job("ns", "a", {"phase": "Restarting", "attempt": 1})
    m.preempted("ns", "a", 0)
    t = text(m)
    assert metric_value(t, "spotguard_jobs", {"phase": "Running"}) == 0.0
    assert metric_value(t, "spotguard_jobs", {"phase": "Restarting"}) == 1.0
    m.forget("ns", "a")
    m.forget("ns", "never-seen")
    t = text(m)
    assert 'trainingjob="a"' not in t
    assert metric_value(t, "spotguard_jobs", {"phase": "Restarting"}) == 0.0


def test_own_registry() -> None:
    a, b = OperatorMetrics(), OperatorMetrics()  # no clash: each has its own registry
    a.failed("ns", "x")
    x = {"namespace": "ns", "trainingjob": "x"}
    assert metric_value(text(a), "spotguard_job_failures_total", x) == 1.0
    assert metric_value(text(b), "spotguard_job_failures_total", x) is None
