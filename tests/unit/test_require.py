"""A missing tool, package or privilege: a skip that says what to install outside CI, a failure under CI."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from testenv.require import SETUP_HINT, require, require_module, require_root, require_tool

ABSENT = "spotguard-no-such-tool"


@pytest.mark.parametrize("value", ["true", "1", "TRUE", "yes"])
def test_a_missing_tool_fails_under_ci(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception) as failed:
        require_tool(ABSENT, "apt-get install it")
    assert f"{ABSENT} is not installed" in str(failed.value) and "apt-get install it" in str(failed.value)


@pytest.mark.parametrize("value", [None, "", "false", "0"])
def test_a_missing_tool_is_skipped_outside_ci_with_what_to_install(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.skip.Exception) as skipped:
        require_tool(ABSENT)
    assert f"{ABSENT} is not installed" in str(skipped.value)
    assert SETUP_HINT in str(skipped.value) and "make setup" in SETUP_HINT and "testenv/provision.sh" in SETUP_HINT


def test_a_tool_is_found_at_its_path_or_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CI", "true")
    assert require_tool("python3", path=sys.executable) == sys.executable
    assert require_tool("sh", path=tmp_path / "sh") == require_tool("sh")  # not there: the one on PATH
    with pytest.raises(pytest.fail.Exception, match="nor on PATH"):
        require_tool(ABSENT, path=tmp_path / ABSENT)


def test_packages_root_and_conditions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    assert require_module("json").dumps(1) == "1"
    with pytest.raises(pytest.skip.Exception, match="spotguard_no_such_module"):
        require_module("spotguard_no_such_module")
    require(True, "never reported")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="pod networks needs root"):
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
        require_root("pod networks")
    with pytest.raises(pytest.fail.Exception, match="spotguard_no_such_module"):
        require_module("spotguard_no_such_module")
