"""Which process is the trainer, as the sidecar sees it through ``/proc``.

The trainer announces its pid in the control directory (``trainer.pid``,
:mod:`spotguard.contract.control`); whether that pid is really the trainer,
whether it still lives and whether it catches a signal is the uploader's
question, answered here from ``/proc``. Used by the sidecar's
:class:`~spotguard.sidecar.service.CheckpointAgent` (also inside
``spotguard run``). Linux only; standard library only.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            # Field 3 is the state; the comm field before it may contain spaces.
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def is_trainer_process(pid: int, markers: Mapping[str, str]) -> bool:
    """Whether ``pid`` is really our trainer, as far as this process can see.

    The pid in ``trainer.pid`` comes from the trainer's PID namespace; in a
    pod without a shared process namespace the same number can be another
    process here (often the sidecar itself, pid 1), or one of the sidecar's
    own threads: ``/proc/<tid>`` answers for a thread as for a process, with
    the sidecar's environment, which carries the same spotguard directories.
    Taken for the trainer, that thread's end would look like the trainer's
    (the sidecar would stop shipping and report the run finished). So the
    sidecar's own threads are never the trainer, and a signal is only sent
    when the process's environment carries the same spotguard directories.
    """
    if pid <= 0 or pid == os.getpid() or _thread_group(pid) == os.getpid():
        return False
    env = _environ(pid)
    if env is None or not markers:
        return False
    for key, want in markers.items():
        got = env.get(key.encode())
        if got is None or _norm(got.decode(errors="replace")) != _norm(want):
            return False
    return True


def _norm(value: str) -> str:
    # "/var/lib/spotguard/checkpoints/" and "/var/lib/spotguard/checkpoints" name the same directory.
    return os.path.normpath(value) if value.startswith("/") else value


def _thread_group(pid: int) -> int | None:
    """The process ``pid`` belongs to (``Tgid`` in ``/proc/<pid>/status``; itself unless a thread), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text(errors="replace").splitlines():
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _environ(pid: int) -> dict[bytes, bytes] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def find_trainer_processes(markers: Mapping[str, str]) -> list[int]:
    """Pids of visible processes that carry all ``markers`` in their environment.

    This is how a sidecar that shares the trainer's PID namespace (a classic
    sidecar with ``shareProcessNamespace``, a process node, ``spotguard
    run``) sees whether the trainer still runs, without the trainer's help.
    Other sidecars (``spotguard sidecar``) and this process are excluded.
    Used for liveness only, never to pick a process to signal: a match may
    be a wrapper shell or a data-loader worker.
    """
    if not markers:
        return []
    want = {k.encode(): _norm(v) for k, v in markers.items()}
    me = os.getpid()
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        env = _environ(int(entry))
        if not env or any(_norm(env.get(k, b"").decode(errors="replace")) != v for k, v in want.items()):
            continue
        cmd = _cmdline(int(entry))
        if b"sidecar" in cmd and any(part.endswith(b"spotguard") or part == b"spotguard.cli" for part in cmd):
            continue
        if pid_alive(int(entry)):
            found.append(int(entry))
    return sorted(found)


def catches_signal(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler installed for ``sig`` right now (``SigCgt``).

    SIGUSR1's default action kills: a trainer that has already put its
    handlers back (it is exiting) must not be signalled.
    """
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (sig - 1)))
    except (OSError, ValueError, IndexError):
        return False
    return False


def signal_trainer(
    pid: int | None,
    markers: Mapping[str, str],
    sig: int = signal.SIGUSR1,
    check: Callable[[int, Mapping[str, str]], bool] = is_trainer_process,
    still_announced: Callable[[int], bool] | None = None,
) -> bool:
    """Send ``sig`` to the trainer if its identity checks out; True if sent.

    ``still_announced(pid)``, asked last, right before the signal: whether
    the trainer still advertises this pid. The Checkpointer withdraws
    ``trainer.pid`` before it removes its handler on the way out, so this
    keeps the window in which a signal could meet the default action tiny.
    """
    if pid is None or not check(pid, markers) or not catches_signal(pid, sig):
        return False
    if still_announced is not None and not still_announced(pid):
        return False
    try:
        os.kill(pid, sig)
    except OSError:
        return False
    return True
