"""The webhook's pure part: annotations to an injection, errors naming the annotation."""

from __future__ import annotations

from typing import Any

import pytest

from spotguard.operator.podbuilder import OperatorConfig
from spotguard.operator.specfields import SpecError
from spotguard.operator.webhook import injection_for_pod, job_name_of, mutated_pod

CFG = OperatorConfig(image="sg:test")


def pod(annotations: dict[str, str], labels: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"annotations": annotations, "labels": labels or {"job-name": "train"}, **meta},
        "spec": {"containers": [{"name": "main", "image": "x"}], "terminationGracePeriodSeconds": 45},
    }


def test_injection_from_annotations() -> None:
    inj = injection_for_pod(
        pod(
            {
                "spotguard.dev/storage": "s3://bucket/runs",
                "spotguard.dev/credentials-secret": "creds",
                "spotguard.dev/save-every-steps": "10",
                "spotguard.dev/save-every-seconds": "90",
                "spotguard.dev/checksum": "sha256",
                "spotguard.dev/keep-last": "5",
                "spotguard.dev/endpoint": "http://127.0.0.1:9000",
            }
        ),
        "team",
        CFG,
    )
    assert inj.storage_uri == "s3://bucket/runs/team/train" and inj.job == "train"
    assert inj.checkpoint.every_steps == 10 and inj.checkpoint.every_seconds == 90.0
    assert inj.checkpoint.checksum == "sha256" and inj.checkpoint.retention.keep_last == 5
    assert inj.checkpoint.credentials_secret is not None and inj.checkpoint.credentials_secret.name == "creds"
    assert inj.grace_period_seconds == 45 and inj.image == "sg:test"


@pytest.mark.parametrize(
    ("annotations", "field"),
    [
        ({}, "metadata.annotations[spotguard.dev/storage]"),
        ({"spotguard.dev/storage": "gs://x"}, "metadata.annotations[spotguard.dev/storage]"),
        (
            {"spotguard.dev/storage": "s3://bucket/x", "spotguard.dev/save-every-steps": "often"},
            "metadata.annotations[spotguard.dev/save-every-steps]",
        ),
        (
            {"spotguard.dev/storage": "s3://bucket/x", "spotguard.dev/save-every-steps": "0"},
            "metadata.annotations[spotguard.dev/save-every-steps]",
        ),
        (
            {"spotguard.dev/storage": "s3://bucket/x", "spotguard.dev/checksum": "md5"},
            "metadata.annotations[spotguard.dev/checksum]",
        ),
    ],
)
def test_errors_name_the_annotation(annotations: dict[str, str], field: str) -> None:
    with pytest.raises(SpecError) as err:
        injection_for_pod(pod(annotations), "ns", CFG)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("meta", "name"),
    [
        ({"annotations": {"spotguard.dev/job-name": "explicit"}, "labels": {"job-name": "j"}}, "explicit"),
        ({"labels": {"job-name": "batch-job"}}, "batch-job"),
        ({"labels": {"batch.kubernetes.io/job-name": "new-label"}}, "new-label"),
        ({"labels": {"jobset.sigs.k8s.io/jobset-name": "js"}}, "js"),
        ({"labels": {}, "ownerReferences": [{"kind": "ReplicaSet", "name": "rs-1", "controller": True}]}, "rs-1"),
        ({"labels": {}}, None),
    ],
)
def test_job_name(meta: dict[str, Any], name: str | None) -> None:
    assert job_name_of({"metadata": meta}) == name


def test_mutated_pod_is_injected_once() -> None:
    p = pod({"spotguard.dev/storage": "file:///mnt/ckpt"})
    spec, uri = mutated_pod(p, "ns", CFG)
    assert uri == "file:///mnt/ckpt/ns/train"
    assert [c["name"] for c in spec["containers"]] == ["main", "spotguard-sidecar"]
    again, _ = mutated_pod({**p, "spec": spec}, "ns", CFG)
    assert again == spec


@pytest.mark.parametrize(("value", "exposed"), [("true", True), ("false", False), (None, False)])
def test_trainer_credentials_by_annotation(value: str | None, exposed: bool) -> None:
    ann = {"spotguard.dev/storage": "s3://bkt/p", "spotguard.dev/credentials-secret": "s3"}
    if value is not None:
        ann["spotguard.dev/expose-credentials-to-trainer"] = value
    spec, _uri = mutated_pod(pod(ann), "ns", CFG)
    main = {e["name"] for e in spec["containers"][0]["env"]}
    assert ("AWS_SECRET_ACCESS_KEY" in main) is exposed
    sidecar = next(c for c in spec["containers"] if c["name"] == "spotguard-sidecar")
    assert "AWS_SECRET_ACCESS_KEY" in {e["name"] for e in sidecar["env"]}


