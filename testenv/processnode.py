"""Process node: a test-support stand-in for kubelet.

There is no kubelet or container runtime in the test environment, so this agent
registers Node objects with a real kube-apiserver (spot GPU pool labels, GPU
capacity, Ready condition, node-status and Lease heartbeats) and runs each pod
bound to its nodes as local processes:

- init containers in order, then the containers concurrently, each in its own
  process group; ``command`` + ``args`` only (there are no images), ``env`` and
  ``envFrom`` (plain values, downward API fields, Secret and ConfigMap keys),
  ``workingDir``;
- volumes (``emptyDir``, ``hostPath``, ``secret``, ``configMap``,
  ``downwardAPI``, ``projected``) bind-mounted at their ``mountPath`` inside a
  private mount namespace per container (needs root), with a private ``/dev``
  (the usual devices, GPUs, a ``/dev/shm`` tmpfs); mount sources are opened
  before anything is mounted, so an emptyDir at ``/tmp`` hides none of them;
- termination messages like kubelet: a fresh file per run at
  ``terminationMessagePath`` (default ``/dev/termination-log``, inside the
  private ``/dev``, never the host's), whose last 4096 bytes become
  ``terminated.message``; ``FallbackToLogsOnError`` uses the run's log (last 80
  lines, at most 2048 bytes) after a failure with an empty file; a command that
  cannot be executed ends ``StartError`` with exit code 128;
- pod and container status like kubelet (Pending, Running, Succeeded/Failed,
  exit codes, reasons), restart policies, graceful deletion (SIGTERM, wait
  ``terminationGracePeriodSeconds``, SIGKILL, then delete with grace 0);
- the three ways a spot node dies, on request: ``drain`` (cordon + eviction
  API), ``shutdown`` (graceful node shutdown: pods end ``Failed`` /
  ``Terminated`` with a ``DisruptionTarget`` condition) and ``kill`` (processes
  SIGKILLed, heartbeats stop, Node deleted, a fresh node joins).

Differences from a real runtime: SIGTERM goes to the container's whole process
group (a runtime signals only PID 1, which also ignores signals it has no
handler for); there is no PID or network namespace (podIP is 127.0.0.1); the
root filesystem is the host's, so mount points outside ``/dev`` and outside
volumes (directories, an empty file for a termination message path elsewhere)
are created on the host and stay; ``/dev/shm`` is per container, not per pod. Not
emulated: images, probes (a running container is ready), lifecycle hooks,
resource limits, ``subPathExpr``, token refresh for projected ServiceAccount
tokens. Container logs go to ``<state-dir>/pods/<namespace>_<pod>/<container>.log``.

    python -m testenv.processnode run --kubeconfig K --nodes 2 --state-dir D
    python -m testenv.processnode preempt --state-dir D --pod NAME --mode drain|shutdown|kill
    python -m testenv.processnode nodes --state-dir D
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import datetime as dt
import fnmatch
import http.server
import json
import logging
import os
import platform
import queue
import re
import secrets
import select
import shutil
import signal
import stat
import string
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, cast
from urllib.parse import urlparse

log = logging.getLogger("processnode")

JSON = dict[str, Any]

MODES = ("drain", "shutdown", "kill")
LOOPBACK = "127.0.0.1"
RUN_MARKER = "SPOTGUARD_TESTENV_RUN"
NODE_LEASE_NAMESPACE = "kube-node-lease"
HEARTBEAT_SECONDS = 5.0
LEASE_SECONDS = 40
DEFAULT_POD_GRACE = 30
SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
SHUTDOWN_REJECT_MESSAGE = "Pod was rejected as the node is shutting down."
# Volume kinds kubelet always mounts read-only.
READ_ONLY_VOLUMES = ("secret", "configMap", "downwardAPI", "projected")

# Kubelet's termination messages: the file's last 4096 bytes; with
# FallbackToLogsOnError and an empty file after a failure, the last 80 lines of
# the run's log, at most their last 2048 bytes.
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"
MAX_TERMINATION_MESSAGE = 4096
MAX_LOG_TAIL_LINES = 80
MAX_LOG_TAIL_BYTES = 2048
# What a container's private /dev keeps of the host's, when present: the devices a
# runtime gives every container, plus GPUs (CUDA needs /dev/nvidia*).
DEV_KEEP = ("null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "mqueue")
DEV_KEEP_PATTERNS = ("nvidia*",)
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}  # fmt: skip
# mount(2) and unshare(2) flags.
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE, MS_STRICTATIME = 4096, 16384, 1 << 18, 1 << 24
CLONE_NEWNS = 0x00020000
START_FAILED = 128  # the exit code a runtime reports for a container that could not start


def utc_now() -> str:
    """Kubernetes ``Time``: RFC 3339, seconds."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_now_micro() -> str:
    """Kubernetes ``MicroTime`` (Lease renewTime)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --- API access ---------------------------------------------------------------


class ApiError(Exception):
    """A non-2xx answer from the apiserver."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status
        self.body = body


