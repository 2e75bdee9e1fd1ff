"""testenv.pytest_cpu: each test phase's CPU, its child processes' included, listed most first."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# One test burns CPU in a child process it waits for, one in its fixture's teardown, one does nothing.
_TESTS = """
import subprocess, sys
import pytest

BURN = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass"

@pytest.fixture
def burns_at_teardown():
    yield
    subprocess.run([sys.executable, "-c", BURN], check=True)

def test_child_burns():
    subprocess.run([sys.executable, "-c", BURN], check=True)

def test_idle(burns_at_teardown):
    pass

def test_nothing():
    pass
"""


def _run(tmp_path: Path, *args: str) -> dict[tuple[str, str], float]:
    (tmp_path / "test_burn.py").write_text(_TESTS)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "testenv.pytest_cpu", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "SPOTGUARD_TEST_CPU_TOP": "9"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = proc.stdout.split("most CPU 9 test phases", 1)[1].splitlines()[1:]
    found = {}
    for line in listed:
        m = re.match(r"\s*([\d.]+)s (\w+)\s+test_burn\.py::(\w+)$", line)
        if m:
            found[(m.group(3), m.group(2))] = float(m.group(1))
    assert re.search(r"CPU of all 9 phases: \d+ s", proc.stdout), proc.stdout
    return found


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_the_phases_that_spent_cpu_in_child_processes_are_listed_first(tmp_path: Path, workers: list[str]) -> None:
    found = _run(tmp_path, *workers)
    top = sorted(found.items(), key=lambda kv: -kv[1])
    assert {name for name, _ in top[:2]} == {("test_child_burns", "call"), ("test_idle", "teardown")}, top
    assert all(seconds >= 0.5 for _, seconds in top[:2]), top
    assert found[("test_nothing", "call")] < 0.3
