"""spotguard's injected containers run as Pod Security "restricted" asks; the user's containers are left alone.

Every field is checked on the rendered pod, on both paths that inject: the
pod builder (TrainingJobs) and the admission webhook (labelled pods).
"""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest

from spotguard.operator.admission import mutate_pod
from spotguard.operator.podbuilder import OperatorConfig, build_pod
from spotguard.operator.spec import parse
from spotguard.operator.specfields import SpecError

INJECTED = ("spotguard-restore", "spotguard-sidecar")
RESTRICTED = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "runAsGroup": 65532,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
    "readOnlyRootFilesystem": True,
}
TRAINER_CONTEXT = {"privileged": False, "capabilities": {"add": ["SYS_PTRACE"]}}


def template(
    pod_context: dict[str, Any] | None = None, trainer_context: dict[str, Any] | None = None
) -> dict[str, Any]:
    trainer: dict[str, Any] = {"name": "trainer", "image": "trainer:1", "command": ["python", "train.py"]}
    if trainer_context is not None:
        trainer["securityContext"] = trainer_context
    spec: dict[str, Any] = {"containers": [trainer]}
    if pod_context is not None:
        spec["securityContext"] = pod_context
    return spec


def built(native: bool, pod_spec: dict[str, Any], **checkpoint: Any) -> dict[str, Any]:
    spec = parse({"template": {"spec": pod_spec}, "checkpoint": {"storage": "s3://bucket/r", **checkpoint}})
    return build_pod("demo", "ns", "uid", spec, 1, OperatorConfig(image="sg:test", native_sidecar=native))["spec"]


def webhooked(native: bool, pod_spec: dict[str, Any]) -> dict[str, Any]:
    pod = {
        "metadata": {
            "name": "p",
            "labels": {"spotguard.dev/inject": "true", "job-name": "train"},
            "annotations": {"spotguard.dev/storage": "s3://bucket/r"},
        },
        "spec": pod_spec,
    }
    cfg = OperatorConfig(image="sg:test", native_sidecar=native)
    response = mutate_pod({"uid": "u", "operation": "CREATE", "namespace": "ns", "object": pod}, cfg)
    assert response["allowed"], response
    ops = json.loads(base64.b64decode(response["patch"]))
    [spec_op] = [op for op in ops if op["path"] == "/spec"]
    spec: dict[str, Any] = spec_op["value"]
    return spec


def containers(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


PATHS = [pytest.param(built, id="builder"), pytest.param(webhooked, id="webhook")]


@pytest.mark.parametrize("render", PATHS)
@pytest.mark.parametrize("native", [False, True])
def test_every_injected_container_is_restricted(render: Any, native: bool) -> None:
    spec = render(native, template())
    by_name = containers(spec)
    for name in INJECTED:
        assert by_name[name]["securityContext"] == RESTRICTED, name
    assert "securityContext" not in by_name.get("trainer", by_name.get("main", {}))
    assert "securityContext" not in spec  # the pod's own context stays the template's (none)


@pytest.mark.parametrize("render", PATHS)
@pytest.mark.parametrize("native", [False, True])
def test_a_read_only_root_gets_a_writable_tmp_and_nothing_else_changes(render: Any, native: bool) -> None:
    spec = render(native, template())
    by_name = containers(spec)
    assert spec["volumes"].count({"name": "spotguard-tmp", "emptyDir": {}}) == 1
    for name in INJECTED:
        mounts = {m["mountPath"]: m for m in by_name[name]["volumeMounts"]}
        assert mounts["/tmp"] == {"name": "spotguard-tmp", "mountPath": "/tmp"}, name
        # Every path it writes is a volume: the checkpoints and control files, its temporary files.
        writable = {p for p, m in mounts.items() if not m.get("readOnly")}
        assert {"/var/lib/spotguard", "/tmp"} <= writable, name
    assert all(m["name"] != "spotguard-tmp" for m in by_name["trainer"]["volumeMounts"])


@pytest.mark.parametrize("render", PATHS)
def test_the_trainer_keeps_its_own_context(render: Any) -> None:
    spec = render(False, template({"fsGroup": 2000}, copy.deepcopy(TRAINER_CONTEXT)))
    assert containers(spec)["trainer"]["securityContext"] == TRAINER_CONTEXT
    assert spec["securityContext"] == {"fsGroup": 2000}


@pytest.mark.parametrize(
    ("pod_context", "trainer_context", "uid", "gid"),
    [
        (None, None, 65532, 65532),
        ({"runAsUser": 1000}, None, 1000, 65532),
        ({"runAsUser": 1000, "runAsGroup": 100}, None, 1000, 100),
        ({"runAsUser": 1000, "runAsGroup": 100}, {"runAsUser": 1001}, 1001, 100),
        (None, {"runAsUser": 1001, "runAsGroup": 101}, 1001, 101),
        # Root is never taken over: spotguard's containers stay non-root.
        ({"runAsUser": 0, "runAsGroup": 0}, None, 65532, 65532),
        (None, {"runAsUser": 0}, 65532, 65532),
        ({"runAsUser": True}, None, 65532, 65532),
    ],
)
@pytest.mark.parametrize("render", PATHS)
def test_the_user_is_the_templates_unless_root(
    render: Any, pod_context: dict[str, Any] | None, trainer_context: dict[str, Any] | None, uid: int, gid: int
) -> None:
    spec = render(False, template(pod_context, trainer_context))
    for name in INJECTED:
        context = containers(spec)[name]["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"], context["runAsNonRoot"]) == (uid, gid, True)


def test_with_every_optional_volume_the_context_is_the_same() -> None:
    spec = built(False, template(), memoryStaging=True, staging={"emptyDir": {"sizeLimit": "10Gi"}})
    for name in INJECTED:
        assert containers(spec)[name]["securityContext"] == RESTRICTED


def test_a_template_may_not_use_the_tmp_volume_name() -> None:
    pod_spec = template()
    pod_spec["volumes"] = [{"name": "spotguard-tmp", "emptyDir": {}}]
    with pytest.raises(SpecError, match="reserved"):
        parse({"template": {"spec": pod_spec}, "checkpoint": {"storage": "s3://bucket/r"}})
