"""The sidecar: ship checkpoints, answer preemption signals and notices.

One loop polls the shared checkpoint directory and ships each newly
committed checkpoint (upload, verify, retention). A notice from a cloud or
from Kubernetes turns into a checkpoint request with a deadline. SIGTERM
(or SIGINT) starts the emergency path: ask the trainer for a checkpoint,
wait for it within the deadline, upload and verify it, exit.

The same :class:`CheckpointAgent` does these duties in-process for
``spotguard run``; the sidecar container's own loop around it, and its
termination report, are :mod:`~spotguard.sidecar.mainloop`'s.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard import gcpause
from spotguard.checkpoint.local import release
from spotguard.checkpoint.store.parts import commit_progress
from spotguard.contract import env as envvars
from spotguard.contract.control import (
    EXIT_FILE,
    CheckpointAck,
    CheckpointRequest,
    ControlChannel,
    RunEnd,
    ack_answers,
    decide_run_end,
    trainer_said_preempted,
    write_heartbeat,
)
from spotguard.contract.retry import EMERGENCY_RETRY_INITIAL, EMERGENCY_RETRY_MAX, retry_delay
from spotguard.sidecar.deadline import ThroughputTracker, notice_deadline, progress_deadline
from spotguard.sidecar.follow import WriteFollower
from spotguard.sidecar.metrics import SidecarMetrics
from spotguard.sidecar.notices import Notice, NoticeSource
from spotguard.sidecar.shipper import (
    CheckpointShipper,
    Shipped,
    log_stage,
    step_of,
)
from spotguard.sidecar.trainerproc import find_trainer_processes, is_trainer_process, signal_trainer

if TYPE_CHECKING:
    from spotguard.checkpoint import RetentionPolicy
    from spotguard.storage import Storage

log = logging.getLogger(__name__)

# After the trainer's exit, how often a part waiting for other nodes' parts is tried again.
FLUSH_AWAIT_POLL_SECONDS = 5.0
# How often the uploader's heartbeat is refreshed at most (well within HEARTBEAT_FRESH_SECONDS).
HEARTBEAT_SECONDS = 1.0
# How often a preemption looks for the trainer's answer: every moment waited here is added to
# SIGTERM -> verified (an incremental checkpoint's is a fraction of a second); a look is a read
# of one small file.
ACK_POLL_SECONDS = 0.005


@dataclass(kw_only=True)
class UploaderConfig:
    """What an uploader of checkpoints is asked to do, the sidecar (:class:`AgentConfig`) or
    ``spotguard run`` (:class:`~spotguard.run.supervisor.RunConfig`): the fields both take,
    with the contract's defaults (:mod:`spotguard.contract.env`)."""

    checkpoint_dir: Path
    grace_seconds: float = envvars.GRACE_SECONDS.default
    # Kept free at the end of the grace period for the upload's last round
    # trips and the process exit; the trainer's deadline is grace minus this.
    safety_margin_seconds: float = envvars.SAFETY_MARGIN_SECONDS.default
    poll_seconds: float = 0.25
    keep_local: int = envvars.KEEP_LOCAL.default
    notice_stops_training: bool = envvars.NOTICE_STOPS_TRAINING.default
    # The trainer's SPOTGUARD_SAVE_EVERY_SECONDS, if set (for the interval metric).
    save_every_seconds: float | None = None
    # Upload only the chunks storage does not hold yet (content-addressed,
    # shared between checkpoints); off: every checkpoint is self-contained.
    # Off unless asked here; the commands' option takes the contract's default.
    incremental: bool = False


