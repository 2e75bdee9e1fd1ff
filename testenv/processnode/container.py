"""Container namespaces: what a container process sets up before it execs its command.

The pod's network and UTS namespaces (held by its sandbox), a PID namespace (the
container's own, or its pod's), a mount namespace with a
private ``/dev``, a fresh ``/proc`` and the volumes, then the command.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import signal
import stat
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

# What a container's private /dev keeps of the host's, when present: the devices a
# runtime gives every container, plus GPUs (CUDA needs /dev/nvidia*).
DEV_KEEP = ("null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "mqueue")
DEV_KEEP_PATTERNS = ("nvidia*",)
DEV_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
}
# mount(2) and unshare(2) flags.
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE, MS_STRICTATIME = 4096, 16384, 1 << 18, 1 << 24
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWUTS = 0x00020000, 0x20000000, 0x40000000, 0x04000000
PR_SET_PDEATHSIG = 1
# What a runtime can deliver to a container (kubelet's stop signal, `kill -s`): the
# shim in front of a container with its own PID namespace passes these on.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
NEW_PID_NAMESPACE = "new"
# The pod's PID 1 when its containers share a process namespace (the "pause" container):
# it only reaps the orphans that are re-parented to it.
PAUSE_PROGRAM = "import signal\nsignal.signal(signal.SIGCHLD, signal.SIG_IGN)\nwhile True:\n    signal.pause()\n"
START_FAILED = 128  # the exit code a runtime reports for a container that could not start


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
    # None: the host's PID namespace; "new": the container's own, its command is PID 1
    # there; else the path of a namespace to join (a pod's, /proc/N/ns/pid_for_children).
    pid_namespace: str | None = None
    # Write end of a pipe: an error before the exec is written there; the exec closes it.
    status_fd: int | None = None
    # The pod's network and UTS namespaces to join (/proc/N/ns/net, /proc/N/ns/uts of its
    # sandbox); None: the host's (hostNetwork).
    net_namespace: str | None = None
    uts_namespace: str | None = None
    # ``securityContext.readOnlyRootFilesystem``: "/" read-only; only the volumes, /dev and /proc are writable.
    read_only_root: bool = False


def launch_argv(spec: LaunchSpec) -> list[str]:
    """The argv that starts a container: :func:`container_init` in a fresh Python, then the command.

    ``-I`` keeps the container's own ``PYTHON*`` variables from changing the launcher; ``-S`` skips the
    site-packages (the launcher needs only the standard library and ``testenv``), which every pod's
    sandbox, pause and containers would otherwise load first (about 15 ms of CPU each).
    """
    root = str(Path(__file__).resolve().parents[2])  # the directory holding testenv/
    boot = (
        f"import sys; sys.path.insert(0, {root!r}); "
        "from testenv.processnode.container import container_init; "
        "sys.exit(container_init(sys.argv[1]))"
    )
    return [sys.executable, "-I", "-S", "-c", boot, json.dumps(asdict(spec))]


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

    With ``pid_namespace``, this process creates or joins the PID namespace and
    forks: the child (PID 1 in a new namespace, as a container's main process
    is) goes on as above and mounts a fresh ``/proc`` that shows only its
    namespace; this process stays as the container's shim, passes signals on
    to it and returns its exit code (128 + signal for a signal), like a
    runtime's shim. Only the child holds the status pipe, so its EOF still
    means that the command runs.
    """
    spec = json.loads(spec_json)
    status_fd = spec.get("status_fd")
    if status_fd is not None:
        os.set_inheritable(status_fd, False)  # the exec closes it: EOF tells the agent the command runs
    command: list[str] = spec["command"]
    pid_namespace = spec.get("pid_namespace")
    try:
        for path, kind, what in (
            (spec.get("net_namespace"), CLONE_NEWNET, "network"),
            (spec.get("uts_namespace"), CLONE_NEWUTS, "UTS"),
        ):
            if path:
                _join_namespace(path, kind, what)
        if pid_namespace:
            child = _fork_into_pid_namespace(pid_namespace)
            if child:
                if status_fd is not None:
                    os.close(status_fd)
                return _shim(child)
        if spec["namespace"]:
            _private_mounts(
                [tuple(m) for m in spec["mounts"]],
                spec.get("termination"),
                bool(pid_namespace),
                bool(spec.get("read_only_root")),
            )
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


def _libc() -> Any:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _check(rc: int, what: str) -> None:
    """errno in, OSError out."""
    if rc != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _join_namespace(path: str, kind: int, what: str) -> None:
    """Join the pod's namespace held by its sandbox (before the fork: children inherit it)."""
    libc = _libc()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise OSError(exc.errno, f"pod sandbox is gone: {path}: {exc.strerror}") from None
    try:
        _check(libc.setns(fd, kind), f"join the pod's {what} namespace {path}")
    finally:
        os.close(fd)


def _fork_into_pid_namespace(target: str) -> int:
    """Create (``"new"``) or join (a namespace file) a PID namespace and fork into it.

    Returns the child's pid in the parent, 0 in the child. Both calls only
    change where *children* go, hence the fork; the child dies with its parent
    (the shim), which dies with the agent.
    """
    libc = _libc()
    if target == NEW_PID_NAMESPACE:
        _check(libc.unshare(CLONE_NEWPID), "unshare the PID namespace")
    else:
        fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _check(libc.setns(fd, CLONE_NEWPID), f"join the PID namespace {target}")
        finally:
            os.close(fd)
    pid = os.fork()
    if pid == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return pid


def _shim(child: int) -> int:
    """Stay in front of the container's process: pass signals on, wait, return its exit code."""

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    _, status = os.waitpid(child, 0)  # retried after each forwarded signal (PEP 475)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


def _private_mounts(
    mounts: list[tuple[str, str, bool]], termination: list[str] | None, fresh_proc: bool, read_only_root: bool = False
) -> None:
    """Enter a new mount namespace and lay out /dev, the volumes and the termination message file.

    With ``fresh_proc`` (a process in its own PID namespace), a new ``/proc``
    shows that namespace's processes only, as in a container. With
    ``read_only_root``, the root mount is made read-only in this namespace
    only (the host's stays writable), after the mount points are made: what
    the container can write is its volumes, ``/dev`` and the host's other
    mounts (``/proc``, ``/sys``), as in a container whose root is read-only.
    """
    libc = _libc()
    check = _check

    def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        check(
            libc.mount(
                *(None if v is None else v.encode() for v in (src, dst, fstype)),
                flags,
                None if data is None else data.encode(),
            ),
            f"mount {src or fstype} at {dst}" if src or fstype else f"change mount {dst}",
        )

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
    dev = [
        (name, _open_path(f"/dev/{name}"))
        for name in sorted(os.listdir("/dev"))
        if name in DEV_KEEP or any(fnmatch.fnmatch(name, p) for p in DEV_KEEP_PATTERNS)
    ]
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
    if read_only_root:
        keep = os.statvfs("/").f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
        mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
    for fd, _, _ in binds:
        os.close(fd)
    for _, fd in dev:
        os.close(fd)
    if fresh_proc:  # last: the binds above go through the old /proc's magic links
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


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
