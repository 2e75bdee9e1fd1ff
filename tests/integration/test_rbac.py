"""The operator's RBAC as the real apiserver enforces it, after ``helm install`` of the chart.

The operator may create per job only a ServiceAccount and a RoleBinding of the
chart's notice ClusterRole: no Role, and no binding of any other role it does
not hold. Then the operator itself, run as the chart's ServiceAccount, gives a
job with the k8s notice source its access.
"""

from __future__ import annotations

import json
import subprocess
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotguard.operator.testing import wait_for
from testenv.kubetest import (
    cond,
    create_job,
    delete_jobs,
    fast_preemption,
    job_body,
    new_namespace,
    operator_process,
    wait_event,
    wait_status,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "spotguard"
RELEASE, NAMESPACE = "sgrbac", "sgrbac-system"
FULLNAME = f"{RELEASE}-spotguard"
NOTICE_ROLE = f"{FULLNAME}-pod-notices"
OPERATOR = f"system:serviceaccount:{NAMESPACE}:{FULLNAME}"
NO_NODE = {"spotguard.dev/test-no-node": "true"}


def tool(kube: Any, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(kube.bin_dir / name), "--kubeconfig", str(kube.kubeconfig), *args],
                          capture_output=True, text=True, check=check, timeout=180)  # fmt: skip


def install(kube: Any, *sets: str) -> None:
    """Install (or upgrade to) the chart with exactly these values (no CRD: the ``crd`` fixture made it)."""
    args = ["upgrade", "--install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
            "--reset-values", "--set", "crds.enabled=false",
            # No process node may run this operator: it would act on other tests' objects.
            "--set-string", "nodeSelector.spotguard\\.dev/no-such-node=true"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    result = tool(kube, "helm", *args, check=False)
    assert result.returncode == 0, result.stderr


def can_i(kube: Any, verb: str, what: str, namespace: str | None, user: str = OPERATOR) -> bool:
    args = ["auth", "can-i", verb, what, f"--as={user}"] + (["-n", namespace] if namespace else [])
    return tool(kube, "kubectl", *args, check=False).stdout.strip() == "yes"


def bind(kube: Any, namespace: str, kind: str, role: str, user: str = OPERATOR) -> subprocess.CompletedProcess[str]:
    """Create (server-side dry run, so every check runs and nothing stays) a RoleBinding as ``user``."""
    return tool(kube, "kubectl", "create", "rolebinding", "probe", f"--{kind}={role}", "-n", namespace,
                f"--serviceaccount={namespace}:someone", "--dry-run=server", f"--as={user}", "-o", "name",
                check=False)  # fmt: skip


def forbidden(result: subprocess.CompletedProcess[str]) -> bool:
    return result.returncode != 0 and "forbidden" in result.stderr.lower()


@pytest.fixture(scope="module")
def namespaces(apis: tuple[Any, Any], crd: None) -> Iterator[tuple[str, str]]:
    """A namespace the operator watches and one it does not."""
    core, _ = apis
    watched, other = new_namespace(core, "rbac-w"), new_namespace(core, "rbac-o")
    yield watched, other
    core.delete_namespace(watched)
    core.delete_namespace(other)


@pytest.fixture(scope="module")
def release(kube: Any, namespaces: tuple[str, str]) -> Iterator[None]:
    install(kube)
    try:
        yield
    finally:
        out = tool(kube, "helm", "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", check=False)
        tool(kube, "kubectl", "delete", "namespace", NAMESPACE, "--wait=false", check=False)
        assert out.returncode == 0, out.stderr


def test_notice_cluster_role_grants_only_what_the_sidecar_uses(kube: Any, release: None) -> None:
    install(kube)
    role = json.loads(tool(kube, "kubectl", "get", "clusterrole", NOTICE_ROLE, "-o", "json").stdout)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
                             {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]


def test_default_install_makes_no_role_and_binds_only_the_notice_cluster_role(
        kube: Any, release: None, namespaces: tuple[str, str]) -> None:
    install(kube)
    ns = namespaces[0]
    roles = "roles.rbac.authorization.k8s.io"
    for verb in ("create", "patch", "update", "escalate", "bind"):
        assert not can_i(kube, verb, roles, ns), verb
        assert not can_i(kube, verb, roles, None), verb
    assert can_i(kube, "create", "rolebindings.rbac.authorization.k8s.io", ns)
    assert not can_i(kube, "patch", "rolebindings.rbac.authorization.k8s.io", ns)
    assert not can_i(kube, "create", "clusterroles.rbac.authorization.k8s.io", None)
    assert not can_i(kube, "create", "clusterrolebindings.rbac.authorization.k8s.io", None)
    # bind: the notice ClusterRole by name, nothing else.
    assert can_i(kube, "bind", f"clusterroles/{NOTICE_ROLE}", ns)
    for other in ("cluster-admin", "admin", "edit", FULLNAME):
        assert not can_i(kube, "bind", f"clusterroles/{other}", ns), other
    assert not can_i(kube, "escalate", "clusterroles.rbac.authorization.k8s.io", None)

    # What the apiserver does with real requests (dry run: every check, nothing stored).
    ok = bind(kube, ns, "clusterrole", NOTICE_ROLE)
    assert ok.returncode == 0, ok.stderr
    for other in ("cluster-admin", "admin", "edit"):
        assert forbidden(bind(kube, ns, "clusterrole", other)), other
    role = tool(kube, "kubectl", "create", "role", "probe", "--verb=get", "--resource=secrets", "-n", ns,
                "--dry-run=server", f"--as={OPERATOR}", check=False)  # fmt: skip
    assert forbidden(role), role.stdout + role.stderr


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="RBAC lets an account that may create RoleBindings bind a role whose every rule it holds"
                   " itself (its own ClusterRole included); only an admission policy could refuse it")
