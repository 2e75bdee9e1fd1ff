"""Node objects: the manifest of a spot GPU node, heartbeats (status + Lease), cordon, retirement."""

from __future__ import annotations

import contextlib
import platform
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from testenv.processnode.api import ApiError, ignore_missing
from testenv.processnode.common import (
    HEARTBEAT_SECONDS,
    JSON,
    LEASE_SECONDS,
    LOOPBACK,
    NODE_LEASE_NAMESPACE,
    STATUS_REPORT_SECONDS,
    log,
    utc_now,
    utc_now_micro,
)
from testenv.processnode.kubeletapi import KubeletServer

if TYPE_CHECKING:
    from testenv.processnode.roles import AgentRole


@dataclass(frozen=True)
class NodeSettings:
    """What every node of the pool looks like."""

    prefix: str = "spot-gpu"
    cpu: str = "16"
    memory: str = "64Gi"
    pods: str = "110"
    gpus: int = 1
    instance_type: str = "g5.4xlarge"
    taint: bool = False
    labels: dict[str, str] = field(default_factory=dict)


SPOT_TAINT = {"key": "spotguard.dev/spot", "value": "true", "effect": "NoSchedule"}


def node_manifest(name: str, settings: NodeSettings, kubelet_version: str, kubelet_port: int = 10250) -> JSON:
    """The Node object of a spot GPU node (status included: nodes may set it on create).

    The apiserver reaches the node's kubelet endpoint (logs) at the InternalIP and ``kubelet_port``.
    """
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": arch,
        "beta.kubernetes.io/os": "linux",
        "beta.kubernetes.io/arch": arch,
        "node.kubernetes.io/instance-type": settings.instance_type,
        "beta.kubernetes.io/instance-type": settings.instance_type,
        "topology.kubernetes.io/region": "local",
        "topology.kubernetes.io/zone": "local-a",
        "spotguard.dev/test-node": "true",
        "cloud.google.com/gke-spot": "true",
        "karpenter.sh/capacity-type": "spot",
        **({"nvidia.com/gpu.present": "true"} if settings.gpus else {}),
        **settings.labels,
    }
    resources = {"cpu": settings.cpu, "memory": settings.memory, "pods": settings.pods}
    if settings.gpus:
        resources["nvidia.com/gpu"] = str(settings.gpus)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": [SPOT_TAINT]} if settings.taint else {},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "addresses": [{"type": "InternalIP", "address": LOOPBACK}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
            "nodeInfo": {
                "machineID": uuid.uuid4().hex,
                "systemUUID": str(uuid.uuid4()),
                "bootID": str(uuid.uuid4()),
                "kernelVersion": platform.release(),
                "osImage": _os_image(),
                "containerRuntimeVersion": "processnode://0.1.0",
                "kubeletVersion": kubelet_version,
                "kubeProxyVersion": kubelet_version,
                "operatingSystem": "linux",
                "architecture": arch,
            },
        },
    }


def _os_image() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    return "Linux"


class ProcessNode:
    """One registered Node: heartbeats (status + Lease), readiness, cordon, retirement."""

    def __init__(self, agent: AgentRole, name: str) -> None:
        self.agent, self.name = agent, name
        self.uid = ""
        self.dead = False
        self.shutting_down = False
        self.preempt_lock = threading.Lock()
        self._ready = (True, "KubeletReady", "kubelet is posting ready status")
        self._ready_since = utc_now()
        self._created = utc_now()
        self._stop = threading.Event()
        self.kubelet: KubeletServer | None = None
        self._status_lock = threading.Lock()
        self._status_posted = 0.0  # time.monotonic() of the last status write

    @property
    def path(self) -> str:
        return f"/api/v1/nodes/{self.name}"

    @property
    def lease_path(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{NODE_LEASE_NAMESPACE}/leases/{self.name}"

    def register(self) -> None:
        cert, key = self.agent.kubelet_cert
        self.kubelet = KubeletServer(self, cert, key, self.agent.client_ca)
        self.kubelet.start()
        manifest = node_manifest(self.name, self.agent.settings, self.agent.kubelet_version, self.kubelet.port)
        manifest["status"]["conditions"] = self._conditions()
        created = self.agent.kube.post("/api/v1/nodes", manifest)
        self.uid = created["metadata"]["uid"]
        self.heartbeat()
        threading.Thread(target=self._beat_loop, name=f"heartbeat {self.name}", daemon=True).start()
        log.info("node %s registered", self.name)

    def _conditions(self) -> list[JSON]:
        now = utc_now()
        healthy = (
            ("MemoryPressure", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            ("DiskPressure", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            ("PIDPressure", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
        )
        conds = [
            {
                "type": t,
                "status": "False",
                "reason": r,
                "message": m,
                "lastHeartbeatTime": now,
                "lastTransitionTime": self._created,
            }
            for t, r, m in healthy
        ]
        ready, reason, message = self._ready
        conds.append(
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": now,
                "lastTransitionTime": self._ready_since,
            }
        )
        return conds

    def heartbeat(self, status: bool = True) -> None:
        """Renew the node's Lease and, with ``status``, post the node's status, as kubelet does."""
        with self._status_lock:
            if self.dead:
                return
            if status:
                self.agent.kube.patch(f"{self.path}/status", {"status": {"conditions": self._conditions()}})
                self._status_posted = time.monotonic()
            renew = {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": utc_now_micro()}
            try:
                self.agent.kube.patch(self.lease_path, {"spec": renew})
            except ApiError as exc:
                ignore_missing(exc)
                owner = {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self.uid}
                lease = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": NODE_LEASE_NAMESPACE, "ownerReferences": [owner]},
                    "spec": renew,
                }
                self.agent.kube.post(f"/apis/coordination.k8s.io/v1/namespaces/{NODE_LEASE_NAMESPACE}/leases", lease)

    def _beat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                self.heartbeat(status=time.monotonic() - self._status_posted >= STATUS_REPORT_SECONDS)
            except Exception as exc:  # noqa: BLE001 - keep beating through apiserver hiccups
                log.warning("node %s: heartbeat failed: %s", self.name, exc)

    def set_ready(self, ready: bool, reason: str, message: str) -> None:
        if self._ready[0] != ready:
            self._ready_since = utc_now()
        self._ready = (ready, reason, message)
        self.heartbeat()

    def cordon(self, on: bool) -> None:
        self.agent.kube.patch(self.path, {"spec": {"unschedulable": True if on else None}})

    def retire(self, delete: bool) -> None:
        """Stop heartbeats; with ``delete``, remove the Node and its Lease."""
        self._stop.set()
        with self._status_lock:
            self.dead = True
        if self.kubelet is not None:
            self.kubelet.stop()
        if not delete:
            return
        for path in (self.path, self.lease_path):
            try:
                self.agent.kube.delete(path)
            except ApiError as exc:
                if exc.status != 404:
                    log.warning("node %s: deleting %s failed: %s", self.name, path, exc)
        log.info("node %s deleted", self.name)
