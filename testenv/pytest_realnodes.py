"""Pytest plugin: ``real_nodes``, nodes with a real kubelet and containerd (``testenv.realnode``).

Registered by ``tests/conftest.py`` (``pytest_plugins``). The session fixture
starts ``SPOTGUARD_TEST_REAL_NODES`` nodes (default 2: pod-to-pod traffic
needs two) on the ``kube`` control plane, waits until they are Ready with
their GPUs, and tears them down at the end of the session, also when tests
fail, leaving nothing on the machine. Pods pull from the registry that
``real_nodes_registry`` names (none by default: the nodes have the ``pause``
and ``busybox`` images); a module overrides that fixture to use another.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from testenv.processnode.api import ApiError, Kube
from testenv.realnode import RealNodes, kubelet_path
from testenv.require import require_root, require_tool


def require_real_nodes() -> None:
    """Skip (fail in CI) where real nodes cannot run: root, the kubelet, containerd, runc, the CNI plugins."""
    require_root("real nodes (kubelet + containerd)")
    require_tool("kubelet", path=kubelet_path())
    for tool in ("containerd", "ctr", "runc", "containerd-shim-runc-v2"):
        require_tool(tool)
    require_tool("bridge", path="/usr/lib/cni/bridge")


@pytest.fixture(scope="session")
def real_nodes_registry() -> str | None:
    """The plain-http registry (``127.0.0.1:PORT``) real nodes pull from; None: no registry."""
    return None


@pytest.fixture(scope="session")
def real_nodes(
    kube: Any, real_nodes_registry: str | None, testenv_supervisor: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealNodes]:
    """Real nodes on the test control plane: ``real_nodes.node_names()``, ``real_nodes.kill(name)``.

    Their pods reach the host services of the test world (``testenv_supervisor.host_services``: the
    apiserver, also as ``10.0.0.1:443``, the object store, a test's own server once registered there)."""
    require_real_nodes()
    ca = getattr(kube, "kubelet_client_ca", None)
    if ca is None:
        pytest.skip("real nodes need the test control plane (its kubelet client CA), not an outside cluster")
    state = tmp_path_factory.mktemp("real-nodes")
    nodes = RealNodes.start(
        kube.kubeconfig,
        ca,
        state,
        count=int(os.environ.get("SPOTGUARD_TEST_REAL_NODES", "2")),
        registry=real_nodes_registry,
        host_services=testenv_supervisor.host_services.directory,
    )
    try:
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(state, ignore_errors=True)


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """``check()``'s first true value, looked at every 0.3 s; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f} s")
        time.sleep(0.3)


def sa_token(api: Kube, namespace: str) -> bool:
    """Whether ``namespace``'s default ServiceAccount has its token (1.20 refuses pods until it has)."""
    try:
        return bool(api.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/default").get("secrets"))
    except ApiError as exc:
        if exc.status == 404:
            return False
        raise


def real_node_namespace(api: Kube, prefix: str) -> Iterator[str]:
    """A namespace whose pods may be created (its token is there), deleted afterwards."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    api.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    wait_for(lambda: sa_token(api, name), 60, "the default ServiceAccount's token (pods are refused without it)")
    yield name
    api.delete(f"/api/v1/namespaces/{name}")
