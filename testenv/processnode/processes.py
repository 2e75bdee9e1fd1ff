"""Container processes: the one thread that forks them, signalling, and leftovers of a dead agent."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import select
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, cast

from testenv.processnode.common import JSON


class Spawner:
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


def start_error(fd: int, timeout: float = 60.0) -> str:
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
