"""The operator's RBAC as the real apiserver enforces it, after ``helm install`` of the chart.

The operator may create no ServiceAccount, no Role and no RoleBinding, and bind
nothing: an account that may create RoleBindings can bind any role whose rules
it holds, its own ClusterRole included, and RBAC cannot prevent that. Pods of
jobs with the k8s notice source get their own pod's disruption state from the
operator's notice relay instead, which the operator, run as the chart's
ServiceAccount, serves with the chart's rights (a TokenReview, a pod read).
"""

from __future__ import annotations

import json
import subprocess
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotguard import notice_relay
from spotguard.operator.testing import wait_for
from testenv.kubetest import (
    create_job,
    delete_jobs,
    fast_preemption,
    job_body,
    new_namespace,
    operator_process,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "spotguard"
RELEASE, NAMESPACE = "sgrbac", "sgrbac-system"
FULLNAME = f"{RELEASE}-spotguard"
OPERATOR = f"system:serviceaccount:{NAMESPACE}:{FULLNAME}"
NO_NODE = {"spotguard.dev/test-no-node": "true"}


def tool(kube: Any, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(kube.bin_dir / name), "--kubeconfig", str(kube.kubeconfig), *args],
        capture_output=True,
        text=True,
        check=check,
        timeout=180,
    )


def install(kube: Any, *sets: str) -> None:
    """Install (or upgrade to) the chart with exactly these values (no CRD: the ``crd`` fixture made it)."""
    args = [
        "upgrade",
        "--install",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--create-namespace",
        "--reset-values",
        "--set",
        "crds.enabled=false",
        # No process node may run this operator: it would act on other tests' objects.
        "--set-string",
        "nodeSelector.spotguard\\.dev/no-such-node=true",
        # Nothing serves the validating webhook here (its Service has no pod, and this apiserver reaches no
        # Service IP): every TrainingJob update of every test would wait out its timeout.
        "--set",
        "webhook.validation.enabled=false",
    ]
    for s in sets:
        args += ["--set", s]
    result = tool(kube, "helm", *args, check=False)
    assert result.returncode == 0, result.stderr


def can_i(kube: Any, verb: str, what: str, namespace: str | None, user: str = OPERATOR) -> bool:
    args = ["auth", "can-i", verb, what, f"--as={user}"] + (["-n", namespace] if namespace else [])
    return tool(kube, "kubectl", *args, check=False).stdout.strip() == "yes"


def bind(kube: Any, namespace: str, kind: str, role: str, user: str = OPERATOR) -> subprocess.CompletedProcess[str]:
    """Create (server-side dry run, so every check runs and nothing stays) a RoleBinding as ``user``."""
    return tool(
        kube,
        "kubectl",
        "create",
        "rolebinding",
        "probe",
        f"--{kind}={role}",
        "-n",
        namespace,
        f"--serviceaccount={namespace}:someone",
        "--dry-run=server",
        f"--as={user}",
        "-o",
        "name",
        check=False,
    )


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


def granted(kube: Any, namespace: str | None) -> dict[str, set[str]]:
    """Every resource the operator may act on in ``namespace`` (cluster-wide rules too) and its verbs, as the
    apiserver itself lists them (``kubectl auth can-i --list``: a SelfSubjectRulesReview)."""
    args = ["auth", "can-i", "--list", f"--as={OPERATOR}"] + (["-n", namespace] if namespace else [])
    out = tool(kube, "kubectl", *args).stdout
    rules: dict[str, set[str]] = {}
    for line in out.splitlines()[1:]:
        if not line.strip() or line[0].isspace():  # non-resource URLs
            continue
        rules.setdefault(line.split()[0], set()).update(line[line.rindex("[") + 1 : line.rindex("]")].split())
    assert "pods" in rules or "tokenreviews.authentication.k8s.io" in rules, out  # the table was read
    return rules


