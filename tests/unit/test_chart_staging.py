"""The chart's ``staging.hostPathPrefix``: passed to the operator when set, refused when it would allow anything."""

from __future__ import annotations

import pytest

from testenv.chart import CHART, helm, operator_command, render


def test_no_prefix_by_default_so_host_path_staging_is_refused() -> None:
    assert not any(a.startswith("--staging-host-path-prefix") for a in operator_command(render()))


def test_the_prefix_reaches_the_operator() -> None:
    cmd = operator_command(render("staging.hostPathPrefix=/mnt/nvme"))
    assert "--staging-host-path-prefix=/mnt/nvme" in cmd


@pytest.mark.parametrize("bad", ["/", "mnt/nvme", "/mnt/../etc", "/mnt/nvme/", "//mnt", "/mnt/./x"])
def test_the_schema_refuses_a_prefix_that_is_not_a_clean_absolute_directory(bad: str) -> None:
    result = helm("template", "rel", str(CHART), "--set", f"staging.hostPathPrefix={bad}", check=False)
    assert result.returncode != 0, bad
    assert "hostPathPrefix" in result.stderr, result.stderr
