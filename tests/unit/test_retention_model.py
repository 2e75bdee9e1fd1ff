"""One retention model: a job's ``spec.checkpoint.retention`` is the sidecar's ``RetentionPolicy``.

Users write the spec's names (``keepLast``, ``keepBest``, ``bestMetric``,
``bestMode``, ``keepEvery``; 0 turns a rule off); the operator maps them to
:class:`~spotguard.checkpoint.store.retention.RetentionPolicy` (None turns a rule
off), hands it to the pod as ``SPOTGUARD_*`` variables, and the sidecar reads
back the very same policy.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from spotguard.checkpoint.store.retention import RetentionPolicy
from spotguard.operator.podbuilder import OperatorConfig, build_pod
from spotguard.operator.spec import SIDECAR_CONTAINER, parse
from spotguard.operator.specfields import SpecError

SPEC: dict[str, Any] = {
    "template": {"spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]}},
    "checkpoint": {"storage": "s3://bucket/root", "credentialsSecret": {"name": "s3"}},
}


def with_retention(retention: dict[str, Any] | None) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    if retention is not None:
        spec["checkpoint"]["retention"] = retention
    return spec


@pytest.mark.parametrize(
    ("retention", "want"),
    [
        (None, RetentionPolicy(keep_last=3)),
        ({}, RetentionPolicy(keep_last=3)),
        ({"keepBest": 0, "keepEvery": 0}, RetentionPolicy(keep_last=3)),
        (
            {"keepLast": 2, "keepBest": 1, "bestMetric": "val_loss", "bestMode": "max", "keepEvery": 1000},
            RetentionPolicy(keep_last=2, keep_best=1, metric="val_loss", mode="max", keep_every=1000),
        ),
        ({"keepBest": 4, "bestMetric": "loss"}, RetentionPolicy(keep_last=3, keep_best=4, metric="loss")),
    ],
)
def test_the_spec_s_retention_is_the_sidecar_s_policy(retention: dict[str, Any] | None, want: RetentionPolicy) -> None:
    job = parse(with_retention(retention))
    assert job.checkpoint.retention == want
    pod = build_pod("demo", "team-a", "uid-1", job, 1, OperatorConfig(image="spotguard:test"))
    containers = [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]
    sidecar = next(c for c in containers if c["name"] == SIDECAR_CONTAINER)
    env = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e}
    assert RetentionPolicy.from_env(env) == want


@pytest.mark.parametrize(
    ("retention", "field"),
    [
        ({"keepBest": 2}, "spec.checkpoint.retention.bestMetric"),
        ({"bestMode": "median"}, "spec.checkpoint.retention.bestMode"),
        ({"keepLast": 0}, "spec.checkpoint.retention.keepLast"),
        ({"keepEvery": -1}, "spec.checkpoint.retention.keepEvery"),
    ],
)
def test_a_bad_retention_names_its_field(retention: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse(with_retention(retention))
    assert err.value.field == field


@pytest.mark.parametrize(
    "policy",
    [
        RetentionPolicy(),
        RetentionPolicy(keep_last=1),
        RetentionPolicy(keep_last=5, keep_best=2, metric="acc", mode="max", keep_every=10),
        RetentionPolicy(keep_best=0, metric="loss"),
    ],
)
def test_to_env_reads_back(policy: RetentionPolicy) -> None:
    assert RetentionPolicy.from_env(policy.to_env()) == policy
