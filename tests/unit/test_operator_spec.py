"""Table tests of the TrainingJob spec parser: good specs parse, bad ones name the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from spotguard.operator.spec import Backoff, parse
from spotguard.operator.specfields import SpecError


def base() -> dict[str, Any]:
    return {
        "template": {
            "spec": {"containers": [{"name": "trainer", "image": "trainer:1", "command": ["python", "train.py"]}]}
        },
        "checkpoint": {"storage": "s3://bucket/jobs", "credentialsSecret": {"name": "s3-creds"}},
    }


def with_(path: str, value: Any) -> dict[str, Any]:
    spec = base()
    keys = path.split(".")
    node: Any = spec
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {})
    if isinstance(node, list):
        node[int(keys[-1])] = value
    elif value is _DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return spec


_DELETE = object()


def test_defaults() -> None:
    spec = parse(base())
    assert spec.checkpoint.storage == "s3://bucket/jobs"
    assert spec.checkpoint.checksum == "crc32c"
    assert spec.checkpoint.credentials_secret is not None
    assert spec.checkpoint.credentials_secret.access_key_id_key == "AWS_ACCESS_KEY_ID"
    assert spec.preemption.max_preemptions == 20 and spec.preemption.backoff_limit == 3
    assert spec.preemption.grace_period_seconds == 60
    assert spec.suspend is False
    assert spec.checkpoint.job_uri("ns", "job") == "s3://bucket/jobs/ns/job"


def test_full_spec() -> None:
    spec = base()
    spec["checkpoint"].update(
        {
            "endpoint": "http://127.0.0.1:9000",
            "region": "eu-west-1",
            "everySteps": 50,
            "everySeconds": 300,
            "checksum": "sha256",
            "retention": {"keepLast": 2, "keepBest": 1, "bestMetric": "val_loss", "bestMode": "min", "keepEvery": 1000},
        }
    )
    spec["preemption"] = {
        "maxPreemptions": 3,
        "backoffLimit": 1,
        "gracePeriodSeconds": 30,
        "backoff": {"initialSeconds": 1, "maxSeconds": 4, "factor": 2},
    }
    spec["sidecar"] = {"image": "sg:dev", "metricsPort": 9500}
    spec["suspend"] = True
    p = parse(spec)
    assert p.checkpoint.every_steps == 50 and p.checkpoint.every_seconds == 300.0
    assert p.checkpoint.retention.metric == "val_loss" and p.checkpoint.retention.keep_every == 1000
    assert p.preemption.backoff == Backoff(1.0, 4.0, 2.0)
    assert p.sidecar.image == "sg:dev" and p.sidecar.metrics_port == 9500
    assert p.suspend is True


def test_storage_root_trailing_slash() -> None:
    p = parse(with_("checkpoint.storage", "file:///mnt/ckpt/"))
    assert p.checkpoint.job_uri("default", "demo") == "file:///mnt/ckpt/default/demo"


BAD: list[tuple[str, dict[str, Any] | None, str]] = [
    ("no spec", None, "spec"),
    ("no template", with_("template", _DELETE), "spec.template"),
    ("no checkpoint", with_("checkpoint", _DELETE), "spec.checkpoint"),
    ("no storage", with_("checkpoint.storage", _DELETE), "spec.checkpoint.storage"),
    ("az:// storage", with_("checkpoint.storage", "az://bucket/x"), "spec.checkpoint.storage"),
    ("relative file storage", with_("checkpoint.storage", "file://relative/x"), "spec.checkpoint.storage"),
    ("bad bucket", with_("checkpoint.storage", "s3://B/x"), "spec.checkpoint.storage"),
    ("no containers", with_("template.spec.containers", []), "spec.template.spec.containers"),
    (
        "container without name",
        with_("template.spec.containers.0", {"image": "x"}),
        "spec.template.spec.containers[0].name",
    ),
    (
        "reserved container name",
        with_("template.spec.containers.0", {"name": "spotguard-sidecar"}),
        "spec.template.spec.containers[0].name",
    ),
    (
        "bad container name",
        with_("template.spec.containers.0", {"name": "Trainer_1"}),
        "spec.template.spec.containers[0].name",
    ),
    (
        "reserved volume",
        with_("template.spec.volumes", [{"name": "spotguard", "emptyDir": {}}]),
        "spec.template.spec.volumes[0].name",
    ),
    ("restartPolicy OnFailure", with_("template.spec.restartPolicy", "OnFailure"), "spec.template.spec.restartPolicy"),
    ("everySteps 0", with_("checkpoint.everySteps", 0), "spec.checkpoint.everySteps"),
    ("everySteps string", with_("checkpoint.everySteps", "10"), "spec.checkpoint.everySteps"),
    ("checksum md5", with_("checkpoint.checksum", "md5"), "spec.checkpoint.checksum"),
    ("endpoint without scheme", with_("checkpoint.endpoint", "minio:9000"), "spec.checkpoint.endpoint"),
    ("secret without name", with_("checkpoint.credentialsSecret", {}), "spec.checkpoint.credentialsSecret.name"),
    ("keepBest without metric", with_("checkpoint.retention", {"keepBest": 2}), "spec.checkpoint.retention.bestMetric"),
    ("bestMode median", with_("checkpoint.retention", {"bestMode": "median"}), "spec.checkpoint.retention.bestMode"),
    ("negative maxPreemptions", with_("preemption.maxPreemptions", -1), "spec.preemption.maxPreemptions"),
    ("grace 0", with_("preemption.gracePeriodSeconds", 0), "spec.preemption.gracePeriodSeconds"),
    (
        "backoff max < initial",
        with_("preemption.backoff", {"initialSeconds": 10, "maxSeconds": 1}),
        "spec.preemption.backoff.maxSeconds",
    ),
    ("suspend string", with_("suspend", "yes"), "spec.suspend"),
    ("metrics port too big", with_("sidecar.metricsPort", 70000), "spec.sidecar.metricsPort"),
    ("labels not strings", with_("template.metadata", {"labels": {"a": 1}}), "spec.template.metadata.labels.a"),
]


@pytest.mark.parametrize(("case", "spec", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_specs_name_the_field(case: str, spec: dict[str, Any] | None, field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse(spec)
    assert err.value.field == field
    assert str(err.value).startswith(field + ": ")


def test_parse_does_not_alias_the_input() -> None:
    raw = base()
    p = parse(raw)
    raw["template"]["spec"]["containers"][0]["image"] = "changed"
    assert p.template.spec["containers"][0]["image"] == "trainer:1"
    assert copy.deepcopy(p) == p


@pytest.mark.parametrize(
    ("backoff", "n", "delay"),
    [
        (Backoff(10, 300, 2), 0, 0.0),
        (Backoff(10, 300, 2), 1, 10.0),
        (Backoff(10, 300, 2), 2, 20.0),
        (Backoff(10, 300, 2), 6, 300.0),
        (Backoff(0, 60, 2), 5, 0.0),
        (Backoff(5, 5, 1), 9, 5.0),
    ],
)
def test_backoff(backoff: Backoff, n: int, delay: float) -> None:
    assert backoff.delay(n) == delay


def test_notices_parse_in_order() -> None:
    spec = parse(with_("preemption.notices", ["k8s", "aws"]))
    assert spec.preemption.notices == ("k8s", "aws") and spec.preemption.watches_own_pod
    assert parse(base()).preemption.notices == ()
    assert not parse(with_("preemption.notices", ["gce", "azure"])).preemption.watches_own_pod


@pytest.mark.parametrize(
    ("notices", "field", "words"),
    [
        (["aws", "ibm"], "spec.preemption.notices[1]", "must be one of aws, gce, azure, k8s, not 'ibm'"),
        (["AWS"], "spec.preemption.notices[0]", "not 'AWS'"),
        (["aws", "aws"], "spec.preemption.notices[1]", "'aws' is listed twice"),
        ("aws,gce", "spec.preemption.notices", "must be a list"),
        ([3], "spec.preemption.notices[0]", "not 3"),
    ],
)
def test_unknown_notices_are_refused_naming_the_field(notices: Any, field: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse(with_("preemption.notices", notices))
    assert err.value.field == field and words in err.value.message


def test_notice_sources_match_the_sidecars() -> None:
    from spotguard.operator.spec import NOTICE_SOURCES
    from spotguard.sidecar.notices import KNOWN_SOURCES

    assert NOTICE_SOURCES == KNOWN_SOURCES


def test_expose_credentials_to_trainer() -> None:
    assert parse(base()).checkpoint.expose_credentials_to_trainer is False
    assert parse(with_("checkpoint.exposeCredentialsToTrainer", True)).checkpoint.expose_credentials_to_trainer
    with pytest.raises(SpecError) as err:
        parse(with_("checkpoint.exposeCredentialsToTrainer", "yes"))
    assert err.value.field == "spec.checkpoint.exposeCredentialsToTrainer"


def test_incremental() -> None:
    assert parse(base()).checkpoint.incremental is True  # on by default
    assert parse(with_("checkpoint.incremental", True)).checkpoint.incremental is True
    assert parse(with_("checkpoint.incremental", False)).checkpoint.incremental is False
    with pytest.raises(SpecError) as err:
        parse(with_("checkpoint.incremental", "true"))
    assert err.value.field == "spec.checkpoint.incremental"


def test_crd_declares_incremental_with_the_parsers_default() -> None:
    from pathlib import Path

    import yaml

    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "trainingjob.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = spec["properties"]["checkpoint"]["properties"]["incremental"]
    assert field["type"] == "boolean"
    assert field["default"] is parse(base()).checkpoint.incremental is True