def assert_makes_no_account_role_or_binding(kube: Any, namespaces: tuple[str | None, ...]) -> None:
    """As the operator: no Role, RoleBinding or ServiceAccount made or changed, nothing bound or escalated."""
    for ns in namespaces:
        rules = granted(kube, ns)
        assert not [r for r in rules if "rbac.authorization.k8s.io" in r or r == "*"], (ns, rules)
        assert not [r for r in rules if r.split("/")[0] in ("serviceaccounts", "roles", "rolebindings")], (ns, rules)
        assert not [r for r, verbs in rules.items() if verbs & {"bind", "escalate", "impersonate", "*"}], (ns, rules)
        # The same, asked one by one as an admission would.
        assert not can_i(kube, "create", "rolebindings.rbac.authorization.k8s.io", ns), ns
        assert not can_i(kube, "bind", "clusterroles.rbac.authorization.k8s.io", ns), ns
        assert not can_i(kube, "create", "serviceaccounts", ns), ns


def test_default_install_makes_no_account_role_or_binding(
    kube: Any, release: None, namespaces: tuple[str, str]
) -> None:
    install(kube)
    ns = namespaces[0]
    assert_makes_no_account_role_or_binding(kube, (ns, namespaces[1], None))
    # The notice relay's TokenReviews (cluster-scoped); no ClusterRole for pods is installed any more.
    assert can_i(kube, "create", "tokenreviews.authentication.k8s.io", None)
    assert not can_i(kube, "create", "subjectaccessreviews.authorization.k8s.io", None)
    assert tool(kube, "kubectl", "get", "clusterrole", f"{FULLNAME}-pod-notices", check=False).returncode != 0

    # What the apiserver does with real requests (dry run: every check, nothing stored).
    for other in ("cluster-admin", "admin", "edit", "view"):
        assert forbidden(bind(kube, ns, "clusterrole", other)), other
    role = tool(
        kube,
        "kubectl",
        "create",
        "role",
        "probe",
        "--verb=get",
        "--resource=secrets",
        "-n",
        ns,
        "--dry-run=server",
        f"--as={OPERATOR}",
        check=False,
    )
    assert forbidden(role), role.stdout + role.stderr
    account = tool(
        kube,
        "kubectl",
        "create",
        "serviceaccount",
        "probe",
        "-n",
        ns,
        "--dry-run=server",
        f"--as={OPERATOR}",
        check=False,
    )
    assert forbidden(account), account.stdout + account.stderr


def test_default_install_cannot_bind_its_own_cluster_role(
    kube: Any, release: None, namespaces: tuple[str, str]
) -> None:
    """The gap RBAC cannot close (an account that creates RoleBindings may bind any role whose rules it holds,
    its own included): closed by the operator's having no right to create RoleBindings at all."""
    install(kube)
    result = bind(kube, namespaces[0], "clusterrole", FULLNAME)
    if result.returncode != 0 and not forbidden(result):
        raise RuntimeError(f"the probe failed: {result.stderr}")
    assert forbidden(result), f"created: {result.stdout}"
    install(kube, f"operator.watchNamespaces={{{namespaces[0]}}}")
    for kind, role in (("clusterrole", FULLNAME), ("role", FULLNAME)):
        result = bind(kube, namespaces[0], kind, role)
        assert forbidden(result), f"{kind} {role}: created: {result.stdout}{result.stderr}"