@dataclass(kw_only=True)
class AgentConfig(UploaderConfig):
    """Settings of the :class:`CheckpointAgent`, the sidecar's and ``spotguard run``'s."""

    control_dir: Path
    proactive_interval_seconds: float | None = None
    trainer_markers: dict[str, str] = field(default_factory=dict)
    # After the trainer exits on its own (no SIGTERM, so no grace period
    # counts), how long shipping its last checkpoint may go without progress:
    # a part of a multi-node checkpoint waits for the other nodes' uploaders,
    # which may lag behind this one by a backlog of routine uploads; it waits
    # longer while their parts keep appearing in storage (see flush).
    finish_seconds: float = envvars.FINISH_SECONDS.default

    @classmethod
    def of(cls, uploader: UploaderConfig, **more: Any) -> AgentConfig:
        """The agent's settings for ``uploader`` (``spotguard run``'s): its uploader fields, and ``more``."""
        return cls(**{f.name: getattr(uploader, f.name) for f in fields(UploaderConfig)}, **more)

    def finish_deadline(self, now: float) -> float:
        """When shipping the exited trainer's last checkpoint gives up, unless it makes progress."""
        return now + max(self.grace_seconds, self.finish_seconds)


@dataclass
class PendingRequest:
    """A checkpoint request written on behalf of a notice, awaiting verification."""

    request: CheckpointRequest
    source: str
    started: float
    notice: Notice | None = None
    notice_source: NoticeSource | None = None
    target_step: int | None = None


TrainerState = str  # "running" | "gone" | "unknown"


