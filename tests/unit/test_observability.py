"""Alert rules and dashboard: promtool unit tests, and every series they use is one spotguard exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from spotguard.operator.metrics import OperatorMetrics
from spotguard.sidecar.metrics import SidecarMetrics
from testenv import cluster
from testenv.require import require_tool

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "charts" / "spotguard" / "files" / "prometheus-rules.yaml"
DASHBOARD = ROOT / "charts" / "spotguard" / "files" / "grafana-dashboard.json"
RULE_TESTS = ROOT / "tests" / "prometheus" / "alerts_test.yaml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_BASE = "https://spotguard.dev/docs/runbooks"
SERIES = re.compile(r"\bspotguard_[a-z_]+\b")


def _promtool() -> str:
    return require_tool("promtool", "run `make setup` (or `bash testenv/provision.sh`: Debian package prometheus)")


def _exported_series() -> set[str]:
    names: set[str] = set()
    for registry in (SidecarMetrics(namespace="ns", job="j").registry, OperatorMetrics().registry):
        for family in registry.collect():
            if family.type == "counter":
                names.add(family.name + "_total")
            elif family.type == "histogram":
                names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
            else:
                names.add(family.name)
    return names


def test_rules_are_valid() -> None:
    out = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    out = subprocess.run(
        [_promtool(), "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_the_issue_names_exists() -> None:
    rules = yaml.safe_load(RULES.read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert {
        "SpotguardCheckpointOverdue",
        "SpotguardEmergencyCheckpointMissedDeadline",
        "SpotguardCheckpointUploadFailing",
        "SpotguardJobPreemptedOften",
    } <= alerts


@pytest.mark.parametrize("source", [RULES, DASHBOARD], ids=lambda p: p.name)
def test_rules_and_dashboard_use_only_exported_series(source: Path) -> None:
    used = set(SERIES.findall(source.read_text()))
    assert used, f"no spotguard series found in {source.name}"
    missing = used - _exported_series()
    assert not missing, f"{source.name} uses series spotguard does not export: {sorted(missing)}"


def _label_names() -> set[str]:
    names: set[str] = set()
    for registry in (SidecarMetrics(namespace="ns", job="j").registry, OperatorMetrics().registry):
        for family in registry.collect():
            for sample in family.samples:
                names.update(sample.labels)
    return names


def test_no_series_carries_prometheus_own_job_label() -> None:
    """``job`` is the label Prometheus gives every target: a series of ours that carried it too would be
    renamed (``exported_job``) by a scrape that does not honor labels, and the alerts would name nothing."""
    names = _label_names()
    assert "trainingjob" in names and "namespace" in names
    assert "job" not in names, sorted(names)
    text = RULES.read_text() + DASHBOARD.read_text()
    assert not re.search(r"\$labels\.job\b|\bjob=~|\{\{job\}\}|[(, ]job[,)]", text), "rules or dashboard use `job`"


def test_build_info_names_the_version_and_the_component() -> None:
    from spotguard import __version__

    for registry, component in (
        (SidecarMetrics(namespace="ns", job="j").registry, "sidecar"),
        (SidecarMetrics(component="run").registry, "run"),
        (OperatorMetrics().registry, "operator"),
    ):
        info = [s for f in registry.collect() if f.name == "spotguard_build_info" for s in f.samples]
        assert len(info) == 1 and info[0].value == 1.0, info
        assert info[0].labels["version"] == __version__ and info[0].labels["component"] == component
    with pytest.raises(ValueError, match="component"):
        SidecarMetrics(component="nosuch")


def _anchor(title: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^a-z0-9 -]", "", title.strip().lower()).replace(" ", "-")


def test_every_alert_links_its_section_of_the_runbooks() -> None:
    rules = yaml.safe_load(RULES.read_text())
    sections = {_anchor(m) for m in re.findall(r"^## (.+)$", RUNBOOKS.read_text(), re.M)}
    for group in rules["groups"]:
        for rule in group["rules"]:
            url = rule["annotations"].get("runbook_url", "")
            assert url == f"{RUNBOOK_BASE}#{rule['alert'].lower()}", (rule["alert"], url)
            assert url.split("#", 1)[1] in sections, f"docs/runbooks.md has no section for {rule['alert']}"


def test_dashboard_is_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "spotguard"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip()


def test_chart_wraps_the_tested_rules_unchanged() -> None:
    helm = require_tool("helm", path=cluster.bin_dir() / "helm")
    out = subprocess.run(
        [
            helm,
            "template",
            "t",
            str(ROOT / "charts" / "spotguard"),
            "--set",
            "prometheusRule.enabled=true",
            "--set",
            "grafanaDashboard.enabled=true",
            "--set",
            "metrics.podMonitor.enabled=true",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    by_kind = {d["kind"]: d for d in docs if d["kind"] in ("PrometheusRule", "PodMonitor", "ConfigMap")}
    assert by_kind["PrometheusRule"]["spec"] == yaml.safe_load(RULES.read_text())
    assert json.loads(by_kind["ConfigMap"]["data"]["spotguard.json"]) == json.loads(DASHBOARD.read_text())
    endpoint = by_kind["PodMonitor"]["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "sg-metrics" and endpoint["honorLabels"] is True


def test_chart_points_the_runbook_links_where_the_user_hosts_them() -> None:
    helm = require_tool("helm", path=cluster.bin_dir() / "helm")
    out = subprocess.run(
        [
            helm,
            "template",
            "t",
            str(ROOT / "charts" / "spotguard"),
            "--set",
            "prometheusRule.enabled=true",
            "--set",
            "prometheusRule.runbookBaseUrl=https://wiki.example/sre/spotguard/",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rule = next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "PrometheusRule")
    urls = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert urls and all(u.startswith("https://wiki.example/sre/spotguard#spotguard") for u in urls), urls
