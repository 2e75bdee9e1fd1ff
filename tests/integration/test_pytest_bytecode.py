"""The suite's pytest sessions keep pytest's rewritten test modules, also where the environment says
PYTHONDONTWRITEBYTECODE: otherwise every session and xdist worker rewrites them all again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from testenv.cluster import RUN_MARKER

ROOT = Path(__file__).resolve().parents[2]


def test_a_session_under_pythondontwritebytecode_keeps_its_rewritten_test_modules(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    # A session of its own: without the outer session's run marker, whose services (those of the lanes
    # beside it too) still run while this one ends and checks for its leftovers.
    env = {k: v for k, v in os.environ.items() if k != RUN_MARKER} | {"PYTHONDONTWRITEBYTECODE": "1"}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider"]
    argv += ["--rootdir", str(ROOT), "-o", "addopts=", str(tmp_path / "test_inner.py")]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kept = [p.name for p in (tmp_path / "__pycache__").glob("test_inner.*pytest*.pyc")]
    assert kept, sorted(p.name for p in tmp_path.rglob("*"))
