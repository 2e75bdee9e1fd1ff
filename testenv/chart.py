"""The Helm chart rendered by the real helm binary, for the tests (no tests here).

``render`` leaves out the users' aggregated roles unless the values name them:
most chart tests are about the operator's own objects and rights.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "charts" / "spotguard"


def helm_bin() -> str:
    from testenv.cluster import bin_dir
    from testenv.require import require_tool

    return require_tool("helm", path=bin_dir() / "helm")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_bin(), *args], capture_output=True, text=True, check=check, timeout=120)


def render(*sets: str) -> list[dict[str, Any]]:
    """The chart's objects (release ``rel`` in ``spotguard-system``), without the user roles unless
    ``sets`` name them (tests/unit/test_chart_platform.py covers those)."""
    args = ["template", "rel", str(CHART), "--namespace", "spotguard-system"]
    if not any(s.startswith("userRoles.") for s in sets):
        sets = ("userRoles.create=false", *sets)
    for s in sets:
        args += ["--set", s]
    docs = [d for d in yaml.safe_load_all(helm(*args).stdout) if d]
    for d in docs:
        assert d.get("apiVersion") and d.get("kind") and d["metadata"].get("name"), d
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def operator_command(docs: list[dict[str, Any]]) -> list[str]:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    cmd: list[str] = containers[0]["command"]
    return cmd