class Kube:
    """Minimal JSON-in/JSON-out access to the apiserver, authenticated by a kubeconfig.

    Objects stay plain dicts (camelCase, as on the wire); that keeps status
    patches exact and avoids model round-trips.
    """

    def __init__(self, kubeconfig: str | os.PathLike[str]) -> None:
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        cfg.connection_pool_maxsize = 64  # one thread per pod, plus heartbeats
        self._api = client.ApiClient(cfg)
        self.server: str = cfg.host

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float | tuple[float, float] = 30.0,
        stream: bool = False,
    ) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = self._api.call_api(
                path,
                method,
                query_params=list((query or {}).items()),
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout,
            )
        except ApiException as exc:
            raise ApiError(int(exc.status or 0), str(exc.body or exc.reason)) from None
        if stream:
            return resp
        return json.loads(resp.data) if resp.data else {}

    def get(self, path: str, query: dict[str, str] | None = None) -> JSON:
        return dict(self.request("GET", path, query=query))

    def post(self, path: str, body: JSON) -> JSON:
        return dict(self.request("POST", path, body))

    def patch(self, path: str, body: JSON) -> JSON:
        """JSON merge patch: lists are replaced whole, which status updates rely on."""
        return dict(self.request("PATCH", path, body, content_type="application/merge-patch+json"))

    def delete(self, path: str, body: JSON | None = None) -> None:
        self.request("DELETE", path, body)


def _ignore_missing(exc: ApiError) -> None:
    if exc.status != 404:
        raise exc


# --- pure helpers ---------------------------------------------------------------


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_vars(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined variables are replaced, ``$$`` is ``$``."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(sub, text)


class Unsupported(Exception):
    """The pod asks for something this stand-in does not emulate (a permanent error)."""


class NotYet(Exception):
    """Something the pod needs does not exist yet (a Secret, a key): kubelet retries."""


_LABEL_REF = re.compile(r"metadata\.(labels|annotations)\['(.+)'\]")


def field_value(pod: JSON, path: str) -> str:
    """A downward API ``fieldRef`` value for a pod running on this loopback node."""
    md, spec = pod["metadata"], pod["spec"]
    m = _LABEL_REF.fullmatch(path)
    if m:
        return str((md.get(m.group(1)) or {}).get(m.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):  # downwardAPI volumes only
        items = md.get(path.split(".")[1]) or {}
        return "".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(items.items()))
    simple = {
        "metadata.name": md.get("name", ""),
        "metadata.namespace": md.get("namespace", ""),
        "metadata.uid": md.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": LOOPBACK,
        "status.podIPs": LOOPBACK,
        "status.hostIP": LOOPBACK,
    }
    if path not in simple:
        raise Unsupported(f"fieldRef {path!r} is not supported by the process node")
    return str(simple[path])


@dataclass(frozen=True)
class LaunchSpec:
    """What :func:`container_init` sets up in a new container process before it execs ``command``."""

    command: list[str]
    workdir: str = "/"
    # (host source, mountPath, read-only) per volume mount.
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)
    # (host file, terminationMessagePath): the container's own termination message file.
    termination: tuple[str, str] | None = None
    # A private mount namespace with a private /dev (needs root).
    namespace: bool = True
    # Write end of a pipe: an error before the exec is written there; the exec closes it.
    status_fd: int | None = None


