"""``helm install`` of the chart against the real apiserver: objects, RBAC as enforced, uninstall."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from spotguard.operator.testing import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "spotguard"
RELEASE, NAMESPACE = "spotguard", "spotguard-system"
SA = f"system:serviceaccount:{NAMESPACE}:{RELEASE}"


def tool(kube: Any, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    flag = "--kubeconfig"
    return subprocess.run(
        [str(kube.bin_dir / name), flag, str(kube.kubeconfig), *args],
        capture_output=True,
        text=True,
        check=check,
        timeout=180,
    )


def adopt_crd(kube: Any) -> None:
    """Let Helm adopt a TrainingJob CRD that something else created (helm refuses otherwise)."""
    crd = "crd/trainingjobs.spotguard.dev"
    if tool(kube, "kubectl", "get", crd, check=False).returncode != 0:
        return
    tool(kube, "kubectl", "label", "--overwrite", crd, "app.kubernetes.io/managed-by=Helm")
    tool(
        kube,
        "kubectl",
        "annotate",
        "--overwrite",
        crd,
        f"meta.helm.sh/release-name={RELEASE}",
        f"meta.helm.sh/release-namespace={NAMESPACE}",
    )


def can_i(kube: Any, verb: str, resource: str, namespace: str | None = "default") -> bool:
    resource, _, sub = resource.partition("/")
    args = ["auth", "can-i", verb, resource, f"--as={SA}"] + ([f"--subresource={sub}"] if sub else [])
    args += ["-n", namespace] if namespace else []
    return tool(kube, "kubectl", *args, check=False).stdout.strip() == "yes"


def test_install_rbac_and_uninstall(kube: Any) -> None:
    adopt_crd(kube)
    # No process node may run the operator here: it would act on other tests' objects.
    result = tool(
        kube,
        "helm",
        "upgrade",
        "--install",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--create-namespace",
        "--set-string",
        "nodeSelector.spotguard\\.dev/no-such-node=true",
        # Nothing serves the validating webhook here (no operator pod runs, and this apiserver reaches no
        # Service IP): other tests' TrainingJob updates would wait out its timeout.
        "--set",
        "webhook.validation.enabled=false",
        check=False,
    )
    assert result.returncode == 0, result.stderr
    try:
        tool(
            kube, "kubectl", "wait", "--for", "condition=established", "crd/trainingjobs.spotguard.dev", "--timeout=60s"
        )
        names = tool(
            kube, "kubectl", "get", "deployment,serviceaccount,service", "-n", NAMESPACE, "-o", "name"
        ).stdout.split()
        assert f"deployment.apps/{RELEASE}" in names and f"serviceaccount/{RELEASE}" in names
        assert f"service/{RELEASE}" in names
        # What the apiserver's RBAC really lets the operator's ServiceAccount do.
        allowed = [
            ("get", "trainingjobs.spotguard.dev"),
            ("watch", "trainingjobs.spotguard.dev"),
            ("patch", "trainingjobs.spotguard.dev"),
            ("patch", "trainingjobs.spotguard.dev/status"),
            ("create", "pods"),
            ("delete", "pods"),
            ("watch", "pods"),
            ("create", "events"),
            ("get", "secrets"),
            ("get", "trainingjobs.spotguard.dev/status"),
            # spec.ttlSecondsAfterFinished: a finished job's object goes (its checkpoints stay).
            ("delete", "trainingjobs.spotguard.dev"),
            # The notice relay reads the pod of the token it verified (pods get, above).
        ]
        for verb, resource in allowed:
            assert can_i(kube, verb, resource), (verb, resource)
        assert can_i(kube, "watch", "nodes", None)
        # The notice relay's TokenReviews of the pods' projected tokens (cluster-scoped).
        assert can_i(kube, "create", "tokenreviews.authentication.k8s.io", None)
        denied = [
            ("update", "trainingjobs.spotguard.dev"),
            ("create", "trainingjobs.spotguard.dev"),
            ("update", "pods"),
            ("create", "pods/eviction"),
            ("update", "trainingjobs.spotguard.dev/status"),
            ("patch", "pods/status"),
            ("list", "secrets"),
            ("create", "secrets"),
            ("delete", "events"),
            ("create", "deployments"),
            ("create", "mutatingwebhookconfigurations.admissionregistration.k8s.io"),
            # No ServiceAccount, Role or RoleBinding made or changed, nothing bound or escalated: an account
            # that may create RoleBindings could bind any role whose rules it holds (its own included).
            ("create", "serviceaccounts"),
            ("create", "rolebindings.rbac.authorization.k8s.io"),
            ("create", "roles.rbac.authorization.k8s.io"),
            ("patch", "roles.rbac.authorization.k8s.io"),
            ("patch", "rolebindings.rbac.authorization.k8s.io"),
            ("escalate", "roles.rbac.authorization.k8s.io"),
            ("bind", "roles.rbac.authorization.k8s.io"),
            ("bind", "clusterroles.rbac.authorization.k8s.io"),
            ("delete", "roles.rbac.authorization.k8s.io"),
            ("delete", "serviceaccounts"),
            ("create", "serviceaccounts/token"),
        ]
        for verb, resource in denied:
            assert not can_i(kube, verb, resource), (verb, resource)
        assert not can_i(kube, "delete", "nodes", None)
        assert not can_i(kube, "list", "customresourcedefinitions.apiextensions.k8s.io", None)
        assert not can_i(kube, "create", "clusterrolebindings.rbac.authorization.k8s.io", None)
        # The Service reaches the notice relay on the liveness port.
        ports = tool(
            kube,
            "kubectl",
            "get",
            "service",
            RELEASE,
            "-n",
            NAMESPACE,
            "-o",
            "jsonpath={range .spec.ports[*]}{.name}={.port}>{.targetPort} {end}",
        ).stdout.split()
        assert "notices=8081>liveness" in ports, ports

        # Watching chosen namespaces: Roles there, nothing namespaced anywhere else.
        watched = "sg-watched-" + RELEASE
        tool(kube, "kubectl", "create", "namespace", watched, check=False)
        result = tool(
            kube,
            "helm",
            "upgrade",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--reuse-values",
            "--set",
            f"operator.watchNamespaces={{{watched}}}",
            check=False,
        )
        assert result.returncode == 0, result.stderr
        for verb, resource in allowed:
            assert can_i(kube, verb, resource, watched), (verb, resource)
            assert not can_i(kube, verb, resource, "default"), (verb, resource, "default")
        assert not can_i(kube, "get", "secrets", None) and not can_i(kube, "list", "pods", None)
        assert can_i(kube, "watch", "nodes", None)
        assert can_i(kube, "create", "tokenreviews.authentication.k8s.io", None)
        for verb, resource in denied:
            assert not can_i(kube, verb, resource, watched), (verb, resource, watched)
        # readCheckpoints=false: no Secret anywhere.
        result = tool(
            kube,
            "helm",
            "upgrade",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--reuse-values",
            "--set",
            "operator.readCheckpoints=false",
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert not can_i(kube, "get", "secrets", watched) and can_i(kube, "create", "pods", watched)
    finally:
        out = tool(kube, "helm", "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", check=False)
        tool(kube, "kubectl", "delete", "namespace", "sg-watched-" + RELEASE, "--wait=false", check=False)
        assert out.returncode == 0, out.stderr
    # The CRD (and with it every TrainingJob) survives the uninstall.
    assert tool(kube, "kubectl", "get", "crd/trainingjobs.spotguard.dev", check=False).returncode == 0
    wait_for(
        lambda: tool(kube, "kubectl", "get", "deployment", RELEASE, "-n", NAMESPACE, check=False).returncode,
        "the deployment to be removed",
    )
