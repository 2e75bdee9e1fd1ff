"""The chart installed against the real apiserver, where it meets the rest of a cluster: the webhook
across ``helm upgrade`` (no certificate rendered), and TrainingJob access through the built-in view and edit roles."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from spotguard.operator.testing import wait_for

pytestmark = pytest.mark.integration

CHART = Path(__file__).resolve().parents[2] / "charts" / "spotguard"
RELEASE, NAMESPACE, TEAM = "sgp", "sgp-system", "sgp-team"
FULLNAME = f"{RELEASE}-spotguard"


def tool(kube: Any, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(kube.bin_dir / name), "--kubeconfig", str(kube.kubeconfig), *args],
        capture_output=True,
        text=True,
        check=check,
        timeout=180,
    )


def get(kube: Any, *what: str) -> dict[str, Any]:
    return json.loads(tool(kube, "kubectl", "get", *what, "-o", "json").stdout)  # type: ignore[no-any-return]


def can_i(kube: Any, user: str, verb: str, resource: str) -> bool:
    resource, _, sub = resource.partition("/")
    args = ["auth", "can-i", verb, resource, f"--as={user}", "-n", TEAM] + ([f"--subresource={sub}"] if sub else [])
    out = tool(kube, "kubectl", *args, check=False)
    return out.stdout.strip() == "yes"


def test_the_webhook_survives_upgrades_unchanged_and_users_get_access_through_view_and_edit(
    kube: Any, crd: None
) -> None:
    # The CRD from the fixture (not the chart: another release may own it), and no node for the
    # operator: only the chart's objects matter.
    base = [
        "--namespace",
        NAMESPACE,
        "--set",
        "crds.enabled=false",
        "--set",
        "webhook.enabled=true",
        "--set-string",
        "nodeSelector.spotguard\\.dev/no-such-node=true",
    ]
    result = tool(kube, "helm", "upgrade", "--install", RELEASE, str(CHART), "--create-namespace", *base, check=False)
    assert result.returncode == 0, result.stderr
    try:

        def snapshot() -> tuple[Any, Any, list[str]]:
            hook = get(kube, "mutatingwebhookconfiguration", FULLNAME)["webhooks"][0]["clientConfig"]
            check = get(kube, "validatingwebhookconfiguration", FULLNAME)["webhooks"][0]["clientConfig"]
            pod = get(kube, "deployment", FULLNAME, "-n", NAMESPACE)["spec"]["template"]
            return hook, check, pod["spec"]["containers"][0]["command"]

        first = snapshot()
        # Helm makes no certificate: the operator (not running here) keeps it, and fills the caBundle.
        assert "caBundle" not in first[0] and "caBundle" not in first[1], first
        assert "--webhook-cert-secret=sgp-spotguard-webhook-tls" in first[2]
        secrets = tool(kube, "kubectl", "get", "secret", f"{FULLNAME}-webhook-tls", "-n", NAMESPACE, check=False)
        assert secrets.returncode != 0 and "NotFound" in secrets.stderr, secrets.stdout
        # An upgrade that changes something else, twice: the webhook configurations and the operator's
        # command stay (nothing random is rendered: no diff for GitOps tools).
        for label in ("a", "b"):
            result = tool(
                kube, "helm", "upgrade", RELEASE, str(CHART), *base, "--set", f"podLabels.round={label}", check=False
            )
            assert result.returncode == 0, result.stderr
            assert snapshot() == first

        # Namespace users: a RoleBinding to the built-in edit or view role is all they need.
        tool(kube, "kubectl", "create", "namespace", TEAM, check=False)
        tool(kube, "kubectl", "create", "rolebinding", "alice-edit", "--clusterrole=edit", "--user=alice", "-n", TEAM)
        tool(kube, "kubectl", "create", "rolebinding", "bob-view", "--clusterrole=view", "--user=bob", "-n", TEAM)
        tj = "trainingjobs.spotguard.dev"
        try:
            wait_for(
                lambda: can_i(kube, "alice", "create", tj) and can_i(kube, "bob", "list", tj),
                "the built-in roles to aggregate TrainingJob access",
                timeout=60,
                interval=0.5,
            )
        except Exception:
            edit = get(kube, "clusterrole", "edit")
            probe = tool(kube, "kubectl", "auth", "can-i", "create", tj, "--as=alice", "-n", TEAM, check=False)
            ours = [r for r in edit.get("rules") or [] if "spotguard.dev" in r.get("apiGroups", [])]
            raise AssertionError(
                f"edit's rules for spotguard.dev: {ours}; can-i: {probe.stdout!r} {probe.stderr!r}"
            ) from None
        for verb in ("get", "list", "watch", "create", "patch", "delete"):
            assert can_i(kube, "alice", verb, tj), verb
        for verb in ("get", "list", "watch"):
            assert can_i(kube, "bob", verb, tj), verb
        for verb in ("create", "patch", "delete"):
            assert not can_i(kube, "bob", verb, tj), verb
        # The status is the operator's: neither may write it.
        assert not can_i(kube, "alice", "patch", f"{tj}/status") and can_i(kube, "bob", "get", f"{tj}/status")
    finally:
        out = tool(kube, "helm", "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", check=False)
        tool(kube, "kubectl", "delete", "namespace", TEAM, NAMESPACE, "--wait=false", check=False)
        assert out.returncode == 0, out.stderr