def test_default_install_cannot_bind_its_own_cluster_role(kube: Any, release: None,
                                                          namespaces: tuple[str, str]) -> None:
    install(kube)
    result = bind(kube, namespaces[0], "clusterrole", FULLNAME)
    if result.returncode != 0 and not forbidden(result):
        raise RuntimeError(f"the probe failed: {result.stderr}")
    assert forbidden(result), f"created: {result.stdout}"


def test_watched_namespaces_keep_secrets_and_bindings_there(kube: Any, release: None,
                                                            namespaces: tuple[str, str]) -> None:
    watched, other = namespaces
    install(kube, f"operator.watchNamespaces={{{watched}}}")
    assert can_i(kube, "get", "secrets", watched)
    assert not can_i(kube, "get", "secrets", other) and not can_i(kube, "get", "secrets", "default")
    assert not can_i(kube, "get", "secrets", None) and not can_i(kube, "list", "secrets", watched)
    assert can_i(kube, "create", "rolebindings.rbac.authorization.k8s.io", watched)
    assert not can_i(kube, "create", "rolebindings.rbac.authorization.k8s.io", other)
    assert can_i(kube, "bind", f"clusterroles/{NOTICE_ROLE}", watched)
    assert not can_i(kube, "bind", f"clusterroles/{NOTICE_ROLE}", other)
    assert not can_i(kube, "create", "roles.rbac.authorization.k8s.io", watched)
    ok = bind(kube, watched, "clusterrole", NOTICE_ROLE)
    assert ok.returncode == 0, ok.stderr
    assert forbidden(bind(kube, watched, "clusterrole", "cluster-admin"))
    assert forbidden(bind(kube, watched, "clusterrole", "admin"))
    assert forbidden(bind(kube, other, "clusterrole", NOTICE_ROLE))
    # readCheckpoints=false: no Secret anywhere, the notice binding stays.
    install(kube, f"operator.watchNamespaces={{{watched}}}", "operator.readCheckpoints=false")
    assert not can_i(kube, "get", "secrets", watched)
    assert can_i(kube, "bind", f"clusterroles/{NOTICE_ROLE}", watched)


