"""Pod networking: a network namespace per pod on a host bridge, all inside 127.0.0.0/8.

Every pod without ``hostNetwork`` gets a *sandbox* process (kubelet's "pause"
container) that creates the pod's network and UTS namespaces and holds them
while the pod lives; the pod's containers join both before they exec. In the
namespace: ``lo`` (127.0.0.1 is the pod's own), and ``eth0``, one end of a veth
pair whose other end is a port of the machine's bridge :data:`BRIDGE`
(:data:`GATEWAY`/16). Pod IPs come from 127.64.0.0/16, so no packet can leave
the machine, and the host reaches every pod's IP directly over the bridge.
Loopback addresses on a non-loopback interface need ``route_localnet``: on the
host it is set on the bridge only (the kernel checks it per interface, on the
one a packet comes in on or goes out of: the bridge, never its veth ports),
so the host's ``all``/``default`` settings are never touched and the setting
goes with the bridge; in a pod it is set in the pod's own namespace.

Pod IPs are unique across every agent on the machine: a table under
:data:`NET_DIR`, changed under an exclusive lock, says which agent (pid and
start time) holds which IP. Every link an agent makes carries its owner in its
alias (``ip link ... alias``, :data:`OWNER_TAG`). A link is removed only by its
owner, or by anyone once its owner is provably gone (a dead agent's leftovers);
a link of a live owner, of any table, and a link without our alias are never
touched, so test worlds on one machine (two sessions, xdist workers, an agent
with another table) run side by side. The bridge goes when the last agent of
the table leaves and no pod is plugged into it; the table's files go with it.

The sandbox also mirrors host services into the pod, but only those a pod on a
real node could reach: for every TCP listener of the host on 127.0.0.1 or the
wildcard address whose port is allowed (the apiserver's, ports given to the
agent, ports registered in its host-services directory: see
:mod:`testenv.processnode.hostservices`), it listens on 127.0.0.1 at that port
inside the pod and forwards each connection to the host's 127.0.0.1
(``os.splice``, two threads per connection). Every other host listener (etcd,
the agent's control port, a test's private server) is unreachable from pods.
The listeners follow the host's and the allow list (refreshed every
:data:`MIRROR_SECONDS`): a service started or registered after the pod is
reachable too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Container, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from testenv.processnode.hostservices import allowed_ports

BRIDGE = "sgpod0"
GATEWAY = "127.64.0.1"
PREFIX_LEN = 16
# Pod IPs: 127.64.1.1 .. 127.64.255.254 (127.64.0.x is the bridge's).
_NET_BASE = (127 << 24) | (64 << 16)
VETH_PREFIX = "sgv"
# The alias of every link an agent makes: "<OWNER_TAG> <pid> <start time>" of the agent.
OWNER_TAG = "spotguard-podnet"
# The machine-wide allocation table and its lock.
NET_DIR = Path(os.environ.get("SPOTGUARD_PODNET_DIR", "/run/spotguard-podnet"))
MIRROR_SECONDS = 0.5
# Once every port a sandbox may mirror is mirrored, it re-reads the host's listeners this seldom:
# reading /proc/<pid>/net/tcp costs in proportion to every socket on the host, and a suite
# keeps dozens of sandboxes up. A port still missing is looked for every MIRROR_SECONDS, a
# registration is seen at once, and a service that went away at the first refused connection.
SETTLED_SECONDS = 5.0
MTU = 65535
CLONE_NEWNET, CLONE_NEWUTS = 0x40000000, 0x04000000
_SPLICE_CHUNK = 1 << 20
_F_SETPIPE_SZ = 1031


def available() -> bool:
    """Whether this process can build pod networks (root and iproute2)."""
    return os.geteuid() == 0 and any(Path(d, "ip").exists() for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"))


def _run(argv: list[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise OSError(0, f"{' '.join(argv)}: {(proc.stderr or proc.stdout).strip()}")
    return proc


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def veth_name(ip: str) -> str:
    """The host end of a pod's veth pair, named after its IP (unique on the machine)."""
    _, _, c, d = (int(x) for x in ip.split("."))
    return f"{VETH_PREFIX}{c:02x}{d:02x}"


