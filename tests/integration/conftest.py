"""Fixtures shared by the integration tests.

Helpers live in modules that are not tests: ``sidecar_helpers`` (the demo
trainer, ``spotguard sidecar``/``run`` as processes, metrics, the store
proxy), ``notice_fakes`` (fake cloud metadata servers), ``reference_runs``
(uninterrupted reference runs), ``ckpt_helpers`` and, for Kubernetes (also
used by ``bench``), ``testenv.kubetest``.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Plain asserts in the helper modules report their operands, as in the tests.
pytest.register_assert_rewrite("sidecar_helpers", "notice_fakes", "reference_runs", "testenv.kubetest")

from reference_runs import ReferenceRuns  # noqa: E402

from testenv import kubetest  # noqa: E402


@pytest.fixture(scope="module")
def apis(kube: Any) -> kubetest.Apis:
    """``(CoreV1Api, CustomObjectsApi)`` on the test control plane."""
    return kubetest.apis(kube)


@pytest.fixture(scope="module")
def crd(kube: Any) -> None:
    """The TrainingJob CRD, installed and served."""
    kubetest.install_crd(kube)


@pytest.fixture(scope="module")
def ns(request: pytest.FixtureRequest, apis: kubetest.Apis, crd: None) -> Iterator[str]:
    """A namespace of the module's own (named after its ``NS_PREFIX``), deleted after the module."""
    core, _ = apis
    name = kubetest.new_namespace(core, getattr(request.module, "NS_PREFIX", "t"))
    yield name
    core.delete_namespace(name)


@pytest.fixture(scope="module")
def operator(kube: Any, ns: str, apis: kubetest.Apis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An operator process watching ``ns`` on the test apiserver; its jobs deleted and its log's tail printed after."""
    op = kubetest.start_operator(kube, ns, tmp_path_factory.mktemp("operator") / f"operator-{ns}.log")
    try:
        yield op
        kubetest.delete_jobs(apis, ns, pods=False)
    finally:
        op.stop()
        print(f"--- operator log ({op.log_path}) ---\n{op.log_tail(60)}")


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReferenceRuns]:
    """Uninterrupted reference runs, each made at most once per session (see ``reference_runs``)."""
    runs = ReferenceRuns(tmp_path_factory.mktemp("references"))
    try:
        yield runs
    finally:
        runs.close()


@pytest.fixture
def memory() -> Iterator[Path]:
    """A staging directory of its own in ``/dev/shm`` (a tmpfs, as ``spotguard run`` uses), removed after the test."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm on this machine")
    path = shm / f"spotguard-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)