def test_trainer_credentials_annotation_must_be_a_boolean() -> None:
    ann = {"spotguard.dev/storage": "s3://bkt/p", "spotguard.dev/expose-credentials-to-trainer": "yes"}
    with pytest.raises(SpecError) as err:
        injection_for_pod(pod(ann), "ns", CFG)
    assert err.value.field == "metadata.annotations[spotguard.dev/expose-credentials-to-trainer]"


# --- pods of a JobSet or an indexed Job: one checkpoint prefix for all nodes ----------------

STORAGE = {"spotguard.dev/storage": "s3://bucket/runs", "spotguard.dev/credentials-secret": "s3"}


def jobset_pod(replicated_job: str, job_index: int, completion_index: int, restart: int = 0) -> dict[str, Any]:
    """A pod as the JobSet controller creates it (its child Job named <jobset>-<rjob>-<index>)."""
    child = f"trainer-{replicated_job}-{job_index}"
    labels = {
        "spotguard.dev/inject": "true",
        "jobset.sigs.k8s.io/jobset-name": "trainer",
        "jobset.sigs.k8s.io/replicatedjob-name": replicated_job,
        "jobset.sigs.k8s.io/job-index": str(job_index),
        "jobset.sigs.k8s.io/restart-attempt": str(restart),
        "batch.kubernetes.io/job-name": child,
        "job-name": child,
        "batch.kubernetes.io/job-completion-index": str(completion_index),
    }
    return {
        "metadata": {
            "name": f"{child}-{completion_index}-x{job_index}q",
            "labels": labels,
            "annotations": {**STORAGE, "jobset.sigs.k8s.io/restart-attempt": str(restart)},
            "ownerReferences": [{"kind": "Job", "name": child, "controller": True}],
        },
        "spec": {
            "containers": [{"name": "node", "image": "x", "command": ["torchrun", "train.py"]}],
            "terminationGracePeriodSeconds": 120,
        },
    }


def env_of(spec: dict[str, Any], container: str) -> dict[str, Any]:
    c = next(c for c in [*spec.get("initContainers", []), *spec["containers"]] if c["name"] == container)
    return {e["name"]: e.get("value") for e in c["env"]}


def test_jobset_pods_share_one_prefix_whatever_their_job_or_index() -> None:
    pods = [
        jobset_pod("workers", 0, 0),
        jobset_pod("workers", 0, 1),
        jobset_pod("workers", 1, 0),
        jobset_pod("driver", 0, 0),
    ]
    results = [mutated_pod(p, "team", CFG) for p in pods]
    assert {uri for _spec, uri in results} == {"s3://bucket/runs/team/trainer"}
    for spec, _uri in results:
        # The restore init container and the sidecar read the same prefix.
        assert env_of(spec, "spotguard-restore")["SPOTGUARD_STORAGE_URI"] == "s3://bucket/runs/team/trainer"
        assert env_of(spec, "spotguard-sidecar")["SPOTGUARD_STORAGE_URI"] == "s3://bucket/runs/team/trainer"
        assert env_of(spec, "node")["SPOTGUARD_JOB"] == "trainer"


def test_jobset_restart_attempt_is_the_attempt() -> None:
    spec, _uri = mutated_pod(jobset_pod("workers", 1, 0, restart=3), "team", CFG)
    for name in ("node", "spotguard-restore", "spotguard-sidecar"):
        assert env_of(spec, name)["SPOTGUARD_ATTEMPT"] == "3"
    # Only the annotation (older JobSet versions, or a label dropped): still read.
    p = jobset_pod("workers", 0, 0, restart=2)
    del p["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"]
    assert injection_for_pod(p, "team", CFG).attempt == 2
    # Plain pods and indexed Job pods have no attempt number.
    assert injection_for_pod(pod(STORAGE), "team", CFG).attempt is None
    p["metadata"]["annotations"]["jobset.sigs.k8s.io/restart-attempt"] = "not-a-number"
    assert injection_for_pod(p, "team", CFG).attempt is None