def test_watched_namespaces_keep_secrets_there(kube: Any, release: None, namespaces: tuple[str, str]) -> None:
    watched, other = namespaces
    install(kube, f"operator.watchNamespaces={{{watched}}}")
    assert can_i(kube, "get", "secrets", watched)
    assert not can_i(kube, "get", "secrets", other) and not can_i(kube, "get", "secrets", "default")
    assert not can_i(kube, "get", "secrets", None) and not can_i(kube, "list", "secrets", watched)
    assert can_i(kube, "get", "pods", watched) and not can_i(kube, "get", "pods", other)
    assert can_i(kube, "create", "tokenreviews.authentication.k8s.io", None)
    assert_makes_no_account_role_or_binding(kube, (watched, other))
    assert forbidden(bind(kube, watched, "clusterrole", "cluster-admin"))
    assert forbidden(bind(kube, watched, "role", FULLNAME))
    # The webhook's certificate (on by default): in the release's namespace only its own Secret is read and
    # updated (create cannot be limited to a name), and only the chart's two webhook configurations patched.
    own = f"secrets/{FULLNAME}-webhook-tls"
    assert can_i(kube, "get", own, NAMESPACE) and can_i(kube, "update", own, NAMESPACE)
    assert can_i(kube, "create", "secrets", NAMESPACE) and not can_i(kube, "create", "secrets", other)
    assert not can_i(kube, "get", "secrets/other", NAMESPACE) and not can_i(kube, "list", "secrets", NAMESPACE)
    assert not can_i(kube, "delete", own, NAMESPACE) and not can_i(kube, "get", own, other)
    for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
        hooks = f"{kind}.admissionregistration.k8s.io"
        assert can_i(kube, "patch", f"{hooks}/{FULLNAME}", None) and can_i(kube, "get", f"{hooks}/{FULLNAME}", None)
        assert not can_i(kube, "patch", f"{hooks}/other", None) and not can_i(kube, "create", hooks, None)
    # readCheckpoints=false: no Secret anywhere.
    install(kube, f"operator.watchNamespaces={{{watched}}}", "operator.readCheckpoints=false")
    assert not can_i(kube, "get", "secrets", watched)
    assert can_i(kube, "create", "tokenreviews.authentication.k8s.io", None)


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
        FULLNAME, NAMESPACE, {"spec": {"expirationSeconds": 3600}}
    ).status.token
    cfg = json.loads(Path(kube.kubeconfig).read_text())
    cfg["users"] = [{"name": "operator", "user": {"token": token}}]
    for ctx in cfg["contexts"]:
        ctx["context"]["user"] = "operator"
    path.write_text(json.dumps(cfg))
    path.chmod(0o600)
    return path


def no_node_job(name: str, storage: str, **pod: Any) -> dict[str, Any]:
    trainer = {"name": "trainer", "image": "trainer:1", "command": ["python", "-m", "train"]}
    return job_body(
        name,
        storage,
        trainer,
        node_selector=NO_NODE,
        pod_spec=pod or None,
        every_steps=10,
        preemption=fast_preemption(3, 1, 5, notices=["k8s"]),
    )


def relay_get(port: int, token: str) -> tuple[int, dict[str, Any]]:
    from spotguard.sidecar.notices import http_request

    resp = http_request(
        f"http://127.0.0.1:{port}{notice_relay.POD_PATH}", headers={"Authorization": f"Bearer {token}"}, timeout=10
    )
    return resp.status, json.loads(resp.body)


