"""The pod runner: one pod's containers from first sight until its object is gone, and its status."""

from __future__ import annotations

import base64
import contextlib
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from testenv.processnode.api import ApiError, ignore_missing
from testenv.processnode.common import (
    CREATED_FILE,
    DEFAULT_POD_GRACE,
    JSON,
    LOOPBACK,
    SHUTDOWN_MESSAGE,
    log,
    pod_dir_name,
    utc_now,
)
from testenv.processnode.container import NEW_PID_NAMESPACE, PAUSE_PROGRAM, LaunchSpec, launch_argv
from testenv.processnode.hosts import HostsFile
from testenv.processnode.podnet import PodNetwork
from testenv.processnode.podspec import (
    DEFAULT_TERMINATION_MESSAGE_PATH,
    MAX_LOG_TAIL_BYTES,
    MAX_TERMINATION_MESSAGE,
    READ_ONLY_VOLUMES,
    NotYet,
    Unsupported,
    exit_code_of,
    expand_vars,
    field_value,
    log_tail,
    projected_items,
    read_only_root,
    read_tail,
    safe_relpath,
)
from testenv.processnode.processes import process_start_time, signal_group, start_error

if TYPE_CHECKING:
    from testenv.processnode.roles import AgentRole, NodeRole


# Container names are DNS labels: no container's "<name>.pid" can be this one.
SANDBOX_PIDFILE = "_sandbox.pid"
NETWORK_PIDFILE = "_network.pid"
HOSTS_FILE = "_etc-hosts"
# How often a pod waiting for a Secret or ConfigMap looks again (kubelet: its next pod sync).
RETRY_SECONDS = 1.0


#: The process node's image: the host's own files that containers run (``python -m spotguard ...``, the
#: ``spotguard`` script): the project's checkout and the interpreter's environment.
IMAGE_PATHS = tuple(dict.fromkeys(os.path.realpath(p) for p in (Path(__file__).resolve().parents[2], sys.prefix)))


def shadowed_image_paths(mounts: list[tuple[str, str, bool]]) -> list[tuple[str, str, bool]]:
    """Pure: the image paths that a volume mounted above them would hide, bound back read-only at their own
    path. An image's programs stay visible under a volume mounted elsewhere in it; here the image is the
    host's file system, and a checkout under /tmp would vanish under spotguard's emptyDir at /tmp."""
    targets = [Path(dst) for _src, dst, _ro in mounts]
    return [(p, p, True) for p in IMAGE_PATHS if any(t in Path(p).parents for t in targets)]


