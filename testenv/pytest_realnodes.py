"""Pytest plugin: ``real_nodes``, nodes with a real kubelet and containerd (``testenv.realnode``).

Registered by ``tests/conftest.py`` (``pytest_plugins``). One set of real nodes
serves the whole session, every real-node module alike: starting a set costs
tens of seconds, pulling the torch image onto a node about a minute, and
tearing a set down as long again, so modules share one instead of each
starting its own.

The fixture API (stable: modules of other authors use it):

- ``real_nodes`` (session): a :class:`~testenv.realnode.RealNodes` on the
  ``kube`` control plane, started at its first use with
  ``SPOTGUARD_TEST_REAL_NODES`` nodes (default 2: pod-to-pod traffic needs
  two), each Ready with its GPU; torn down at the end of the session, also
  when tests fail, leaving nothing on the machine. ``node_names()``,
  ``node(name)``, ``kill(name)`` (a node lost), ``add_node()`` (a
  replacement), ``set_no``, ``host_proxy``, ``dns``.
- ``real_nodes_registry`` (session): the plain-http registry
  (``127.0.0.1:PORT``) the nodes pull from: the session's ``image_registry``
  with both project images (``testenv.pytest_images``; built by ``make
  setup``, found in the cache here). Pods run ``image_registry.refs[target]``
  or the imported ``pause`` and ``busybox``.
- :func:`ensure_real_nodes`: at least ``count`` live nodes (a module that needs
  more adds them; they stay for the modules after it).
- :func:`real_node_namespace`: a namespace whose pods may be created, deleted
  afterwards; :func:`require_real_nodes`: skip (fail in CI) where real nodes
  cannot run; :func:`wait_for`.

What a module owes the others: its pods in a namespace of its own (deleted at
its end), and the nodes as it found them apart from their number: labels and
taints it put on them removed. A node it lost (``kill``) stays lost; a module
that needs a given number of nodes calls :func:`ensure_real_nodes`. A module
that shows a set's own start or teardown (what is left on the machine) starts
a set of its own with :meth:`RealNodes.start`.
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
def real_nodes_registry(image_registry: Any) -> str | None:
    """The plain-http registry (``127.0.0.1:PORT``) real nodes pull from: the session's, with both images."""
    return str(image_registry.address)


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


def ensure_real_nodes(nodes: RealNodes, count: int) -> list[str]:
    """At least ``count`` live nodes in ``nodes`` (the ones missing started at once, then waited for):
    their names, oldest first."""
    started = [nodes.add_node(wait=False) for _ in range(count - len(nodes.node_names()))]
    for node in started:
        nodes.wait_ready(node)
    return nodes.node_names()


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