def test_operator_with_the_charts_rbac_relays_a_notice_pods_disruption(
    kube: Any, apis: tuple[Any, Any], release: None, namespaces: tuple[str, str], tmp_path: Path
) -> None:
    """The operator, as the chart's ServiceAccount: the pod of a job with the k8s source runs as its template's
    account (with no rights), its sidecar alone gets a token for the relay, and the relay answers it."""
    from kubernetes import client

    core, _ = apis
    rbac = client.RbacAuthorizationV1Api(core.api_client)
    ns, other = namespaces
    install(kube, f"operator.watchNamespaces={{{ns}}}")
    store = f"file://{tmp_path}/store"
    # A job an older operator served: the account and RoleBinding it made, owned by the job. They stay as
    # they are (the operator may not touch them) and go with the job.
    legacy = create_job(apis, ns, no_node_job("legacy", store))
    owner = [
        {
            "apiVersion": "spotguard.dev/v1alpha1",
            "kind": "TrainingJob",
            "name": "legacy",
            "uid": legacy["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    old = {"name": "legacy-spotguard-pod-notices", "namespace": ns, "ownerReferences": owner}
    rbac.create_namespaced_role_binding(
        ns,
        {
            "metadata": old,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
            "subjects": [{"kind": "ServiceAccount", "name": "legacy-spotguard-notices", "namespace": ns}],
        },
    )
    old_version = rbac.read_namespaced_role_binding(old["name"], ns).metadata.resource_version
    core.create_namespaced_service_account(ns, {"metadata": {"name": "trainer-sa"}})
    wait_for(lambda: core.read_namespaced_service_account("trainer-sa", ns).secrets, "trainer-sa's token", timeout=60)

    cfg = service_account_kubeconfig(kube, core, tmp_path / "operator.kubeconfig")
    as_operator = types.SimpleNamespace(env=lambda: {"KUBECONFIG": str(cfg)})
    op = operator_process(as_operator, ns, tmp_path / "operator.log")
    url = f"http://127.0.0.1:{op.liveness_port}{notice_relay.POD_PATH}"
    op.argv += ["--notice-url", url]
    op.start()
    try:
        create_job(apis, ns, no_node_job("notice", store, serviceAccountName="trainer-sa"))
        pod = wait_for(lambda: core.read_namespaced_pod("notice-a1", ns), "pod notice-a1", timeout=60)
        assert pod.spec.service_account_name == "trainer-sa"
        (volume,) = [v for v in pod.spec.volumes if v.name == "spotguard-notice-token"]
        (projected,) = volume.projected.sources
        assert projected.service_account_token.audience == notice_relay.AUDIENCE
        assert projected.service_account_token.expiration_seconds == 600
        for c in pod.spec.containers:
            mounted = any(m.name == "spotguard-notice-token" for m in c.volume_mounts or [])
            assert mounted == (c.name == "spotguard-sidecar"), c.name
        sidecar = next(c for c in pod.spec.containers if c.name == "spotguard-sidecar")
        assert {e.name: e.value for e in sidecar.env}["SPOTGUARD_NOTICE_URL"] == url
        # The pod's account may do nothing: the relay reads for it.
        user = f"system:serviceaccount:{ns}:trainer-sa"
        for verb, what in (("get", "pods/notice-a1"), ("list", "pods"), ("create", "events"), ("get", "secrets")):
            assert not can_i(kube, verb, what, ns, user), (verb, what)
        # No account, Role or binding made for the job; the older operator's binding untouched.
        accounts = [a.metadata.name for a in core.list_namespaced_service_account(ns).items]
        assert sorted(accounts) == ["default", "trainer-sa"]
        assert sorted(b.metadata.name for b in rbac.list_namespaced_role_binding(ns).items) == [old["name"], FULLNAME]
        assert rbac.read_namespaced_role_binding(old["name"], ns).metadata.resource_version == old_version
        legacy_pod = wait_for(lambda: core.read_namespaced_pod("legacy-a1", ns), "pod legacy-a1", timeout=60)
        assert legacy_pod.spec.service_account_name == "default"

        # The relay, with the chart's rights only (TokenReview, pod get), answers the pod's bound token.
        token = core.create_namespaced_service_account_token(
            "trainer-sa",
            ns,
            {
                "spec": {
                    "audiences": [notice_relay.AUDIENCE],
                    "expirationSeconds": 600,
                    "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": "notice-a1", "uid": pod.metadata.uid},
                }
            },
        )
        status, view = relay_get(op.liveness_port, token.status.token)
        assert status == 200 and view["metadata"]["uid"] == pod.metadata.uid, view
        # What Kubernetes 1.26+ writes before it evicts or shuts down (1.20 never does: written as it would).
        core.patch_namespaced_pod_status(
            "notice-a1",
            ns,
            {
                "status": {
                    "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}]
                }
            },
        )
        wait_for(
            lambda: any(
                c["type"] == "DisruptionTarget"
                for c in relay_get(op.liveness_port, token.status.token)[1]["status"]["conditions"]
            ),
            "the DisruptionTarget through the relay",
            timeout=15,
        )
        # A pod of a namespace the operator does not serve: refused before anything is read.
        stranger = core.create_namespaced_pod(
            other,
            {
                "metadata": {"name": "stranger", "labels": {"spotguard.dev/job": "x"}},
                "spec": {"nodeSelector": NO_NODE, "containers": [{"name": "c", "image": "busybox"}]},
            },
        )
        foreign = core.create_namespaced_service_account_token(
            "default",
            other,
            {
                "spec": {
                    "audiences": [notice_relay.AUDIENCE],
                    "expirationSeconds": 600,
                    "boundObjectRef": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": "stranger",
                        "uid": stranger.metadata.uid,
                    },
                }
            },
        )
        assert relay_get(op.liveness_port, foreign.status.token)[0] == 403
        core.delete_namespaced_pod("stranger", other, grace_period_seconds=0)
        delete_jobs(apis, ns, pods=False)
        assert "Forbidden" not in op.log_tail(200), op.log_tail(200)
    finally:
        op.stop()
        print(f"--- operator log ---\n{op.log_tail(60)}")
