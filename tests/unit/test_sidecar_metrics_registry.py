"""The sidecar's metric families, checked in-process (the HTTP scrape is an integration test)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from spotguard.sidecar.deadline import DeadlineAssessment
from spotguard.sidecar.metrics import SidecarMetrics


def samples(m: SidecarMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(m.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


LABELS = (("namespace", "ns"), ("trainingjob", "j"))


def test_names_follow_the_convention_and_labels_are_bounded() -> None:
    m = SidecarMetrics("ns", "j")
    allowed = {"namespace", "trainingjob", "stage", "source", "result", "reason", "le"}
    for (name, labels), _ in samples(m).items():
        assert name.startswith("spotguard_")
        if name == "spotguard_build_info":  # constant per process: the versions
            assert {k for k, _ in labels} == {"version", "python", "component"}
            continue
        assert {k for k, _ in labels} <= allowed, name


def test_last_verified_never_moves_backwards() -> None:
    m = SidecarMetrics("ns", "j")
    m.observe_verified(0.1, 30, 1000.0)
    m.observe_verified(0.1, 20, 2000.0)  # an older checkpoint re-verified
    s = samples(m)
    assert s[("spotguard_checkpoint_last_verified_step", LABELS)] == 30
    assert s[("spotguard_checkpoint_last_verified_timestamp_seconds", LABELS)] == 1000.0
    verified = (("namespace", "ns"), ("result", "verified"), ("trainingjob", "j"))
    assert s[("spotguard_checkpoint_uploads_total", verified)] == 2


def test_deadline_gauges() -> None:
    m = SidecarMetrics("ns", "j")
    m.set_deadline(DeadlineAssessment(expected_seconds=12.5, budget_seconds=10.0, at_risk=True), 15.0)
    s = samples(m)
    assert s[("spotguard_checkpoint_deadline_at_risk", LABELS)] == 1
    assert s[("spotguard_checkpoint_expected_emergency_seconds", LABELS)] == 12.5
    assert s[("spotguard_checkpoint_grace_seconds", LABELS)] == 15.0


def test_two_instances_do_not_clash() -> None:
    a, b = SidecarMetrics("ns", "a"), SidecarMetrics("ns", "b")
    a.notice("gce")
    gce = (("namespace", "ns"), ("source", "gce"), ("trainingjob", "a"))
    assert ("spotguard_preemption_notices_total", gce) in samples(a)
    assert not any(n == "spotguard_preemption_notices_total" for n, _ in samples(b))