def launch_argv(spec: LaunchSpec) -> list[str]:
    """The argv that starts a container: :func:`container_init` in a fresh Python, then the command.

    ``-I`` keeps the container's own ``PYTHON*`` variables from changing the launcher.
    """
    root = str(Path(__file__).resolve().parent.parent)
    boot = (f"import sys; sys.path.insert(0, {root!r}); "
            "from testenv.processnode import container_init; sys.exit(container_init(sys.argv[1]))")  # fmt: skip
    return [sys.executable, "-I", "-c", boot, json.dumps(asdict(spec))]


def container_init(spec_json: str) -> int:
    """The start of every container process: mounts, ``workingDir``, then exec of the command.

    With ``namespace``, the process gets its own mount namespace (private
    propagation: nothing leaks back to the host, and everything goes when the
    container's last process does) with a private ``/dev`` that holds the
    container's termination message file, and its volumes bind-mounted at
    their ``mountPath`` (parents first, so nested mounts land on top). Every
    source is opened before anything is mounted, so that a mount (an emptyDir
    at ``/tmp``) cannot hide the source of a later one (a secret volume kept
    under the state dir in ``/tmp``). A failure before the exec goes to the
    status pipe, and the process exits 128; returns only then.
    """
    spec = json.loads(spec_json)
    status_fd = spec.get("status_fd")
    if status_fd is not None:
        os.set_inheritable(status_fd, False)  # the exec closes it: EOF tells the agent the command runs
    command: list[str] = spec["command"]
    try:
        if spec["namespace"]:
            _private_mounts([tuple(m) for m in spec["mounts"]], spec.get("termination"))
        try:
            os.makedirs(spec["workdir"], exist_ok=True)
            os.chdir(spec["workdir"])
        except OSError as exc:
            raise OSError(exc.errno, f"workingDir {spec['workdir']!r}: {exc.strerror}") from None
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            if isinstance(exc, FileNotFoundError) and "/" not in command[0]:
                reason = "executable file not found in $PATH"
            raise OSError(exc.errno, f"exec: {json.dumps(command[0])}: {reason}") from None
    except OSError as exc:
        message = exc.strerror or str(exc)
        if status_fd is None:
            print(f"processnode: {message}", file=sys.stderr)
        else:
            os.write(status_fd, message.encode())
        return START_FAILED
    return START_FAILED  # not reached: execvp returns only by raising


def _private_mounts(mounts: list[tuple[str, str, bool]], termination: list[str] | None) -> None:
    """Enter a new mount namespace and lay out /dev, the volumes and the termination message file."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.unshare.argtypes = [ctypes.c_int]

    def check(rc: int, what: str) -> None:  # errno in, OSError out
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        check(libc.mount(*(None if v is None else v.encode() for v in (src, dst, fstype)), flags,
                         None if data is None else data.encode()),
              f"mount {src or fstype} at {dst}" if src or fstype else f"change mount {dst}")  # fmt: skip

    def bind(fd: int, dst: str, read_only: bool) -> None:
        _mount_point(dst, fd)
        # The magic link reaches the opened file even where its path is hidden now.
        mount(f"/proc/self/fd/{fd}", dst, None, MS_BIND | MS_REC)
        if read_only:
            keep = os.statvfs(dst).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
            mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)

    check(libc.unshare(CLONE_NEWNS), "unshare the mount namespace")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    binds = [(_open_path(src), dst, ro) for src, dst, ro in mounts]
    if termination is not None:
        binds.append((_open_path(termination[0]), termination[1], False))
    dev = [(name, _open_path(f"/dev/{name}")) for name in sorted(os.listdir("/dev"))
           if name in DEV_KEEP or any(fnmatch.fnmatch(name, p) for p in DEV_KEEP_PATTERNS)]  # fmt: skip
    # A private /dev first (the host's stays as it is), then the binds, parents first.
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_STRICTATIME, "mode=755,size=65536k")
    for name, fd in dev:
        bind(fd, f"/dev/{name}", False)
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/shm")
    mount("shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=1777")
    for fd, dst, ro in sorted(binds, key=lambda b: len(PurePosixPath(b[1]).parts)):
        bind(fd, dst, ro)
    for fd, _, _ in binds:
        os.close(fd)
    for _, fd in dev:
        os.close(fd)


def _open_path(path: str) -> int:
    try:
        return os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise OSError(exc.errno, f"open {path}: {exc.strerror}") from None


def _mount_point(path: str, fd: int) -> None:
    """A directory or an empty file at ``path``, like the source open as ``fd``, to mount onto."""
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.makedirs(path, exist_ok=True)
            return
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
    except OSError as exc:
        raise OSError(exc.errno, f"mount point {path}: {exc.strerror}") from None


def log_tail(data: bytes, max_lines: int = MAX_LOG_TAIL_LINES, max_bytes: int = MAX_LOG_TAIL_BYTES) -> bytes:
    """Kubelet's fallback termination message: the last ``max_lines`` lines of a log, then their last ``max_bytes``."""
    start = len(data)
    for _ in range(max_lines):
        if start == 0:
            break
        start = data.rfind(b"\n", 0, start - 1) + 1
    return data[start:][-max_bytes:] if max_bytes else b""


