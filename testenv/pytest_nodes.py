"""Pytest plugin: ``process_nodes``, spot GPU nodes that run pods as local processes.

Registered by ``tests/conftest.py`` (``pytest_plugins``). The fixture starts one
process node agent (``python -m testenv.processnode run``) for the session on
the ``kube`` control plane, waits until its nodes are Ready, and stops it at
the end, also when tests fail, so that no pod process outlives the session.

``SPOTGUARD_TEST_NODES`` sets how many nodes (default 4: a gang of two, the operator, and a spare).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from testenv.processnode import ProcessNodes


@pytest.fixture(scope="session")
def process_nodes(
    kube: Any, testenv_supervisor: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessNodes]:
    """A running process node agent; preempt its nodes with ``process_nodes.preempt(pod, ns, mode)``.

    Its pods reach the host services of the test world (``testenv_supervisor.host_services``: the
    apiserver, the object store) and those a test adds with ``process_nodes.host_services``.
    """
    count = int(os.environ.get("SPOTGUARD_TEST_NODES", "4"))
    ca = getattr(kube, "kubelet_client_ca", None)  # None for a cluster the tests did not start
    nodes = ProcessNodes.start(
        kube.kubeconfig,
        tmp_path_factory.mktemp("process-nodes"),
        count=count,
        extra_args=["--client-ca-file", str(ca)] if ca else None,
        host_services=testenv_supervisor.host_services.directory,
        # The tests' own files (a file:// store) stay reachable and writable in containers with a read-only
        # root (spotguard's, with an emptyDir at /tmp), as a real pod reaches its store over the network.
        writable_host_paths=[tmp_path_factory.getbasetemp()],
    )
    try:
        yield nodes
    finally:
        nodes.stop()