def _process_start(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _me() -> str:
    return f"{os.getpid()} {_process_start(os.getpid())}"


def _alive(owner: str) -> bool:
    pid, _, start = owner.partition(" ")
    return pid.isdigit() and _process_start(int(pid)) == start


def link_owner(name: str) -> str | None:
    """The agent (``pid start``) that made link ``name``, from its alias; None: no agent made it."""
    try:
        alias = Path("/sys/class/net", name, "ifalias").read_text().strip()
    except OSError:
        return None
    tag, _, owner = alias.partition(" ")
    return owner if tag == OWNER_TAG and owner else None


def _mark_link(name: str, owner: str | None) -> None:
    """Record who made link ``name`` (None: the bridge, shared by every agent) in its alias."""
    _run(["ip", "link", "set", "dev", name, "alias", OWNER_TAG if owner is None else f"{OWNER_TAG} {owner}"])


def _delete_link_of(name: str, owner: str) -> None:
    """Delete link ``name`` if ``owner`` made it."""
    if link_owner(name) == owner:
        _delete_link(name)


def _delete_stale_link(name: str) -> bool:
    """Delete link ``name`` if the agent that made it is gone; returns whether the name is free now.

    A link of a live agent (whatever its table) and a link without our alias (not
    made by an agent, or one killed between making it and naming its owner) stay.
    """
    if not _link_exists(name):
        return True
    owner = link_owner(name)
    if owner is None or _alive(owner):
        return False
    _delete_link(name)
    return not _link_exists(name)


class IpPool:
    """The machine-wide table of pod IPs and the bridge, shared by every agent (see the module docstring)."""

    def __init__(self, directory: Path = NET_DIR) -> None:
        self.dir = directory

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the table's lock. The last agent out removes the lock file and the directory
        (see :meth:`_table`), so a lock taken on a file that is no longer there is retried."""
        lock = self.dir / "lock"
        while True:
            self.dir.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:
                continue  # the directory went between mkdir and open
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    current = os.stat(lock)
                except FileNotFoundError:
                    continue
                held = os.fstat(fd)
                if (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino):
                    yield
                    return
            finally:
                os.close(fd)  # releases the lock

    @contextlib.contextmanager
    def _table(self) -> Iterator[dict[str, Any]]:
        with self._locked():
            path = self.dir / "pods.json"
            try:
                table: dict[str, Any] = json.loads(path.read_text())
            except (OSError, ValueError):
                table = {}
            table.setdefault("agents", [])
            table.setdefault("ips", {})
            before = json.dumps(table, sort_keys=True)
            self._reclaim(table)
            yield table
            if not table["agents"] and not table["ips"]:
                # Nobody left: the table's files go (a waiting agent starts a new one).
                for name in ("pods.json", "pods.tmp", "lock"):
                    with contextlib.suppress(FileNotFoundError):
                        (self.dir / name).unlink()
                with contextlib.suppress(OSError):
                    self.dir.rmdir()
            elif json.dumps(table, sort_keys=True) != before:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
                tmp.replace(path)

    @staticmethod
    def _reclaim(table: dict[str, Any]) -> None:
        """Drop the entries of agents that are gone, and the host ends of their pods' veths."""
        table["agents"] = [a for a in table["agents"] if _alive(a)]
        for ip, entry in list(table["ips"].items()):
            if not _alive(entry["agent"]):
                del table["ips"][ip]
                _delete_link_of(veth_name(ip), entry["agent"])

    def register(self) -> None:
        """An agent starts: remove what dead agents left (stale veths of any table) and make the bridge."""
        with self._table() as table:
            me = _me()
            if me not in table["agents"]:
                table["agents"].append(me)
            for name in os.listdir("/sys/class/net"):
                if name.startswith(VETH_PREFIX):
                    _delete_stale_link(name)
            _ensure_bridge()

    def unregister(self) -> None:
        """An agent stops: release its IPs and veths; the last agent takes the bridge down."""
        with self._table() as table:
            me = _me()
            table["agents"] = [a for a in table["agents"] if a != me]
            for ip, entry in list(table["ips"].items()):
                if entry["agent"] == me:
                    del table["ips"][ip]
                    _delete_link_of(veth_name(ip), me)
            if not table["agents"] and not table["ips"]:
                _retire_bridge()

    def allocate(self, pod: str) -> str:
        """A free pod IP for ``pod`` (``namespace/name``), held by this agent."""
        with self._table() as table:
            _ensure_bridge()
            for n in range(256, 1 << 16):
                if n & 0xFF in (0, 255):
                    continue
                ip = socket.inet_ntoa(struct.pack("!I", _NET_BASE | n))
                # A veth of that name that no dead agent left (another table's) keeps its IP taken.
                if ip not in table["ips"] and _delete_stale_link(veth_name(ip)):
                    table["ips"][ip] = {"agent": _me(), "pod": pod}
                    return ip
        raise OSError(errno.EADDRNOTAVAIL, "no free pod IP left")

    def release(self, ip: str) -> None:
        with self._table() as table:
            _delete_link_of(veth_name(ip), _me())
            table["ips"].pop(ip, None)

    def sweep(self) -> None:
        """Reclaim what dead agents left; take the bridge down when no agent is left (after a crash)."""
        with self._table() as table:
            if not table["agents"] and not table["ips"]:
                _retire_bridge()

    def held(self) -> dict[str, str]:
        """IP -> pod of every live allocation on the machine."""
        with self._table() as table:
            return {ip: str(e["pod"]) for ip, e in table["ips"].items()}


def _delete_link(name: str) -> None:
    if _link_exists(name):
        _run(["ip", "link", "del", name], check=False)


def _ensure_bridge() -> None:
    if not _link_exists(BRIDGE):
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"], check=False)  # or another table's agent did
        if not _link_exists(BRIDGE):
            raise OSError(0, f"cannot create the pod bridge {BRIDGE}")
        _mark_link(BRIDGE, None)
    _run(["ip", "addr", "replace", f"{GATEWAY}/{PREFIX_LEN}", "dev", BRIDGE])
    # On the bridge only: the kernel checks route_localnet on the interface a packet comes in on
    # or goes out of, and for the host that is the bridge (the veths are its ports). So the
    # host's conf/all and conf/default are left as they are, and this setting goes with the bridge.
    Path(f"/proc/sys/net/ipv4/conf/{BRIDGE}/route_localnet").write_text("1")
    _run(["ip", "link", "set", BRIDGE, "up"])


def _retire_bridge() -> None:
    """Take the bridge down if no pod (of any table) is plugged into it, unless something else names it."""
    try:
        ports = os.listdir(f"/sys/class/net/{BRIDGE}/brif")
        alias = Path("/sys/class/net", BRIDGE, "ifalias").read_text().strip()
    except OSError:
        return
    if not ports and alias in (OWNER_TAG, ""):  # "": an agent died before naming it
        _delete_link(BRIDGE)


@dataclass(frozen=True)
class SandboxSpec:
    """What a pod's sandbox process sets up (see :func:`sandbox_main`)."""

    hostname: str
    host_pid: int  # a process in the host's network namespace (the agent): its listeners are mirrored
    status_fd: int
    host_ports: list[int]  # the host ports the pod may reach (the apiserver's, ...)
    host_services: str | None  # and those registered in this directory (see hostservices)


class PodNetwork:
    """One pod's network: its IP, its sandbox process (namespaces + mirror), its veth pair."""

    def __init__(
        self,
        pool: IpPool,
        pod: str,
        hostname: str,
        host_ports: Collection[int] = (),
        host_services: str | os.PathLike[str] | None = None,
    ) -> None:
        self.pool, self.pod, self.hostname = pool, pod, hostname
        self.host_ports = sorted(host_ports)
        self.host_services = None if host_services is None else str(host_services)
        self.ip: str | None = None
        self.veth: str | None = None  # the host end, once this network made it
        self.sandbox: subprocess.Popen[bytes] | None = None

    @property
    def net_namespace(self) -> str:
        assert self.sandbox is not None
        return f"/proc/{self.sandbox.pid}/ns/net"

    @property
    def uts_namespace(self) -> str:
        assert self.sandbox is not None
        return f"/proc/{self.sandbox.pid}/ns/uts"

    def create(self, spawn: Callable[..., subprocess.Popen[bytes]]) -> None:
        """Allocate the IP, start the sandbox, wire ``eth0`` to the bridge; raises OSError (all undone)."""
        try:
            self.ip = self.pool.allocate(self.pod)
            read_status, status_fd = os.pipe()
            spec = SandboxSpec(self.hostname, os.getpid(), status_fd, self.host_ports, self.host_services)
            root = str(Path(__file__).resolve().parents[2])
            boot = (
                f"import sys; sys.path.insert(0, {root!r}); "
                "from testenv.processnode.podnet import sandbox_main; "
                "sys.exit(sandbox_main(sys.argv[1]))"
            )
            try:
                self.sandbox = spawn(
                    [sys.executable, "-I", "-S", "-c", boot, json.dumps(asdict(spec))],  # -I -S: as launch_argv
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    cwd="/",
                    pass_fds=(status_fd,),
                )
            finally:
                os.close(status_fd)
            with os.fdopen(read_status, "rb") as status:
                answer = status.read().decode("utf-8", "replace")
            if answer != "ok":
                raise OSError(0, f"pod sandbox: {answer or 'exited'}")
            veth, pid = veth_name(self.ip), self.sandbox.pid
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    veth,
                    "mtu",
                    str(MTU),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "mtu",
                    str(MTU),
                    "netns",
                    str(pid),
                ]
            )
            self.veth = veth
            _mark_link(veth, _me())
            _run(["ip", "link", "set", veth, "master", BRIDGE, "up"])
            inside = f"addr add {self.ip}/{PREFIX_LEN} dev eth0\nlink set eth0 up\nroute add default via {GATEWAY}\n"
            _run(["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-batch", "-"], stdin=inside)
            _run(["nsenter", f"--net=/proc/{pid}/ns/net", "sysctl", "-qw", "net.ipv4.conf.eth0.route_localnet=1"])
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        """Kill the sandbox (the namespaces go with the pod's last process), drop the veth, free the IP."""
        proc, self.sandbox = self.sandbox, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        veth, self.veth = self.veth, None
        if veth is not None and link_owner(veth) is None:
            _delete_link(veth)  # made here, but its owner not yet recorded
        if self.ip is not None:
            self.pool.release(self.ip)  # deletes the host end, and with it the pod's eth0
        # The IP stays known: kubelet keeps reporting status.podIP of a pod that has ended.