def read_tail(path: Path, limit: int, start: int = 0) -> bytes:
    """At most the last ``limit`` bytes of ``path`` from offset ``start`` on; empty if it cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(max(start, os.fstat(f.fileno()).st_size - limit))
            return f.read(limit)
    except OSError:
        return b""


def exit_code_of(returncode: int) -> int:
    """Popen's returncode (negative for signals) as a container exit code (128 + signal)."""
    return 128 - returncode if returncode < 0 else returncode


def safe_relpath(rel: str) -> str:
    """A volume item path must stay inside its volume, as the apiserver also checks."""
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or ".." in parts:
        raise Unsupported(f"volume item path {rel!r} must be relative and must not contain '..'")
    return rel


def projected_items(
    data: dict[str, bytes], items: list[JSON] | None, optional: bool, what: str
) -> dict[str, tuple[bytes, int | None]]:
    """Files of a secret/configMap volume source: every key, or just the listed ``items``."""
    if not items:
        return {safe_relpath(k): (v, None) for k, v in data.items()}
    out: dict[str, tuple[bytes, int | None]] = {}
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise NotYet(f"{what}: key {item['key']!r} not found")
        out[safe_relpath(item["path"])] = (data[item["key"]], item.get("mode"))
    return out


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


def node_manifest(name: str, settings: NodeSettings, kubelet_version: str) -> JSON:
    """The Node object of a spot GPU node (status included: nodes may set it on create)."""
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
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
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


# --- processes ------------------------------------------------------------------


class _Spawner:
    """Forks every container process from one thread that lives as long as the agent.

    Children get ``PR_SET_PDEATHSIG=SIGKILL`` (via ``setpriv``) so they die
    even if the agent is SIGKILLed; the kernel sends it when the *thread* that
    forked them exits, hence not from the short-lived pod threads.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[concurrent.futures.Future[subprocess.Popen[bytes]], list[str], JSON]]
        self._jobs = queue.Queue()
        self._prefix = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
        threading.Thread(target=self._loop, name="spawner", daemon=True).start()

    def spawn(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        fut: concurrent.futures.Future[subprocess.Popen[bytes]] = concurrent.futures.Future()
        self._jobs.put((fut, [*self._prefix, *argv], kwargs))
        return fut.result()

    def _loop(self) -> None:
        while True:
            fut, argv, kwargs = self._jobs.get()
            try:
                fut.set_result(cast("subprocess.Popen[bytes]", subprocess.Popen(argv, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)


def signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _start_error(fd: int, timeout: float = 60.0) -> str:
    """What a container's launcher wrote to its status pipe: empty once the command runs (the exec closed it)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0 and poller.poll(left * 1000):
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def process_start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat: tells a live process from a later one with the same PID."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split())[19]
    except (OSError, IndexError):
        return None


