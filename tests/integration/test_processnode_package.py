"""The process node package: one module per idea, the names others use still at the top, a light launcher."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = (
    "api",
    "podspec",
    "container",
    "processes",
    "pod",
    "node",
    "agent",
    "control",
    "kubeletapi",
    "cli",
    "podnet",
    "hostservices",
    "hosts",
)


def run_python(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n{code}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_one_module_per_idea_and_the_old_names_at_the_top() -> None:
    package = ROOT / "testenv" / "processnode"
    assert package.is_dir() and not (ROOT / "testenv" / "processnode.py").exists()
    assert {p.stem for p in package.glob("*.py")} >= set(MODULES)
    names = "ProcessNodes, SHUTDOWN_MESSAGE, log_tail, container_init, LaunchSpec, PreemptError, Kube, main"
    out = run_python(f"from testenv.processnode import {names}; print(ProcessNodes.__module__, log_tail(b'a\\nb'))")
    assert out.split() == ["testenv.processnode.control", "b'a\\nb'"]


def test_container_launcher_loads_only_what_it_needs() -> None:
    """A container's launcher (and its shim, which lives as long as the container) imports no agent code."""
    out = run_python(
        "import testenv.processnode.container\n"
        "print(sorted(m for m in sys.modules if m.startswith('testenv.processnode.') or m == 'http.server'))"
    )
    assert out.strip() == "['testenv.processnode.container']"


def test_cli_runs_as_a_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "testenv.processnode", "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert all(cmd in out.stdout for cmd in ("run", "preempt", "nodes"))
