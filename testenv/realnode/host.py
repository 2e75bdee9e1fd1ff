"""What real nodes change on the host, and how each change is undone.

- the set's pod bridge (``sgrn<k>``, :mod:`testenv.realnode.config`): made by
  the set, with ``route_localnet`` on the bridge only (never the host's
  ``all``/``default``), its owner in the link's alias, deleted with the set;
- cgroups: a cgroupRoot per node in every cgroup v1 hierarchy, removed
  bottom-up once nothing runs in them;
- mounts: containerd's snapshots, the pods' network namespaces and shm,
  kubelet's volumes, all below the node's state directory (or below
  ``/run/containerd`` and ``/var/lib/kubelet``), unmounted deepest first;
- files the kubelet and containerd write outside the state directory whatever
  their flags (:data:`HOST_PATHS`), removed when this set made them;
- the kernel settings the kubelet tunes when it starts (:data:`KUBELET_SYSCTLS`),
  put back.

Each node's containerd (with its shims and containers) and kubelet share a
mount namespace of their own, where the kubelet's fixed paths
(:data:`PRIVATE_PATHS`) are the node's own directories: kubelets sharing
/var/log/pods remove one another's pod logs (a kubelet takes the log directory
of a pod it does not know for a deleted pod's), and the last one to start owns
/var/lib/kubelet's device-plugin socket. Their mounts go with the namespace.

Processes are killed all at once (:func:`kill_all`): SIGKILL to every pid
first, then the wait, so a lost node's kubelet, containerd, shims and
containers die together.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

CGROUP_V1 = Path("/sys/fs/cgroup")
#: Paths the kubelet (device-plugin socket, pod logs), the CNI library (its cache) and the
#: containerd shims (their sockets) use whatever they are told.
HOST_PATHS = (
    Path("/var/lib/kubelet"),
    Path("/var/log/pods"),
    Path("/var/log/containers"),
    Path("/var/lib/cni"),
    Path("/run/containerd"),
)
#: The kernel settings the kubelet tunes at start (``protectKernelDefaults: false``; with ``true`` it
#: refuses to start on a machine whose values differ): put back when the set stops.
KUBELET_SYSCTLS = tuple(
    Path("/proc/sys", name)
    for name in (
        "vm/overcommit_memory",
        "vm/panic_on_oom",
        "kernel/panic",
        "kernel/panic_on_oops",
        "kernel/keys/root_maxkeys",
        "kernel/keys/root_maxbytes",
    )
)
#: The kubelet's fixed paths that each node gets to itself (:func:`in_node_mounts`).
PRIVATE_PATHS = (Path("/var/lib/kubelet"), Path("/var/log/pods"), Path("/var/log/containers"))
#: Executables whose processes belong to real nodes.
NODE_PROGRAMS = ("kubelet", "containerd", "containerd-shim-runc-v2", "runc")
OWNER_TAG = "spotguard-realnode"


def run(argv: list[str], check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60, check=False)
    if check and proc.returncode != 0:
        raise OSError(0, f"{' '.join(argv)}: {(proc.stderr or proc.stdout).strip()}")
    return proc


def process_start(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_alive(owner: str) -> bool:
    """Whether ``"<pid> <start time>"`` still names a live process."""
    pid, _, start = owner.partition(" ")
    return pid.isdigit() and process_start(int(pid)) == start


def me() -> str:
    return f"{os.getpid()} {process_start(os.getpid())}"


def sysctls_now() -> dict[Path, str]:
    return {p: p.read_text().strip() for p in KUBELET_SYSCTLS if p.exists()}


def restore_sysctls(before: dict[Path, str]) -> None:
    for path, value in before.items():
        if path.read_text().strip() != value:
            path.write_text(value)


# --- the pod bridge ------------------------------------------------------------


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def link_owner(name: str) -> str | None:
    """The owner recorded in a link's alias, or None for a link that is not ours."""
    try:
        alias = Path("/sys/class/net", name, "ifalias").read_text().strip()
    except OSError:
        return None
    tag, _, owner = alias.partition(" ")
    return owner if tag == OWNER_TAG else None


def claim_bridge(name: str, gateway: str, prefix_len: int) -> bool:
    """Make the bridge ``name`` ours (False: another live set holds it). A bridge whose owner
    is gone is taken over: a set that died without cleaning up left it."""
    if link_exists(name):
        owner = link_owner(name)
        if owner is None or owner_alive(owner):
            return False
        run(["ip", "link", "del", name], check=False)
    if run(["ip", "link", "add", name, "type", "bridge"], check=False).returncode != 0:
        return False  # another set made it a moment ago
    run(["ip", "link", "set", "dev", name, "alias", f"{OWNER_TAG} {me()}"])
    run(["ip", "addr", "replace", f"{gateway}/{prefix_len}", "dev", name])
    # Loopback-range addresses on a real interface: allowed on this bridge only, where the kernel
    # checks it (the interface a packet comes in on or leaves by); the host's defaults stay.
    Path(f"/proc/sys/net/ipv4/conf/{name}/route_localnet").write_text("1")
    run(["ip", "link", "set", name, "up"])
    return True


def bridge_ports(name: str) -> list[str]:
    try:
        return sorted(p.name for p in Path("/sys/class/net", name, "brif").iterdir())
    except OSError:
        return []


def delete_bridge(name: str) -> None:
    """Delete the bridge and whatever veth is still plugged into it."""
    for port in bridge_ports(name):
        run(["ip", "link", "del", port], check=False)
    if link_exists(name):
        run(["ip", "link", "del", name], check=False)


# --- cgroups -------------------------------------------------------------------


