"""The node agent: registers the nodes, watches their pods, runs them, and simulates spot deaths."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import secrets
import string
import threading
import time
from collections.abc import Collection
from pathlib import Path
from urllib.parse import urlparse

from testenv.processnode.api import ApiError, Kube, ignore_missing, watch_lines
from testenv.processnode.common import (
    DEFAULT_POD_GRACE,
    JSON,
    LOOPBACK,
    MODES,
    RUN_MARKER,
    SHUTDOWN_REJECT_MESSAGE,
    PreemptError,
    log,
)
from testenv.processnode.control import ControlHandler
from testenv.processnode.hosts import ClusterHosts
from testenv.processnode.kubeletapi import self_signed_cert
from testenv.processnode.node import NodeSettings, ProcessNode
from testenv.processnode.pod import PodRunner
from testenv.processnode.podnet import IpPool, available
from testenv.processnode.processes import Spawner, kill_recorded_processes


class Agent:
    """Registers the nodes, runs their pods, and simulates spot deaths on request."""

    def __init__(
        self,
        kube: Kube,
        state_dir: Path,
        count: int,
        settings: NodeSettings,
        shutdown_grace: int = 30,
        delete_nodes: bool = True,
        client_ca: Path | None = None,
        host_ports: Collection[int] = (),
        host_services: Path | None = None,
        writable_host_paths: Collection[Path] = (),
    ) -> None:
        self.kube, self.state_dir, self.count, self.settings = kube, state_dir, count, settings
        # The kubelet endpoints' serving certificate, and the CA of the clients they serve.
        self.kubelet_cert = self_signed_cert(state_dir / "kubelet")
        self.client_ca = client_ca
        self.shutdown_grace = shutdown_grace
        self.delete_nodes = delete_nodes
        self.stopping = threading.Event()
        self.spawner = Spawner()
        self.nodes: dict[str, ProcessNode] = {}
        self.runners: dict[str, PodRunner] = {}
        self.lock = threading.RLock()
        server = urlparse(kube.server)
        self.service_host = server.hostname or LOOPBACK
        self.service_port = str(server.port or 443)
        # The host services pods may reach (see hostservices): the apiserver, the ports given,
        # and those registered in the host-services directory; no other host listener.
        self.host_ports = set(host_ports)
        if self.service_host in (LOOPBACK, "localhost"):
            self.host_ports.add(int(self.service_port))
        self.host_services = host_services if host_services is not None else state_dir / "host-services"
        # Host directories bound at their own path into containers with a read-only root: the test world's files,
        # standing in for what a real pod reaches over the network (a file:// store).
        self.writable_host_paths = tuple(str(p) for p in writable_host_paths)
        self.kubelet_version = "v1.20.2"
        self.eviction_version = "policy/v1beta1"
        self._server: http.server.ThreadingHTTPServer | None = None
        # Pod networks (as root): IPs from the machine-wide pool; None: pods share the host's network.
        self.ip_pool: IpPool | None = IpPool() if available() else None
        self.hosts = ClusterHosts()

    # -- start / stop --

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        version = self.kube.get("/version")
        self.kubelet_version = version.get("gitVersion", self.kubelet_version)
        minor = int(re.sub(r"\D", "", str(version.get("minor", "20"))) or 20)
        # policy/v1 Eviction arrived in 1.22; 1.20 takes only policy/v1beta1.
        self.eviction_version = "policy/v1" if minor >= 22 else "policy/v1beta1"
        if self.ip_pool is not None:
            self.ip_pool.register()  # also clears what a crashed agent left
        for _ in range(self.count):
            self._add_node()
        threading.Thread(target=self._watch_pods, name="pod watch", daemon=True).start()
        threading.Thread(target=self._watch_endpoint_slices, name="endpoint slice watch", daemon=True).start()
        self._server = http.server.ThreadingHTTPServer((LOOPBACK, 0), ControlHandler)
        self._server.agent = self  # type: ignore[attr-defined]
        threading.Thread(target=self._server.serve_forever, name="control", daemon=True).start()
        self._write_control()
        log.info("ready: nodes %s, control port %d", ", ".join(self.node_names()), self._server.server_port)

    def stop(self) -> None:
        """Kill every pod process (whole groups) and, by default, delete the Node objects."""
        self.stopping.set()
        with self.lock:
            runners = list(self.runners.values())
            nodes = list(self.nodes.values())
            self.runners.clear()
            self.nodes.clear()
        for done in [r.request("agent") for r in runners]:
            done.wait(15)
        for node in nodes:
            node.retire(delete=self.delete_nodes)
        if self.ip_pool is not None:
            try:
                self.ip_pool.unregister()
            except OSError as exc:
                log.warning("pod network cleanup: %s", exc)
        if self._server is not None:
            self._server.shutdown()
        with contextlib.suppress(OSError):
            (self.state_dir / "control.json").unlink()
        kill_recorded_processes(self.state_dir)

    def _add_node(self) -> ProcessNode:
        suffix = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))
        node = ProcessNode(self, f"{self.settings.prefix}-{suffix}")
        # Known before the Node exists: the scheduler can bind a pod to it while it registers
        # (a replacement node, pods waiting), and a pod event for an unknown node is dropped.
        with self.lock:
            self.nodes[node.name] = node
        try:
            node.register()
        except BaseException:
            with self.lock:
                self.nodes.pop(node.name, None)
            raise
        return node

    def runner_of(self, node: ProcessNode, namespace: str, name: str) -> PodRunner | None:
        """The runner of pod ``namespace/name`` on ``node``, if it runs there."""
        with self.lock:
            for runner in self.runners.values():
                if runner.node is node and runner.namespace == namespace and runner.name == name:
                    return runner
        return None

    def node_names(self) -> list[str]:
        with self.lock:
            return sorted(self.nodes)

    def _write_control(self) -> None:
        assert self._server is not None
        info = {
            "pid": os.getpid(),
            "port": self._server.server_port,
            "nodes": self.node_names(),
            "host_services": str(self.host_services),
        }
        tmp = self.state_dir / "control.json.tmp"
        tmp.write_text(json.dumps(info))
        tmp.replace(self.state_dir / "control.json")

    def base_env(self, hostname: str) -> dict[str, str]:
        """What every container gets before its own env: PATH, hostname, the apiserver's address."""
        env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "HOSTNAME": hostname,
            "KUBERNETES_SERVICE_HOST": self.service_host,
            "KUBERNETES_SERVICE_PORT": self.service_port,
            "KUBERNETES_SERVICE_PORT_HTTPS": self.service_port,
            "KUBERNETES_PORT": f"tcp://{self.service_host}:{self.service_port}",
        }
        if RUN_MARKER in os.environ:  # lets the test suite find leftovers
            env[RUN_MARKER] = os.environ[RUN_MARKER]
        return env

    # -- pod watch --

    def _watch_pods(self) -> None:
        while not self.stopping.is_set():
            try:
                listing = self.kube.get("/api/v1/pods", {"fieldSelector": "spec.nodeName!="})
                self._resync(listing["items"])
                rv = listing["metadata"]["resourceVersion"]
                while not self.stopping.is_set():
                    rv = self._watch_once(rv)
            except Exception as exc:  # noqa: BLE001 - relist and carry on, like an informer
                if not self.stopping.is_set():
                    log.warning("pod watch: %s; relisting", exc)
                    self.stopping.wait(1.0)

    def _watch_once(self, rv: str) -> str:
        query = {
            "watch": "true",
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "60",
            "fieldSelector": "spec.nodeName!=",
        }
        resp = self.kube.request("GET", "/api/v1/pods", query=query, timeout=(10.0, 90.0), stream=True)
        try:
            for line in watch_lines(resp):
                event = json.loads(line)
                if event["type"] == "ERROR":
                    raise RuntimeError(f"watch expired: {event['object'].get('message')}")
                obj = event["object"]
                rv = obj["metadata"]["resourceVersion"]
                if event["type"] != "BOOKMARK" and not self.stopping.is_set():
                    self.on_pod(event["type"], obj)
        finally:
            resp.release_conn()
        return rv

    # -- endpoint slice watch (the hosts files' stand-in for kube-proxy and the DNS of Services) --

    def _watch_endpoint_slices(self) -> None:
        path = ""
        while not self.stopping.is_set():
            try:
                if not path:  # discovery.k8s.io/v1 since 1.21; 1.20 serves v1beta1
                    served = self.kube.get("/apis/discovery.k8s.io").get("versions") or []
                    version = "v1" if any(v.get("version") == "v1" for v in served) else "v1beta1"
                    path = f"/apis/discovery.k8s.io/{version}/endpointslices"
                listing = self.kube.get(path)
                self.hosts.resync_endpoint_slices(listing["items"])
                rv = listing["metadata"]["resourceVersion"]
                while not self.stopping.is_set():
                    query = {
                        "watch": "true",
                        "resourceVersion": rv,
                        "allowWatchBookmarks": "true",
                        "timeoutSeconds": "60",
                    }
                    resp = self.kube.request("GET", path, query=query, timeout=(10.0, 90.0), stream=True)
                    try:
                        for line in watch_lines(resp):
                            event = json.loads(line)
                            if event["type"] == "ERROR":
                                raise RuntimeError(f"watch expired: {event['object'].get('message')}")
                            rv = event["object"]["metadata"]["resourceVersion"]
                            if event["type"] != "BOOKMARK":
                                self.hosts.observe_endpoint_slice(event["type"], event["object"])
                    finally:
                        resp.release_conn()
            except Exception as exc:  # noqa: BLE001 - relist and carry on, like an informer
                if not self.stopping.is_set():
                    log.warning("endpoint slice watch: %s; relisting", exc)
                    self.stopping.wait(1.0)

    def _resync(self, pods: list[JSON]) -> None:
        self.hosts.resync(pods)
        for pod in pods:
            self.on_pod("MODIFIED", pod)
        uids = {p["metadata"]["uid"] for p in pods}
        with self.lock:
            vanished = [r for uid, r in self.runners.items() if uid not in uids]
        for runner in vanished:
            self.on_pod("DELETED", runner.pod)

    def on_pod(self, kind: str, pod: JSON) -> None:
        """React to a pod event: start a runner, forward a deletion, or forget the pod."""
        md = pod["metadata"]
        uid = md["uid"]
        self.hosts.observe(kind, pod)
        with self.lock:
            runner = self.runners.get(uid)
            if kind == "DELETED":
                if runner is not None:
                    del self.runners[uid]
                    runner.request("gone")
                return
            node = self.nodes.get(pod["spec"].get("nodeName", ""))
            if node is None:
                return
            deleting = md.get("deletionTimestamp") is not None
            phase = (pod.get("status") or {}).get("phase")
            if runner is None and not deleting and phase not in ("Succeeded", "Failed") and not node.shutting_down:
                runner = PodRunner(self, node, pod)
                self.runners[uid] = runner
                runner.start()
                return
        if runner is not None:
            runner.pod = pod
            if deleting:
                grace = md.get("deletionGracePeriodSeconds")
                runner.request("delete", None if grace is None else int(grace))
        elif deleting:
            self._force_delete(pod)  # nothing of it runs here: finish the deletion
        elif node.shutting_down and phase not in ("Succeeded", "Failed"):
            self._reject(pod, "NodeShutdown", SHUTDOWN_REJECT_MESSAGE)

    def _force_delete(self, pod: JSON) -> None:
        md = pod["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": md["uid"]},
        }
        try:
            self.kube.delete(f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}", body)
        except ApiError as exc:
            if exc.status not in (404, 409):
                log.warning("pod %s/%s: delete failed: %s", md["namespace"], md["name"], exc)

    def _reject(self, pod: JSON, reason: str, message: str) -> None:
        """Kubelet's admission refusal: the pod fails at once."""
        md = pod["metadata"]
        status = {"phase": "Failed", "reason": reason, "message": message}
        try:
            self.kube.patch(f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}/status", {"status": status})
        except ApiError as exc:
            ignore_missing(exc)

    # -- spot deaths --

    def preempt(self, namespace: str, pod_name: str, mode: str, grace: int | None = None) -> JSON:
        """Make the node running ``namespace/pod_name`` die the ``mode`` way; returns what happened."""
        if mode not in MODES:
            raise PreemptError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
        try:
            pod = self.kube.get(f"/api/v1/namespaces/{namespace}/pods/{pod_name}")
        except ApiError as exc:
            if exc.status == 404:
                raise PreemptError(f"pod {namespace}/{pod_name} not found") from None
            raise
        node_name = pod["spec"].get("nodeName")
        with self.lock:
            node = self.nodes.get(node_name or "")
        if node is None:
            raise PreemptError(
                f"pod {namespace}/{pod_name} is on node {node_name!r}, not on a process node of this agent "
                f"({', '.join(self.node_names())})"
            )
        with node.preempt_lock:
            if node.dead:
                raise PreemptError(f"node {node.name} is already gone")
            log.info("preempt %s (pod %s/%s): %s", node.name, namespace, pod_name, mode)
            if mode == "drain":
                return self._drain(node)
            if mode == "shutdown":
                return self._shutdown(node, self.shutdown_grace if grace is None else grace)
            return self._kill(node)

    def _pods_on(self, node: ProcessNode) -> list[JSON]:
        items: list[JSON] = self.kube.get("/api/v1/pods", {"fieldSelector": f"spec.nodeName={node.name}"})["items"]
        return items

    def _runners_on(self, node: ProcessNode) -> list[PodRunner]:
        with self.lock:
            return [r for r in self.runners.values() if r.node is node]

    def _evict(self, pod: JSON) -> None:
        """Ask the eviction API to delete ``pod``; a "not now" is left for the caller's next round."""
        md = pod["metadata"]
        body = {
            "apiVersion": self.eviction_version,
            "kind": "Eviction",
            "metadata": {"name": md["name"], "namespace": md["namespace"]},
        }
        try:
            self.kube.post(f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}/eviction", body)
        except ApiError as exc:
            # 429: a PodDisruptionBudget says not now. 403 in a terminating namespace: the
            # namespace controller is about to delete the pod anyway. kubectl drain retries both.
            retry_later = exc.status == 429 or (exc.status == 403 and "NamespaceTerminating" in exc.body)
            if not retry_later and exc.status != 404:
                raise PreemptError(f"evicting {md['namespace']}/{md['name']}: {exc}") from None

    def _drain(self, node: ProcessNode) -> JSON:
        """Cordon, evict every pod, wait until they are gone, uncordon (a fresh, empty node)."""
        node.cordon(True)
        try:
            pods = self._pods_on(node)
            evicted = [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods]
            grace = max(
                (int(p["spec"].get("terminationGracePeriodSeconds", DEFAULT_POD_GRACE)) for p in pods), default=0
            )
            deadline = time.monotonic() + grace + 60
            while pods:
                for pod in pods:
                    if pod["metadata"].get("deletionTimestamp") is None:
                        self._evict(pod)
                if time.monotonic() > deadline:
                    left = [p["metadata"]["name"] for p in pods]
                    raise PreemptError(f"drain {node.name}: pods still there after evictions: {left}")
                time.sleep(0.5)
                pods = self._pods_on(node)
        finally:
            node.cordon(False)
        return {"mode": "drain", "node": node.name, "pods": evicted}

    def _shutdown(self, node: ProcessNode, grace: int) -> JSON:
        """Graceful node shutdown: SIGTERM, wait (at most ``grace``), SIGKILL; pods end Failed/Terminated."""
        node.shutting_down = True
        node.set_ready(False, "KubeletNotReady", "node is shutting down")
        try:
            runners = self._runners_on(node)
            for done in [r.request("shutdown", grace) for r in runners]:
                done.wait(grace + 60)
        finally:
            node.shutting_down = False
            node.set_ready(True, "KubeletReady", "kubelet is posting ready status")
        return {"mode": "shutdown", "node": node.name, "pods": [r.key for r in runners]}

    def _kill(self, node: ProcessNode) -> JSON:
        """Abrupt loss: SIGKILL everything, heartbeats stop, the Node goes; a new node joins."""
        with self.lock:
            node.dead = True
            self.nodes.pop(node.name, None)
            runners = [r for r in self.runners.values() if r.node is node]
            for r in runners:
                del self.runners[r.uid]
        for done in [r.request("kill") for r in runners]:
            done.wait(30)
        node.retire(delete=True)
        replacement = self._add_node()
        self._write_control()
        return {"mode": "kill", "node": node.name, "pods": [r.key for r in runners], "replacement": replacement.name}
