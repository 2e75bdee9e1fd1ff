"""The chart's ``operator.allowedEndpoints``, rendered with the real helm binary and read by the operator's parser."""

from __future__ import annotations

import pytest

from testenv.chart import CHART, helm, operator_command, render


def flags(*sets: str) -> list[str]:
    return [a for a in operator_command(render(*sets)) if a.startswith("--allowed-endpoints")]


def test_by_default_no_endpoint_is_listed_the_cloud_only() -> None:
    assert flags() == []


def test_the_listed_endpoints_reach_the_operator_as_one_flag_it_parses() -> None:
    from spotguard.cli import build_parser
    from spotguard.operator.endpoints import parse_patterns

    sets = ("operator.allowedEndpoints={minio.storage.svc:9000,*.s3.internal}",)
    assert flags(*sets) == ["--allowed-endpoints=minio.storage.svc:9000,*.s3.internal"]
    cmd = operator_command(render(*sets))
    args = build_parser().parse_args(["operator", *cmd[2:]])
    assert parse_patterns(args.allowed_endpoints) == ("minio.storage.svc:9000", "*.s3.internal")


def test_an_operator_that_reads_no_storage_gets_no_list() -> None:
    assert flags("operator.readCheckpoints=false", "operator.allowedEndpoints={minio.svc}") == []


@pytest.mark.parametrize("bad", ["operator.allowedEndpoints={http://minio.svc}", "operator.allowedEndpoints=minio"])
def test_the_schema_refuses_what_is_no_endpoint_pattern(bad: str) -> None:
    result = helm("template", "rel", str(CHART), "--set", bad, check=False)
    assert result.returncode != 0, result.stdout[-500:]