def test_replicas_may_touch_only_their_own_lease(kube: Any, release: None, namespaces: tuple[str, str]) -> None:
    """Leader election (replicaCount >= 2): create a Lease, read and renew only the chart's one."""
    lease, leases = f"{FULLNAME}-leader", "leases.coordination.k8s.io"
    install(kube)
    assert not can_i(kube, "create", leases, NAMESPACE) and not can_i(kube, "get", f"{leases}/{lease}", NAMESPACE)
    install(kube, "replicaCount=2")
    assert can_i(kube, "create", leases, NAMESPACE)
    for verb in ("get", "update"):
        assert can_i(kube, verb, f"{leases}/{lease}", NAMESPACE), verb
        assert not can_i(kube, verb, f"{leases}/other", NAMESPACE), verb
    for verb in ("list", "watch", "delete", "patch"):
        assert not can_i(kube, verb, f"{leases}/{lease}", NAMESPACE), verb
    for ns in (*namespaces, "kube-node-lease", None):
        assert not can_i(kube, "create", leases, ns) and not can_i(kube, "get", f"{leases}/{lease}", ns), ns
    # kopf peering is gone with its rights.
    assert not can_i(kube, "get", "clusterkopfpeerings.kopf.dev", None)
    install(kube)


# --- the operator as the chart's ServiceAccount ---------------------------------------


def service_account_kubeconfig(kube: Any, core: Any, path: Path) -> Path:
    """A kubeconfig of the operator's ServiceAccount (a token from the TokenRequest API)."""
    token = core.create_namespaced_service_account_token(
        FULLNAME, NAMESPACE, {"spec": {"expirationSeconds": 3600}}).status.token
    cfg = json.loads(Path(kube.kubeconfig).read_text())
    cfg["users"] = [{"name": "operator", "user": {"token": token}}]
    for ctx in cfg["contexts"]:
        ctx["context"]["user"] = "operator"
    path.write_text(json.dumps(cfg))
    path.chmod(0o600)
    return path


def no_node_job(name: str, storage: str, **pod: Any) -> dict[str, Any]:
    trainer = {"name": "trainer", "image": "trainer:1", "command": ["python", "-m", "train"]}
    return job_body(name, storage, trainer, node_selector=NO_NODE, pod_spec=pod or None, every_steps=10,
                    preemption=fast_preemption(3, 1, 5, notices=["k8s"]))  # fmt: skip