def cgroup_hierarchies() -> list[Path]:
    """The mounted cgroup hierarchies: every v1 one, and the v2 ``unified`` of a hybrid machine, where
    runc makes each container's cgroup too."""
    try:
        return sorted(p for p in CGROUP_V1.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def make_cgroup_root(root: str) -> None:
    """The node's cgroupRoot in every hierarchy (the kubelet refuses to start without it)."""
    for h in cgroup_hierarchies():
        d = h / root.lstrip("/")
        d.mkdir(exist_ok=True)
        if (h / "cpuset.cpus").exists():  # a new v1 cpuset has no CPUs and no memory nodes until given some
            for f in ("cpuset.cpus", "cpuset.mems"):
                (d / f).write_text((h / f).read_text())


def cgroup_pids(root: str) -> set[int]:
    """Every pid in the node's cgroups, in every hierarchy."""
    pids: set[int] = set()
    for h in cgroup_hierarchies():
        top = h / root.lstrip("/")
        if not top.exists():
            continue
        for dirpath, _dirs, _files in os.walk(top):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in (Path(dirpath) / "cgroup.procs").read_text().split())
    return pids


def remove_cgroup_root(root: str) -> list[str]:
    """rmdir the node's cgroups bottom-up; returns those that would not go (something still runs there)."""
    stuck = []
    # A cgroup is busy for a moment after its last process has died: retry, for 10 s in all (one
    # that still holds a process never goes, and a tree has hundreds of them).
    deadline = time.monotonic() + 10
    for h in cgroup_hierarchies():
        top = h / root.lstrip("/")
        if not top.exists():
            continue
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: -len(Path(w[0]).parts)):
            while True:
                try:
                    Path(dirpath).rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        stuck.append(dirpath)
                        break
                    time.sleep(0.1)
    return stuck


# --- processes -----------------------------------------------------------------


def pids_with_env(entry: str) -> set[int]:
    """Live processes whose environment holds ``entry`` (``NAME=value``)."""
    needle = entry.encode()
    found = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                found.add(int(d.name))
        except OSError:
            continue
    return found


def kill_all(pids: Iterable[int], timeout: float = 10.0) -> None:
    """SIGKILL every pid at once, then wait until each is gone (or a zombie)."""
    pids = set(pids) - {os.getpid()}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def node_program_pids() -> set[int]:
    """Every process on the machine that runs one of :data:`NODE_PROGRAMS`."""
    found = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            exe = os.readlink(d / "exe")
        except OSError:
            continue
        if Path(exe).name in NODE_PROGRAMS and alive(int(d.name)):
            found.add(int(d.name))
    return found


# --- mounts and files ----------------------------------------------------------


def in_node_mounts(private: Path, argv: list[str]) -> list[str]:
    """``argv`` in a new mount namespace where each of :data:`PRIVATE_PATHS` is a directory of
    ``private`` (made here, as are the mount points, which the set removes with :data:`HOST_PATHS`)."""
    binds = []
    for path in PRIVATE_PATHS:
        source = private / str(path.relative_to("/")).replace("/", "-")
        source.mkdir(parents=True, exist_ok=True)
        path.mkdir(parents=True, exist_ok=True)
        binds += [str(source), str(path)]
    script = 'set -e; while [ "$1" != -- ]; do mount --bind "$1" "$2"; shift 2; done; shift; exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *binds, "--", *argv]


def in_mounts_of(pid: int, argv: list[str]) -> list[str]:
    """``argv`` in the mount namespace of process ``pid``."""
    return ["nsenter", f"--mount=/proc/{pid}/ns/mnt", "--", *argv]


def mounts_below(*roots: Path, pid: int | None = None) -> list[str]:
    """Mount points at or below any of ``roots``, deepest first, as this process (or ``pid``) sees them."""
    prefixes = [str(r.resolve()) if r.exists() else str(r) for r in roots]
    found = []
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid or 'self'}/mountinfo").read_text().splitlines():
            point = line.split()[4].encode().decode("unicode_escape")
            if any(point == p or point.startswith(p.rstrip("/") + "/") for p in prefixes):
                found.append(point)
    return sorted(set(found), key=lambda p: -len(Path(p).parts))


def unmount_below(*roots: Path) -> None:
    """Unmount everything at or below ``roots``, deepest first (lazily: a busy mount still goes)."""
    for _ in range(3):  # a mount can hide another at the same point
        points = mounts_below(*roots)
        if not points:
            return
        for point in points:
            run(["umount", "-l", point], check=False)


def _entries(path: Path, depth: int = 2) -> set[str]:
    """Relative paths below ``path``, ``depth`` levels deep."""
    found: set[str] = set()
    level = [""]
    for _ in range(depth):
        nxt = []
        for rel in level:
            d = path / rel
            if not d.is_dir() or d.is_symlink():
                continue
            with contextlib.suppress(OSError):
                for name in os.listdir(d):
                    nxt.append(f"{rel}/{name}" if rel else name)
        found.update(nxt)
        level = nxt
    return found


def host_paths_now() -> dict[Path, set[str]]:
    """What each of :data:`HOST_PATHS` holds now, two levels deep (absent paths are left out)."""
    return {p: _entries(p) for p in HOST_PATHS if p.exists()}


def restore_host_paths(before: dict[Path, set[str]]) -> None:
    """Remove what appeared in :data:`HOST_PATHS` since ``before`` (:func:`host_paths_now`): a path
    that was absent entirely, otherwise each entry that was not there, so another set's stay."""
    for path in HOST_PATHS:
        if not path.exists():
            continue
        if path not in before:
            unmount_below(path)
            shutil.rmtree(path, ignore_errors=True)
            continue
        for rel in sorted(_entries(path) - before[path], key=lambda r: -r.count("/")):
            target = path / rel
            unmount_below(target)
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    target.unlink()
