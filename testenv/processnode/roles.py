"""What the parts of a process node see of each other: typing only, so that imports point one way.

The agent owns its nodes and pods (``agent`` imports ``node``, ``pod`` and
``control``), a node owns its kubelet endpoints (``node`` imports
``kubeletapi``). The parts below still call back up: a pod asks its agent
for the pod network and its node whether it died, a node its agent for the
apiserver client, the kubelet endpoints their node for a pod's runner.
They name what they call by these protocols instead of importing the
classes above them, so that no import runs back up and the no-cycles
contract holds for the test environment too.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol

from testenv.processnode.api import Kube
from testenv.processnode.common import JSON
from testenv.processnode.hosts import ClusterHosts
from testenv.processnode.podnet import IpPool
from testenv.processnode.processes import Spawner


class RunnerRole(Protocol):
    """A pod's runner (``pod.PodRunner``) as the kubelet endpoints read it."""

    closed: bool
    dir: Path
    init: list[Any]  # pod.Container
    main: list[Any]  # pod.Container


class NodeRole(Protocol):
    """A node (``node.ProcessNode``) as its pods and kubelet endpoints see it."""

    name: str
    dead: bool
    agent: AgentRole


class AgentRole(Protocol):
    """The agent (``agent.Agent``) as its nodes, pods and control socket see it."""

    kube: Kube
    settings: Any  # node.NodeSettings
    kubelet_cert: tuple[Path, Path]
    client_ca: Path | None
    kubelet_version: str
    stopping: threading.Event
    spawner: Spawner
    host_ports: set[int]
    host_services: Path
    writable_host_paths: tuple[str, ...]
    ip_pool: IpPool | None
    hosts: ClusterHosts

    def base_env(self, hostname: str) -> dict[str, str]: ...

    def node_names(self) -> list[str]: ...

    def preempt(self, namespace: str, pod_name: str, mode: str, grace: int | None = None) -> JSON: ...

    def runner_of(self, node: Any, namespace: str, name: str) -> RunnerRole | None: ...