class CheckpointAgent:
    """Ships checkpoints and runs the emergency protocol against one trainer."""

    def __init__(
        self,
        config: AgentConfig,
        storage: Storage,
        metrics: SidecarMetrics,
        retention: RetentionPolicy | None = None,
        trainer_state: Callable[[], TrainerState] | None = None,
    ) -> None:
        self.config = config
        self.storage = storage
        self.metrics = metrics
        self.channel = ControlChannel(config.control_dir)
        self.tracker = ThroughputTracker(config.grace_seconds, config.safety_margin_seconds)
        self.shipper = CheckpointShipper(
            config.checkpoint_dir,
            storage,
            metrics,
            self.tracker,
            retention,
            config.keep_local,
            configured_interval=config.save_every_seconds,
            incremental=config.incremental,
        )
        self._trainer_state_override = trainer_state
        self._notices: queue.Queue[tuple[Notice, NoticeSource]] = queue.Queue()
        self.pending: list[PendingRequest] = []
        self._last_proactive = 0.0
        self._at_risk_logged: bool | None = None
        self._seen_trainer = False
        self._seen_pid: int | None = None
        self._gone_said = False
        # Set when a notice asked the trainer to stop after its checkpoint.
        self.stop_reason: str | None = None
        self._state_cache: tuple[float, TrainerState] | None = None
        # Set on a preemption (the signal latch's event): housekeeping stops.
        self.interrupt: threading.Event | None = None
        # When the heartbeat was last written (monotonic), and what it said (shipping, verified step).
        self._beat: tuple[float, tuple[bool, int | None, bool]] | None = None
        #: On the preemption's path (the heartbeat says so from then on).
        self._in_emergency = False
        metrics.grace.labels(**metrics.labels).set(config.grace_seconds)

    # -- trainer -------------------------------------------------------------

    def trainer_state(self) -> TrainerState:
        """Is the trainer still running? ``unknown`` when this process cannot tell."""
        if self._trainer_state_override is not None:
            return self._trainer_state_override()
        if (self.config.control_dir / EXIT_FILE).exists():
            self._gone_because(f"{EXIT_FILE} recorded its exit")
            return "gone"
        now = time.monotonic()
        if self._state_cache is not None and now - self._state_cache[0] < 0.2:
            return self._state_cache[1]
        state = self._look_for_trainer()
        self._state_cache = (now, state)
        return state

    def _gone_because(self, why: str) -> None:
        """Say once why the trainer is taken for gone (the sidecar ends with it)."""
        if not self._gone_said:
            self._gone_said = True
            log.info("trainer gone: %s", why)

    def _look_for_trainer(self) -> TrainerState:
        pid = self.channel.trainer_pid()
        if pid is not None:
            if is_trainer_process(pid, self.config.trainer_markers):
                self._seen_pid = pid
                return "running"
            if pid == self._seen_pid:
                self._gone_because(f"pid {pid}, seen running, no longer runs")
                return "gone"  # we saw this very process run; it has exited
        # No usable pid file: look for processes carrying the trainer's
        # environment (works when we share its PID namespace).
        if find_trainer_processes(self.config.trainer_markers):
            self._seen_trainer = True
            return "running"
        if self._seen_trainer:
            self._gone_because("no process carries the trainer's environment any more")
            return "gone"
        # Never seen: not started yet, exited before we looked, or in a PID
        # namespace we cannot see. Without a way to tell, don't guess.
        return "unknown"

    def wake_trainer(self) -> bool:
        """SIGUSR1 to the trainer when its identity can be checked."""
        return signal_trainer(
            self.channel.trainer_pid(),
            self.config.trainer_markers,
            still_announced=lambda pid: self.channel.trainer_pid() == pid,
        )

    # -- notices -------------------------------------------------------------

    def enqueue_notice(self, notice: Notice, source: NoticeSource) -> None:
        """Called from the notice watcher thread."""
        self._notices.put((notice, source))

    def handle_notices(self) -> None:
        """Turn queued notices into checkpoint requests."""
        while True:
            try:
                notice, source = self._notices.get_nowait()
            except queue.Empty:
                return
            self.metrics.notice(notice.source)
            now = time.time()
            deadline = notice_deadline(
                notice.deadline, now, self.config.grace_seconds, self.config.safety_margin_seconds
            )
            if notice.deadline is not None and notice.deadline - self.config.safety_margin_seconds <= now:
                log.warning(
                    "notice source=%s: its announced time leaves %.1fs, not more than the "
                    "safety margin of %.1fs: checkpointing anyway (best effort)",
                    notice.source,
                    notice.deadline - now,
                    self.config.safety_margin_seconds,
                )
            preempt = notice.preempt and self.config.notice_stops_training
            req = self.channel.request_checkpoint(f"notice:{notice.source}", deadline, preempt)
            if preempt and self.stop_reason is None:
                self.stop_reason = req.reason
            self.wake_trainer()
            self.pending.append(PendingRequest(req, notice.source, now, notice, source))
            log.warning(
                "notice source=%s %s: requested checkpoint id=%s deadline_in=%.1fs",
                notice.source,
                notice.detail,
                req.id,
                deadline - now,
            )

    def settle_pending(self) -> None:
        """Complete notice requests whose checkpoint is now verified in storage."""
        if not self.pending:
            return
        ack = self.channel.read_ack()
        last = self.shipper.last_shipped
        still: list[PendingRequest] = []
        for item in self.pending:
            if item.target_step is None and ack is not None and ack_answers(ack, item.request):
                if ack.step is None or not ack.complete:
                    self.metrics.failure("save")
                    log.error("trainer could not checkpoint for request %s (%s)", item.request.id, item.source)
                    continue
                item.target_step = ack.step
                self._record_requested_save(item.request, ack)
            if item.target_step is not None and last is not None and last.step >= item.target_step:
                elapsed = time.time() - item.started
                self.metrics.observe_emergency(elapsed, item.source)
                log_stage("notice_checkpoint", elapsed, source=item.source, step=last.step, name=last.name)
                if item.notice is not None and item.notice_source is not None:
                    item.notice_source.acknowledge(item.notice)
                continue
            still.append(item)
        self.pending = still

    # -- routine -------------------------------------------------------------

    def signalled(self, _source: str = "") -> None:
        """A preemption's signal came (called from the signal handler, before the trainer hears of
        it): from now on the heartbeat says this uploader is on its preemption's path, so that a
        trainer that saves before this uploader's loop gets there (it may be stopping a routine
        upload first) waits for its checkpoint instead of leaving (:mod:`spotguard.contract.final`).
        Never raises: it runs inside whatever the main thread was doing."""
        self._in_emergency = True
        self._beat = None
        try:
            self.beat(tmp_tag=".signal")
        except Exception as exc:  # noqa: BLE001 - a signal handler must not raise into the code it interrupted
            log.debug("could not say the preemption in the heartbeat: %s", exc)

    def beat(self, tmp_tag: str = "") -> None:
        """Tell the trainer this uploader is alive, whether it ships, and the
        newest step it verified (``uploader-heartbeat.json``): only while it
        ships may a preemption's save skip its fsync; a trainer that finished,
        or was preempted, waits for its last step to be verified
        (:mod:`spotguard.contract.final`)."""
        # Failing: a checkpoint newer than the newest verified one could not be shipped.
        last = self.shipper.last_shipped
        shipping = not any(step_of(name) > (last.step if last else -1) for name in list(self.shipper.failed))
        said = (shipping, last.step if last else None, self._in_emergency)
        now = time.monotonic()
        if self._beat is not None and self._beat[1] == said and now - self._beat[0] < HEARTBEAT_SECONDS:
            return
        try:
            write_heartbeat(
                self.config.control_dir, shipping=shipping, verified=said[1], emergency=said[2], tmp_tag=tmp_tag
            )
        except OSError as exc:
            log.debug("could not write the heartbeat: %s", exc)
            return
        self._beat = (now, said)

    def step(self) -> list[Shipped]:
        """One round of routine duties: notices, shipping, housekeeping."""
        self.beat()
        self.handle_notices()
        shipped = self.shipper.ship(housekeeping=False, should_stop=self._interrupted)
        self.beat()  # at once when the round changed whether it ships
        self.settle_pending()
        if shipped and not self._interrupted():
            self.shipper.housekeeping(self._interrupted)
        self._deadline_check()
        return shipped

    def _interrupted(self) -> bool:
        return self.interrupt is not None and self.interrupt.is_set()

    def _deadline_check(self) -> None:
        assessment = self.tracker.assessment()
        self.metrics.set_deadline(assessment, self.config.grace_seconds)
        if assessment.at_risk != self._at_risk_logged and assessment.expected_seconds is not None:
            level = logging.WARNING if assessment.at_risk else logging.INFO
            log.log(level, "deadline: %s", assessment.describe())
            self._at_risk_logged = assessment.at_risk
        interval = self.config.proactive_interval_seconds
        if not assessment.at_risk or not interval or self.pending:
            return
        now = time.time()
        if now - self._last_proactive < interval:
            return
        self._last_proactive = now
        req = self.channel.request_checkpoint("proactive", now + self.config.grace_seconds, False)
        self.wake_trainer()
        self.pending.append(PendingRequest(req, "proactive", now))
        log.warning("deadline at risk: requested a proactive checkpoint id=%s", req.id)

    # -- emergency -----------------------------------------------------------

    def emergency(
        self, source: str, received_at: float, forward: Callable[[CheckpointRequest], None] | None = None
    ) -> bool:
        """Preemption now: get the newest state verified in storage before the deadline.

        Meanwhile this process's background deletes of pruned checkpoints
        wait (:func:`~spotguard.checkpoint.local.release.held`), and so does
        the cyclic garbage collector (:mod:`spotguard.gcpause`): a full
        collection of the process amid the upload's manifests and pickle
        inspection waited tens of milliseconds there.
        """
        with release.held(), gcpause.paused():
            return self._emergency(source, received_at, forward)

    def _emergency(self, source: str, received_at: float, forward: Callable[[CheckpointRequest], None] | None) -> bool:
        """:meth:`emergency`'s work.

        The emergency path is save -> upload -> verify -> pointer, and
        nothing else (no retention, no local pruning, no re-reading of what
        is already verified); the caller reports. A storage error is retried
        with backoff until the deadline. ``forward`` delivers the request
        beyond the control file (``spotguard run`` signals its child's
        process group). Returns True when a checkpoint at or after the
        trainer's last step is verified.
        """
        deadline = received_at + self.config.grace_seconds - self.config.safety_margin_seconds
        self._in_emergency = True  # from now on the heartbeat says so: a preempted trainer waits for it
        self.beat()
        state = self.trainer_state()
        log.warning("preemption source=%s trainer=%s deadline_in=%.1fs", source, state, deadline - time.time())
        target: str | None = None
        if state != "gone":
            t0 = time.monotonic()
            req = self.channel.request_checkpoint("sigterm", deadline, preempt=True)
            follower = self._follow_save(req, deadline)
            # The trainer may have answered its own SIGTERM already: then a
            # signal would only reach a process on its way out.
            woke = False if ack_answers(self.channel.read_ack(), req) else self.wake_trainer()
            if forward is not None:
                forward(req)
            log_stage("request", time.monotonic() - t0, id=req.id, signalled=woke)
            target = self._await_trainer(req, deadline)
            log_stage("save", time.monotonic() - t0, name=target or "none")
            if follower is not None:
                sent = follower.finish(target, deadline - time.time())
                chunks = follower.prestored()
                if target is not None and sent:
                    # Stored while the trainer wrote it: the upload resumes, sending only what is missing.
                    self.shipper.note_prestored(target, chunks)
                counts = {"chunks": len(chunks.located), "stored": len(chunks.stored)} if chunks is not None else {}
                log_stage("follow", time.monotonic() - t0, name=follower.name or "none", files=len(sent), **counts)
        t1 = time.monotonic()
        want = step_of(target) if target else -1
        verified_at: float | None = None
        attempt = 0
        while True:
            want = max(want, self._newest_committed_step())
            if not self._verified_at_least(want):
                verified_at = None
                self.shipper.ship(newest_only=True, housekeeping=False)
                if self._verified_at_least(want):
                    verified_at = time.time()
            elif verified_at is None:
                verified_at = time.time()
            # A preempted trainer waits for this before it exits (spotguard.contract.final): told at once.
            self.beat()
            now = time.time()
            if now >= deadline:
                break
            if verified_at is not None:
                # A trainer we can watch may still commit once more on its way out.
                if self.trainer_state() != "running":
                    if self._newest_committed_step() <= want:
                        break
                    continue
                time.sleep(self.config.poll_seconds / 2)
                continue
            attempt += 1
            pause = min(retry_delay(attempt, EMERGENCY_RETRY_INITIAL, EMERGENCY_RETRY_MAX), deadline - now)
            log.warning(
                "stage=retry attempt=%d in=%.2fs want_step=%s reason=%s",
                attempt,
                pause,
                want,
                self._why_not_verified() or "not committed yet",
            )
            time.sleep(max(0.0, pause))
        log_stage("ship", time.monotonic() - t1, attempts=attempt + 1)
        last = self.shipper.last_shipped
        if verified_at is not None and self._verified_at_least(want):
            elapsed = verified_at - received_at
            self.metrics.observe_emergency(elapsed, source)
            log_stage(
                "emergency",
                elapsed,
                result="verified",
                step=last.step if last else None,
                name=last.name if last else None,
            )
            return True
        self.metrics.failure("emergency")
        log.error(
            "stage=emergency seconds=%.3f result=failed want_step=%s verified_step=%s",
            time.time() - received_at,
            want,
            last.step if last else None,
        )
        return False

    def _follow_save(self, req: CheckpointRequest, deadline: float) -> WriteFollower | None:
        """Send the preemption's save while the trainer writes it (:mod:`spotguard.sidecar.follow`):
        as chunks (incremental), or as whole files to a store that takes a growing file."""
        known = self.shipper.known_digests() if self.config.incremental else None
        if known is None and not hasattr(self.shipper.storage, "upload_growing"):
            return None
        since = req.written_at if req.written_at is not None else time.time()
        return WriteFollower(self.shipper.storage, self.config.control_dir, since, deadline, known).start()

    def flush(self, deadline: float) -> bool:
        """Ship until the newest committed checkpoint is verified, or ``deadline``.

        For a trainer that has exited: its last checkpoint must not be left
        behind because the store hiccupped once. The newest goes first, and
        alone: a backlog of older routine checkpoints (a slow store) would
        otherwise use up the time (a gang member stopped because another node
        went has its grace period for its part of the final checkpoint), and
        once the newest is verified the older ones could only make storage
        look older. No housekeeping: the caller runs it once it knows the run
        finished (not on the way out of a preemption).

        A part of a distributed checkpoint waiting for the other nodes' parts
        gives up only once storage has shown no progress of them (new parts,
        new bytes, a live upload's heartbeat: :func:`commit_progress`) for as
        long as ``deadline`` first allowed: a slow node is waited for while it
        uploads, a node that never comes is not.
        """
        attempt = 0
        signalled = False
        span = max(0.0, deadline - time.time())
        seen: tuple[int, int, float] | None = None
        while True:
            self.shipper.ship(newest_only=True, housekeeping=False)
            newest = self._newest_committed()
            if self._verified_at_least(step_of(newest) if newest else -1):
                return True
            if not signalled and self.interrupt is not None and self.interrupt.is_set():
                # SIGTERM while waiting: from now on the grace period counts.
                signalled = True
                deadline = min(deadline, time.time() + self.config.grace_seconds - self.config.safety_margin_seconds)
            if not signalled and newest is not None and newest in self.shipper.awaiting:
                seen, deadline = self._parts_progress(newest, seen, deadline, span)
            attempt += 1
            # Parts waiting for other nodes are polled every few seconds; a
            # failing store backs off further.
            slowest = FLUSH_AWAIT_POLL_SECONDS if not self.shipper.failed else 30.0
            pause = min(retry_delay(attempt, maximum=slowest), deadline - time.time())
            if pause <= 0:
                log.error(
                    "the newest checkpoint could not be verified in storage: %s",
                    self._why_not_verified() or "unknown reason",
                )
                return False
            time.sleep(pause)

    def _parts_progress(
        self, name: str, before: tuple[int, int, float] | None, deadline: float, span: float
    ) -> tuple[tuple[int, int, float] | None, float]:
        """One look at the other parts of ``name`` in storage: what was seen, and the deadline it gives."""
        try:
            seen = commit_progress(self.storage, name)
        except Exception as exc:  # noqa: BLE001 - a storage error is no progress; the deadline stands
            log.warning("could not look at the other parts of %s: %s", name, exc)
            return before, deadline
        later = progress_deadline(deadline, span, before, seen, time.time())
        if later > deadline:
            log.info(
                "%s: the other nodes' parts make progress (%d objects, %d bytes in storage); waiting up to %.0fs more",
                name,
                seen[0],
                seen[1],
                span,
            )
        return seen, later

    def settle_staging(
        self, staging: Path, verified_step: int | None = None, *, background: bool = False, remove_dir: bool = False
    ) -> None:
        """Before the memory ``staging`` goes (this uploader exits): staged checkpoints
        verified in storage are removed, the others copied to the checkpoint
        directory (:func:`~spotguard.checkpoint.local.staged.settle_staged`); then ``staging`` is emptied
        (``background``: after this process exits, see :func:`~spotguard.checkpoint.local.staged.remove_staging`;
        ``remove_dir``: ``staging`` too).
        ``verified_step``: the newest verified one (default: the newest shipped here)."""
        from spotguard.checkpoint.local.staged import remove_staging, settle_staged

        if verified_step is None:
            last = self.shipper.last_shipped
            verified_step = last.step if last is not None else -1
        try:
            removed, copied = settle_staged(self.config.checkpoint_dir, verified_step)
            remove_staging(staging, background=background, remove_dir=remove_dir)
        except OSError as exc:
            log.error("could not settle the checkpoints staged in %s: %s", staging, exc)
            return
        if removed or copied:
            log.info("staged in memory: %d verified and removed, %d copied to disk", len(removed), len(copied))

    def _why_not_verified(self) -> str:
        """Failures, and parts stored but waiting for other nodes' parts, in one line."""
        return "; ".join(
            [
                *self.shipper.failed.values(),
                *(f"{name}: awaiting {what}" for name, what in self.shipper.awaiting.items()),
            ]
        )

    def run_end(self, signal_source: str | None, trainer_gone_before_signal: bool) -> RunEnd:
        """How the run ended, from what the trainer left behind (see :func:`decide_run_end`)."""
        newest = self.shipper.committed()
        reason: str | None = None
        if newest:
            from spotguard.checkpoint import read_local_manifest

            try:
                reason = read_local_manifest(newest[-1]).reason or "interval"
            except (OSError, ValueError):
                reason = None
        said = trainer_said_preempted(self.channel.read_exit(), reason, self.stop_reason)
        return decide_run_end(
            signal_source=signal_source,
            trainer_gone_before_signal=trainer_gone_before_signal,
            trainer_preempted=said,
            stop_reason=self.stop_reason,
        )

    def trainer_last_step(self) -> int | None:
        """The last step the trainer reached, as it said on exit or in its last ack."""
        exit_doc = self.channel.read_exit()
        if exit_doc is not None and exit_doc.last_step is not None:
            return exit_doc.last_step
        ack = self.channel.read_ack()
        return ack.step if ack is not None else None

    def _verified_at_least(self, step: int) -> bool:
        if step < 0:
            return True  # nothing was ever committed: nothing to lose
        last = self.shipper.last_shipped
        return last is not None and last.step >= step

    def _await_trainer(self, req: CheckpointRequest, deadline: float) -> str | None:
        """Wait for the trainer's answer: an ack, or its exit. Returns the ckpt name."""
        signalled_again = False
        written_at = req.written_at if req.written_at is not None else time.time()
        while time.time() < deadline:
            self.beat()
            ack = self.channel.read_ack()
            if ack_answers(ack, req):
                assert ack is not None
                if ack.name is None or not ack.complete:
                    log.error("the trainer could not commit its emergency checkpoint in time")
                    self.metrics.failure("save")
                    return self._newest_committed()
                self._record_requested_save(req, ack)
                return ack.name
            state = self.trainer_state()
            if state == "gone":
                newest = self._newest_committed()
                return newest
            if not signalled_again and time.time() > written_at + 1.0:
                # A trainer that installed its handler late gets one more
                # nudge (the control file stays the contract either way).
                self.wake_trainer()
                signalled_again = True
            time.sleep(ACK_POLL_SECONDS)
        log.error("no checkpoint from the trainer before the deadline (request %s)", req.id)
        return None

    def _record_requested_save(self, req: CheckpointRequest, ack: CheckpointAck) -> None:
        # Request to acknowledgement: the wait for the trainer's next step
        # boundary plus the synchronous write (the write alone is in the
        # manifest's timing and in the save histogram).
        if req.written_at is not None:
            self.metrics.request_latency.labels(**self.metrics.labels).observe(max(0.0, ack.mtime - req.written_at))

    def _newest_committed(self) -> str | None:
        names = [p.name for p in self.shipper.committed()]
        return max(names, key=step_of) if names else None

    def _newest_committed_step(self) -> int:
        newest = self._newest_committed()
        return step_of(newest) if newest else -1


def default_markers(checkpoint_dir: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment entries that identify our trainer's processes.

    The checkpoint directory, plus the pod identity when set: on a shared
    host (a process node) every pod's trainer uses the same mount path.
    """
    env = dict(os.environ) if env is None else env
    markers = {envvars.CHECKPOINT_DIR.name: str(checkpoint_dir)}
    for key in ("POD_NAME", "POD_NAMESPACE", envvars.ATTEMPT.name):
        if env.get(key):
            markers[key] = env[key]
    return markers