@dataclass
class Container:
    """One container of a pod and what kubelet would report about it."""

    spec: JSON
    init: bool
    state: JSON
    proc: subprocess.Popen[bytes] | None = None
    container_id: str | None = None
    started_at: str | None = None
    restarts: int = 0
    last_state: JSON = field(default_factory=dict)
    # This run's termination message file on the host, and where its log output starts.
    termination_file: Path | None = None
    log_offset: int = 0
    # Where the run before this one started in the log (``kubectl logs --previous``).
    prev_log_offset: int | None = None
    # Whether ``proc`` is a shim in front of the container's own process (a PID namespace):
    # a stop signal then goes to that process only, as a runtime sends it.
    shim: bool = False

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def exit_code(self) -> int | None:
        term = self.state.get("terminated")
        return None if term is None else int(term["exitCode"])

    def status(self) -> JSON:
        image = str(self.spec.get("image", ""))
        running = "running" in self.state
        st: JSON = {
            "name": self.name,
            "image": image,
            "imageID": f"processnode://{image}",
            "ready": (self.exit_code() == 0) if self.init else running,
            "restartCount": self.restarts,
            "started": running,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            st["containerID"] = f"processnode://{self.container_id}"
        return st


@dataclass
class Request:
    """Something asked of a pod runner from outside; ``done`` is set once handled."""

    kind: str  # delete | shutdown | kill | gone | agent
    grace: int | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class Exited:
    """A container process ended (``proc`` is None when it could not be started)."""

    container: Container
    proc: subprocess.Popen[bytes] | None
    code: int
    reason: str | None = None
    message: str | None = None


class _Stop(Exception):
    def __init__(self, request: Request) -> None:
        self.request = request


class PodRunner:
    """Runs one pod on one process node, from first sight until its object is gone."""

    def __init__(self, agent: AgentRole, node: NodeRole, pod: JSON) -> None:
        self.agent, self.node, self.pod = agent, node, pod
        md, spec = pod["metadata"], pod["spec"]
        self.uid: str = md["uid"]
        self.namespace: str = md["namespace"]
        self.name: str = md["name"]
        self.key = f"{self.namespace}/{self.name}"
        self.restart_policy: str = spec.get("restartPolicy", "Always")
        self.grace: int = int(spec.get("terminationGracePeriodSeconds", DEFAULT_POD_GRACE))
        main_waiting = "PodInitializing" if spec.get("initContainers") else "ContainerCreating"
        self.init = [
            Container(c, True, {"waiting": {"reason": "PodInitializing"}}) for c in spec.get("initContainers") or []
        ]
        self.main = [Container(c, False, {"waiting": {"reason": main_waiting}}) for c in spec["containers"]]
        # Per pod, as kubelet's /var/log/pods/<namespace>_<name>_<uid>: a later pod of the same name
        # (a job made again) starts with logs of its own (ProcessNodes.pod_dir finds the newest).
        self.dir = agent.state_dir / "pods" / pod_dir_name(self.namespace, self.name, self.uid)
        self.volumes_dir = agent.state_dir / "volumes" / self.uid
        self.phase = "Pending"
        self.initialized = not self.init
        self.reason: str | None = None
        self.message: str | None = None
        self.disrupted = False
        self.start_time = utc_now()
        self.share_processes = bool(spec.get("shareProcessNamespace"))
        self.host_network = bool(spec.get("hostNetwork"))
        self.hostname: str = spec.get("hostname") or self.name
        # The pod's network namespace (None: the host's) and the IP it reports.
        self.network: PodNetwork | None = None
        self.pod_ip = LOOPBACK
        self._hosts_attached = False
        # With shareProcessNamespace, the PID 1 of the pod's namespace that its containers join.
        self._sandbox: subprocess.Popen[bytes] | None = None
        self._volumes: dict[str, Path] = {}
        self._read_only: set[str] = set()
        self._q: queue.Queue[Request | Exited] = queue.Queue()
        self._deferred: list[Request] = []
        self._lock = threading.Lock()
        self._closed = False
        self._transitions: dict[str, tuple[str, str]] = {}
        self._published: JSON | None = None
        self._events: set[tuple[str, str]] = set()
        self._thread = threading.Thread(target=self._run, name=f"pod {self.key}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def closed(self) -> bool:
        """Whether the runner has finished (its pod is gone from this node)."""
        return self._closed

    def request(self, kind: str, grace: int | None = None) -> threading.Event:
        """Ask the runner to delete/shutdown/kill/forget the pod; returns an event set when done."""
        req = Request(kind, grace)
        with self._lock:
            if self._closed:
                req.done.set()
            else:
                self._q.put(req)
        return req.done

    # -- lifecycle (runs in the pod thread) --

    def _run(self) -> None:
        try:
            try:
                self._lifecycle()
                self._kill_all()  # the pod has ended: its sandbox goes, as kubelet tears it down
                self._release_network()
            except _Stop as stop:
                if self._handle_stop(stop.request):
                    return
            self._idle()
        except Exception:  # noqa: BLE001 - a runner failure is logged with the pod's name; teardown follows
            log.exception("pod %s: runner failed", self.key)
        finally:
            self._kill_all()
            self._release_network()
            for leftover in self.dir.glob("*.termination-log"):
                with contextlib.suppress(OSError):
                    leftover.unlink()
            with self._lock:
                self._closed = True
            while not self._q.empty():
                item = self._q.get()
                if isinstance(item, Request):
                    item.done.set()
            for req in self._deferred:
                req.done.set()

    def _lifecycle(self) -> None:
        if not self.dir.exists():
            self.dir.mkdir(parents=True)
            (self.dir / CREATED_FILE).write_text(str(time.time_ns()))
        self._prepare_network()
        self._publish()
        if not self._prepare_volumes():
            return
        for c in self.init:
            while True:
                self._start(c)
                code = self._wait_exit(c)
                if code == 0:
                    break
                if self.restart_policy == "Never":
                    self.phase = "Failed"
                    self._publish()
                    return
                self._sleep(self._backoff(c))
        self.initialized = True
        for c in self.main:
            c.state = {"waiting": {"reason": "ContainerCreating"}}
        for c in self.main:
            self._start(c)
        self.phase = "Running"
        self._publish()
        self._supervise()

    def _supervise(self) -> None:
        """Wait for container exits, restart per restartPolicy, end in Succeeded/Failed."""
        restart_at: dict[str, float] = {}
        by_name = {c.name: c for c in self.main}
        while restart_at or any(c.exit_code() is None for c in self.main):
            timeout = max(0.0, min(restart_at.values()) - time.monotonic()) if restart_at else None
            ev = self._next(timeout)
            if ev is None:
                for name, due in list(restart_at.items()):
                    if due <= time.monotonic():
                        del restart_at[name]
                        self._start(by_name[name])
                self._publish()
                continue
            c = ev.container
            if ev.proc is not c.proc:
                continue  # a stale exit of an earlier run
            self._record_exit(ev)
            code = ev.code
            if self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and code != 0):
                restart_at[c.name] = time.monotonic() + self._backoff(c)
            self._publish()
        self.phase = "Succeeded" if all(c.exit_code() == 0 for c in self.main) else "Failed"
        self._publish()

    def _backoff(self, c: Container) -> float:
        """Kubelet's crash-loop back-off, compressed (1 s doubling, at most 10 s)."""
        delay = min(10.0, 2.0 ** min(c.restarts, 4))
        c.last_state = c.state
        c.state = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:.0f}s restarting failed container={c.name} pod={self.name}",
            }
        }
        c.restarts += 1
        self._publish()
        return delay

    def _next(self, timeout: float | None) -> Exited | None:
        """The next container exit (None on timeout); a request interrupts as ``_Stop``."""
        try:
            item = self._q.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, Request):
            raise _Stop(item)
        return item

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self._next(left)

    def _wait_exit(self, c: Container) -> int:
        while True:
            ev = self._next(None)
            if ev is not None and ev.container is c and ev.proc is c.proc:
                self._record_exit(ev)
                self._publish()
                return ev.code

    def _handle_stop(self, req: Request) -> bool:
        """Carry out a request that interrupted the lifecycle; True when the runner is finished."""
        if req.kind == "delete":
            self._terminate(self._grace_for(req))
            self.phase = "Succeeded" if self.main and all(c.exit_code() == 0 for c in self.main) else "Failed"
            self._publish()
            self._delete_pod()
            self._cleanup()
            req.done.set()
            return True
        if req.kind == "shutdown":
            self._terminate(self._grace_for(req))
            self.phase, self.reason, self.message = "Failed", "Terminated", SHUTDOWN_MESSAGE
            self.disrupted = True
            self._publish()
            self._cleanup()
            req.done.set()
            return False
        # kill, gone, agent: no grace and nobody to report to.
        self._kill_all()
        self._cleanup()
        req.done.set()
        return True

    def _idle(self) -> None:
        """The pod has ended; stay until its object is deleted, then finish that deletion."""
        while True:
            item = self._deferred.pop(0) if self._deferred else self._q.get()
            if isinstance(item, Exited):
                continue
            if item.kind == "delete":
                self._delete_pod()
            if item.kind != "shutdown":  # nothing is running any more to shut down
                self._cleanup()
                item.done.set()
                return
            item.done.set()

    def _grace_for(self, req: Request) -> int:
        if req.kind == "shutdown":
            return min(self.grace, req.grace if req.grace is not None else self.grace)
        return req.grace if req.grace is not None else self.grace

    def _terminate(self, grace: float) -> None:
        """SIGTERM every container's process group, SIGKILL what is left after ``grace`` seconds."""
        live = [c for c in (*self.init, *self.main) if c.proc is not None]
        for c in live:
            assert c.proc is not None
            if c.shim:  # the shim passes it to the container's main process only, as a runtime does
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.proc.pid, signal.SIGTERM)
            else:
                signal_group(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        killed = False
        while any(c.proc is not None for c in live):
            left = deadline - time.monotonic()
            if left <= 0 and not killed:
                for c in live:
                    if c.proc is not None:
                        signal_group(c.proc.pid, signal.SIGKILL)
                killed = True
            try:
                item = self._q.get(timeout=30.0 if killed else left)
            except queue.Empty:
                if killed:
                    log.error("pod %s: processes survived SIGKILL", self.key)
                    return
                continue
            if isinstance(item, Request):
                self._deferred.append(item)  # handled once this termination is over
                if item.kind in ("kill", "gone", "agent"):
                    deadline = time.monotonic()
                elif item.kind == "delete" and item.grace is not None:
                    deadline = min(deadline, time.monotonic() + item.grace)
            elif item.proc is not None and item.proc is item.container.proc:
                self._record_exit(item)
        for c in self.main:  # not started, or waiting to restart: will not run again
            if "terminated" not in c.state and c.last_state.get("terminated"):
                c.state = c.last_state

    # -- containers --

    def _start(self, c: Container) -> None:
        """Start a container's process; a container that cannot start gets an ``Exited`` event."""
        while True:
            try:
                env = self._env(c)
                break
            except NotYet as exc:
                # Kubelet's reason, which the operator reports; retried, so a Secret created later starts it.
                c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
                self._publish()
                self._event("Failed", f"Error: {exc}")
                self._sleep(RETRY_SECONDS)
            except Unsupported as exc:
                self._not_started(c, "CreateContainerConfigError", str(exc))
                return
        command = [expand_vars(a, env) for a in (c.spec.get("command") or [])]
        args = [expand_vars(a, env) for a in (c.spec.get("args") or [])]
        if not command:
            self._not_started(
                c,
                "ContainerCannotRun",
                "the process node runs `command` + `args` only and knows no image entrypoint: set `command`",
            )
            return
        mounts = self._mounts(c, env)
        mounts += shadowed_image_paths(mounts)
        root = os.geteuid() == 0
        if mounts and not root:
            self._not_started(c, "ContainerCannotRun", "volumes need root (bind mounts in a private mount namespace)")
            return
        try:
            pid_namespace = self._pid_namespace() if root else None
        except OSError as exc:
            self._not_started(c, "StartError", f"pod sandbox: {exc.strerror or exc}")
            return
        if root and read_only_root(c.spec):
            # The test world's own files (a file:// store), at their own path: reachable and writable under
            # the read-only root, and whatever the container mounts above them (spotguard's emptyDir at /tmp).
            mounts += [(path, path, False) for path in self.agent.writable_host_paths if os.path.isdir(path)]
        if root and self._hosts_attached:  # kubelet's per-pod /etc/hosts, kept current by the agent
            mounts.append((str(self.dir / HOSTS_FILE), "/etc/hosts", False))
        termination = self._termination_file(c) if root else None
        log_path = self.dir / f"{c.name}.log"
        read_status, status_fd = os.pipe()
        network = self.network
        spec = LaunchSpec(
            [*command, *args],
            c.spec.get("workingDir") or "/",
            mounts,
            termination,
            root,
            pid_namespace=pid_namespace,
            status_fd=status_fd,
            net_namespace=network.net_namespace if network else None,
            uts_namespace=network.uts_namespace if network else None,
            read_only_root=root and read_only_root(c.spec),
        )
        try:
            with log_path.open("ab") as out:
                if c.started_at is not None:  # it ran before
                    c.prev_log_offset = c.log_offset
                c.log_offset = os.fstat(out.fileno()).st_size  # the fallback message reads this run's output only
                proc = self.agent.spawner.spawn(
                    launch_argv(spec),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group, killed as a whole
                    cwd="/",
                    pass_fds=(status_fd,),
                )
        except OSError as exc:
            os.close(read_status)
            self._not_started(c, "StartError", str(exc))
            return
        finally:
            os.close(status_fd)
        error = start_error(read_status)
        os.close(read_status)
        if error:
            signal_group(proc.pid, signal.SIGKILL)  # it exits by itself; this makes sure
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            log.warning("pod %s: container %s did not start: %s", self.key, c.name, error)
            self._termination_message(c, 0)  # drops the unused message file
            self._not_started(c, "StartError", error)
            return
        c.proc = proc
        c.shim = pid_namespace is not None
        c.container_id = secrets.token_hex(32)
        c.started_at = utc_now()
        c.state = {"running": {"startedAt": c.started_at}}
        with contextlib.suppress(OSError):
            (self.dir / f"{c.name}.pid").write_text(f"{proc.pid} {process_start_time(proc.pid)}")
        threading.Thread(target=self._reap, args=(c, proc), name=f"reap {self.key}/{c.name}", daemon=True).start()

    def _prepare_network(self) -> None:
        """The pod sandbox: its own network (IP, ``lo``, ``eth0``), hostname, and hosts file.

        hostNetwork pods, and every pod of an agent that cannot build
        namespaces, stay on the host's network with the node's address.
        Retried, like kubelet's sandbox creation, until it works.
        """
        pool = self.agent.ip_pool
        if pool is not None and not self.host_network:
            while True:
                network = PodNetwork(pool, self.key, self.hostname, self.agent.host_ports, self.agent.host_services)
                try:
                    network.create(self.agent.spawner.spawn)
                    break
                except OSError as exc:
                    log.warning("pod %s: sandbox: %s", self.key, exc.strerror or exc)
                    self._publish()
                    self._event("FailedCreatePodSandBox", f"Failed to create pod sandbox: {exc.strerror or exc}")
                    self._sleep(RETRY_SECONDS)
            assert network.sandbox is not None and network.ip is not None
            self.network, self.pod_ip = network, network.ip
            with contextlib.suppress(OSError):
                pid = network.sandbox.pid
                (self.dir / NETWORK_PIDFILE).write_text(f"{pid} {process_start_time(pid)}")
        if os.geteuid() == 0:
            spec = self.pod["spec"]
            hosts = HostsFile(
                self.dir / HOSTS_FILE,
                self.namespace,
                self.pod_ip,
                self.hostname,
                spec.get("subdomain") or "",
                self.network is None,
            )
            self.agent.hosts.attach(self.uid, hosts)
            self._hosts_attached = True

    def _release_network(self) -> None:
        """Tear the pod's network down (its processes are gone); the reported IP stays, as with kubelet."""
        network, self.network = self.network, None
        if network is not None:
            network.destroy()
            with contextlib.suppress(OSError):
                (self.dir / NETWORK_PIDFILE).unlink()
        if self._hosts_attached:
            self._hosts_attached = False
            self.agent.hosts.detach(self.uid)

    def _pid_namespace(self) -> str:
        """The PID namespace of a container: its own, or with shareProcessNamespace the pod's.

        The pod's is held by a sandbox process (kubelet's "pause" container),
        started with the first container that needs it; raises OSError if it
        cannot be started.
        """
        if not self.share_processes:
            return NEW_PID_NAMESPACE
        if self._sandbox is None or self._sandbox.poll() is not None:
            read_status, status_fd = os.pipe()
            spec = LaunchSpec(
                [sys.executable, "-I", "-S", "-c", PAUSE_PROGRAM],
                namespace=False,
                status_fd=status_fd,
                pid_namespace=NEW_PID_NAMESPACE,
            )
            try:
                proc = self.agent.spawner.spawn(
                    launch_argv(spec),
                    env=self.agent.base_env(self.pod["spec"].get("hostname") or self.name),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    cwd="/",
                    pass_fds=(status_fd,),
                )
            except OSError:
                os.close(read_status)
                raise
            finally:
                os.close(status_fd)
            error = start_error(read_status)
            os.close(read_status)
            if error:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait(30)
                raise OSError(0, error)
            self._sandbox = proc
            with contextlib.suppress(OSError):
                (self.dir / SANDBOX_PIDFILE).write_text(f"{proc.pid} {process_start_time(proc.pid)}")
        # The sandbox's shim created the namespace; its child is the namespace's PID 1.
        return f"/proc/{self._sandbox.pid}/ns/pid_for_children"

    def _stop_sandbox(self) -> None:
        proc, self._sandbox = self._sandbox, None
        if proc is not None:
            signal_group(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    def _termination_file(self, c: Container) -> tuple[str, str] | None:
        """A fresh, empty message file for this run of ``c`` (host path, terminationMessagePath)."""
        path = str(c.spec.get("terminationMessagePath", DEFAULT_TERMINATION_MESSAGE_PATH) or "")
        if not path.startswith("/"):
            return None
        host = self.dir / f"{c.name}.termination-log"
        # A new file, not the old one truncated: a leftover process of an earlier run cannot write into it.
        with contextlib.suppress(FileNotFoundError):
            host.unlink()
        host.touch()
        host.chmod(0o666)  # as kubelet: writable by a container that does not run as root
        c.termination_file = host
        return str(host), path

    def _termination_message(self, c: Container, code: int) -> str:
        """What kubelet reports as the message of a run of ``c`` that ended with ``code``."""
        data = b""
        if c.termination_file is not None:
            data = read_tail(c.termination_file, MAX_TERMINATION_MESSAGE)
            with contextlib.suppress(OSError):
                c.termination_file.unlink()
            c.termination_file = None
        if not data and code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            # One byte more than needed, to see whether the tail starts at a line.
            tail = read_tail(self.dir / f"{c.name}.log", MAX_LOG_TAIL_BYTES + 1, c.log_offset)
            data = log_tail(tail)
        return data.decode("utf-8", "replace")

    def _not_started(self, c: Container, reason: str, message: str) -> None:
        c.proc, c.container_id, c.started_at = None, None, utc_now()
        self._q.put(Exited(c, None, 128, reason, message))

    def _reap(self, c: Container, proc: subprocess.Popen[bytes]) -> None:
        code = exit_code_of(proc.wait())
        # Like a runtime tearing down the container: nothing of it outlives its main process.
        signal_group(proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            (self.dir / f"{c.name}.pid").unlink()
        self._q.put(Exited(c, proc, code))

    def _record_exit(self, ev: Exited) -> None:
        c = ev.container
        term: JSON = {
            "exitCode": ev.code,
            "reason": ev.reason or ("Completed" if ev.code == 0 else "Error"),
            "startedAt": c.started_at or utc_now(),
            "finishedAt": utc_now(),
        }
        message = ev.message or ""
        if ev.proc is not None:
            extra = self._termination_message(c, ev.code)
            message = f"{message}: {extra}" if message and extra else message or extra
        if message:
            term["message"] = message
        if c.container_id:
            term["containerID"] = f"processnode://{c.container_id}"
        c.state = {"terminated": term}
        c.proc = None

    def _kill_all(self) -> None:
        for c in (*self.init, *self.main):
            proc = c.proc
            if proc is not None:
                signal_group(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
                c.proc = None
        self._stop_sandbox()

    # -- env and volumes --

    def _object_data(self, kind: str, name: str, optional: bool) -> dict[str, bytes] | None:
        """Data of a Secret or ConfigMap of this pod's namespace; None if optional and missing."""
        try:
            obj = self.agent.kube.get(f"/api/v1/namespaces/{self.namespace}/{kind}/{name}")
        except ApiError as exc:
            ignore_missing(exc)
            if optional:
                return None
            raise NotYet(f'{kind[:-1]} "{name}" not found') from None  # kubelet's words
        data = {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}
        for k, v in (obj.get("data") or {}).items():
            data[k] = base64.b64decode(v) if kind == "secrets" else v.encode()
        return data

    def _env(self, c: Container) -> dict[str, str]:
        env = self.agent.base_env(self.hostname)
        # A container's temporary files are its own and go with its pod, as in its own /tmp under kubelet
        # (torchrun, for one, leaves a directory in the temporary directory at every run); the
        # container's own env may still set TMPDIR.
        if not read_only_root(c.spec):  # a read-only root has no writable /tmp but what the pod mounts there
            env["TMPDIR"] = str(self._own_tmp(c))
        for src in c.spec.get("envFrom") or []:
            for kind, key in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
                ref = src.get(key)
                if ref:
                    data = self._object_data(kind, ref["name"], bool(ref.get("optional"))) or {}
                    for k, v in data.items():
                        env[src.get("prefix", "") + k] = v.decode("utf-8", "surrogateescape")
        for var in c.spec.get("env") or []:
            source = var.get("valueFrom")
            if source is None:
                env[var["name"]] = expand_vars(var.get("value", ""), env)
            elif "fieldRef" in source:
                env[var["name"]] = field_value(self.pod, source["fieldRef"]["fieldPath"], self.pod_ip)
            elif "secretKeyRef" in source or "configMapKeyRef" in source:
                kind = "secrets" if "secretKeyRef" in source else "configmaps"
                ref = source.get("secretKeyRef") or source["configMapKeyRef"]
                optional = bool(ref.get("optional"))
                values = self._object_data(kind, ref["name"], optional)
                if values is not None and ref["key"] in values:
                    env[var["name"]] = values[ref["key"]].decode("utf-8", "surrogateescape")
                elif not optional:
                    what = "Secret" if kind == "secrets" else "ConfigMap"
                    raise NotYet(f"couldn't find key {ref['key']} in {what} {self.namespace}/{ref['name']}")
            else:
                raise Unsupported(f"env {var['name']}: valueFrom {sorted(source)} is not supported by the process node")
        return env

    def _own_tmp(self, c: Container) -> Path:
        """The container's temporary directory, below the pod's volumes (removed with them)."""
        path = self.volumes_dir / "tmp" / c.name
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o1777)  # any user the container runs as, as /tmp
        return path

    def _prepare_volumes(self) -> bool:
        """Materialise the pod's volumes, retrying while a Secret/ConfigMap is missing."""
        while True:
            try:
                self._volumes = self._materialise_volumes()
                return True
            except Unsupported as exc:
                self.phase, self.reason, self.message = "Failed", "UnsupportedVolume", str(exc)
                self._publish()
                return False
            except NotYet as exc:
                # As kubelet: the containers stay waiting (ContainerCreating), the reason goes to an Event.
                self._publish()
                self._event("FailedMount", str(exc))
                self._sleep(RETRY_SECONDS)

    def _materialise_volumes(self) -> dict[str, Path]:
        out: dict[str, Path] = {}
        for vol in self.pod["spec"].get("volumes") or []:
            try:
                out[vol["name"]] = self._materialise_volume(vol)
            except NotYet as exc:
                raise NotYet(f'MountVolume.SetUp failed for volume "{vol["name"]}" : {exc}') from None
        return out

    def _materialise_volume(self, vol: JSON) -> Path:
        """One volume's directory (or hostPath) on the host."""
        name = vol["name"]
        kind = next((k for k in vol if k != "name"), "")
        target: Path = self.volumes_dir / name
        if kind in READ_ONLY_VOLUMES:
            self._read_only.add(name)
        if kind == "emptyDir":
            target.mkdir(parents=True, exist_ok=True)
        elif kind == "hostPath":
            target = self._host_path(vol["hostPath"])
        elif kind in READ_ONLY_VOLUMES:
            files = self._volume_files(kind, vol[kind])
            shutil.rmtree(target, ignore_errors=True)
            mode = vol[kind].get("defaultMode", 0o644)
            for rel, (content, item_mode) in files.items():
                path = target / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content)
                path.chmod(item_mode if item_mode is not None else mode)
            target.mkdir(parents=True, exist_ok=True)
        else:
            raise Unsupported(f"volume {name!r}: type {kind!r} is not supported by the process node")
        return target

    @staticmethod
    def _host_path(src: JSON) -> Path:
        path, kind = Path(src["path"]), src.get("type", "")
        if kind == "FileOrCreate" and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        elif kind in ("", "DirectoryOrCreate") and not path.exists():
            path.mkdir(parents=True, exist_ok=True)
        elif not path.exists():
            raise NotYet(f"hostPath {path} ({kind}) does not exist")
        return path

    def _volume_files(self, kind: str, src: JSON) -> dict[str, tuple[bytes, int | None]]:
        """The files of a secret/configMap/downwardAPI/projected volume."""
        if kind == "secret":
            return self._keyed_files("secrets", src["secretName"], src)
        if kind == "configMap":
            return self._keyed_files("configmaps", src["name"], src)
        if kind == "downwardAPI":
            return self._downward_files(src.get("items") or [])
        files: dict[str, tuple[bytes, int | None]] = {}
        for source in src.get("sources") or []:
            if "secret" in source:
                files.update(self._keyed_files("secrets", source["secret"]["name"], source["secret"]))
            elif "configMap" in source:
                files.update(self._keyed_files("configmaps", source["configMap"]["name"], source["configMap"]))
            elif "downwardAPI" in source:
                files.update(self._downward_files(source["downwardAPI"].get("items") or []))
            elif "serviceAccountToken" in source:
                files.update(self._token_file(source["serviceAccountToken"]))
            else:
                raise Unsupported(f"projected source {sorted(source)} is not supported by the process node")
        return files

    def _keyed_files(self, kind: str, name: str, src: JSON) -> dict[str, tuple[bytes, int | None]]:
        optional = bool(src.get("optional"))
        data = self._object_data(kind, name, optional)
        return projected_items(data or {}, src.get("items"), optional, "secret" if kind == "secrets" else "config")

    def _downward_files(self, items: list[JSON]) -> dict[str, tuple[bytes, int | None]]:
        out: dict[str, tuple[bytes, int | None]] = {}
        for item in items:
            if "fieldRef" not in item:
                raise Unsupported(f"downwardAPI item {item.get('path')!r}: only fieldRef is supported")
            value = field_value(self.pod, item["fieldRef"]["fieldPath"], self.pod_ip)
            out[safe_relpath(item["path"])] = (value.encode(), item.get("mode"))
        return out

    def _token_file(self, src: JSON) -> dict[str, tuple[bytes, int | None]]:
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        spec: JSON = {
            "audiences": [src["audience"]] if src.get("audience") else [],
            "expirationSeconds": int(src.get("expirationSeconds", 3600)),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid},
        }
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        try:
            token = self.agent.kube.post(f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{sa}/token", body)
        except ApiError as exc:
            raise NotYet(f"token for serviceaccount {self.namespace}/{sa}: {exc}") from None
        return {safe_relpath(src["path"]): (token["status"]["token"].encode(), None)}

    def _mounts(self, c: Container, env: dict[str, str]) -> list[tuple[str, str, bool]]:
        mounts = []
        for m in c.spec.get("volumeMounts") or []:
            src = self._volumes[m["name"]]
            # subPathExpr: $(VAR) from the container's environment, as kubelet expands it.
            sub = m.get("subPath") or (expand_vars(m["subPathExpr"], env) if m.get("subPathExpr") else "")
            if sub:
                src = src / safe_relpath(sub)
                if not src.exists():
                    src.mkdir(parents=True)
            read_only = bool(m.get("readOnly")) or m["name"] in self._read_only
            mounts.append((str(src), str(m["mountPath"]), read_only))
        return mounts

    def _cleanup(self) -> None:
        """Drop the pod's materialised volumes (logs stay). Its mounts vanished with its processes."""
        self._stop_sandbox()
        self._release_network()
        shutil.rmtree(self.volumes_dir, ignore_errors=True)
        for leftover in (*self.dir.glob("*.pid"), *self.dir.glob("*.termination-log")):
            with contextlib.suppress(OSError):
                leftover.unlink()

    # -- status --

    def _condition(self, kind: str, ok: bool, reason: str | None = None, message: str | None = None) -> JSON:
        status = "True" if ok else "False"
        previous = self._transitions.get(kind)
        if previous is None or previous[0] != status:
            self._transitions[kind] = (status, utc_now())
        cond: JSON = {
            "type": kind,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": self._transitions[kind][1],
        }
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        return cond

    def pod_status(self) -> JSON:
        """The pod's status as kubelet would report it now."""
        terminal = self.phase in ("Succeeded", "Failed")
        ready = self.phase == "Running" and all("running" in c.state for c in self.main)
        not_ready = [c.name for c in self.main if "running" not in c.state]
        not_ready_reason = "PodCompleted" if terminal else "ContainersNotReady"
        not_ready_msg = f"containers with unready status: [{' '.join(not_ready)}]"
        pending_init = [c.name for c in self.init if c.exit_code() != 0]
        conditions = [
            self._condition(
                "Initialized",
                self.initialized,
                None if self.initialized else "ContainersNotInitialized",
                None if self.initialized else f"containers with incomplete status: [{' '.join(pending_init)}]",
            ),
            self._condition("Ready", ready, None if ready else not_ready_reason, None if ready else not_ready_msg),
            self._condition(
                "ContainersReady", ready, None if ready else not_ready_reason, None if ready else not_ready_msg
            ),
            self._condition("PodScheduled", True),
        ]
        if self.disrupted:
            conditions.append(self._condition("DisruptionTarget", True, "TerminationByKubelet", SHUTDOWN_MESSAGE))
        status: JSON = {
            "phase": self.phase,
            "conditions": conditions,
            "hostIP": LOOPBACK,
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
            "startTime": self.start_time,
            "containerStatuses": [c.status() for c in self.main],
            "reason": self.reason,
            "message": self.message,
        }
        if self.init:
            status["initContainerStatuses"] = [c.status() for c in self.init]
        return status

    def _publish(self) -> None:
        """Patch the pod's status if it changed (never for a dead node or a stopping agent)."""
        if self.node.dead or self.agent.stopping.is_set():
            return
        status = self.pod_status()
        if status == self._published:
            return
        path = f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status"
        for attempt in range(3):
            try:
                self.agent.kube.patch(path, {"metadata": {"uid": self.uid}, "status": status})
                self._published = status
                return
            except ApiError as exc:
                if exc.status == 404:  # deleted
                    return
                log.warning("pod %s: status update failed (attempt %d): %s", self.key, attempt + 1, exc)
                if exc.status < 500 and exc.status not in (0, 429):
                    return  # a refusal (e.g. the name now belongs to a new pod): retrying will not help
                time.sleep(0.5)

    def _event(self, reason: str, message: str) -> None:
        """A Warning Event on the pod from kubelet, once per distinct reason and message (kubelet aggregates)."""
        if (reason, message) in self._events or self.node.dead or self.agent.stopping.is_set():
            return
        self._events.add((reason, message))
        now = utc_now()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{self.name}.{secrets.token_hex(8)}", "namespace": self.namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": self.name,
                "namespace": self.namespace,
                "uid": self.uid,
            },
            "reason": reason,
            "message": message,
            "type": "Warning",
            "source": {"component": "kubelet", "host": self.node.name},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.agent.kube.post(f"/api/v1/namespaces/{self.namespace}/events", event)
        except ApiError as exc:
            log.warning("pod %s: event %s not posted: %s", self.key, reason, exc)

    def _delete_pod(self) -> None:
        """Finish a graceful deletion, as kubelet does once the containers are gone."""
        if self.node.dead:
            return
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": self.uid},
        }
        try:
            self.agent.kube.delete(f"/api/v1/namespaces/{self.namespace}/pods/{self.name}", body)
        except ApiError as exc:
            if exc.status not in (404, 409):
                log.warning("pod %s: delete failed: %s", self.key, exc)