def shutdown(core: Any, ns: str, pod: str) -> None:
    """What kubelet's graceful node shutdown leaves (1.26+)."""
    core.patch_namespaced_pod_status(pod, ns, {"status": {
        "phase": "Failed", "reason": "Terminated",
        "message": "Pod was terminated in response to imminent node shutdown.",
        "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}]}})


def test_operator_with_the_charts_rbac_gives_a_notice_job_its_own_access(
        kube: Any, apis: tuple[Any, Any], release: None, namespaces: tuple[str, str], tmp_path: Path) -> None:
    from kubernetes import client

    core, _ = apis
    rbac = client.RbacAuthorizationV1Api(core.api_client)
    ns = namespaces[0]
    install(kube, f"operator.watchNamespaces={{{ns}}}")
    store = f"file://{tmp_path}/store"
    # A job an older operator served: its Role (on attempt 1's pod) and RoleBinding, owned by the job.
    legacy = create_job(apis, ns, no_node_job("legacy", store))
    owner = [{"apiVersion": "spotguard.dev/v1alpha1", "kind": "TrainingJob", "name": "legacy",
              "uid": legacy["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]  # fmt: skip
    old = "legacy-spotguard-notices"
    meta = {"name": old, "namespace": ns, "ownerReferences": owner}
    rbac.create_namespaced_role(ns, {"metadata": meta, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "watch"], "resourceNames": ["legacy-a1"]}]})
    rbac.create_namespaced_role_binding(ns, {"metadata": meta, "roleRef": {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": old},
        "subjects": [{"kind": "ServiceAccount", "name": old, "namespace": ns}]})
    old_version = rbac.read_namespaced_role(old, ns).metadata.resource_version

    cfg = service_account_kubeconfig(kube, core, tmp_path / "operator.kubeconfig")
    as_operator = types.SimpleNamespace(env=lambda: {"KUBECONFIG": str(cfg)})
    op = operator_process(as_operator, ns, tmp_path / "operator.log",
                          extra_args=["--notice-cluster-role", NOTICE_ROLE]).start()
    try:
        job = create_job(apis, ns, no_node_job("notice", store))
        pod = wait_for(lambda: core.read_namespaced_pod("notice-a1", ns), "pod notice-a1", timeout=60)
        account = "notice-spotguard-notices"
        assert pod.spec.service_account_name == account
        sa = core.read_namespaced_service_account(account, ns)
        bindings = [b for b in rbac.list_namespaced_role_binding(ns).items
                    if b.metadata.owner_references and b.metadata.owner_references[0].uid == job["metadata"]["uid"]]
        assert len(bindings) == 1, [b.metadata.name for b in bindings]
        binding = bindings[0]
        assert (binding.role_ref.kind, binding.role_ref.name) == ("ClusterRole", NOTICE_ROLE)
        assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [("ServiceAccount", account, ns)]
        for obj in (sa, binding):
            assert [r.uid for r in obj.metadata.owner_references] == [job["metadata"]["uid"]]
        # No Role but the chart's own (the operator's rights here) and the older operator's.
        assert sorted(r.metadata.name for r in rbac.list_namespaced_role(ns).items) == sorted([FULLNAME, old])
        # What the pod's account may do: read a pod and post Events in its namespace, nothing more.
        user = f"system:serviceaccount:{ns}:{account}"
        assert can_i(kube, "get", "pods/notice-a1", ns, user) and can_i(kube, "create", "events", ns, user)
        assert not can_i(kube, "list", "pods", ns, user) and not can_i(kube, "get", "secrets", ns, user)
        assert not can_i(kube, "patch", "pods/notice-a1", ns, user)
        assert not can_i(kube, "get", "pods/notice-a1", namespaces[1], user)

        # The older job: a binding of its own to the ClusterRole; the old Role is never changed again.
        wait_for(lambda: core.read_namespaced_pod("legacy-a1", ns), "pod legacy-a1", timeout=60)
        shutdown(core, ns, "legacy-a1")
        wait_for(lambda: core.read_namespaced_pod("legacy-a2", ns), "pod legacy-a2", timeout=60)
        assert rbac.read_namespaced_role(old, ns).metadata.resource_version == old_version
        assert can_i(kube, "get", "pods/legacy-a2", ns, f"system:serviceaccount:{ns}:{old}")

        # A template with its own ServiceAccount and the k8s source: refused, with what to change.
        create_job(apis, ns, no_node_job("own-sa", store, serviceAccountName="trainer-sa"))
        st = wait_status(apis, ns, "own-sa", "Invalid", lambda s: cond(s, "Invalid").get("status") == "True")
        message = cond(st, "Invalid")["message"]
        assert "spec.template.spec.serviceAccountName" in message and "remove serviceAccountName" in message
        wait_event(apis, ns, "own-sa", "InvalidSpec", lambda t, r, m: r == "InvalidSpec" and "k8s" in m)
        assert not core.list_namespaced_pod(ns, label_selector="spotguard.dev/job=own-sa").items
        delete_jobs(apis, ns, pods=False)
    finally:
        op.stop()
        print(f"--- operator log ---\n{op.log_tail(60)}")
