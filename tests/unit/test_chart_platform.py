"""The chart where it meets the rest of a cluster: user roles, a disruption budget, subcharts, the
webhook's certificate (rendered with the real helm binary; installed in test_helm_platform.py)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from testenv.chart import CHART, by_kind, helm, one, render


def test_user_roles_aggregate_into_view_edit_and_admin_and_never_write_status() -> None:
    default = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART)).stdout) if d]  # on by default
    roles = {r["metadata"]["name"]: r for r in by_kind(default, "ClusterRole")}
    view, edit = roles["rel-spotguard-trainingjobs-view"], roles["rel-spotguard-trainingjobs-edit"]
    agg = "rbac.authorization.k8s.io/aggregate-to-"
    assert {k for k, v in view["metadata"]["labels"].items() if k.startswith(agg) and v == "true"} == {
        agg + "view",
        agg + "edit",
        agg + "admin",
    }
    assert {k for k, v in edit["metadata"]["labels"].items() if k.startswith(agg) and v == "true"} == {
        agg + "edit",
        agg + "admin",
    }
    assert view["rules"] == [
        {
            "apiGroups": ["spotguard.dev"],
            "resources": ["trainingjobs", "trainingjobs/status"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    (rule,) = edit["rules"]
    assert rule["resources"] == ["trainingjobs"] and "get" not in rule["verbs"]
    assert {"create", "update", "patch", "delete"} <= set(rule["verbs"])
    names = {r["metadata"]["name"] for r in by_kind(render("userRoles.create=false"), "ClusterRole")}
    assert not any("trainingjobs-" in n for n in names), names


def test_a_disruption_budget_only_with_several_replicas_and_in_the_api_version_the_cluster_serves() -> None:
    assert not by_kind(render(), "PodDisruptionBudget")
    old = one(render("replicaCount=2"), "PodDisruptionBudget")  # helm template alone knows no policy/v1
    assert old["apiVersion"] == "policy/v1beta1"
    args = ["template", "rel", str(CHART), "--set", "replicaCount=3", "--api-versions", "policy/v1/PodDisruptionBudget"]
    pdb = one([d for d in yaml.safe_load_all(helm(*args).stdout) if d], "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1
    pods = one(render("replicaCount=3"), "Deployment")["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["selector"]["matchLabels"] == pods


def test_the_values_schema_accepts_what_a_parent_chart_passes_and_still_refuses_typos() -> None:
    render("global.imageRegistry=registry.example", "global.anything.nested=1")
    bad = helm("template", "rel", str(CHART), "--set", "replicaCuont=2", check=False)
    assert bad.returncode != 0 and "replicaCuont" in bad.stderr


def _webhook(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (hook,) = one(docs, "MutatingWebhookConfiguration")["webhooks"]
    return hook  # type: ignore[no-any-return]


def test_without_cert_manager_the_chart_renders_no_certificate_and_the_operator_keeps_one() -> None:
    docs = render()
    assert not by_kind(docs, "Secret") and not by_kind(docs, "Certificate")
    assert "caBundle" not in _webhook(docs)["clientConfig"]
    cmd = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--webhook-cert-secret=rel-spotguard-webhook-tls" in cmd and "--webhook-configuration=rel-spotguard" in cmd


@pytest.mark.parametrize("issuer", [None, "name=corp-ca,kind=ClusterIssuer"])
def test_cert_manager_issues_the_certificate_and_injects_the_ca(issuer: str | None) -> None:
    sets = ["webhook.enabled=true", "webhook.certManager.enabled=true"]
    if issuer:
        sets += [f"webhook.certManager.issuerRef.{kv}" for kv in issuer.split(",")]
    docs = render(*sets)
    assert not by_kind(docs, "Secret"), "cert-manager writes the Secret"
    cert = one(docs, "Certificate")
    assert cert["spec"]["secretName"] == "rel-spotguard-webhook-tls"
    assert "rel-spotguard.spotguard-system.svc" in cert["spec"]["dnsNames"]
    config = one(docs, "MutatingWebhookConfiguration")
    inject = config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    assert inject == "spotguard-system/rel-spotguard-webhook"
    assert "caBundle" not in _webhook(docs)["clientConfig"]
    validating = one(docs, "ValidatingWebhookConfiguration")
    assert validating["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == inject
    assert "caBundle" not in validating["webhooks"][0]["clientConfig"]
    if issuer:
        assert cert["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer"} and not by_kind(docs, "Issuer")
    else:
        assert cert["spec"]["issuerRef"] == {"name": "rel-spotguard-selfsigned", "kind": "Issuer"}
        assert one(docs, "Issuer")["spec"] == {"selfSigned": {}}
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "webhook-tls", "secret": {"secretName": "rel-spotguard-webhook-tls"}} in pod["volumes"]
    # cert-manager keeps the certificate and the caBundle: the operator only serves the mounted files.
    assert not any(
        a.startswith(("--webhook-cert-secret", "--webhook-configuration")) for a in pod["containers"][0]["command"]
    )
    assert not any(
        "admissionregistration.k8s.io" in r["apiGroups"] for c in by_kind(docs, "ClusterRole") for r in c["rules"]
    )
    assert not [r for r in by_kind(docs, "Role") if r["metadata"]["name"].endswith("-webhook-certificate")]