# --- the sandbox process -------------------------------------------------------------------


def sandbox_main(spec_json: str) -> int:
    """The pod's sandbox: new network + UTS namespaces, ``lo`` up, hostname, then mirror host services."""
    import ctypes

    spec = SandboxSpec(**json.loads(spec_json))
    os.set_inheritable(spec.status_fd, False)
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        host_ns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        if libc.unshare(CLONE_NEWNET | CLONE_NEWUTS) != 0:
            raise OSError(ctypes.get_errno(), "unshare the network and UTS namespaces")
        name = spec.hostname.encode()
        if libc.sethostname(name, len(name)) != 0:
            raise OSError(ctypes.get_errno(), "sethostname")
        for conf in ("all", "default", "lo"):  # the pod's own namespace (unshared above), not the host's
            Path(f"/proc/sys/net/ipv4/conf/{conf}/route_localnet").write_text("1")
        _run(["ip", "link", "set", "lo", "up"])
        ports, services = frozenset(spec.host_ports), spec.host_services
        mirror = Mirror(host_ns, spec.host_pid, libc, lambda: ports | allowed_ports(services))
        mirror.refresh()  # before any container starts
    except OSError as exc:
        os.write(spec.status_fd, f"{exc.strerror or exc}".encode())
        return 1
    os.write(spec.status_fd, b"ok")
    os.close(spec.status_fd)
    mirror.serve()
    return 0


