"""The host side of real nodes' pod access to the test world's services: one proxy per node set.

Pods on a real node reach what a pod on a cluster reaches, here all on the
host's 127.0.0.1: the apiserver (through the ``kubernetes`` Service's
``10.0.0.1:443``, or ``127.0.0.1:<its port>``), the object store, a test's own
server, each only once its port is allowed (the host-services directory of
:mod:`testenv.processnode.hostservices`, which the process nodes read too; the
apiserver's port always). No kube-proxy, no host-wide nft rule or sysctl:

- in each pod's namespace the chained CNI plugin :mod:`testenv.realnode.cniplugin`
  sends those connections to the set's bridge gateway (``127.<80+k>.0.1``);
- on the host, :class:`HostProxy` (``python -m testenv.realnode.hostnet``, a
  service of the set's supervisor, stopped with it) listens on the gateway at
  every allowed port and forwards each connection to ``127.0.0.1`` at that
  port. Every :data:`REFRESH_SECONDS` it rereads the allow list: a port
  registered while pods run gets its listener, and every pod's nft set of
  allowed ports (from the pod files the plugin writes) is brought up to date.

A port that is not allowed has no listener on the gateway and no rule in any
pod: the pod's own 127.0.0.1 answers (refused, or the pod's own listener).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import selectors
import signal
import socket
import sys
import threading
from pathlib import Path

from testenv.cluster import Service, Supervisor, wait_until
from testenv.processnode.podnet import _reset, forward_both_ways  # the process nodes' forwarding, byte for byte
from testenv.realnode.cniplugin import PLUGIN_TYPE, allowed, in_netns, ports_update
from testenv.realnode.config import CNI_BIN_DIR

log = logging.getLogger("realnode.hostnet")

REFRESH_SECONDS = 0.5
#: Where a set keeps the plugin's pod files (below its state directory).
PODS_DIR = "hostnet-pods"


def plugin_bin_dir(directory: Path) -> Path:
    """A node's CNI plugin directory: Debian's plugins and ``spotguard-hostservices`` (links to each)."""
    directory.mkdir(parents=True, exist_ok=True)
    targets = {p.name: p for p in Path(CNI_BIN_DIR).iterdir()}
    targets[PLUGIN_TYPE] = Path(__file__).resolve().with_name("cniplugin.py")
    for name, target in targets.items():
        link = directory / name
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to(target)
    return directory


def start_host_proxy(sup: Supervisor, gateway: str, api_port: int, host_services: Path, pods_dir: Path) -> Service:
    """Start the set's :class:`HostProxy` under ``sup`` and wait until it listens for the apiserver."""
    argv = [sys.executable, "-m", "testenv.realnode.hostnet", "--gateway", gateway, "--api-port", str(api_port)]
    argv += ["--host-services", str(host_services), "--pods-dir", str(pods_dir)]
    root = str(Path(__file__).resolve().parents[2])
    svc = sup.start(f"hostnet-{gateway}", argv, extra_env={"PYTHONPATH": root}, stop_timeout=5.0)
    wait_until(lambda: _listening(gateway, api_port), 30, "the host services proxy", svc)
    return svc


def _listening(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


class HostProxy:
    """Listeners on the gateway for the allowed host ports; the pods' nft sets kept equal to them."""

    def __init__(self, gateway: str, api_port: int, host_services: Path, pods_dir: Path) -> None:
        self.gateway, self.api_port = gateway, api_port
        self.host_services, self.pods_dir = host_services, pods_dir
        self.selector = selectors.DefaultSelector()
        self.listeners: dict[int, socket.socket] = {}
        self.pushed: dict[str, frozenset[int]] = {}  # pod file -> the ports its namespace allows now

    def allowed(self) -> frozenset[int]:
        return frozenset(allowed(self.api_port, self.host_services))

    def refresh(self) -> None:
        ports = self.allowed()
        for port in [p for p in self.listeners if p not in ports]:
            sock = self.listeners.pop(port)
            self.selector.unregister(sock)
            sock.close()
        for port in sorted(ports - set(self.listeners)):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.gateway, port))
                sock.listen(128)
            except OSError as exc:
                sock.close()
                # In use: a host service on the wildcard address, which pods reach on the gateway anyway.
                if exc.errno != errno.EADDRINUSE:
                    raise
                continue
            sock.setblocking(False)
            self.listeners[port] = sock
            self.selector.register(sock, selectors.EVENT_READ, port)
        self._sync_pods(ports)

    def _sync_pods(self, ports: frozenset[int]) -> None:
        try:
            names = {n for n in os.listdir(self.pods_dir) if not n.startswith(".")}
        except FileNotFoundError:
            names = set()
        for gone in set(self.pushed) - names:
            del self.pushed[gone]
        for name in sorted(names):
            if self.pushed.get(name) == ports:
                continue
            pod_file = self.pods_dir / name
            try:
                netns = pod_file.read_text().strip()
            except FileNotFoundError:
                continue  # a CNI DEL just now
            try:
                in_netns(netns, ["nft", "-f", "-"], stdin=ports_update(ports))
            except OSError as exc:
                if Path(netns).exists():
                    log.warning("pod %s: allowed ports not updated: %s", name, exc)
                else:  # the pod's sandbox went without a CNI DEL (its node was lost)
                    pod_file.unlink(missing_ok=True)
                continue
            self.pushed[name] = ports
            log.info("pod %s: host ports %s", name, ",".join(map(str, sorted(ports))))

    def serve(self, stop: threading.Event) -> None:
        self.refresh()
        while not stop.is_set():
            for key, _ in self.selector.select(REFRESH_SECONDS) if self.listeners else []:
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    conn, _ = sock.accept()
                    conn.setblocking(True)
                    threading.Thread(target=_forward, args=(conn, key.data), daemon=True).start()
            if not self.listeners:
                stop.wait(REFRESH_SECONDS)
            self.refresh()


def _forward(conn: socket.socket, port: int) -> None:
    """One pod connection to the host's 127.0.0.1 at ``port``, both ways, resets passed on."""
    try:
        upstream = socket.create_connection(("127.0.0.1", port), timeout=30)
    except OSError:
        _reset(conn)  # refused, as the service itself would
        return
    upstream.settimeout(None)
    forward_both_ways(conn, upstream)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testenv.realnode.hostnet", description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", required=True, help="the set's bridge gateway address")
    parser.add_argument("--api-port", required=True, type=int, help="the apiserver's port on 127.0.0.1")
    parser.add_argument("--host-services", required=True, type=Path, help="the allow list of host ports")
    parser.add_argument("--pods-dir", required=True, type=Path, help="the CNI plugin's pod files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    HostProxy(args.gateway, args.api_port, args.host_services, args.pods_dir).serve(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
