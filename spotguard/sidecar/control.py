"""The sidecar's side of the control channel with the trainer.

The channel is a directory shared with the trainer (``SPOTGUARD_CONTROL_DIR``,
default ``<checkpoint dir>/.control``):

- ``checkpoint-request.json`` (written here, atomically):
  ``{"id", "reason", "deadline", "preempt"}``;
- ``checkpoint-ack.json`` (written by the Checkpointer after it committed
  the requested checkpoint): ``{"id", "step", "name"}``;
- ``trainer.pid`` (written by the Checkpointer): the trainer's process id,
  so a signal can wake it up when the process is visible;
- ``trainer-exit.json`` (written by the trainer when it is done, optional):
  tells a sidecar that cannot see the trainer's process that it has exited.

The Checkpointer reads requests at step boundaries; the signal only makes
it notice sooner. Files are the contract, signals are a courtesy.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUEST_FILE = "checkpoint-request.json"
ACK_FILE = "checkpoint-ack.json"
PID_FILE = "trainer.pid"
EXIT_FILE = "trainer-exit.json"


@dataclass(frozen=True)
class CheckpointRequest:
    """A request for the trainer to checkpoint at its next step boundary."""

    id: str
    reason: str
    deadline: float
    preempt: bool
    written_at: float

    def to_json(self) -> dict[str, Any]:
        """The wire form (the contract's four keys)."""
        return {"id": self.id, "reason": self.reason, "deadline": self.deadline,
                "preempt": self.preempt}


@dataclass(frozen=True)
class CheckpointAck:
    """The trainer's answer: which checkpoint it committed for which request.

    ``step``/``name`` are None, or ``complete`` False, when the trainer could
    not commit a checkpoint for the request (deadline passed, write failed).
    """

    id: str | None
    step: int | None
    name: str | None
    mtime: float
    complete: bool = True


def control_dir_from_env(checkpoint_dir: Path, env: Mapping[str, str] | None = None) -> Path:
    """``SPOTGUARD_CONTROL_DIR``, else ``<checkpoint dir>/.control``."""
    env = os.environ if env is None else env
    value = env.get("SPOTGUARD_CONTROL_DIR")
    return Path(value) if value else checkpoint_dir / ".control"


def atomic_write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write JSON so readers see either the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(dict(payload), fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class ControlChannel:
    """Writes checkpoint requests and reads acknowledgements in a control directory."""

    def __init__(self, control_dir: Path, pid_file: Path | None = None) -> None:
        self.dir = control_dir
        self.pid_file = pid_file if pid_file is not None else control_dir / PID_FILE

    @property
    def request_path(self) -> Path:
        """Where requests go."""
        return self.dir / REQUEST_FILE

    @property
    def ack_path(self) -> Path:
        """Where the trainer acknowledges."""
        return self.dir / ACK_FILE

    def request_checkpoint(
        self, reason: str, deadline: float, preempt: bool, request_id: str | None = None
    ) -> CheckpointRequest:
        """Atomically (re)place the pending request; a newer request supersedes an older one."""
        req = CheckpointRequest(
            id=request_id or uuid.uuid4().hex,
            reason=reason,
            deadline=deadline,
            preempt=preempt,
            written_at=time.time(),
        )
        atomic_write_json(self.request_path, req.to_json())
        return req

    def read_ack(self) -> CheckpointAck | None:
        """The current acknowledgement, or None (missing or half-visible file)."""
        try:
            stat = self.ack_path.stat()
            doc = json.loads(self.ack_path.read_text(encoding="utf-8"))
            ack_id, step, name = doc.get("id"), doc.get("step"), doc.get("name")
            return CheckpointAck(
                id=str(ack_id) if ack_id is not None else None,
                step=int(step) if step is not None else None,
                name=str(name) if name is not None else None,
                mtime=stat.st_mtime,
                complete=bool(doc.get("complete", True)) and step is not None,
            )
        except (OSError, ValueError, TypeError, AttributeError):
            return None

    def trainer_pid(self) -> int | None:
        """The trainer's pid as the Checkpointer recorded it, if any."""
        try:
            text = self.pid_file.read_text(encoding="utf-8").strip()
        except OSError:
            return None
        try:
            # Plain integer, or a JSON object {"pid": N, ...}.
            if text.startswith("{"):
                return int(json.loads(text)["pid"])
            return int(text)
        except (ValueError, KeyError, TypeError):
            return None

    def clear(self) -> None:
        """Remove request, ack and pid files left by an earlier run."""
        for name in (REQUEST_FILE, ACK_FILE, PID_FILE, EXIT_FILE):
            with contextlib.suppress(FileNotFoundError):
                (self.dir / name).unlink()


def ack_answers(ack: CheckpointAck | None, request: CheckpointRequest) -> bool:
    """Pure: does ``ack`` answer ``request``?

    Either it names the request's id, or it was written after the request
    (the trainer may have saved on its own SIGTERM, which kubelet sends to
    every container at once, and acknowledged under its own id).
    """
    if ack is None:
        return False
    # 50 ms slack: file mtimes and time.time() are not taken at the same instant.
    return ack.id == request.id or ack.mtime >= request.written_at - 0.05


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
    process here (often the sidecar itself, pid 1). So a signal is only sent
    when the process's environment carries the same spotguard directories.
    """
    if pid <= 0 or pid == os.getpid():
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