def host_listeners(pid: int | str, ports: Container[int]) -> dict[int, str]:
    """Port -> address to forward to, for the TCP listeners of ``pid``'s network namespace at ``ports``.

    Listeners on 127.0.0.1 and on the wildcard address (v4, or v6 taking v4) are
    reached at 127.0.0.1; those on ``::1`` only at ``::1``.
    """
    found: dict[int, str] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != "0A":  # LISTEN
                continue
            addr, _, port_hex = fields[1].partition(":")
            port = int(port_hex, 16)
            if port not in ports:
                continue
            if name == "tcp":
                ip = socket.inet_ntoa(struct.pack("<I", int(addr, 16)))
                if ip in ("127.0.0.1", "0.0.0.0"):  # noqa: S104 - reading, not binding
                    found[port] = "127.0.0.1"
            else:
                raw = b"".join(struct.pack("<I", int(addr[i : i + 8], 16)) for i in range(0, 32, 8))
                ip6 = socket.inet_ntop(socket.AF_INET6, raw)
                if ip6 in ("::", "::ffff:127.0.0.1"):
                    found[port] = "127.0.0.1"
                elif ip6 == "::1":
                    found.setdefault(port, "::1")
    return found


class Mirror:
    """Listeners inside the pod's namespace for the host's services, forwarding to the host's 127.0.0.1.

    Only the ports that ``allowed`` returns (asked at every refresh) are mirrored.
    """

    def __init__(self, host_ns: int, host_pid: int, libc: Any, allowed: Callable[[], Collection[int]]) -> None:
        self.host_ns, self.host_pid, self.libc = host_ns, host_pid, libc
        self.allowed = allowed
        self.selector = selectors.DefaultSelector()
        self.listeners: dict[int, tuple[socket.socket, str]] = {}
        self._allowed: frozenset[int] = frozenset()
        self._refreshed = 0.0  # monotonic time of the last read of the host's listeners
        self._stale = threading.Event()  # a forward found its host service gone

    def due(self, now: float) -> bool:
        """Whether to re-read the host's listeners now (see :data:`SETTLED_SECONDS`)."""
        allowed = frozenset(self.allowed())
        return (
            allowed != self._allowed
            or self._stale.is_set()
            or now - self._refreshed >= SETTLED_SECONDS
            or any(port not in self.listeners for port in allowed)
        )

    def refresh(self) -> None:
        allowed = frozenset(self.allowed())
        self._allowed, self._refreshed = allowed, time.monotonic()
        self._stale.clear()
        wanted = host_listeners(self.host_pid, allowed)
        for port in [p for p in self.listeners if wanted.get(p) != self.listeners[p][1]]:
            sock, _ = self.listeners.pop(port)
            self.selector.unregister(sock)
            sock.close()
        for port, target in wanted.items():
            if port in self.listeners:
                continue
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen(128)
            except OSError:  # the pod uses that port itself
                sock.close()
                continue
            sock.setblocking(False)
            self.listeners[port] = (sock, target)
            self.selector.register(sock, selectors.EVENT_READ, (port, target))

    def serve(self) -> None:
        next_refresh = time.monotonic() + MIRROR_SECONDS
        while True:
            timeout = max(0.0, next_refresh - time.monotonic())
            for key, _ in self.selector.select(timeout) if self.listeners else _sleep(timeout):
                port, target = key.data
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                while True:
                    try:
                        conn, _ = sock.accept()
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        break
                    conn.setblocking(True)
                    threading.Thread(target=self._forward, args=(conn, target, port), daemon=True).start()
            now = time.monotonic()
            if now >= next_refresh:
                if self.due(now):
                    self.refresh()
                next_refresh = time.monotonic() + MIRROR_SECONDS

    def _forward(self, conn: socket.socket, target: str, port: int) -> None:
        """One connection: connect out from the host's namespace (this thread joins it), then pump both ways."""
        if self.libc.setns(self.host_ns, CLONE_NEWNET) != 0:
            _reset(conn)
            return
        try:
            upstream = socket.create_connection((target, port), timeout=30)
        except OSError:
            self._stale.set()  # the service went away: the next look drops its mirror (refused, as on a node)
            _reset(conn)
            return
        upstream.settimeout(None)
        for s in (conn, upstream):
            with contextlib.suppress(OSError):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        forward_both_ways(conn, upstream)


