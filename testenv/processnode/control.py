"""The control API on 127.0.0.1 (``GET /nodes``, ``POST /preempt``): the agent's server and the client."""

from __future__ import annotations

import contextlib
import glob
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testenv.processnode.api import ApiError, Kube
from testenv.processnode.common import (
    CREATED_FILE,
    JSON,
    LOOPBACK,
    NODE_LEASE_NAMESPACE,
    PreemptError,
    log,
    pod_dir_name,
)
from testenv.processnode.hostservices import HostServices
from testenv.processnode.podnet import IpPool, available
from testenv.processnode.processes import kill_recorded_processes, process_start_time, signal_group

if TYPE_CHECKING:
    from testenv.processnode.roles import AgentRole


class ControlHandler(http.server.BaseHTTPRequestHandler):
    """Control API on 127.0.0.1: ``GET /nodes``, ``POST /preempt``."""

    server: Any

    def _reply(self, code: int, body: JSON) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/nodes":
            self._reply(200, {"nodes": self.server.agent.node_names()})
        else:
            self._reply(404, {"error": f"no such endpoint {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/preempt":
            self._reply(404, {"error": f"no such endpoint {self.path}"})
            return
        agent: AgentRole = self.server.agent
        try:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            args = (req.get("namespace", "default"), req["pod"], req.get("mode", "drain"), req.get("grace_seconds"))
        except (ValueError, KeyError) as exc:
            self._reply(400, {"error": f"bad request: {exc}"})
            return
        if not req.get("wait", True):
            threading.Thread(target=self._preempt_quietly, args=(agent, args), daemon=True).start()
            self._reply(202, {"accepted": True})
            return
        try:
            self._reply(200, agent.preempt(*args))
        except PreemptError as exc:
            self._reply(400, {"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - reported to the caller as one line
            log.exception("preempt failed")
            self._reply(500, {"error": f"preempt failed: {exc}"})

    @staticmethod
    def _preempt_quietly(agent: AgentRole, args: tuple[Any, ...]) -> None:
        try:
            agent.preempt(*args)
        except Exception:  # noqa: BLE001 - a background preempt has no caller to tell; it is logged
            log.exception("preempt %s failed", args)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base class signature
        log.debug("control: " + format, *args)


class ProcessNodes:
    """Handle on a running agent: start it, preempt its nodes, stop it.

    ``ProcessNodes.start(...)`` runs ``python -m testenv.processnode run`` as a
    subprocess in its own session and waits until its nodes are Ready;
    ``ProcessNodes(state_dir)`` attaches to an agent that is already running.
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        proc: subprocess.Popen[bytes] | None = None,
        kubeconfig: str | os.PathLike[str] | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.proc = proc
        self.kubeconfig = kubeconfig

    @classmethod
    def start(
        cls,
        kubeconfig: str | os.PathLike[str],
        state_dir: str | os.PathLike[str],
        count: int = 2,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
        host_services: str | os.PathLike[str] | None = None,
        writable_host_paths: list[str | os.PathLike[str]] | None = None,
    ) -> ProcessNodes:
        """Start an agent. Its pods reach the apiserver and the host ports registered in
        ``host_services`` (default: a directory of the agent's own; see :attr:`host_services`).
        ``writable_host_paths`` are bound at their own path into every container with a read-only root
        (the test world's files)."""
        state = Path(state_dir)
        state.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            (state / "control.json").unlink()
        child_env = dict(os.environ if env is None else env)
        # Containers inherit the agent's PATH: make the virtualenv's python/spotguard resolve.
        child_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{child_env.get('PATH', os.defpath)}"
        root = str(Path(__file__).resolve().parents[2])  # the directory holding testenv/
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, child_env.get("PYTHONPATH")) if p)
        argv = [
            sys.executable,
            "-m",
            "testenv.processnode",
            "run",
            "--kubeconfig",
            str(kubeconfig),
            "--nodes",
            str(count),
            "--state-dir",
            str(state),
            *(extra_args or []),
        ]
        if host_services is not None:
            argv += ["--host-services-dir", str(Path(host_services).resolve())]
        for path in writable_host_paths or []:
            argv += ["--writable-host-path", str(Path(path).resolve())]
        with (state / "agent.log").open("ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
            )
        nodes = cls(state, proc, kubeconfig)
        try:
            nodes.wait_ready(kubeconfig, count, timeout)
        except BaseException:
            nodes.stop()
            raise
        return nodes

    def wait_ready(self, kubeconfig: str | os.PathLike[str], count: int, timeout: float) -> None:
        """Wait for the control file, then for ``count`` nodes Ready in the API."""
        deadline = time.monotonic() + timeout
        kube: Kube | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"process node agent exited with {self.proc.returncode}:\n{self.log_tail()}")
            if (self.state_dir / "control.json").exists():
                kube = kube or Kube(kubeconfig)
                names = self.node_names()
                if len(names) == count and all(node_ready(kube, n) for n in names):
                    return
            time.sleep(0.3)
        raise TimeoutError(f"process nodes not Ready after {timeout:.0f}s:\n{self.log_tail()}")

    @property
    def host_services(self) -> HostServices:
        """The host ports this agent's pods may reach besides the apiserver's: ``host_services.add(port, name)``,
        or ``with host_services.exposed(port, name): ...``."""
        try:
            directory = json.loads((self.state_dir / "control.json").read_text())["host_services"]
        except (OSError, ValueError, KeyError):
            raise RuntimeError(f"no process node agent running with state dir {self.state_dir}") from None
        return HostServices(directory)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join((self.state_dir / "agent.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no agent log)"

    def _call(self, method: str, path: str, body: JSON | None = None, timeout: float = 300.0) -> JSON:
        try:
            port = json.loads((self.state_dir / "control.json").read_text())["port"]
        except (OSError, ValueError, KeyError):
            raise RuntimeError(f"no process node agent running with state dir {self.state_dir}") from None
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://{LOOPBACK}:{port}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return dict(json.loads(resp.read()))
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]
            except (ValueError, KeyError):
                message = str(exc)
            raise PreemptError(message) from None
        except urllib.error.URLError as exc:
            raise RuntimeError(f"process node agent not reachable on port {port}: {exc.reason}") from None

    def node_names(self) -> list[str]:
        """Names of the agent's live nodes."""
        return list(self._call("GET", "/nodes")["nodes"])

    def preempt(
        self,
        pod: str,
        namespace: str = "default",
        mode: str = "drain",
        grace_seconds: int | None = None,
        wait: bool = True,
    ) -> JSON:
        """Kill the node running ``pod`` the ``mode`` way (drain, shutdown, kill).

        With ``wait`` (default) this returns once the node has died and come back
        (drain: pods gone, node uncordoned; shutdown: pods terminated and
        reported, node Ready; kill: Node deleted, replacement Ready), with
        ``{"node", "mode", "pods", "replacement"?}``.
        """
        body = {"pod": pod, "namespace": namespace, "mode": mode, "grace_seconds": grace_seconds, "wait": wait}
        return self._call("POST", "/preempt", body)

    def pod_ip(self, namespace: str, pod: str, timeout: float = 60.0) -> str:
        """The pod's IP (``status.podIP``, as the apiserver has it), waiting until it has one.

        Pods of a process node have their own network namespace and IP in
        127.64.0.0/16 (reachable from the host); hostNetwork pods have the node's, 127.0.0.1.
        """
        if self.kubeconfig is None:
            raise RuntimeError("pod_ip needs the kubeconfig (ProcessNodes.start or ProcessNodes(..., kubeconfig=))")
        kube = Kube(self.kubeconfig)
        deadline = time.monotonic() + timeout
        while True:
            try:
                ip = (kube.get(f"/api/v1/namespaces/{namespace}/pods/{pod}").get("status") or {}).get("podIP")
            except ApiError as exc:
                if exc.status != 404:
                    raise
                ip = None
            if ip:
                return str(ip)
            if time.monotonic() > deadline:
                raise TimeoutError(f"pod {namespace}/{pod} has no IP after {timeout:.0f}s")
            time.sleep(0.2)

    def container_pid(self, namespace: str, pod: str, container: str) -> int:
        """The pid of a running container's first process: its shim (with a PID namespace) or its command.

        It leads the container's process group, which holds every process of
        the container (the command, and what it started). Raises
        ProcessLookupError when the container does not run now.
        """
        path = self.pod_dir(namespace, pod) / f"{container}.pid"
        try:
            pid_text, start = path.read_text().split()
            pid = int(pid_text)
        except (OSError, ValueError):
            raise ProcessLookupError(f"container {container} of pod {namespace}/{pod} does not run here") from None
        if process_start_time(pid) != start:
            raise ProcessLookupError(f"container {container} of pod {namespace}/{pod} has ended")
        return pid

    def signal_container(self, namespace: str, pod: str, container: str, sig: int) -> int:
        """Send ``sig`` to every process of a running container (``SIGSTOP`` freezes it, ``SIGCONT``
        continues it: a stalled machine, a long pause). Returns the container's pid (:meth:`container_pid`)."""
        pid = self.container_pid(namespace, pod, container)
        os.killpg(pid, sig)
        return pid

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        """Where a container's stdout/stderr are written (of the newest pod of that name)."""
        return self.pod_dir(namespace, pod) / f"{container}.log"

    def pod_dir(self, namespace: str, pod: str) -> Path:
        """The directory of the newest pod named ``pod`` (its logs, pid files); a path that does not exist
        when no pod of that name ran here. Each pod has its own, as kubelet's log directories are per
        UID: a pod made again under an earlier one's name starts with logs of its own."""

        def created(d: Path) -> int:
            try:
                return int((d / CREATED_FILE).read_text())
            except (OSError, ValueError):
                return 0

        made = list((self.state_dir / "pods").glob(f"{glob.escape(namespace)}_{glob.escape(pod)}_*"))
        if not made:
            return self.state_dir / "pods" / pod_dir_name(namespace, pod, "none")
        return max(made, key=created)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the agent (SIGTERM, then SIGKILL) and make sure no pod process survives it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc is not None:
            signal_group(self.proc.pid, signal.SIGKILL)  # anything left in the agent's session
        kill_recorded_processes(self.state_dir)
        if available():
            with contextlib.suppress(OSError):
                IpPool().sweep()  # what an agent that died without cleaning up left of pod networks
        control = self.state_dir / "control.json"
        if control.exists() and self.kubeconfig is not None:
            # The agent died without cleaning up (it removes this file when it does): its Nodes too.
            kube = Kube(self.kubeconfig)
            for name in json.loads(control.read_text()).get("nodes", []):
                for path in (
                    f"/api/v1/nodes/{name}",
                    f"/apis/coordination.k8s.io/v1/namespaces/{NODE_LEASE_NAMESPACE}/leases/{name}",
                ):
                    with contextlib.suppress(ApiError):
                        kube.delete(path)
            control.unlink()


def node_ready(kube: Kube, name: str) -> bool:
    try:
        node = kube.get(f"/api/v1/nodes/{name}")
    except ApiError:
        return False
    conds = (node.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
