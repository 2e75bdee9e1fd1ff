"""``spotguard run``: supervise a training command on a machine without Kubernetes.

The supervisor restores the newest verified checkpoint (where the store signs
reads, it grants the command reads of it instead: the command streams it into
its tensors, and the local copy is restored after, in the background), runs the command
with the Checkpointer's environment, ships checkpoints as the sidecar would
(in-process), treats SIGTERM/SIGINT as a preemption (emergency checkpoint,
upload, verify, exit) and restarts the command after a crash within a
budget. It keeps nothing in memory that the next start needs: a supervisor
killed with SIGKILL is replaced by running the same command again.

A complete local checkpoint is never dropped because storage is down: one
that verifies against its own manifest and is newer than anything
verified in storage is kept, resumed from, and shipped once storage
answers again. Retention (``--keep-*``) is the sidecar's: applied after
routine uploads and when the command finished, never on the way out of a
preemption. ``--notices`` turns on the sidecar's cloud and Kubernetes
notice pollers: a notice yields a verified checkpoint before SIGTERM.

Exit statuses: 0 the command finished; 128+N preempted by signal N with a
verified checkpoint (143 for SIGTERM, 130 for SIGINT; 143 too when the
command stopped for a preemption it was told about directly); 3 the newest
checkpoint (after a preemption, or the last one of a finished command) could
not be verified in storage; 2 a usage or setup error; else the command's own
status once the restart budget is spent.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from spotguard.contract import env as envvars
from spotguard.contract.control import (
    CheckpointRequest,
    ControlChannel,
    forget_verified_local,
    write_verified_local,
)
from spotguard.run.credentials import is_credential, without_credentials
from spotguard.sidecar.granting import Granting, restore_newer_than
from spotguard.sidecar.metrics import SidecarMetrics
from spotguard.sidecar.notices import NoticeSource, NoticeWatcher
from spotguard.sidecar.service import AgentConfig, CheckpointAgent, UploaderConfig
from spotguard.sidecar.shipper import log_stage, step_of
from spotguard.signalsafe import SignalLatch

if TYPE_CHECKING:
    from spotguard.checkpoint import CheckpointInfo, RetentionPolicy
    from spotguard.storage import Storage

log = logging.getLogger(__name__)

EXIT_FINISHED = 0
EXIT_USAGE = 2
EXIT_EMERGENCY_FAILED = 3
LOCK_FILE = "supervisor.lock"
CHILD_FILE = "child.json"
# torchrun forwards SIGTERM to its workers and SIGKILLs them after this many
# seconds (30 by default); ``spotguard run`` sets it to the grace period.
TORCHRUN_SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"

_PR_SET_PDEATHSIG = 1


class SetupError(Exception):
    """A problem the user can fix (said in one line)."""


@dataclass(kw_only=True)
class RunConfig(UploaderConfig):
    """Everything ``spotguard run`` was asked to do: what it uploads as the sidecar does (the
    :class:`~spotguard.sidecar.service.UploaderConfig` fields), and how it runs the command."""

    command: list[str]
    workdir: Path
    storage_uri: str
    # spotguard run's own margin, shorter than the sidecar's (it takes no option for it).
    safety_margin_seconds: float = 3.0
    max_restarts: int = 3
    backoff_seconds: float = 1.0
    backoff_max_seconds: float = 60.0
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    job: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)
    retention: RetentionPolicy | None = None
    notice_sources: list[NoticeSource] = field(default_factory=list)
    notice_interval_seconds: float = envvars.NOTICE_INTERVAL.default
    # Hand the command the cloud credentials and SPOTGUARD_STORAGE_URI (see spotguard.run.credentials).
    pass_credentials: bool = envvars.PASS_CREDENTIALS.default
    # Where the store signs reads: the command streams the checkpoint it resumes from (spotguard.sidecar.granting).
    restore_grant: bool = envvars.RESTORE_GRANT.default
    # Let a preemption's checkpoint be written to /dev/shm (see spotguard.checkpoint.local.staged).
    memory_staging: bool = True
    # With memory staging: set its memory aside after each routine save (see spotguard.checkpoint.local.reserve).
    staging_reserve: bool = envvars.STAGING_RESERVE.default

    @property
    def control_dir(self) -> Path:
        """The control channel directory inside the checkpoint directory."""
        return self.checkpoint_dir / ".control"


#: Where a machine's shared memory file system is mounted.
SHM = Path("/dev/shm")


def is_memory_mount(mounts: str, path: str) -> bool:
    """Pure: whether ``/proc/mounts`` text ``mounts`` mounts a memory file system (tmpfs) at ``path``."""
    fstype = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[1] == path:
            fstype = fields[2]  # the last mount at a path hides the earlier ones
    return fstype in {"tmpfs", "ramfs"}


def memory_staging_dir(workdir: Path, shm: Path = SHM) -> Path | None:
    """The directory of ``shm`` where a run in ``workdir`` stages its
    preemption's checkpoints (one per work directory, so that a run finds
    what a supervisor that died left there); None when ``shm`` is not a
    memory file system."""
    try:
        mounts = Path("/proc/mounts").read_text()
    except OSError:
        return None
    if not is_memory_mount(mounts, str(shm)):
        return None
    key = hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:16]
    return shm / f"spotguard-{key}"


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
    pids = kill_run(run_id)
    if pids:
        log.warning("killed %d process(es) left by an earlier spotguard run: %s", len(pids), pids)
    return pids


def kill_run(run_id: str) -> list[int]:
    """SIGKILL every visible process carrying ``SPOTGUARD_RUN_ID=run_id``.

    A launcher's workers live outside its process group (torchrun starts
    each in a session of its own), so a group signal does not reach them;
    the run id in their environment does.
    """
    pids = processes_with_env(envvars.RUN_ID.name, run_id)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return pids


class Supervisor:
    """Runs one training command to completion, preemption or exhausted budget."""

    def __init__(self, config: RunConfig, storage: Storage, metrics: SidecarMetrics) -> None:
        self.config = config
        self.storage = storage
        self.metrics = metrics
        self.run_id = uuid.uuid4().hex
        self.child: subprocess.Popen[bytes] | None = None
        # The command hears of a preemption at once, from the signal handler:
        # the supervisor's own loop may be inside a slow storage call then. The
        # heartbeat says the preemption first, so the trainer waits for its checkpoint.
        self.latch = SignalLatch(on_signal=self._on_signal)
        self._forwarded = False
        self._told_withheld = False
        agent_config = AgentConfig.of(
            config, control_dir=config.control_dir, trainer_markers={envvars.RUN_ID.name: self.run_id}
        )
        self.agent = CheckpointAgent(agent_config, storage, metrics, config.retention, trainer_state=self._child_state)
        self.agent.interrupt = self.latch.event
        self.attempt = 0
        self.staging = memory_staging_dir(config.workdir) if config.memory_staging else None
        self.granting = Granting(
            config.control_dir,
            config.checkpoint_dir,
            storage,
            self.agent.shipper,
            self._vouch,
        )

    def _child_state(self) -> str:
        if self.child is None:
            return "gone"
        return "running" if self.child.poll() is None else "gone"

    # -- startup -------------------------------------------------------------

    def recover(self) -> None:
        """Make the work directory safe to start from, whatever happened before.

        Forget the old control channel and half-written checkpoints; move
        local checkpoints that fail their own manifest aside (they cannot be
        loaded; one in storage is fetched again); ship complete ones that never reached storage (the previous
        supervisor may have died before, or storage was down); stage a
        checkpoint from storage only when it is newer than the newest local
        one. With storage unreachable, the newest complete local checkpoint
        is resumed from (and shipped once storage answers); only with
        nothing local either is that a reason to stop.
        """
        from spotguard.checkpoint import verify_local_checkpoint
        from spotguard.checkpoint.local.commit import move_aside_refused, remove_checkpoint_dir

        ckdir = self.config.checkpoint_dir
        ckdir.mkdir(parents=True, exist_ok=True)
        for tmp in ckdir.glob(".tmp-*"):
            # Half-written by a trainer that died; no writer can be alive now.
            if tmp.is_symlink():
                tmp.unlink()
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        # What a supervisor that died left in memory: not known to be verified, so copied to the disk.
        self._settle_staging(verified_step=-1)
        ControlChannel(self.config.control_dir).clear()
        self.granting.end()  # an earlier start's grant is never used, its local copy is complete
        forget_verified_local(self.config.control_dir)  # this start verifies again what it vouches for
        shipper = self.agent.shipper
        shipper.adopt_existing()
        newest_local: str | None = None
        for path in reversed(shipper.committed()):
            stored = path.name in shipper.shipped
            if stored and newest_local is not None:
                continue  # older and safe in storage: never resumed from, never shipped again
            # The one to resume from is checked even when storage holds it: a
            # restored copy is not fsynced (fetch.py), so a machine that
            # crashed may have left it torn. Its stored copy is fetched again.
            before = self._stamps(path)
            result = verify_local_checkpoint(path)
            if result.ok:
                if newest_local is None:
                    self._vouch(path, before)
                newest_local = newest_local or path.name
                continue
            if stored:
                log.warning(
                    "local copy of %s is damaged (%s): it is in storage, fetching it again", path.name, result.reason
                )
                shipper.forget(path.name)
                remove_checkpoint_dir(path)
            else:
                # Never in storage: kept aside for a look, out of every listing.
                move_aside_refused(path, f"it fails its own manifest: {result.reason}")
        shipper.ship(housekeeping=False)
        newest_local = self._loadable_local()
        t0 = time.monotonic()
        try:
            # A grant lets the trainer stream the checkpoint into its tensors; else the local copy first.
            if self.config.restore_grant and self.granting.offer(step_of(newest_local) if newest_local else -1):
                return
            info = self._restore_newer_than(step_of(newest_local) if newest_local else -1)
        except Exception as exc:  # noqa: BLE001 - storage down: the local state decides
            self.metrics.failure("restore")
            if newest_local is None:
                raise SetupError(f"cannot restore from {self.config.storage_uri}: {exc}") from exc
            log.warning(
                "storage unreachable (%s): resuming from local %s, which is not verified in "
                "storage yet; it is shipped once storage answers",
                " ".join(str(exc).split()),
                newest_local,
            )
            return
        if info is not None:
            log_stage("restore", time.monotonic() - t0, name=info.name, step=info.step)
            # The restore verified every byte against the stored manifest.
            shipper.mark_verified(info.name)
            self._vouch(Path(info.uri))
        elif newest_local is not None:
            verified = newest_local in shipper.shipped
            log.info(
                "resuming from local %s%s",
                newest_local,
                "" if verified else " (not verified in storage yet; shipping it)",
            )
        else:
            log.info("no verified checkpoint in %s yet: starting from scratch", self.config.storage_uri)

    def _stamps(self, path: Path) -> dict[str, list[int]] | None:
        """The stamps of local checkpoint ``path``'s files now (None when they cannot be read)."""
        from spotguard.checkpoint import read_local_manifest
        from spotguard.checkpoint.format.manifest import ManifestError
        from spotguard.checkpoint.local.inplace import file_stamps

        try:
            return file_stamps(path, read_local_manifest(path))
        except (OSError, ManifestError):
            return None

    def _vouch(self, path: Path, before: dict[str, list[int]] | None = None) -> None:
        """Tell the trainer that local checkpoint ``path`` verified whole just now, so that it
        does not checksum it again (:func:`~spotguard.contract.control.write_verified_local`);
        ``before``: its stamps before it was verified, which must not have changed since."""
        stamps = self._stamps(path)
        if stamps is None or (before is not None and before != stamps):
            return
        try:
            write_verified_local(self.config.control_dir, path.name, stamps)
        except OSError as exc:  # the trainer then checksums it again: slower, never wrong
            log.warning("could not record that %s verified: %s", path.name, exc)

    def _loadable_local(self) -> str | None:
        """The newest local checkpoint a trainer can load.

        One node's part of a multi-node checkpoint cannot be loaded alone: it
        counts only once every part is verified in storage, and then as the
        global checkpoint, fetched here in its place. A part still waiting
        for the other nodes' parts stays (it is shipped again each round) but
        is not resumed from.
        """
        from spotguard.checkpoint import CheckpointCorruptError, read_local_manifest, restore_checkpoint
        from spotguard.checkpoint.format.manifest import ManifestError

        shipper = self.agent.shipper
        for path in reversed(shipper.committed()):
            try:
                manifest = read_local_manifest(path)
            except (OSError, ManifestError):
                continue
            if manifest.locally_complete:
                return path.name
            if path.name not in shipper.shipped:
                log.info(
                    "local %s is part %s of %d: not resumable until every part is verified in storage",
                    path.name,
                    manifest.sharding.part if manifest.sharding else "?",
                    manifest.sharding.parts if manifest.sharding else 0,
                )
                continue
            try:
                restore_checkpoint(self.storage, path.name, self.config.checkpoint_dir)
            except CheckpointCorruptError as exc:
                log.warning("cannot fetch the global %s: %s", path.name, "; ".join(exc.problems))
                continue
            except Exception as exc:  # noqa: BLE001 - storage down: an older local one may do
                log.warning("cannot fetch the global %s: %s", path.name, " ".join(str(exc).split()))
                continue
            log.info("fetched the global %s in place of this node's part", path.name)
            self._vouch(path)
            return path.name
        return None

    def _restore_newer_than(self, step: int) -> CheckpointInfo | None:
        """Stage the newest checkpoint in storage newer than ``step`` that
        verifies (walking back past broken ones); None when there is none.
        Storage errors propagate."""
        return restore_newer_than(self.storage, self.config.checkpoint_dir, step)

    # -- child ---------------------------------------------------------------

    def child_env(self) -> dict[str, str]:
        """The Checkpointer's environment for the command.

        Without ``pass_credentials`` the command gets neither the cloud
        credentials (:func:`is_credential`) nor the storage URI: the supervisor staged the checkpoint
        to resume from before the start and ships what the command commits,
        so the trainer never needs storage (as in a pod, where only the
        restore init container and the sidecar get them).
        """
        env = dict(os.environ)
        env.update(self.config.extra_env)
        env.update(
            {
                envvars.CHECKPOINT_DIR.name: envvars.to_env(envvars.CHECKPOINT_DIR, str(self.config.checkpoint_dir)),
                envvars.STORAGE_URI.name: envvars.to_env(envvars.STORAGE_URI, self.config.storage_uri),
                envvars.CONTROL_DIR.name: envvars.to_env(envvars.CONTROL_DIR, str(self.config.control_dir)),
                envvars.ATTEMPT.name: envvars.to_env(envvars.ATTEMPT, self.attempt),
                envvars.RUN_ID.name: envvars.to_env(envvars.RUN_ID, self.run_id),
            }
        )
        if self.staging is not None:
            env[envvars.EMERGENCY_STAGING.name] = envvars.to_env(envvars.EMERGENCY_STAGING, str(self.staging))
            if self.config.staging_reserve:
                env[envvars.STAGING_RESERVE.name] = envvars.to_env(envvars.STAGING_RESERVE, True)
        if not self.config.pass_credentials:
            withheld = sorted(k for k in env if is_credential(k))
            if withheld and not self._told_withheld:
                self._told_withheld = True  # names only, never values; once per run
                log.info("the command does not get %s (--pass-credentials hands them on)", ", ".join(withheld))
            env = without_credentials(env)
        # Under torchrun the workers must get the whole grace period for their
        # emergency checkpoint; the supervisor kills them at its own deadline.
        env.setdefault(TORCHRUN_SHUTDOWN_ENV, str(max(1, math.ceil(self.config.grace_seconds))))
        if self.config.job:
            env[envvars.JOB.name] = envvars.to_env(envvars.JOB, self.config.job)
        return env

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the command in its own process group, tied to our life."""
        (self.config.workdir / CHILD_FILE).write_text(
            json.dumps({"run_id": self.run_id, "supervisor_pid": os.getpid()}), encoding="utf-8"
        )
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
        log.info("started attempt %d: pid %d: %s", self.attempt, child.pid, " ".join(self.config.command))
        return child

    def _signal_group(self, sig: int) -> None:
        if self.child is None or self.child.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.child.pid, sig)

    def _reap(self) -> None:
        """Once the command has exited: kill what it left running (a launcher's
        workers that outlived it), so nothing writes to the checkpoint
        directory behind the supervisor's back."""
        pids = kill_run(self.run_id)
        if pids:
            log.warning("killed %d process(es) the command left running: %s", len(pids), pids)

    def _on_signal(self, source: str) -> None:
        self.agent.signalled(source)
        self._forward_once()

    def _forward(self, _req: CheckpointRequest) -> None:
        self._forward_once()

    def _forward_once(self) -> None:
        # The Checkpointer treats SIGTERM as a preemption request, and any
        # other program gets the signal it would get on a real shutdown.
        # Once only: a second SIGTERM could reach a trainer that has already
        # put the default handler back on its way out, and kill it there.
        if self._forwarded or self.child is None or self.child.poll() is not None:
            return
        self._forwarded = True
        self._signal_group(signal.SIGTERM)

    # -- main ----------------------------------------------------------------

    def run(self) -> int:
        """Supervise until the command finishes, is preempted, or runs out of restarts."""
        self.latch.install()
        watcher = NoticeWatcher(
            self.config.notice_sources,
            self.agent.enqueue_notice,
            self.config.notice_interval_seconds,
            on_error=lambda _name: self.metrics.failure("notice"),
        )
        try:
            kill_leftovers(self.config.workdir)
            self.recover()
            if self.config.notice_sources:
                watcher.start()
                log.info("polling notices: %s", ",".join(s.name for s in self.config.notice_sources))
            restarts = 0
            # Restarts since the last one after which training made progress:
            # the backoff doubles only while the command keeps failing
            # without a newer checkpoint verified in between.
            streak = 0
            while True:
                if self.latch.event.is_set():
                    return self._preempted()
                verified_before = self._verified_step()
                self.attempt += 1
                ControlChannel(self.config.control_dir).clear()
                self._forwarded = False
                self.child = self.spawn()
                while self.child.poll() is None and not self.latch.event.is_set():
                    self.agent.step()
                    self.granting.follow()
                    self.latch.event.wait(self.config.poll_seconds)
                if self.latch.event.is_set():
                    return self._preempted()
                rc = self.child.returncode
                self._reap()
                # A finished command's last checkpoint may wait longer than a crashed one's:
                # after a crash the next attempt goes on shipping.
                now = time.time()
                shipped = self.agent.flush(
                    self.agent.config.finish_deadline(now) if rc == 0 else now + self.config.grace_seconds
                )
                if rc == 0:
                    return self._ended(shipped)
                restarts += 1
                reason = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
                if restarts > self.config.max_restarts:
                    log.error("command failed (%s); restart budget of %d spent", reason, self.config.max_restarts)
                    return rc if rc > 0 else 128 - rc
                streak = 1 if self._verified_step() > verified_before else streak + 1
                delay = backoff_delay(streak, self.config.backoff_seconds, self.config.backoff_max_seconds)
                self.metrics.restart("crash")
                log.warning(
                    "command failed (%s); restart %d/%d in %.1fs", reason, restarts, self.config.max_restarts, delay
                )
                if self.latch.event.wait(delay):
                    return self._preempted()
                self.recover()
        finally:
            watcher.stop()
            self._signal_group(signal.SIGKILL)
            if self.child is not None:
                self._reap()
            self._settle_staging(self._verified_step(), on_exit=True)
            self.latch.restore()

    def _settle_staging(self, verified_step: int, *, on_exit: bool = False) -> None:
        """Settle what is staged in memory; on the way out, its memory is freed after the exit."""
        if self.staging is None:
            return
        self.agent.settle_staging(self.staging, verified_step, background=on_exit, remove_dir=True)

    def _ended(self, shipped: bool) -> int:
        """The command exited 0: finished, or stopped for a preemption it was told about."""
        self.granting.end()  # the local copy of what it resumed from is complete before the exit
        end = self.agent.run_end(None, trainer_gone_before_signal=True)
        if not shipped:
            return EXIT_EMERGENCY_FAILED
        if end.preempted:
            log.info(
                "preempted (%s): newest verified checkpoint %s; run the same command to resume",
                end.reason,
                self._last_name(),
            )
            return 128 + int(signal.SIGTERM)
        log.info("command finished; newest verified checkpoint: %s", self._last_name())
        self.agent.shipper.housekeeping(self.latch.event.is_set)
        return EXIT_FINISHED

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
            self._reap()
        self.agent.settle_pending()
        end = self.agent.run_end(source, trainer_gone_before_signal=False)
        log_stage(
            "report",
            0.0,
            preempted=end.preempted,
            reason=end.reason,
            step=self.agent.shipper.last_shipped.step if self.agent.shipper.last_shipped else None,
        )
        if not ok:
            return EXIT_EMERGENCY_FAILED
        signum = signal.SIGINT if source == "sigint" else signal.SIGTERM
        log.info("preempted: newest verified checkpoint %s; run the same command to resume", self._last_name())
        return 128 + int(signum)

    def _verified_step(self) -> int:
        last = self.agent.shipper.last_shipped
        return last.step if last is not None else -1

    def _last_name(self) -> str:
        last = self.agent.shipper.last_shipped
        return last.name if last else "none"
