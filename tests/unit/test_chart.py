"""The Helm chart, rendered with the real helm binary and checked object by object."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from testenv.chart import CHART, by_kind, helm, one, operator_command, render

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "trainingjob.yaml"


NAMESPACED_RULES = {
    # delete: spec.ttlSecondsAfterFinished deletes a finished job's object.
    ("spotguard.dev", "trainingjobs"): {"get", "list", "watch", "patch", "delete"},
    ("spotguard.dev", "trainingjobs/status"): {"get", "patch"},
    ("", "pods"): {"get", "list", "watch", "create", "delete"},
    ("", "events"): {"create"},
    # The headless Service of a job of several nodes.
    ("", "services"): {"get", "create"},
    ("", "secrets"): {"get"},
}
WEBHOOK_CONFIGURATION_RULES = {
    # The webhook's CA into the caBundle of the chart's two configurations (by name).
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations"): {"get", "patch"},
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations"): {"get", "patch"},
}
CLUSTER_RULES = {
    ("", "nodes"): {"get", "list", "watch"},
    # The notice relay verifies the pods' projected tokens (cluster-scoped, as system:auth-delegator).
    ("authentication.k8s.io", "tokenreviews"): {"create"},
    # The webhook is on by default, its certificate kept by the operator.
    **WEBHOOK_CONFIGURATION_RULES,
}
#: The Role in the release's namespace with which the operator keeps the webhook's certificate.
CERT_ROLE = "rel-spotguard-webhook-certificate"
CERT_RULES = [
    # create cannot be limited to a name; read and update only the one Secret.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    {
        "apiGroups": [""],
        "resources": ["secrets"],
        "verbs": ["get", "update"],
        "resourceNames": ["rel-spotguard-webhook-tls"],
    },
]
EXPECTED_RULES = {**NAMESPACED_RULES, **CLUSTER_RULES}
NOTICE_URL = "http://rel-spotguard.spotguard-system.svc:8081/notices/v1/pod"


def rules_of(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "resourceNames" not in rule or rule["resourceNames"]
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault((group, res), set()).update(rule["verbs"])
    return out


def operator_cluster_role(docs: list[dict[str, Any]]) -> dict[str, Any]:
    roles = by_kind(docs, "ClusterRole")
    assert len(roles) == 1, [r["metadata"]["name"] for r in roles]
    return roles[0]


def rules(docs: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    return rules_of(operator_cluster_role(docs))


def rbac_rules(role: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in role["rules"] if "rbac.authorization.k8s.io" in r["apiGroups"] or "*" in r["apiGroups"]]


def test_crd_copy_is_identical() -> None:
    assert (CHART / "files" / "trainingjob.yaml").read_bytes() == CRD.read_bytes(), (
        "charts/spotguard/files/trainingjob.yaml differs from crds/trainingjob.yaml: "
        "cp crds/trainingjob.yaml charts/spotguard/files/"
    )


def test_lint_strict() -> None:
    result = helm("lint", str(CHART), "--strict", check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_default_render() -> None:
    docs = render()
    assert sorted(d["kind"] for d in docs) == sorted(
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "Service",
            "CustomResourceDefinition",
            # The webhook, on by default: its configurations, and the Role to keep its certificate.
            "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration",
            "Role",
            "RoleBinding",
        ]
    )
    crd = one(docs, "CustomResourceDefinition")
    source = yaml.safe_load(CRD.read_text())
    assert crd["spec"] == source["spec"]  # the chart installs exactly the source of truth
    assert crd["metadata"]["name"] == "trainingjobs.spotguard.dev"
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema["properties"]["spec"]["required"] == ["template", "checkpoint"]
    assert crd["spec"]["versions"][0]["subresources"] == {"status": {}}

    dep = one(docs, "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate", "rollingUpdate": None}
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"] == "rel-spotguard"
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["image"] == "spotguard/spotguard:0.1.0"
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    # Readiness on the same port (the operator serves both, whatever the replica's role).
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "liveness"}
    cmd = operator_command(docs)
    assert cmd[:2] == ["spotguard", "operator"]
    assert "--all-namespaces" in cmd and "--metrics-port=8080" in cmd
    assert "--liveness=http://0.0.0.0:8081/healthz" in cmd
    assert "--image=spotguard/spotguard:0.1.0" in cmd
    assert f"--notice-url={NOTICE_URL}" in cmd
    assert "--webhook" in cmd
    assert not any(a.startswith(("--peering", "--leader-elect", "--notice-cluster-role")) for a in cmd)
    # The replica's identity comes from its pod's name (and a suffix of the process's own).
    env = {e["name"]: e.get("valueFrom") for e in container["env"]}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}

    svc = one(docs, "Service")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert [p["name"] for p in svc["spec"]["ports"]] == ["metrics", "webhook", "notices"]
    binding = one(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-spotguard", "namespace": "spotguard-system"}]


def test_rbac_is_exactly_what_the_operator_uses() -> None:
    assert rules(render()) == EXPECTED_RULES
    without_secrets = dict(EXPECTED_RULES)
    del without_secrets[("", "secrets")]
    assert rules(render("operator.readCheckpoints=false")) == without_secrets


@pytest.mark.parametrize(
    "sets", [(), ("operator.watchNamespaces={ml,research}",), ("operator.readCheckpoints=false",), ("replicaCount=3",)]
)
def test_operator_may_make_no_account_role_or_binding(sets: tuple[str, ...]) -> None:
    """RBAC lets an account that may create RoleBindings bind any role whose rules it holds (its own
    included): the operator may not create one at all, nor ServiceAccounts, Roles, or bind anything."""
    docs = render(*sets)
    for role in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"):
        assert rbac_rules(role) == [], role["metadata"]
        granted = rules_of(role)
        assert ("", "serviceaccounts") not in granted and ("", "serviceaccounts/token") not in granted
        assert not any("escalate" in verbs or "bind" in verbs or "*" in verbs for verbs in granted.values())
        assert not any(res == "*" for _, res in granted), role["metadata"]
    # Only the chart's own bindings exist, of the chart's own roles.
    for b in by_kind(docs, "ClusterRoleBinding") + by_kind(docs, "RoleBinding"):
        assert b["roleRef"]["name"].startswith("rel-spotguard"), b["metadata"]


@pytest.mark.parametrize(
    ("sets", "url"),
    [
        ((), NOTICE_URL),
        (("fullnameOverride=sg", "liveness.port=18081"), "http://sg.spotguard-system.svc:18081/notices/v1/pod"),
        (("metrics.enabled=false",), NOTICE_URL),
    ],
)
def test_the_notice_relay_is_reached_through_the_charts_service(sets: tuple[str, ...], url: str) -> None:
    from spotguard.cli import build_parser
    from spotguard.operator.cli import notice_url_problem

    docs = render(*sets)
    cmd = operator_command(docs)
    assert f"--notice-url={url}" in cmd
    args = build_parser().parse_args(["operator", *cmd[2:]])
    assert args.notice_url == url and notice_url_problem(args.notice_url, args.liveness) is None
    # The Service's port is the container's own (the URL holds without port translation), on the probes port.
    svc = one(docs, "Service")
    (port,) = [p for p in svc["spec"]["ports"] if p["name"] == "notices"]
    live = int(urlsplit(args.liveness).port or 0)
    assert port["port"] == live and port["targetPort"] == "liveness"
    assert f"http://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:{live}/" in url
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "liveness", "containerPort": live, "protocol": "TCP"} in container["ports"]


def test_read_checkpoints_false_reaches_the_operator() -> None:
    # Documented to stop the storage polling: the operator is told so, and may read no Secret.
    cmd = operator_command(render("operator.readCheckpoints=false"))
    assert "--no-read-checkpoints" in cmd
    assert not any(a.startswith(("--checkpoint-poll-seconds", "--checkpoint-full-read-seconds")) for a in cmd)
    assert "--no-read-checkpoints" not in operator_command(render())


def test_the_storage_polls_full_read_interval_reaches_the_operator() -> None:
    from spotguard.cli import build_parser

    cmd = operator_command(render())
    assert "--checkpoint-full-read-seconds=1800" in cmd
    assert "--checkpoint-full-read-seconds=0" in operator_command(render("operator.checkpointFullReadSeconds=0"))
    args = build_parser().parse_args(["operator", *cmd[2:]])
    assert args.checkpoint_full_read_seconds == 1800
    docs = render("operator.readCheckpoints=false", "operator.watchNamespaces={ml}")
    for role in by_kind(docs, "Role") + by_kind(docs, "ClusterRole"):
        if role["metadata"]["name"] == CERT_ROLE:  # the webhook's own Secret, no job's
            assert role["rules"] == CERT_RULES
            continue
        assert ("", "secrets") not in rules_of(role), role["metadata"]


def test_the_apiserver_and_checkpoint_read_timeouts_reach_the_operator() -> None:
    from spotguard.cli import build_parser
    from spotguard.contract.env import API_TIMEOUT_SECONDS, CHECKPOINT_READ_TIMEOUT_SECONDS

    cmd = operator_command(render())
    assert "--api-timeout-seconds=30" in cmd and "--checkpoint-read-timeout-seconds=60" in cmd
    args = build_parser().parse_args(["operator", *cmd[2:]])
    # The chart's defaults are the operator's own.
    assert (args.api_timeout_seconds, args.checkpoint_read_timeout_seconds) == (
        API_TIMEOUT_SECONDS.default,
        CHECKPOINT_READ_TIMEOUT_SECONDS.default,
    )
    set_both = operator_command(render("operator.apiTimeoutSeconds=5", "operator.checkpointReadTimeoutSeconds=7"))
    args = build_parser().parse_args(["operator", *set_both[2:]])
    assert (args.api_timeout_seconds, args.checkpoint_read_timeout_seconds) == (5, 7)
    # No storage read, no read timeout; the apiserver's stays.
    quiet = operator_command(render("operator.readCheckpoints=false"))
    assert "--api-timeout-seconds=30" in quiet
    assert not any(a.startswith("--checkpoint-read-timeout-seconds") for a in quiet)


def test_watched_namespaces_get_roles_not_a_cluster_role() -> None:
    docs = render("operator.watchNamespaces={ml,research}")
    # Cluster-wide: only Nodes (cluster-scoped; a vanished node is a preemption), TokenReviews and the
    # chart's own two webhook configurations (by name).
    assert rules(docs) == CLUSTER_RULES
    assert not any(("", "secrets") in rules_of(r) or ("", "pods") in rules_of(r) for r in by_kind(docs, "ClusterRole"))
    # Secrets: get in each watched namespace; in the release's namespace only the webhook's own Secret.
    cert = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] == CERT_ROLE]
    assert [(r["metadata"]["namespace"], r["rules"]) for r in cert] == [("spotguard-system", CERT_RULES)]
    roles = {r["metadata"]["namespace"]: r for r in by_kind(docs, "Role") if r["metadata"]["name"] != CERT_ROLE}
    assert sorted(roles) == ["ml", "research"]
    for ns, role in roles.items():
        assert role["metadata"]["name"] == "rel-spotguard"
        assert rules_of(role) == NAMESPACED_RULES, ns
    bindings = {
        b["metadata"]["namespace"]: b for b in by_kind(docs, "RoleBinding") if b["metadata"]["name"] != CERT_ROLE
    }
    assert sorted(bindings) == ["ml", "research"]
    for b in bindings.values():
        assert b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "rel-spotguard"}
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "rel-spotguard", "namespace": "spotguard-system"}]
    assert one(docs, "ClusterRoleBinding")["roleRef"]["name"] == "rel-spotguard"
    # All namespaces: no Role but the webhook certificate's (none without the webhook).
    assert [r["metadata"]["name"] for r in by_kind(render(), "Role")] == [CERT_ROLE]
    assert by_kind(render("webhook.enabled=false"), "Role") == []
    assert by_kind(render("webhook.enabled=false"), "RoleBinding") == []
    assert by_kind(render("rbac.create=false", "operator.watchNamespaces={ml}"), "Role") == []


def test_every_verb_the_operator_uses_is_granted() -> None:
    # Each API call in the operator's shell needs one of these (a call added there must be granted here).
    source = (ROOT / "spotguard" / "operator" / "reconcile.py").read_text()
    source += (ROOT / "spotguard" / "operator" / "kubeapi.py").read_text()
    source += (ROOT / "spotguard" / "operator" / "handlers.py").read_text()
    source += (ROOT / "spotguard" / "operator" / "probe.py").read_text()
    source += (ROOT / "spotguard" / "operator" / "notices.py").read_text()
    calls = {
        "get_namespaced_custom_object": ("spotguard.dev", "trainingjobs", "get"),
        "delete_namespaced_custom_object": ("spotguard.dev", "trainingjobs", "delete"),
        "patch_namespaced_custom_object_status": ("spotguard.dev", "trainingjobs/status", "patch"),
        "read_namespaced_pod": ("", "pods", "get"),
        "create_namespaced_pod": ("", "pods", "create"),
        "delete_namespaced_pod": ("", "pods", "delete"),
        "list_namespaced_pod": ("", "pods", "list"),
        "read_node": ("", "nodes", "get"),
        "create_namespaced_event": ("", "events", "create"),
        "read_namespaced_secret": ("", "secrets", "get"),
        "create_namespaced_service": ("", "services", "create"),
        "read_namespaced_service": ("", "services", "get"),
        # The notice relay's TokenReview of a pod's projected token.
        "create_token_review": ("authentication.k8s.io", "tokenreviews", "create"),
    }
    granted = rules(render())
    for call, (group, resource, verb) in calls.items():
        assert call in source, f"{call} no longer used: update this table"
        assert verb in granted[(group, resource)], call
    # No Role, RoleBinding or ServiceAccount is ever made or changed.
    for call in (
        "create_namespaced_role(",
        "patch_namespaced_role(",
        "patch_namespaced_role_binding",
        "replace_namespaced_role",
        "create_namespaced_role_binding",
        "create_namespaced_service_account",
        "RbacAuthorizationV1Api",
    ):
        assert call not in source, call


def test_namespaces_crds_and_metrics_switches() -> None:
    docs = render("operator.watchNamespaces={ml,research}", "crds.keep=false", "metrics.enabled=false")
    cmd = operator_command(docs)
    assert "--namespace=ml" in cmd and "--namespace=research" in cmd and "--all-namespaces" not in cmd
    assert "--metrics-port=0" in cmd
    assert "annotations" not in one(docs, "CustomResourceDefinition")["metadata"]
    # The Service stays for the notice relay (and the webhook, on by default).
    assert [p["name"] for p in one(docs, "Service")["spec"]["ports"]] == ["webhook", "notices"]
    assert by_kind(render("crds.enabled=false"), "CustomResourceDefinition") == []


def test_webhook() -> None:
    docs = render()  # on by default
    config = one(docs, "MutatingWebhookConfiguration")
    (hook,) = config["webhooks"]
    assert hook["objectSelector"] == {"matchLabels": {"spotguard.dev/inject": "true"}}
    assert hook["rules"][0]["resources"] == ["pods"] and hook["rules"][0]["operations"] == ["CREATE"]
    assert hook["sideEffects"] == "None" and hook["failurePolicy"] == "Fail"
    service = hook["clientConfig"]["service"]
    assert service == {"name": "rel-spotguard", "namespace": "spotguard-system", "path": "/mutate-pods", "port": 443}
    # TrainingJob updates that would throw progress away: the same Service; Ignore keeps editing
    # possible while the operator is down (which refuses such changes itself).
    (check,) = one(docs, "ValidatingWebhookConfiguration")["webhooks"]
    assert check["rules"] == [
        {
            "operations": ["UPDATE"],
            "apiGroups": ["spotguard.dev"],
            "apiVersions": ["*"],
            "resources": ["trainingjobs"],
            "scope": "Namespaced",
        }
    ]
    assert check["clientConfig"]["service"] == {**service, "path": "/validate-trainingjobs"}
    assert check["failurePolicy"] == "Ignore" and check["sideEffects"] == "None"
    assert check["admissionReviewVersions"] == ["v1"] and "namespaceSelector" not in check
    strict = render("webhook.validation.failurePolicy=Fail")
    assert one(strict, "ValidatingWebhookConfiguration")["webhooks"][0]["failurePolicy"] == "Fail"
    assert by_kind(render("webhook.validation.enabled=false"), "ValidatingWebhookConfiguration") == []
    off = render("webhook.enabled=false")
    assert by_kind(off, "ValidatingWebhookConfiguration") == by_kind(off, "MutatingWebhookConfiguration") == []
    assert not any(a.startswith("--webhook") for a in operator_command(off))
    assert not any(g == "admissionregistration.k8s.io" for g, _ in rules(off))
    # The operator keeps the certificate: the chart renders none, and no caBundle.
    assert by_kind(docs, "Secret") == []
    assert "caBundle" not in hook["clientConfig"] and "caBundle" not in check["clientConfig"]
    cmd = operator_command(docs)
    for arg in (
        "--webhook",
        "--webhook-cert=/tls/tls.crt",
        "--webhook-key=/tls/tls.key",
        "--webhook-cert-secret=rel-spotguard-webhook-tls",
        "--webhook-host=rel-spotguard.spotguard-system.svc",
        "--webhook-configuration=rel-spotguard",
        "--webhook-cert-days=365",
    ):
        assert arg in cmd, arg
    from spotguard.cli import build_parser
    from spotguard.operator.cli import cert_secret_problem

    assert cert_secret_problem(build_parser().parse_args(["operator", *cmd[2:]])) is None
    assert [p["name"] for p in one(docs, "Service")["spec"]["ports"]] == ["metrics", "webhook", "notices"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    # Written by the operator into memory: the root filesystem stays read-only.
    assert {"name": "webhook-tls", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}} in pod["volumes"]
    assert {"name": "webhook-tls", "mountPath": "/tls", "readOnly": False} in pod["containers"][0]["volumeMounts"]
    assert "checksum/webhook-tls" not in (one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"] or {})
    # Granted: the chart's two configurations by name, and the one Secret in the release's namespace.
    roles = by_kind(docs, "ClusterRole")
    hooks = [r for role in roles for r in role["rules"] if "admissionregistration.k8s.io" in r["apiGroups"]]
    assert hooks == [
        {
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["mutatingwebhookconfigurations", "validatingwebhookconfigurations"],
            "verbs": ["get", "patch"],
            "resourceNames": ["rel-spotguard"],
        }
    ]
    (cert_role,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] == CERT_ROLE]
    assert cert_role["metadata"]["namespace"] == "spotguard-system" and cert_role["rules"] == CERT_RULES
    (binding,) = [b for b in by_kind(docs, "RoleBinding") if b["metadata"]["name"] == CERT_ROLE]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-spotguard", "namespace": "spotguard-system"}]


def test_two_renders_are_byte_identical() -> None:
    """GitOps: nothing random or time-dependent is rendered (no generated key or certificate)."""
    for sets in (
        (),
        ("webhook.enabled=true",),
        ("replicaCount=2",),
        ("webhook.certManager.enabled=true",),
        ("operator.watchNamespaces={ml}",),
    ):
        args = ["template", "rel", str(CHART), "--namespace", "spotguard-system"]
        for s in sets:
            args += ["--set", s]
        first, second = helm(*args).stdout, helm(*args).stdout
        assert first == second, sets
        # No certificate, key or CA of any kind (the operator or cert-manager provides them).
        docs = [d for d in yaml.safe_load_all(first) if d]
        assert not by_kind(docs, "Secret"), sets
        for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            for config in by_kind(docs, kind):
                assert all("caBundle" not in hook["clientConfig"] for hook in config["webhooks"]), sets


def test_the_certificate_keeper_is_granted_what_it_calls() -> None:
    source = (ROOT / "spotguard" / "operator" / "webhookcert.py").read_text()
    calls = {
        "read_namespaced_secret": "get",
        "create_namespaced_secret": "create",
        "replace_namespaced_secret": "update",
    }
    granted = {verb for rule in CERT_RULES for verb in rule["verbs"]}
    for call, verb in calls.items():
        assert call in source, f"{call} no longer used: update this table"
        assert verb in granted, call
    for kind in ("mutating", "validating"):
        for call, verb in (
            (f"read_{kind}_webhook_configuration", "get"),
            (f"patch_{kind}_webhook_configuration", "patch"),
        ):
            assert call in source, call
            assert verb in WEBHOOK_CONFIGURATION_RULES[("admissionregistration.k8s.io", f"{kind}webhookconfigurations")]


LEASE = "rel-spotguard-leader"
#: What leader election needs: create a Lease (RBAC cannot limit create to a name), read and renew only its own.
LEADER_RULES = [
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "update"],
        "resourceNames": [LEASE],
    },
]


def test_several_replicas_elect_a_leader_with_a_lease() -> None:
    docs = render("replicaCount=2")
    dep = one(docs, "Deployment")
    # Rolling: a new replica stands by before an old one hands its Lease over.
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    cmd = operator_command(docs)
    assert "--leader-elect" in cmd and f"--leader-elect-resource-name={LEASE}" in cmd
    assert "--leader-elect-resource-namespace=spotguard-system" in cmd
    assert {
        "--leader-elect-lease-duration=15",
        "--leader-elect-renew-deadline=10",
        "--leader-elect-retry-period=2",
    } <= set(cmd)
    assert not any(a.startswith("--peering") for a in cmd)
    # No kopf peering any more: no CRD of kopf's, no peering object, no rule for it.
    assert {c["metadata"]["name"] for c in by_kind(docs, "CustomResourceDefinition")} == {"trainingjobs.spotguard.dev"}
    assert not by_kind(docs, "ClusterKopfPeering")
    assert rules(docs) == EXPECTED_RULES
    # The Lease's Role, in the release's namespace only, bound to the operator's account.
    (role,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] != CERT_ROLE]
    assert role["metadata"] == {
        **role["metadata"],
        "name": "rel-spotguard-leader-election",
        "namespace": "spotguard-system",
    }
    assert role["rules"] == LEADER_RULES
    (binding,) = [b for b in by_kind(docs, "RoleBinding") if b["metadata"]["name"] != CERT_ROLE]
    assert binding["metadata"]["namespace"] == "spotguard-system"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "rel-spotguard-leader-election",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-spotguard", "namespace": "spotguard-system"}]
    # Also when only some namespaces are watched: the Lease stays in the operator's own.
    docs = render("replicaCount=3", "operator.watchNamespaces={ml}")
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]) for r in by_kind(docs, "Role")}
    assert roles == {
        ("ml", "rel-spotguard"),
        ("spotguard-system", "rel-spotguard-leader-election"),
        ("spotguard-system", CERT_ROLE),
    }
    assert by_kind(render("replicaCount=2", "rbac.create=false"), "Role") == []


def test_leader_election_durations_reach_the_operator_and_are_checked() -> None:
    cmd = operator_command(
        render(
            "replicaCount=2",
            "leaderElection.leaseDurationSeconds=30",
            "leaderElection.renewDeadlineSeconds=20",
            "leaderElection.retryPeriodSeconds=4",
        )
    )
    assert {
        "--leader-elect-lease-duration=30",
        "--leader-elect-renew-deadline=20",
        "--leader-elect-retry-period=4",
    } <= set(cmd)
    for sets, why in (
        (("leaderElection.renewDeadlineSeconds=15",), "longer than leaderElection.renewDeadline"),
        (("leaderElection.retryPeriodSeconds=9",), "1.2 x leaderElection.retryPeriodSeconds"),
    ):
        args = ["template", "rel", str(CHART), "--set", "replicaCount=2"]
        for s in sets:
            args += ["--set", s]
        result = helm(*args, check=False)
        assert result.returncode != 0 and why in result.stderr, result.stderr
    # One replica runs alone: the durations are not used, nor checked.
    assert "--leader-elect" not in operator_command(render("leaderElection.renewDeadlineSeconds=15"))


def test_leader_election_is_granted_what_it_calls() -> None:
    # Each API call of the election needs one of these verbs on the one Lease (or create).
    source = (ROOT / "spotguard" / "operator" / "leader.py").read_text()
    calls = {"read_namespaced_lease": "get", "replace_namespaced_lease": "update", "create_namespaced_lease": "create"}
    (role,) = [r for r in by_kind(render("replicaCount=2"), "Role") if r["metadata"]["name"] != CERT_ROLE]
    for call, verb in calls.items():
        assert call in source, f"{call} no longer used: update this table"
        assert any(verb in r["verbs"] for r in role["rules"]), call
    for call in ("patch_namespaced_lease", "delete_namespaced_lease", "list_namespaced_lease"):
        assert call not in source, call


def test_service_monitor() -> None:
    mon = one(
        render("metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom"), "ServiceMonitor"
    )
    # honorLabels: the series carry the TrainingJob's own namespace/job labels.
    assert mon["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "honorLabels": True, "interval": "30s"}]
    assert mon["metadata"]["labels"]["release"] == "prom"


def test_scheduling_values_reach_the_pod() -> None:
    docs = render("nodeSelector.pool=system", "tolerations[0].key=dedicated", "tolerations[0].operator=Exists")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "system"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]


@pytest.mark.parametrize(
    "bad",
    [
        "replicaCount=0",
        "operator.nativeSidecar=maybe",
        "webhook.failurePolicy=Sometimes",
        "metrics.port=70000",
        "unknownKey=1",
        "image.pullPolicy=Sometimes",
        "leaderElection.leaseDurationSeconds=0",
        "leaderElection.retryPeriodSeconds=-1",
        "leaderElection.renewDeadline=5",
        "operator.apiTimeoutSeconds=0",
        "operator.checkpointReadTimeoutSeconds=-1",
    ],
)
def test_schema_refuses_bad_values(bad: str) -> None:
    result = helm("template", "rel", str(CHART), "--set", bad, check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications" in result.stderr or "at '/" in result.stderr, result.stderr


def test_values_schema_is_json() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"])
