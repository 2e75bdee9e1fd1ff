"""The CRD's storage URI check, as a real apiserver runs it, against the grammar's table.

Every row of ``tests/storage_uris.json`` becomes a TrainingJob: the rows the
grammar (``spotguard.storage.uri``) accepts are created, the others refused
by the OpenAPI validation with the field named. The unit test
``tests/unit/test_storage_uri.py`` checks storage and the operator's spec
check against the same table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spotguard.storage.uri import is_storage_uri
from testenv.kubetest import create_job, no_node_job

NS_PREFIX = "uri"
TABLE: list[dict[str, Any]] = json.loads(
    (Path(__file__).resolve().parents[1] / "storage_uris.json").read_text(encoding="utf-8")
)


def test_the_apiserver_accepts_and_refuses_as_the_grammar_does(apis: tuple[Any, Any], ns: str) -> None:
    from kubernetes.client.exceptions import ApiException

    disagree: list[str] = []
    for i, row in enumerate(TABLE):
        uri, accepted = row["uri"], row["accepted"]
        assert is_storage_uri(uri) is accepted, row["why"]
        try:
            create_job(apis, ns, no_node_job(f"uri-{i}", uri))
        except ApiException as exc:
            if exc.status != 422 or "spec.checkpoint.storage" not in (exc.body or ""):
                raise
            if accepted:
                disagree.append(f"refused, the grammar accepts: {row['why']}: {uri!r}: {exc.body}")
        else:
            if not accepted:
                disagree.append(f"created, the grammar refuses: {row['why']}: {uri!r}")
    assert disagree == []
