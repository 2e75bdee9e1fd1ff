"""The lanes of ``make test``: which pytest arguments each lane adds to the command line's."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from testenv import cluster, lanes

ROOT = Path(__file__).resolve().parents[2]


def test_the_heavy_lane_collects_only_its_modules_unless_tests_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert lanes.lane_args("heavy", ["--durations=30", "-x"]) == list(lanes.HEAVY_MODULES)
    assert all((ROOT / m).is_file() for m in lanes.HEAVY_MODULES)
    # A command line that names tests keeps its own selection (the marker still splits it).
    assert lanes.lane_args("heavy", ["tests/unit"]) == []
    assert lanes.lane_args("heavy", ["tests/integration/test_fleet.py::test_x", "-q"]) == []


def test_the_light_lane_spreads_over_xdist_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lanes.WORKERS_ENV, "3")
    assert lanes.lane_args("light", ["tests/unit"]) == ["-n", "3", "--dist", "loadfile"]
    monkeypatch.setenv(lanes.WORKERS_ENV, "0")
    assert lanes.lane_args("light") == []


def test_real_nodes_have_a_lane_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert lanes.lane_args("real", ["--durations=30"]) == list(lanes.REAL_NODE_MODULES)
    assert all((ROOT / m).is_file() for m in lanes.REAL_NODE_MODULES)
    # Every module that starts real nodes is in it: no control plane has both kinds of node.
    starts_real_nodes = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if p.parent.name != "unit" and ("real_nodes" in p.read_text() or "RealNodes.start" in p.read_text())
    }
    assert starts_real_nodes <= set(lanes.REAL_NODE_MODULES)
    assert not set(lanes.REAL_NODE_MODULES) & set(lanes.HEAVY_MODULES)
    # Each test runs in exactly one lane.
    assert lanes.LANES["real"] == "realnodes"
    assert all("not realnodes" in expr for name, expr in lanes.LANES.items() if name != "real")


def test_the_real_lane_compares_a_sets_teardown_before_the_shared_set_starts() -> None:
    """The real-node modules share one set (``real_nodes``), started by the first test that asks for it: the
    module whose first test compares the machine before and after a set of its own runs first, while no
    other set runs (its comparison of the kubelet's fixed paths and sysctls needs that)."""
    first = (ROOT / lanes.REAL_NODE_MODULES[0]).read_text()
    tests = [line.split("(", 1)[0].removeprefix("def ") for line in first.splitlines() if line.startswith("def test_")]
    assert tests[0] == "test_realnodes_teardown", tests
    signature = first.split("def test_realnodes_teardown(", 1)[1].split(") ->", 1)[0]
    assert "real_nodes:" not in signature, signature  # it must not start the shared set itself


def test_the_real_lane_builds_its_images_first_and_fails_under_ci_when_it_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real lane's command builds the images (beside the other lanes), then runs its pytest session;
    a build that fails stops the lane under CI and leaves the tests to say so elsewhere."""
    import os
    import subprocess

    real = lanes.lane_command("real", "realnodes")
    assert real[:2] == ["bash", "-c"] and real[2].startswith(f"{sys.executable} -m testenv.images build || ")
    assert lanes.lane_command("light", "x", ["tests/unit"])[:3] == [sys.executable, "-m", "pytest"]
    monkeypatch.setattr(lanes, "PREPARE", {"real": ("no_such_module_here",)})
    cmd = lanes.lane_command("real", "realnodes", ["--co", "-q", "-p", "no:cacheprovider", "tests/unit/test_trials.py"])
    # Not this session's run marker: the session it starts would take this session's services for its own leftovers.
    env = {k: v for k, v in os.environ.items() if k not in ("CI", cluster.RUN_MARKER)}
    ran = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "no_such_module_here" in ran.stderr
    assert ran.returncode == 5, ran.stdout[-2000:]  # pytest ran: nothing there is marked realnodes
    ci = subprocess.run(cmd, cwd=ROOT, env={**env, "CI": "true"}, capture_output=True, text=True, timeout=120)
    assert ci.returncode == 1 and "deselected" not in ci.stdout, ci.stdout[-2000:]


def test_a_lane_ends_with_its_exit_status_and_the_cpu_time_of_its_whole_tree() -> None:
    """The lane's own process and a child it waited for each burn CPU: both count; the exit status is the
    lane's own; reaped once (its CPU time is then no longer known)."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    script = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {burn!r}])\n{burn}sys.exit(3)\n"
    p = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while (cpu := lanes.reap(p)) is None:
        assert time.monotonic() < deadline, "the lane never ended"
        time.sleep(0.05)
    assert p.returncode == 3 and p.poll() == 3
    assert cpu >= 0.6, cpu  # 0.3 s each, the child's counted once the lane waited for it
    assert lanes.reap(p) == 0.0
