"""The host services that pods may reach: an allow list of ports, one file per port in a directory.

On a real node a pod reaches the cluster's services (the apiserver, an object
store, other pods), not whatever else listens on the node's loopback address.
A pod sandbox mirrors a host listener into the pod only if its port is allowed:
the apiserver's (the agent knows it from its kubeconfig), ports given to the
agent (``--host-service PORT``), and the ports registered in the agent's
host-services directory. The test world registers its services there (the
object store; a test its own server), also while pods run: sandboxes reread
the directory every time they refresh their mirror.

    services = HostServices(directory)
    with services.exposed(port, "fault proxy"):
        ...  # pods reach 127.0.0.1:port on the host

Only the standard library: a pod sandbox imports this module.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


class HostServices:
    """A directory naming the host ports that pods may reach (file name: the port; content: what it is)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def add(self, port: int, name: str) -> None:
        """Let pods reach the host's 127.0.0.1:``port`` (``name`` says what listens there)."""
        if not 0 < port < 65536:
            raise ValueError(f"not a port: {port}")
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{port}.{os.getpid()}.tmp"
        tmp.write_text(f"{name}\n")
        tmp.replace(self.directory / str(port))

    def remove(self, port: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.directory / str(port)).unlink()

    @contextlib.contextmanager
    def exposed(self, port: int, name: str) -> Iterator[None]:
        """Pods reach ``port`` for the duration of the block."""
        self.add(port, name)
        try:
            yield
        finally:
            self.remove(port)

    def ports(self) -> dict[int, str]:
        """Port -> what listens there, for every registered port."""
        return {port: self._name(port) for port in allowed_ports(self.directory)}

    def _name(self, port: int) -> str:
        try:
            return (self.directory / str(port)).read_text().strip()
        except OSError:
            return ""


def allowed_ports(directory: str | os.PathLike[str] | None) -> set[int]:
    """The ports registered in ``directory`` (none if it does not exist)."""
    if directory is None:
        return set()
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    return {int(n) for n in names if n.isdigit() and 0 < int(n) < 65536}
