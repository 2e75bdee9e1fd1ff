"""Helpers for testing against a real apiserver: run the operator as a subprocess, poll.

Like ``kopf.testing``, these ship with the package so that users' own tests
(and ours) can start a real ``spotguard operator`` next to a cluster.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

T = TypeVar("T")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (all held open while choosing)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    return free_ports(1)[0]


class ProcessExited(RuntimeError):
    """The process being waited for has exited."""


def wait_for(check: Callable[[], T | None], what: str, timeout: float = 60.0, interval: float = 0.2) -> T:
    """Poll ``check`` until it returns something truthy; raise with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except ProcessExited:
            raise
        except Exception as exc:  # noqa: BLE001 - keep polling whatever fails; the last error is reported
            last = exc
        if time.monotonic() > deadline:
            suffix = f" (last error: {last!r})" if last else ""
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}{suffix}")
        time.sleep(interval)


def http_get(url: str, timeout: float = 5.0) -> str:
    """GET a URL on the loopback interface and return the body as text."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback test URLs only
        body: bytes = resp.read()
        return body.decode()


class OperatorProcess:
    """``spotguard operator`` as a subprocess, ready when its liveness endpoint answers."""

    def __init__(
        self,
        args: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        *,
        metrics_port: int | None = None,
        liveness_port: int | None = None,
    ) -> None:
        ports = free_ports(2)
        self.metrics_port = metrics_port or ports[0]
        self.liveness_port = liveness_port or ports[1]
        self.log_path = log_path
        self.argv = [
            sys.executable,
            "-m",
            "spotguard.cli",
            "operator",
            "--metrics-address",
            "127.0.0.1",
            "--metrics-port",
            str(self.metrics_port),
            "--liveness",
            f"http://127.0.0.1:{self.liveness_port}/healthz",
            *args,
        ]
        self.env = {**os.environ, **env}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> OperatorProcess:
        """Start and wait until kopf reports it is alive."""
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

        def alive() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ProcessExited(f"operator exited with {self.proc.returncode}:\n{self.log_tail()}")
            http_get(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=1.0)
            return True

        try:
            wait_for(alive, "the operator's liveness endpoint", timeout=timeout)
        except BaseException:  # the operator stopped on any exit, an interrupt too; raised again
            self.stop()
            raise
        return self

    def metrics(self) -> str:
        """The Prometheus exposition text."""
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def log_tail(self, n: int = 60) -> str:
        """The last lines of the operator's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL the whole process group; returns the exit status."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                return proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()

    def kill(self) -> None:
        """SIGKILL at once (a crash)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> OperatorProcess:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def metric_value(text: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """The value of one sample in Prometheus exposition text (None when absent)."""
    want = labels or {}
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        got: dict[str, str] = {}
        for part in rest.rstrip("}").split(","):
            if "=" in part:
                k, _, v = part.partition("=")
                got[k.strip()] = v.strip().strip('"')
        if all(got.get(k) == v for k, v in want.items()):
            return float(value)
    return None