def test_indexed_job_pods_share_one_prefix() -> None:
    def indexed(index: int) -> dict[str, Any]:
        labels = {
            "spotguard.dev/inject": "true",
            "batch.kubernetes.io/job-name": "ddp",
            "job-name": "ddp",
            "batch.kubernetes.io/job-completion-index": str(index),
        }
        return {
            "metadata": {
                "name": f"ddp-{index}-abcde",
                "labels": labels,
                "annotations": {**STORAGE, "batch.kubernetes.io/job-completion-index": str(index)},
            },
            "spec": {"containers": [{"name": "node", "image": "x"}]},
        }

    (spec0, uri0), (spec1, uri1) = mutated_pod(indexed(0), "ns", CFG), mutated_pod(indexed(1), "ns", CFG)
    assert uri0 == uri1 == "s3://bucket/runs/ns/ddp"
    assert env_of(spec0, "spotguard-sidecar") == env_of(spec1, "spotguard-sidecar")
    assert "SPOTGUARD_ATTEMPT" not in env_of(spec0, "node")
    # Only the newer label (the legacy job-name label gone).
    only_new = indexed(2)
    del only_new["metadata"]["labels"]["job-name"]
    assert mutated_pod(only_new, "ns", CFG)[1] == "s3://bucket/runs/ns/ddp"


def test_job_name_annotation_wins_over_jobset_and_job() -> None:
    p = jobset_pod("workers", 1, 0)
    p["metadata"]["annotations"]["spotguard.dev/job-name"] = "llm-pretrain"
    inj = injection_for_pod(p, "team", CFG)
    assert inj.job == "llm-pretrain" and inj.storage_uri == "s3://bucket/runs/team/llm-pretrain"


def test_jobset_name_from_the_annotation_when_the_label_is_absent() -> None:
    p = jobset_pod("workers", 1, 0)
    del p["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"]
    p["metadata"]["annotations"]["jobset.sigs.k8s.io/jobset-name"] = "trainer"
    assert job_name_of(p) == "trainer"


def test_jobset_pod_injection_is_idempotent() -> None:
    p = jobset_pod("workers", 1, 1, restart=1)
    spec, uri = mutated_pod(p, "team", CFG)
    again, uri2 = mutated_pod({**p, "spec": spec}, "team", CFG)
    assert again == spec and uri2 == uri
    node_env = [e["name"] for e in spec["containers"][0]["env"]]
    assert node_env.count("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") == 1 and node_env.count("SPOTGUARD_ATTEMPT") == 1


def test_torchrun_shutdown_timeout_is_the_grace_period_unless_set() -> None:
    spec, _uri = mutated_pod(jobset_pod("workers", 0, 0), "team", CFG)
    assert env_of(spec, "node")["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "120"
    assert spec["terminationGracePeriodSeconds"] == 120
    # spotguard's own containers run no torchrun.
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in env_of(spec, "spotguard-sidecar")
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in env_of(spec, "spotguard-restore")
    # The user's own value wins, in any container; the default grace period otherwise.
    p = jobset_pod("workers", 0, 0)
    p["spec"]["containers"][0]["env"] = [{"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": "300"}]
    p["spec"]["containers"].append({"name": "logger", "image": "y"})
    del p["spec"]["terminationGracePeriodSeconds"]
    spec, _uri = mutated_pod(p, "team", CFG)
    assert env_of(spec, "node")["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "300"
    assert env_of(spec, "logger")["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "60"
    assert [e["name"] for e in spec["containers"][0]["env"]].count("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") == 1


@pytest.mark.parametrize(("value", "incremental"), [("true", True), ("false", False), (None, True)])
def test_incremental_by_annotation(value: str | None, incremental: bool) -> None:
    ann = {"spotguard.dev/storage": "s3://bkt/p"}
    if value is not None:
        ann["spotguard.dev/incremental"] = value
    assert injection_for_pod(pod(ann), "ns", CFG).checkpoint.incremental is incremental
    spec, _uri = mutated_pod(pod(ann), "ns", CFG)
    sidecar = next(c for c in spec["containers"] if c["name"] == "spotguard-sidecar")
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env.get("SPOTGUARD_INCREMENTAL") == (None if incremental else "false")  # absent: the default, on
    assert "SPOTGUARD_INCREMENTAL" not in {e["name"] for e in spec["containers"][0]["env"]}


def test_incremental_annotation_must_be_a_boolean() -> None:
    ann = {"spotguard.dev/storage": "s3://bkt/p", "spotguard.dev/incremental": "yes"}
    with pytest.raises(SpecError) as err:
        injection_for_pod(pod(ann), "ns", CFG)
    assert err.value.field == "metadata.annotations[spotguard.dev/incremental]"


def test_an_injected_sidecar_fails_its_pod_after_a_preemption() -> None:
    """A Job learns that a pod did not finish only from its phase: the webhook's sidecar exits 143 then."""
    spec, _uri = mutated_pod(pod({"spotguard.dev/storage": "s3://bkt/p"}), "ns", CFG)
    assert env_of(spec, "spotguard-sidecar")["SPOTGUARD_PREEMPTED_EXIT_CODE"] == "143"
    assert "SPOTGUARD_PREEMPTED_EXIT_CODE" not in env_of(spec, "main")