def kill_recorded_processes(state_dir: Path) -> list[int]:
    """SIGKILL the process groups recorded in ``*.pid`` files that are still the same processes.

    A safety net for an agent that died without cleaning up.
    """
    killed = []
    for pidfile in (state_dir / "pods").glob("*/*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid_text, start = pidfile.read_text().split()
            pid = int(pid_text)
            if process_start_time(pid) == start:
                signal_group(pid, signal.SIGKILL)
                killed.append(pid)
            pidfile.unlink()
    return killed


# --- pods -------------------------------------------------------------------------


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

    def __init__(self, agent: Agent, node: ProcessNode, pod: JSON) -> None:
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
        self.dir = agent.state_dir / "pods" / f"{self.namespace}_{self.name}"
        self.volumes_dir = agent.state_dir / "volumes" / self.uid
        self.phase = "Pending"
        self.initialized = not self.init
        self.reason: str | None = None
        self.message: str | None = None
        self.disrupted = False
        self.start_time = utc_now()
        self._volumes: dict[str, Path] = {}
        self._read_only: set[str] = set()
        self._q: queue.Queue[Request | Exited] = queue.Queue()
        self._deferred: list[Request] = []
        self._lock = threading.Lock()
        self._closed = False
        self._transitions: dict[str, tuple[str, str]] = {}
        self._published: JSON | None = None
        self._thread = threading.Thread(target=self._run, name=f"pod {self.key}", daemon=True)

    def start(self) -> None:
        self._thread.start()

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
            except _Stop as stop:
                if self._handle_stop(stop.request):
                    return
            self._idle()
        except Exception:
            log.exception("pod %s: runner failed", self.key)
        finally:
            self._kill_all()
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
        self.dir.mkdir(parents=True, exist_ok=True)
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
                c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
                self._publish()
                self._sleep(1.0)
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
        mounts = self._mounts(c)
        root = os.geteuid() == 0
        if mounts and not root:
            self._not_started(c, "ContainerCannotRun", "volumes need root (bind mounts in a private mount namespace)")
            return
        termination = self._termination_file(c) if root else None
        log_path = self.dir / f"{c.name}.log"
        read_status, status_fd = os.pipe()
        spec = LaunchSpec([*command, *args], c.spec.get("workingDir") or "/", mounts, termination, root, status_fd)
        try:
            with log_path.open("ab") as out:
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
        error = _start_error(read_status)
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
        c.container_id = secrets.token_hex(32)
        c.started_at = utc_now()
        c.state = {"running": {"startedAt": c.started_at}}
        with contextlib.suppress(OSError):
            (self.dir / f"{c.name}.pid").write_text(f"{proc.pid} {process_start_time(proc.pid)}")
        threading.Thread(target=self._reap, args=(c, proc), name=f"reap {self.key}/{c.name}", daemon=True).start()

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

    # -- env and volumes --

    def _object_data(self, kind: str, name: str, optional: bool) -> dict[str, bytes] | None:
        """Data of a Secret or ConfigMap of this pod's namespace; None if optional and missing."""
        try:
            obj = self.agent.kube.get(f"/api/v1/namespaces/{self.namespace}/{kind}/{name}")
        except ApiError as exc:
            _ignore_missing(exc)
            if optional:
                return None
            raise NotYet(f"{kind[:-1]} {self.namespace}/{name} not found") from None
        data = {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}
        for k, v in (obj.get("data") or {}).items():
            data[k] = base64.b64decode(v) if kind == "secrets" else v.encode()
        return data

    def _env(self, c: Container) -> dict[str, str]:
        env = self.agent.base_env(self.pod["spec"].get("hostname") or self.name)
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
                env[var["name"]] = field_value(self.pod, source["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in source or "configMapKeyRef" in source:
                kind = "secrets" if "secretKeyRef" in source else "configmaps"
                ref = source.get("secretKeyRef") or source["configMapKeyRef"]
                optional = bool(ref.get("optional"))
                values = self._object_data(kind, ref["name"], optional)
                if values is not None and ref["key"] in values:
                    env[var["name"]] = values[ref["key"]].decode("utf-8", "surrogateescape")
                elif not optional:
                    raise NotYet(f"key {ref['key']!r} not found in {kind[:-1]} {self.namespace}/{ref['name']}")
            else:
                raise Unsupported(f"env {var['name']}: valueFrom {sorted(source)} is not supported by the process node")
        return env

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
                for c in (*self.init, *self.main):
                    c.state = {"waiting": {"reason": "ContainerCreating", "message": f"MountVolume: {exc}"}}
                self._publish()
                self._sleep(1.0)

    def _materialise_volumes(self) -> dict[str, Path]:
        out: dict[str, Path] = {}
        for vol in self.pod["spec"].get("volumes") or []:
            name = vol["name"]
            kind = next((k for k in vol if k != "name"), "")
            target = self.volumes_dir / name
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
            out[name] = target
        return out

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
        return projected_items(data or {}, src.get("items"), optional, f"{kind[:-1]} {self.namespace}/{name}")

    def _downward_files(self, items: list[JSON]) -> dict[str, tuple[bytes, int | None]]:
        out: dict[str, tuple[bytes, int | None]] = {}
        for item in items:
            if "fieldRef" not in item:
                raise Unsupported(f"downwardAPI item {item.get('path')!r}: only fieldRef is supported")
            value = field_value(self.pod, item["fieldRef"]["fieldPath"])
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

    def _mounts(self, c: Container) -> list[tuple[str, str, bool]]:
        mounts = []
        for m in c.spec.get("volumeMounts") or []:
            src = self._volumes[m["name"]]
            if m.get("subPath"):
                src = src / safe_relpath(m["subPath"])
                if not src.exists():
                    src.mkdir(parents=True)
            read_only = bool(m.get("readOnly")) or m["name"] in self._read_only
            mounts.append((str(src), str(m["mountPath"]), read_only))
        return mounts

    def _cleanup(self) -> None:
        """Drop the pod's materialised volumes (logs stay). Its mounts vanished with its processes."""
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
        cond: JSON = {"type": kind, "status": status, "lastProbeTime": None,
                      "lastTransitionTime": self._transitions[kind][1]}  # fmt: skip
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
            "podIP": LOOPBACK,
            "podIPs": [{"ip": LOOPBACK}],
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


# --- nodes ------------------------------------------------------------------------


class ProcessNode:
    """One registered Node: heartbeats (status + Lease), readiness, cordon, retirement."""

    def __init__(self, agent: Agent, name: str) -> None:
        self.agent, self.name = agent, name
        self.uid = ""
        self.dead = False
        self.shutting_down = False
        self.preempt_lock = threading.Lock()
        self._ready = (True, "KubeletReady", "kubelet is posting ready status")
        self._ready_since = utc_now()
        self._created = utc_now()
        self._stop = threading.Event()
        self._status_lock = threading.Lock()

    @property
    def path(self) -> str:
        return f"/api/v1/nodes/{self.name}"

    @property
    def lease_path(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{NODE_LEASE_NAMESPACE}/leases/{self.name}"

    def register(self) -> None:
        manifest = node_manifest(self.name, self.agent.settings, self.agent.kubelet_version)
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
            {"type": t, "status": "False", "reason": r, "message": m,
             "lastHeartbeatTime": now, "lastTransitionTime": self._created}
            for t, r, m in healthy
        ]  # fmt: skip
        ready, reason, message = self._ready
        conds.append(
            {"type": "Ready", "status": "True" if ready else "False", "reason": reason, "message": message,
             "lastHeartbeatTime": now, "lastTransitionTime": self._ready_since}
        )  # fmt: skip
        return conds

    def heartbeat(self) -> None:
        """Post node status and renew the node's Lease, as kubelet does every few seconds."""
        with self._status_lock:
            if self.dead:
                return
            self.agent.kube.patch(f"{self.path}/status", {"status": {"conditions": self._conditions()}})
            renew = {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": utc_now_micro()}
            try:
                self.agent.kube.patch(self.lease_path, {"spec": renew})
            except ApiError as exc:
                _ignore_missing(exc)
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
                self.heartbeat()
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
        if not delete:
            return
        for path in (self.path, self.lease_path):
            try:
                self.agent.kube.delete(path)
            except ApiError as exc:
                if exc.status != 404:
                    log.warning("node %s: deleting %s failed: %s", self.name, path, exc)
        log.info("node %s deleted", self.name)


# --- the agent ----------------------------------------------------------------------


class PreemptError(Exception):
    """A preemption request that cannot be carried out (one line for the caller)."""


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
    ) -> None:
        self.kube, self.state_dir, self.count, self.settings = kube, state_dir, count, settings
        self.shutdown_grace = shutdown_grace
        self.delete_nodes = delete_nodes
        self.stopping = threading.Event()
        self.spawner = _Spawner()
        self.nodes: dict[str, ProcessNode] = {}
        self.runners: dict[str, PodRunner] = {}
        self.lock = threading.RLock()
        server = urlparse(kube.server)
        self.service_host = server.hostname or LOOPBACK
        self.service_port = str(server.port or 443)
        self.kubelet_version = "v1.20.2"
        self.eviction_version = "policy/v1beta1"
        self._server: http.server.ThreadingHTTPServer | None = None

    # -- start / stop --

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        version = self.kube.get("/version")
        self.kubelet_version = version.get("gitVersion", self.kubelet_version)
        minor = int(re.sub(r"\D", "", str(version.get("minor", "20"))) or 20)
        # policy/v1 Eviction arrived in 1.22; 1.20 takes only policy/v1beta1.
        self.eviction_version = "policy/v1" if minor >= 22 else "policy/v1beta1"
        for _ in range(self.count):
            self._add_node()
        threading.Thread(target=self._watch_pods, name="pod watch", daemon=True).start()
        self._server = http.server.ThreadingHTTPServer((LOOPBACK, 0), _ControlHandler)
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
        if self._server is not None:
            self._server.shutdown()
        with contextlib.suppress(OSError):
            (self.state_dir / "control.json").unlink()
        kill_recorded_processes(self.state_dir)

    def _add_node(self) -> ProcessNode:
        suffix = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))
        node = ProcessNode(self, f"{self.settings.prefix}-{suffix}")
        node.register()
        with self.lock:
            self.nodes[node.name] = node
        return node

    def node_names(self) -> list[str]:
        with self.lock:
            return sorted(self.nodes)

    def _write_control(self) -> None:
        assert self._server is not None
        info = {"pid": os.getpid(), "port": self._server.server_port, "nodes": self.node_names()}
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
        query = {"watch": "true", "resourceVersion": rv, "allowWatchBookmarks": "true",
                 "timeoutSeconds": "60", "fieldSelector": "spec.nodeName!="}  # fmt: skip
        resp = self.kube.request("GET", "/api/v1/pods", query=query, timeout=(10.0, 90.0), stream=True)
        try:
            for line in _lines(resp):
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

    def _resync(self, pods: list[JSON]) -> None:
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
            _ignore_missing(exc)

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
        body = {"apiVersion": self.eviction_version, "kind": "Eviction",
                "metadata": {"name": md["name"], "namespace": md["namespace"]}}  # fmt: skip
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


def _lines(resp: Any) -> Iterator[bytes]:
    """Newline-delimited JSON from a streaming watch response."""
    buf = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield line
    if buf.strip():
        yield buf


class _ControlHandler(http.server.BaseHTTPRequestHandler):
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
        agent: Agent = self.server.agent
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
    def _preempt_quietly(agent: Agent, args: tuple[Any, ...]) -> None:
        try:
            agent.preempt(*args)
        except Exception:
            log.exception("preempt %s failed", args)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base class signature
        log.debug("control: " + format, *args)


# --- client side: tests and the CLI -------------------------------------------------------


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
    ) -> ProcessNodes:
        state = Path(state_dir)
        state.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            (state / "control.json").unlink()
        child_env = dict(os.environ if env is None else env)
        # Containers inherit the agent's PATH: make the virtualenv's python/spotguard resolve.
        child_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{child_env.get('PATH', os.defpath)}"
        root = str(Path(__file__).resolve().parent.parent)
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, child_env.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", "testenv.processnode", "run", "--kubeconfig", str(kubeconfig),
                "--nodes", str(count), "--state-dir", str(state), *(extra_args or [])]  # fmt: skip
        with (state / "agent.log").open("ab") as out:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=child_env, start_new_session=True,
            )  # fmt: skip
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
                if len(names) == count and all(_node_ready(kube, n) for n in names):
                    return
            time.sleep(0.3)
        raise TimeoutError(f"process nodes not Ready after {timeout:.0f}s:\n{self.log_tail()}")

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
        req = urllib.request.Request(f"http://{LOOPBACK}:{port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
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

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        """Where a container's stdout/stderr are written."""
        return self.state_dir / "pods" / f"{namespace}_{pod}" / f"{container}.log"

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


def _node_ready(kube: Kube, name: str) -> bool:
    try:
        node = kube.get(f"/api/v1/nodes/{name}")
    except ApiError:
        return False
    conds = (node.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


# --- CLI ------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    labels = {}
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"processnode: --label {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        labels[key] = value
    settings = NodeSettings(
        prefix=args.name_prefix, cpu=args.cpu, memory=args.memory, pods=args.pods, gpus=args.gpus,
        instance_type=args.instance_type, taint=args.taint, labels=labels,
    )  # fmt: skip
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        kube = Kube(args.kubeconfig)
    except Exception as exc:  # noqa: BLE001 - a user error: one line
        print(f"processnode: cannot load kubeconfig {args.kubeconfig}: {exc}", file=sys.stderr)
        return 2
    agent = Agent(kube, Path(args.state_dir).resolve(), args.nodes, settings, args.shutdown_grace_period,
                  delete_nodes=not args.keep_nodes)  # fmt: skip
    try:
        agent.start()
        while not stop.wait(1.0):
            pass
    except ApiError as exc:
        print(f"processnode: apiserver refused: {exc}", file=sys.stderr)
        return 1
    finally:
        log.info("stopping")
        agent.stop()
    return 0


def _preempt(args: argparse.Namespace) -> int:
    try:
        result = ProcessNodes(args.state_dir).preempt(
            args.pod, args.namespace, args.mode, args.grace_period, not args.no_wait
        )
    except (PreemptError, RuntimeError) as exc:
        print(f"processnode: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


def _nodes(args: argparse.Namespace) -> int:
    try:
        print("\n".join(ProcessNodes(args.state_dir).node_names()))
    except RuntimeError as exc:
        print(f"processnode: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testenv.processnode", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="register nodes and run their pods until SIGTERM/SIGINT")
    run.add_argument("--kubeconfig", required=True)
    run.add_argument("--state-dir", required=True, help="logs, volumes and control.json go here")
    run.add_argument("--nodes", type=int, default=2)
    run.add_argument("--name-prefix", default="spot-gpu")
    run.add_argument("--cpu", default="16")
    run.add_argument("--memory", default="64Gi")
    run.add_argument("--pods", default="110")
    run.add_argument("--gpus", type=int, default=1, help="nvidia.com/gpu per node")
    run.add_argument("--instance-type", default="g5.4xlarge")
    run.add_argument("--taint", action="store_true", help="taint nodes spotguard.dev/spot=true:NoSchedule")
    run.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="extra node label")
    run.add_argument("--shutdown-grace-period", type=int, default=30, help="seconds, for --mode shutdown")
    run.add_argument("--keep-nodes", action="store_true", help="leave the Node objects when stopping")
    run.set_defaults(func=_run)

    pre = sub.add_parser("preempt", help="make the node running a pod die (drain, shutdown, kill)")
    pre.add_argument("--state-dir", required=True)
    pre.add_argument("--pod", required=True)
    pre.add_argument("--namespace", default="default")
    pre.add_argument("--mode", choices=MODES, required=True)
    pre.add_argument("--grace-period", type=int, default=None, help="shutdown grace period override (s)")
    pre.add_argument("--no-wait", action="store_true", help="return once the preemption has started")
    pre.set_defaults(func=_preempt)

    nodes = sub.add_parser("nodes", help="list the agent's live nodes")
    nodes.add_argument("--state-dir", required=True)
    nodes.set_defaults(func=_nodes)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
