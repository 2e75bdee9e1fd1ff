"""The k8s notice source's access: a job's own ServiceAccount bound to the chart's fixed ClusterRole."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from spotguard.operator import reconcile
from spotguard.operator.podbuilder import (
    DEFAULT_NOTICE_CLUSTER_ROLE,
    OperatorConfig,
    build_pods,
    notice_access,
    notice_binding_name,
    notice_service_account,
    pod_service_account,
)
from spotguard.operator.spec import SpecError, parse

RBAC = "rbac.authorization.k8s.io"


def raw_spec(notices: list[str] | None = None, *, nodes: int = 1, **pod: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "template": {"spec": {**pod, "containers": [{"name": "trainer", "image": "trainer:1"}]}},
        "checkpoint": {"storage": "s3://bucket/root"},
        "nodes": nodes,
    }
    if notices is not None:
        spec["preemption"] = {"notices": notices}
    return spec


def owner(job: str = "demo", uid: str = "uid-1") -> list[dict[str, Any]]:
    return [{"apiVersion": "spotguard.dev/v1alpha1", "kind": "TrainingJob", "name": job, "uid": uid,
             "controller": True, "blockOwnerDeletion": True}]  # fmt: skip


# --- the objects -------------------------------------------------------------------


def test_access_is_a_service_account_and_a_binding_of_the_fixed_cluster_role() -> None:
    spec = parse(raw_spec(["k8s", "aws"]))
    objs = notice_access("demo", "team-a", "uid-1", spec)
    assert [o["kind"] for o in objs] == ["ServiceAccount", "RoleBinding"]
    account, binding = objs
    assert account["apiVersion"] == "v1"
    assert account["metadata"]["name"] == "demo-spotguard-notices" == notice_service_account("demo")
    assert binding["apiVersion"] == f"{RBAC}/v1"
    assert binding["metadata"]["name"] == notice_binding_name("demo")
    assert binding["roleRef"] == {"apiGroup": RBAC, "kind": "ClusterRole", "name": DEFAULT_NOTICE_CLUSTER_ROLE}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-spotguard-notices",
                                    "namespace": "team-a"}]
    for o in objs:
        assert o["metadata"]["namespace"] == "team-a"
        assert o["metadata"]["ownerReferences"] == owner()
        assert o["metadata"]["labels"] == {"spotguard.dev/job": "demo", "app.kubernetes.io/managed-by": "spotguard"}
        assert "rules" not in o


def test_the_cluster_role_is_the_operators_setting() -> None:
    spec = parse(raw_spec(["k8s"]))
    binding = notice_access("demo", "ns", "uid-1", spec, cluster_role="rel-spotguard-pod-notices")[1]
    assert binding["roleRef"] == {"apiGroup": RBAC, "kind": "ClusterRole", "name": "rel-spotguard-pod-notices"}


def test_binding_name_is_not_the_name_of_an_older_operators_binding() -> None:
    # An older operator made a RoleBinding named like the account, to a Role; roleRef never
    # changes, so the binding to the ClusterRole needs a name of its own.
    assert notice_binding_name("demo") != notice_service_account("demo")
    assert notice_binding_name("demo").startswith("demo-")
    long = notice_binding_name("j" * 253)
    assert len(long) <= 253 and long != notice_binding_name("j" * 252)


def test_no_k8s_source_no_access_and_the_templates_account_stays() -> None:
    spec = parse(raw_spec(["aws"], serviceAccountName="trainer-sa"))
    assert notice_access("demo", "ns", "uid-1", spec) == []
    pod = build_pods("demo", "ns", "uid-1", spec, 1, OperatorConfig())[0]
    assert pod["spec"]["serviceAccountName"] == "trainer-sa"
    assert "serviceAccountName" not in build_pods("demo", "ns", "uid-1", parse(raw_spec()), 1, OperatorConfig())[0][
        "spec"]


def test_every_pod_of_a_gang_runs_as_the_jobs_own_account() -> None:
    spec = parse(raw_spec(["k8s"], nodes=3))
    pods = build_pods("gang", "ns", "uid-1", spec, 4, OperatorConfig())
    assert [p["spec"]["serviceAccountName"] for p in pods] == ["gang-spotguard-notices"] * 3
    assert pod_service_account("gang", spec) == "gang-spotguard-notices"
    # The same objects for every attempt: nothing names a pod.
    assert notice_access("gang", "ns", "uid-1", spec) == notice_access("gang", "ns", "uid-1", spec)
    assert "resourceNames" not in str(notice_access("gang", "ns", "uid-1", spec))


# --- the spec ----------------------------------------------------------------------


@pytest.mark.parametrize("field", ["serviceAccountName", "serviceAccount"])
@pytest.mark.parametrize("account", ["trainer-sa", "default"])
def test_own_service_account_with_the_k8s_source_is_refused(field: str, account: str) -> None:
    raw = raw_spec(["aws", "k8s"])
    raw["template"]["spec"][field] = account
    with pytest.raises(SpecError) as err:
        parse(raw)
    assert err.value.field == f"spec.template.spec.{field}"
    message = err.value.message
    assert f"remove {field}" in message and "k8s" in message and "spec.preemption.notices" in message
    assert "ServiceAccount" in message


def test_own_service_account_without_the_k8s_source_is_kept() -> None:
    spec = parse(raw_spec(["aws", "gce"], serviceAccountName="trainer-sa"))
    assert spec.template.spec["serviceAccountName"] == "trainer-sa"
    assert parse(raw_spec(["k8s"])).preemption.watches_own_pod


# --- the operator's calls ----------------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class Recorder:
    """Any API: records each call; ``conflict`` names the calls that answer 409."""

    def __init__(self, conflict: tuple[str, ...] = ()) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.conflict = conflict
        self.api_client = None

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            self.calls.append((name, args))
            if name in self.conflict:
                raise ApiError(409)

        return call


def context(core: Recorder) -> reconcile.Context:
    return reconcile.Context(core=core, custom=None, config=OperatorConfig(), metrics=None)  # type: ignore[arg-type]


def test_ensure_access_creates_the_account_then_the_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    core, rbac = Recorder(), Recorder()
    monkeypatch.setattr(reconcile, "_rbac", lambda ctx: rbac)
    objs = notice_access("demo", "ns", "uid-1", parse(raw_spec(["k8s"])), cluster_role="x-pod-notices")
    reconcile.ensure_access(context(core), objs)
    assert [c[0] for c in core.calls] == ["create_namespaced_service_account"]
    assert [c[0] for c in rbac.calls] == ["create_namespaced_role_binding"]
    assert rbac.calls[0][1] == ("ns", objs[1])


def test_ensure_access_keeps_what_exists_and_never_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    core = Recorder(conflict=("create_namespaced_service_account",))
    rbac = Recorder(conflict=("create_namespaced_role_binding",))
    monkeypatch.setattr(reconcile, "_rbac", lambda ctx: rbac)
    reconcile.ensure_access(context(core), notice_access("demo", "ns", "uid-1", parse(raw_spec(["k8s"]))))
    # An existing binding is this job's (same name, same content); an older operator's Role is left alone.
    assert [c[0] for c in core.calls] == ["create_namespaced_service_account"]
    assert [c[0] for c in rbac.calls] == ["create_namespaced_role_binding"]


def test_ensure_access_refuses_a_role(monkeypatch: pytest.MonkeyPatch) -> None:
    rbac = Recorder()
    monkeypatch.setattr(reconcile, "_rbac", lambda ctx: rbac)
    role = {"apiVersion": f"{RBAC}/v1", "kind": "Role", "metadata": {"name": "r", "namespace": "ns"}, "rules": []}
    with pytest.raises(ValueError):
        reconcile.ensure_access(context(Recorder()), [role])
    assert rbac.calls == []


def test_apply_binds_the_context_cluster_role(monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import UTC, datetime

    from spotguard.operator.decide import Decision

    seen: list[list[dict[str, Any]]] = []
    monkeypatch.setattr(reconcile, "ensure_access", lambda ctx, objs: seen.append(objs))
    monkeypatch.setattr(reconcile, "create_pod", lambda ctx, pod, uid: True)
    ctx = context(Recorder())
    assert ctx.notice_cluster_role == DEFAULT_NOTICE_CLUSTER_ROLE
    ctx.notice_cluster_role = "rel-pod-notices"
    job = {"metadata": {"namespace": "ns", "name": "demo", "uid": "uid-1"}, "status": {}}
    reconcile.apply(ctx, job, parse(raw_spec(["k8s"])), Decision(status={}, create_attempt=1), datetime.now(UTC))
    (objs,) = seen
    assert objs[1]["roleRef"]["name"] == "rel-pod-notices"


# --- the setting -------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    from spotguard.operator import cli

    top = argparse.ArgumentParser()
    cli.register(top.add_subparsers())
    return top


def test_cli_setting_and_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTGUARD_NOTICE_CLUSTER_ROLE", raising=False)
    assert parser().parse_args(["operator"]).notice_cluster_role == DEFAULT_NOTICE_CLUSTER_ROLE
    args = parser().parse_args(["operator", "--notice-cluster-role", "rel-spotguard-pod-notices"])
    assert args.notice_cluster_role == "rel-spotguard-pod-notices"
    monkeypatch.setenv("SPOTGUARD_NOTICE_CLUSTER_ROLE", "from-env")
    assert parser().parse_args(["operator"]).notice_cluster_role == "from-env"


def test_handlers_carry_the_setting() -> None:
    from spotguard.operator.handlers import OperatorOptions

    assert OperatorOptions().notice_cluster_role == DEFAULT_NOTICE_CLUSTER_ROLE
    assert OperatorOptions(notice_cluster_role="x").notice_cluster_role == "x"
