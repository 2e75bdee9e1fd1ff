"""One storage URI grammar: storage, the operator's spec check and the CRD accept and refuse the same URIs.

The table (``tests/storage_uris.json``) is shared with
``tests/integration/test_storage_uri_crd.py``, which sends each row to a real
apiserver as a TrainingJob.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from spotguard.operator.spec import parse_storage
from spotguard.operator.specfields import SpecError
from spotguard.storage import StorageError, open_storage
from spotguard.storage.uri import MAX_URI_LENGTH, STORAGE_URI_PATTERN, StorageURI, parse_storage_uri

ROOT = Path(__file__).resolve().parents[2]
TABLE: list[dict[str, Any]] = json.loads((ROOT / "tests" / "storage_uris.json").read_text(encoding="utf-8"))
ROWS = [pytest.param(row["uri"], row["accepted"], id=row["why"]) for row in TABLE]
# Clients are made, never used: no request leaves this process.
OPTIONS = {
    "s3": {"region": "us-east-1", "endpoint_url": "http://127.0.0.1:9"},
    "gs": {"endpoint_url": "http://127.0.0.1:9"},
}


def crd_storage_schema(path: Path) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text(encoding="utf-8"))
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field: dict[str, Any] = spec["properties"]["checkpoint"]["properties"]["storage"]
    return field


SCHEMA = crd_storage_schema(ROOT / "crds" / "trainingjob.yaml")


def crd_accepts(uri: str) -> bool:
    """The CRD's checks as the apiserver runs them: Go's regexp ``MatchString`` (a search, where ``$``
    matches only at the very end: Python's ``\\Z``) and ``maxLength`` in characters."""
    pattern = SCHEMA["pattern"]
    assert pattern.endswith("$") and pattern.count("$") == 1
    return len(uri) <= SCHEMA["maxLength"] and re.search(pattern[:-1] + r"\Z", uri) is not None


def storage_accepts(uri: str) -> bool:
    try:
        open_storage(uri, **OPTIONS.get(uri[:2], {}))
    except StorageError:
        return False
    return True


def operator_accepts(uri: str) -> bool:
    try:
        parse_storage(uri, "spec.checkpoint.storage")
    except SpecError as exc:
        assert exc.field == "spec.checkpoint.storage"
        return False
    return True


def grammar_accepts(uri: str) -> bool:
    try:
        parse_storage_uri(uri)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("uri", "accepted"), ROWS)
def test_storage_the_operator_and_the_crd_agree(uri: str, accepted: bool) -> None:
    assert {
        "grammar": grammar_accepts(uri),
        "storage": storage_accepts(uri),
        "operator": operator_accepts(uri),
        "crd": crd_accepts(uri),
    } == dict.fromkeys(("grammar", "storage", "operator", "crd"), accepted)


def test_the_crd_carries_the_grammar() -> None:
    assert SCHEMA["pattern"] == STORAGE_URI_PATTERN and SCHEMA["maxLength"] == MAX_URI_LENGTH
    chart = crd_storage_schema(ROOT / "charts" / "spotguard" / "files" / "trainingjob.yaml")
    assert chart["pattern"] == STORAGE_URI_PATTERN


def test_the_table_covers_both_answers_for_each_scheme() -> None:
    seen = {(row["uri"].partition("://")[0], row["accepted"]) for row in TABLE}
    assert {("s3", True), ("s3", False), ("gs", True), ("gs", False), ("file", True), ("file", False)} <= seen


@pytest.mark.parametrize(
    ("uri", "want"),
    [
        ("s3://bucket//a/b/", StorageURI("s3", "bucket", "a/b")),
        ("s3://My_Bucket", StorageURI("s3", "My_Bucket", "")),
        ("gs://b.c.d/x/.y", StorageURI("gs", "b.c.d", "x/.y")),
        ("file:///mnt/ckpt/", StorageURI("file", "", "/mnt/ckpt/")),
    ],
)
def test_parts(uri: str, want: StorageURI) -> None:
    assert parse_storage_uri(uri) == want


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3://bucket/a/../b", "invalid prefix in 's3://bucket/a/../b'"),
        ("s3:///x", "no bucket in 's3:///x': use s3://BUCKET/PREFIX"),
        ("gs://Bucket/x", "invalid bucket name 'Bucket' in 'gs://Bucket/x': GCS bucket names are"),
        ("s3://a/x", "invalid bucket name 'a' in 's3://a/x': S3 bucket names are 3-255"),
        ("file://host/x", "file URI with a host is not supported"),
        ("file:relative", "file URI must be absolute"),
        ("s3://bucket/x\n", "control character"),
        ("s3://bucket/" + "k" * 2000, "longer than 1024 characters"),
        ("az://bucket", "unsupported storage URI 'az://bucket': use s3://BUCKET[/PREFIX]"),
    ],
)
def test_a_refusal_says_what_is_wrong(uri: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_storage_uri(uri)
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_storage(uri, "spec.checkpoint.storage")