def forward_both_ways(conn: socket.socket, upstream: socket.socket) -> None:
    """Copy each side to the other until both are done; then close both, or reset both where one reset."""
    failed = threading.Event()
    back = threading.Thread(target=_pump, args=(upstream, conn, failed), daemon=True)
    back.start()
    _pump(conn, upstream, failed)
    back.join()
    for s in (conn, upstream):
        _reset(s) if failed.is_set() else s.close()


def _sleep(seconds: float) -> list[Any]:
    time.sleep(seconds)
    return []


def _pump(src: socket.socket, dst: socket.socket, failed: threading.Event) -> None:
    """Copy ``src`` to ``dst`` through a pipe (``splice``: no copies through Python), then half-close ``dst``."""
    r, w = os.pipe()
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, _F_SETPIPE_SZ, _SPLICE_CHUNK)
    flags = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_MORE", 4)
    try:
        while not failed.is_set():
            n = os.splice(src.fileno(), w, _SPLICE_CHUNK, flags=flags)
            if n == 0:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            while n:
                n -= os.splice(r, dst.fileno(), n, flags=flags)
    except OSError:
        # A reset on one side resets the other (a fault proxy's reset reaches the pod as one).
        failed.set()
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
    finally:
        os.close(r)
        os.close(w)


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
