"""``spotguard run``: supervise a training command on a machine without Kubernetes.

The supervisor restores the newest verified checkpoint, runs the command
with the Checkpointer's environment, ships checkpoints as the sidecar would
(in-process), treats SIGTERM/SIGINT as a preemption (emergency checkpoint,
upload, verify, exit) and restarts the command after a crash within a
budget. It keeps nothing in memory that the next start needs: a supervisor
killed with SIGKILL is replaced by running the same command again.

Exit statuses: 0 the command finished; 128+N preempted by signal N with a
verified checkpoint (143 for SIGTERM, 130 for SIGINT); 3 the newest
checkpoint (after a preemption, or the last one of a finished command) could
not be verified in storage; 2 a usage or setup error; else the command's own
status once the restart budget is spent.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from spotguard.sidecar.control import CheckpointRequest, ControlChannel
from spotguard.sidecar.metrics import SidecarMetrics
from spotguard.sidecar.service import AgentConfig, CheckpointAgent, SignalLatch
from spotguard.sidecar.shipper import log_stage

if TYPE_CHECKING:
    from spotguard.storage import Storage

log = logging.getLogger(__name__)

EXIT_FINISHED = 0
EXIT_USAGE = 2
EXIT_EMERGENCY_FAILED = 3
RUN_ID_ENV = "SPOTGUARD_RUN_ID"
LOCK_FILE = "supervisor.lock"
CHILD_FILE = "child.json"

_PR_SET_PDEATHSIG = 1


class SetupError(Exception):
    """A problem the user can fix (said in one line)."""


@dataclass
class RunConfig:
    """Everything ``spotguard run`` was asked to do."""

    command: list[str]
    workdir: Path
    storage_uri: str
    checkpoint_dir: Path
    max_restarts: int = 3
    grace_seconds: float = 30.0
    safety_margin_seconds: float = 3.0
    backoff_seconds: float = 1.0
    backoff_max_seconds: float = 60.0
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    keep_local: int = 1
    poll_seconds: float = 0.25
    job: str = ""
    save_every_seconds: float | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def control_dir(self) -> Path:
        """The control channel directory inside the checkpoint directory."""
        return self.checkpoint_dir / ".control"


def backoff_delay(restart: int, initial: float, maximum: float) -> float:
    """Pure: exponential backoff before restart number ``restart`` (1-based)."""
    if restart <= 0:
        return 0.0
    return float(min(maximum, initial * (2 ** (restart - 1))))


def _set_pdeathsig() -> None:
    # Runs in the child between fork and exec: die with the supervisor,
    # even when it is SIGKILLed and can clean nothing up.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@contextlib.contextmanager
def workdir_lock(workdir: Path) -> Iterator[None]:
    """Hold an exclusive lock on the work directory (freed by the kernel on any death)."""
    workdir.mkdir(parents=True, exist_ok=True)
    fh: IO[str] = open(workdir / LOCK_FILE, "a+", encoding="utf-8")  # noqa: SIM115 - held for the block
    try:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SetupError(
                f"another spotguard run is using {workdir}; stop it or pass a different --workdir"
            ) from None
        yield
    finally:
        fh.close()


def processes_with_env(key: str, value: str) -> list[int]:
    """Pids of processes (visible to us) whose environment has ``key=value``."""
    needle = f"{key}={value}".encode()
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def kill_leftovers(workdir: Path) -> list[int]:
    """Kill what a SIGKILLed predecessor's command left running (grandchildren
    escape PR_SET_PDEATHSIG); they carry its run id in their environment."""
    try:
        previous = json.loads((workdir / CHILD_FILE).read_text(encoding="utf-8"))
        run_id = str(previous["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    pids = processes_with_env(RUN_ID_ENV, run_id)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if pids:
        log.warning("killed %d process(es) left by an earlier spotguard run: %s", len(pids), pids)
    return pids


class Supervisor:
    """Runs one training command to completion, preemption or exhausted budget."""

    def __init__(self, config: RunConfig, storage: Storage, metrics: SidecarMetrics) -> None:
        self.config = config
        self.storage = storage
        self.metrics = metrics
        self.run_id = uuid.uuid4().hex
        self.child: subprocess.Popen[bytes] | None = None
        self.latch = SignalLatch()
        agent_config = AgentConfig(
            checkpoint_dir=config.checkpoint_dir,
            control_dir=config.control_dir,
            grace_seconds=config.grace_seconds,
            safety_margin_seconds=config.safety_margin_seconds,
            poll_seconds=config.poll_seconds,
            keep_local=config.keep_local,
            trainer_markers={RUN_ID_ENV: self.run_id},
            save_every_seconds=config.save_every_seconds,
        )
        self.agent = CheckpointAgent(agent_config, storage, metrics, trainer_state=self._child_state)
        self.attempt = 0

    def _child_state(self) -> str:
        if self.child is None:
            return "gone"
        return "running" if self.child.poll() is None else "gone"

    # -- startup -------------------------------------------------------------

    def recover(self) -> None:
        """Make the work directory safe to start from, whatever happened before.

        Ship complete local checkpoints that never reached storage (the
        previous supervisor may have died before uploading them), drop local
        ones that fail verification, forget the old control channel, and
        stage the newest verified checkpoint.
        """
        from spotguard.checkpoint import restore_latest

        ckdir = self.config.checkpoint_dir
        ckdir.mkdir(parents=True, exist_ok=True)
        for tmp in ckdir.glob(".tmp-*"):
            # Half-written by a trainer that died; no writer can be alive now.
            shutil.rmtree(tmp, ignore_errors=True)
        ControlChannel(self.config.control_dir).clear()
        self.agent.shipper.adopt_existing()
        self.agent.shipper.ship()
        for path in self.agent.shipper.committed():
            if path.name not in self.agent.shipper.shipped:
                log.warning("dropping local %s: it could not be verified in storage (%s)",
                            path.name, self.agent.shipper.failed.get(path.name, "not shipped"))
                shutil.rmtree(path, ignore_errors=True)
        t0 = time.monotonic()
        try:
            info = restore_latest(self.storage, ckdir)
        except Exception as exc:  # noqa: BLE001 - reported, then start from scratch is wrong: stop
            self.metrics.failure("restore")
            raise SetupError(f"cannot restore from {self.config.storage_uri}: {exc}") from exc
        if info is None:
            log.info("no verified checkpoint in %s yet: starting from scratch",
                     self.config.storage_uri)
        else:
            log_stage("restore", time.monotonic() - t0, name=getattr(info, "name", None),
                      step=getattr(info, "step", None))
        # Whatever restore staged came from storage: mark it shipped.
        self.agent.shipper.adopt_existing()

    # -- child ---------------------------------------------------------------

    def child_env(self) -> dict[str, str]:
        """The Checkpointer's environment for the command."""
        env = dict(os.environ)
        env.update(self.config.extra_env)
        env.update({
            "SPOTGUARD_CHECKPOINT_DIR": str(self.config.checkpoint_dir),
            "SPOTGUARD_STORAGE_URI": self.config.storage_uri,
            "SPOTGUARD_CONTROL_DIR": str(self.config.control_dir),
            "SPOTGUARD_ATTEMPT": str(self.attempt),
            RUN_ID_ENV: self.run_id,
        })
        if self.config.job:
            env["SPOTGUARD_JOB"] = self.config.job
        return env

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the command in its own process group, tied to our life."""
        (self.config.workdir / CHILD_FILE).write_text(
            json.dumps({"run_id": self.run_id, "supervisor_pid": os.getpid()}), encoding="utf-8")
        try:
            child = subprocess.Popen(
                self.config.command,
                env=self.child_env(),
                stdin=subprocess.DEVNULL,
                process_group=0,
                preexec_fn=_set_pdeathsig,
            )
        except OSError as exc:
            raise SetupError(f"cannot start {self.config.command[0]!r}: {exc.strerror}") from exc
        log.info("started attempt %d: pid %d: %s", self.attempt, child.pid,
                 " ".join(self.config.command))
        return child

    def _signal_group(self, sig: int) -> None:
        if self.child is None or self.child.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.child.pid, sig)

    def _forward(self, _req: CheckpointRequest) -> None:
        # The Checkpointer treats SIGTERM as a preemption request, and any
        # other program gets the signal it would get on a real shutdown.
        self._signal_group(signal.SIGTERM)

    # -- main ----------------------------------------------------------------

    def run(self) -> int:
        """Supervise until the command finishes, is preempted, or runs out of restarts."""
        self.latch.install()
        try:
            kill_leftovers(self.config.workdir)
            self.recover()
            restarts = 0
            while True:
                if self.latch.event.is_set():
                    return self._preempted()
                self.attempt += 1
                ControlChannel(self.config.control_dir).clear()
                self.child = self.spawn()
                while self.child.poll() is None and not self.latch.event.is_set():
                    self.agent.step()
                    self.latch.event.wait(self.config.poll_seconds)
                if self.latch.event.is_set():
                    return self._preempted()
                rc = self.child.returncode
                shipped = self.agent.flush(time.time() + self.config.grace_seconds)
                if rc == 0:
                    if not shipped:
                        return EXIT_EMERGENCY_FAILED
                    log.info("command finished; newest verified checkpoint: %s",
                             self._last_name())
                    return EXIT_FINISHED
                restarts += 1
                reason = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
                if restarts > self.config.max_restarts:
                    log.error("command failed (%s); restart budget of %d spent", reason,
                              self.config.max_restarts)
                    return rc if rc > 0 else 128 - rc
                delay = backoff_delay(restarts, self.config.backoff_seconds,
                                      self.config.backoff_max_seconds)
                self.metrics.restart("crash")
                log.warning("command failed (%s); restart %d/%d in %.1fs", reason, restarts,
                            self.config.max_restarts, delay)
                if self.latch.event.wait(delay):
                    return self._preempted()
                self.recover()
        finally:
            self._signal_group(signal.SIGKILL)
            self.latch.restore()

    def _preempted(self) -> int:
        source = self.latch.source or "sigterm"
        self.metrics.notice(source)
        ok = self.agent.emergency(source, self.latch.received_at, forward=self._forward)
        deadline = self.latch.received_at + self.config.grace_seconds
        if self.child is not None:
            try:
                self.child.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                log.error("command still running at the deadline: killing it")
                self._signal_group(signal.SIGKILL)
                self.child.wait()
        if not ok:
            return EXIT_EMERGENCY_FAILED
        signum = signal.SIGINT if source == "sigint" else signal.SIGTERM
        log.info("preempted: newest verified checkpoint %s; run the same command to resume",
                 self._last_name())
        return 128 + int(signum)

    def _last_name(self) -> str:
        last = self.agent.shipper.last_shipped
        return last.name if last else "none"


def configure_logging(verbose: bool = False) -> None:
    """One structured line per event on stderr."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s spotguard %(levelname)s %(message)s",
    )
