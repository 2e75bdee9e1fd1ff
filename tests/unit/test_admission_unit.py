"""The admission server's pure part: which TrainingJob updates are refused, and the injection's JSONPatch.

Patches are applied with ``jsonpatch`` (kopf's own dependency, an independent
RFC 6902 implementation), as the apiserver applies them: a path through a
missing member fails.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from spotguard.operator.admission import (
    ALLOW_RESTART_ANNOTATION,
    LEGACY_MUTATE_PATH,
    MUTATE_PATH,
    VALIDATE_PATH,
    escape_pointer,
    json_patch,
    mutate_pod,
    request_namespace,
    restart_refusal,
    review_response,
    validate_trainingjob,
    webhook_configurations,
)
from spotguard.operator.podbuilder import ANNOTATION_INJECTED, OperatorConfig

CFG = OperatorConfig(image="sg:test")


def job(
    *,
    storage: str = "s3://bkt-a/runs",
    attempt: int | None = 1,
    phase: str = "Running",
    annotations: dict[str, str] | None = None,
    gpus: int | None = None,
    **spec: Any,
) -> dict[str, Any]:
    trainer: dict[str, Any] = {"name": "trainer", "image": "t:1"}
    if gpus is not None:
        trainer["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    body: dict[str, Any] = {
        "apiVersion": "spotguard.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "llm", "namespace": "team", "annotations": annotations or {}},
        "spec": {"template": {"spec": {"containers": [trainer]}}, "checkpoint": {"storage": storage}, **spec},
        "status": {"phase": phase} if attempt is None else {"phase": phase, "attempt": attempt},
    }
    return body


def edited(old: dict[str, Any], **checkpoint: Any) -> dict[str, Any]:
    new = copy.deepcopy(old)
    new["spec"]["checkpoint"].update(checkpoint)
    return new


# --- which updates are refused ------------------------------------------------------


def test_changing_the_storage_of_a_running_job_is_refused_saying_what_it_would_do_and_how() -> None:
    old = job()
    message = restart_refusal(old, edited(old, storage="s3://bkt-b/runs"))
    assert message is not None
    assert (
        "changing spec.checkpoint.storage from s3://bkt-a/runs to s3://bkt-b/runs would restart training from nothing"
    ) in message
    assert (
        "s3://bkt-b/runs/team/llm has none of this job's checkpoints; they are in s3://bkt-a/runs/team/llm"
    ) in message
    assert f"{ALLOW_RESTART_ANNOTATION}=true" in message and "delete the job and create a new one" in message
    assert "copy everything under s3://bkt-a/runs/team/llm/ to s3://bkt-b/runs/team/llm/" in message
    assert "spotguard ckpt ls s3://bkt-b/runs/team/llm" in message


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"checkpoint": {"storage": "s3://bkt-a/runs", "endpoint": "https://other-store"}}, "spec.checkpoint.endpoint"),
        ({"nodes": 2}, "spec.nodes from 1 to 2"),
        ({"nprocPerNode": 8}, "spec.nprocPerNode from 1 to 8"),
    ],
)
def test_every_field_that_loses_or_reshards_progress_is_refused(change: dict[str, Any], field: str) -> None:
    old = job()
    new = copy.deepcopy(old)
    new["spec"].update(change)
    message = restart_refusal(old, new)
    assert message is not None and field in message, message
    assert ALLOW_RESTART_ANNOTATION in message


def test_a_world_size_change_says_it_reshards_with_the_sizes() -> None:
    old = job(nodes=2, nprocPerNode=4)
    new = copy.deepcopy(old)
    new["spec"]["nodes"] = 3
    message = restart_refusal(old, new)
    assert message is not None
    assert (
        "changing spec.nodes from 2 to 3 would resume at another world size (12 training processes instead of"
        " 8)" in message
    )
    assert "resharded, not resumed exactly" in message
    assert "copy everything" not in message  # nothing to copy: the checkpoints stay where they are


def test_the_same_world_size_laid_out_otherwise_passes() -> None:
    """The restore is exact when the number of ranks is the same, whatever the nodes."""
    old = job(nodes=2, nprocPerNode=4)
    new = copy.deepcopy(old)
    new["spec"].update(nodes=1, nprocPerNode=8)
    assert restart_refusal(old, new) is None
    new["spec"].update(nodes=1, nprocPerNode=4)
    message = restart_refusal(old, new)
    assert (
        message is not None and "spec.nodes from 2 to 1" in message and "(4 training processes instead of 8)" in message
    )


def test_processes_per_node_that_follow_the_gpu_limit_count_too() -> None:
    old = job(gpus=4)
    new = job(gpus=8)
    message = restart_refusal(old, new)
    assert message is not None
    assert "spec.nprocPerNode (the trainer's nvidia.com/gpu limit) from 4 to 8" in message
    # The same count written out explicitly changes nothing.
    assert restart_refusal(old, job(gpus=4, nprocPerNode=4)) is None


def test_several_changes_are_named_together() -> None:
    old = job()
    new = edited(old, storage="s3://bkt-b/x")
    new["spec"]["nodes"] = 2
    message = restart_refusal(old, new)
    assert message is not None and "spec.checkpoint.storage" in message and "spec.nodes from 1 to 2" in message


def test_the_annotation_in_the_update_lets_it_through() -> None:
    old = job()
    new = edited(old, storage="s3://bkt-b/runs")
    new["metadata"]["annotations"][ALLOW_RESTART_ANNOTATION] = "true"
    assert restart_refusal(old, new) is None
    new["metadata"]["annotations"][ALLOW_RESTART_ANNOTATION] = "yes"  # only "true" counts
    assert restart_refusal(old, new) is not None


@pytest.mark.parametrize(
    ("attempt", "phase"),
    [(None, "Pending"), (0, "Pending"), (0, "Suspended"), (1, "Succeeded"), (4, "Failed")],
)
def test_a_job_not_started_or_finished_may_change_anything(attempt: int | None, phase: str) -> None:
    old = job(attempt=attempt, phase=phase)
    new = edited(old, storage="s3://bkt-b/runs")
    new["spec"]["nodes"] = 4
    assert restart_refusal(old, new) is None


@pytest.mark.parametrize("phase", ["Pending", "Running", "Restarting", "Suspended"])
def test_a_started_job_is_guarded_in_every_unfinished_phase(phase: str) -> None:
    old = job(attempt=2, phase=phase)
    assert restart_refusal(old, edited(old, storage="s3://bkt-b/runs")) is not None


@pytest.mark.parametrize(
    "checkpoint",
    [
        {"checksum": "sha256"},  # every manifest names its own algorithm
        {"incremental": True},  # a restore reads chunked and whole-file checkpoints alike
        {"everySteps": 50, "everySeconds": 600},
        {"retention": {"keepLast": 9}},
        {"credentialsSecret": "other"},
        {"storage": "s3://bkt-a/runs/"},  # the same root: <storage>/<ns>/<job> is unchanged
    ],
)
def test_safe_changes_pass(checkpoint: dict[str, Any]) -> None:
    old = job()
    assert restart_refusal(old, edited(old, **checkpoint)) is None


def test_an_update_that_leaves_the_spec_alone_passes() -> None:
    """Status-only and metadata-only updates (kopf's finalizer and annotations, a user's label)."""
    old = job()
    new = copy.deepcopy(old)
    new["status"] = {"phase": "Restarting", "attempt": 2}
    new["metadata"]["labels"] = {"team": "x"}
    new["metadata"]["finalizers"] = ["spotguard.dev/finalizer"]
    assert restart_refusal(old, new) is None


def test_the_review_refuses_with_422_and_passes_status_and_other_operations() -> None:
    old = job()
    new = edited(old, storage="s3://bkt-b/runs")
    request = {"uid": "u1", "operation": "UPDATE", "namespace": "team", "oldObject": old, "object": new}
    response = validate_trainingjob(request)
    assert response["uid"] == "u1" and response["allowed"] is False
    assert response["status"]["code"] == 422 and "spec.checkpoint.storage" in response["status"]["message"]
    # The status subresource, a create, and a namespace this operator does not serve pass untouched.
    assert validate_trainingjob({**request, "subResource": "status"}) == {"uid": "u1", "allowed": True}
    assert validate_trainingjob({**request, "operation": "CREATE"})["allowed"] is True
    assert validate_trainingjob(request, namespaces=("other",))["allowed"] is True
    assert validate_trainingjob(request, namespaces=("team",))["allowed"] is False


# --- the injection's JSONPatch ----------------------------------------------------------


def labelled_pod(annotations: dict[str, str] | None, *, namespace: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p", "labels": {"spotguard.dev/inject": "true", "job-name": "train"}}
    if annotations is not None:
        meta["annotations"] = annotations
    if namespace:
        meta["namespace"] = namespace
    return {"metadata": meta, "spec": {"containers": [{"name": "main", "image": "x"}]}}


def admit(pod: dict[str, Any], namespace: str = "team") -> dict[str, Any]:
    return mutate_pod({"uid": "u", "operation": "CREATE", "namespace": namespace, "object": pod}, CFG)


def patched(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    result: dict[str, Any] = jsonpatch.apply_patch(pod, ops)
    return result


def test_the_patch_injects_the_sidecar_and_records_the_storage() -> None:
    pod = labelled_pod({"spotguard.dev/storage": "s3://bkt/r"})
    result = patched(pod, admit(pod))
    assert result["metadata"]["annotations"][ANNOTATION_INJECTED] == "s3://bkt/r/team/train"
    assert result["metadata"]["annotations"]["spotguard.dev/storage"] == "s3://bkt/r"
    assert [c["name"] for c in result["spec"]["containers"]] == ["main", "spotguard-sidecar"]
    assert [c["name"] for c in result["spec"]["initContainers"]] == ["spotguard-restore"]


def test_the_patch_for_a_pod_without_annotations_adds_the_whole_map() -> None:
    # A pod without annotations never gets this far (its storage annotation is required), so build the
    # patch from a pod that has them and apply it to one that has none: the map must be added whole.
    pod = labelled_pod({"spotguard.dev/storage": "s3://bkt/r"})
    bare = copy.deepcopy(pod)
    del bare["metadata"]["annotations"]
    ops = json_patch(bare, {"metadata": {"annotations": {ANNOTATION_INJECTED: "s3://x"}}})
    assert ops == [{"op": "add", "path": "/metadata/annotations", "value": {ANNOTATION_INJECTED: "s3://x"}}]
    assert jsonpatch.apply_patch(bare, ops)["metadata"]["annotations"] == {ANNOTATION_INJECTED: "s3://x"}
    # With annotations present, one key is added (its "/" escaped) and the others are kept.
    ops = json_patch(pod, {"metadata": {"annotations": {ANNOTATION_INJECTED: "s3://x"}}})
    assert ops == [{"op": "add", "path": "/metadata/annotations/spotguard.dev~1injected", "value": "s3://x"}]
    assert jsonpatch.apply_patch(pod, ops)["metadata"]["annotations"] == {
        "spotguard.dev/storage": "s3://bkt/r",
        ANNOTATION_INJECTED: "s3://x",
    }
    # Without metadata at all.
    assert json_patch({"spec": {}}, {"metadata": {"annotations": {"a": "b"}}}) == [
        {"op": "add", "path": "/metadata", "value": {"annotations": {"a": "b"}}}
    ]


def test_pointer_segments_are_escaped() -> None:
    assert escape_pointer("spotguard.dev/injected") == "spotguard.dev~1injected"
    assert escape_pointer("a~b/c") == "a~0b~1c"


def test_the_request_namespace_is_used_when_the_pod_has_none() -> None:
    pod = labelled_pod({"spotguard.dev/storage": "s3://bkt/r"})
    assert request_namespace({"namespace": "team-a", "object": pod}) == "team-a"
    assert (
        patched(pod, admit(pod, "team-a"))["metadata"]["annotations"][ANNOTATION_INJECTED] == "s3://bkt/r/team-a/train"
    )
    own = labelled_pod({"spotguard.dev/storage": "s3://bkt/r"}, namespace="own")
    assert request_namespace({"namespace": "", "object": own}) == "own"


def test_bad_annotations_are_refused_with_400_naming_the_annotation() -> None:
    response = admit(labelled_pod({"spotguard.dev/storage": "s3://bkt/r", "spotguard.dev/keep-last": "many"}))
    assert response["allowed"] is False and response["status"]["code"] == 400
    assert "metadata.annotations[spotguard.dev/keep-last]" in response["status"]["message"]
    assert response["status"]["message"].startswith("spotguard: ")


def test_pods_not_asking_for_injection_pass_unchanged() -> None:
    pod = labelled_pod({"spotguard.dev/storage": "s3://bkt/r"})
    pod["metadata"]["labels"]["spotguard.dev/inject"] = "false"
    assert admit(pod) == {"uid": "u", "allowed": True}
    request = {"uid": "u", "operation": "UPDATE", "namespace": "t", "object": labelled_pod({})}
    assert mutate_pod(request, CFG) == {"uid": "u", "allowed": True}


def test_reviews_are_answered_on_their_paths_in_their_version() -> None:
    pod = labelled_pod({"spotguard.dev/storage": "s3://bkt/r"})
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u", "operation": "CREATE", "namespace": "t", "object": pod},
    }
    for path in (MUTATE_PATH, LEGACY_MUTATE_PATH):
        status, body = review_response(path, review, CFG)
        assert status == 200 and body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
        assert body["response"]["uid"] == "u" and body["response"]["patchType"] == "JSONPatch"
    status, body = review_response(MUTATE_PATH, {**review, "apiVersion": "admission.k8s.io/v1beta1"}, CFG)
    assert body["apiVersion"] == "admission.k8s.io/v1beta1"
    status, body = review_response(VALIDATE_PATH, review, CFG)
    assert status == 200 and body["response"] == {"uid": "u", "allowed": True}
    assert review_response("/elsewhere", review, CFG)[0] == 404
    assert review_response(MUTATE_PATH, {"kind": "AdmissionReview"}, CFG)[0] == 400
    assert review_response(MUTATE_PATH, review, None)[0] == 503


def test_managed_configurations_point_at_the_server_and_trust_its_certificate() -> None:
    mutating, validating = webhook_configurations("sg", "https://127.0.0.1:9443", b"PEM")
    (m,) = mutating["webhooks"]
    (v,) = validating["webhooks"]
    assert m["clientConfig"] == {
        "url": "https://127.0.0.1:9443/mutate-pods",
        "caBundle": base64.b64encode(b"PEM").decode(),
    }
    assert v["clientConfig"]["url"] == "https://127.0.0.1:9443/validate-trainingjobs"
    assert v["rules"][0]["resources"] == ["trainingjobs"] and v["rules"][0]["operations"] == ["UPDATE"]
    assert v["failurePolicy"] == "Ignore" and m["failurePolicy"] == "Fail"
    assert m["objectSelector"] == {"matchLabels": {"spotguard.dev/inject": "true"}}


def test_managing_the_configurations_needs_the_address_the_apiserver_calls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from spotguard.cli import build_parser

    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_text("-")
    key.write_text("-")
    args = build_parser().parse_args(
        ["operator", "--webhook", "--webhook-cert", str(cert), "--webhook-key", str(key), "--webhook-manage", "sg"]
    )
    assert args.func(args) == 2
    assert "--webhook-manage needs --webhook-host" in capsys.readouterr().err
