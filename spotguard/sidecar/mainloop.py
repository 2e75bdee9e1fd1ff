"""The sidecar container's life: its options, its main loop, and its last word.

:func:`run_sidecar` is what ``spotguard sidecar`` runs once it is set up: it
serves metrics, starts the notice watcher, does the routine duties of the
:class:`~spotguard.sidecar.service.CheckpointAgent` until the trainer exits
or SIGTERM comes (the :class:`~spotguard.signalsafe.SignalLatch`), runs
the emergency path in the second case, and ends by writing the termination
report, the JSON the operator reads from the container's termination message.
``spotguard run`` does the same duties in-process (``supervisor``) without
this loop.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from spotguard.contract.control import RunEnd, read_staging_full
from spotguard.contract.env import EMERGENCY_STAGING, STAGING_POD_DIR, from_env
from spotguard.contract.report import TerminationReport
from spotguard.sidecar.events import REASON_METRICS_PORT_UNAVAILABLE, post_pod_event_async
from spotguard.sidecar.granting import Granting, vouch_restored
from spotguard.sidecar.metrics import SIDECAR_PORT_HINT
from spotguard.sidecar.notices import NoticeSource, NoticeWatcher
from spotguard.sidecar.service import CheckpointAgent
from spotguard.sidecar.shipper import log_stage
from spotguard.signalsafe import SignalLatch

log = logging.getLogger(__name__)

# Exit statuses of the sidecar.
EXIT_OK = 0
EXIT_EMERGENCY_FAILED = 1

# How long a classic sidecar whose trainer finished waits for an Event still being posted.
EVENT_JOIN_SECONDS = 10.0


@dataclass
class SidecarOptions:
    """What ``spotguard sidecar`` was asked to do beyond the agent's duties."""

    exit_with_trainer: bool = True
    metrics_port: int | None = None
    metrics_addr: str = "0.0.0.0"
    notice_interval_seconds: float = 2.0
    # Kubernetes shows this file's content as the container's termination
    # message; the operator reads the report from there.
    termination_log: Path | None = None
    # Post Kubernetes Events on the own pod (when POD_NAME/POD_NAMESPACE and
    # an apiserver configuration are there; best effort).
    post_events: bool = True
    # The exit status after a preemption handled well (SPOTGUARD_PREEMPTED_EXIT_CODE): 0 where the
    # operator reads the report, non-zero where only the pod's phase speaks (a webhook-injected Job's pod:
    # a preempted pod that succeeded would complete the Job half-trained).
    preempted_exit_code: int = EXIT_OK


def termination_report(
    preempted: bool, reason: str, verified_step: int | None, trainer_step: int | None, metrics_error: str | None = None
) -> TerminationReport:
    """Pure: the sidecar's last word (:class:`~spotguard.contract.report.TerminationReport`).

    ``verified_step`` is the newest checkpoint verified in storage,
    ``trainer_step`` the last step the trainer reached (so the operator can
    count lost steps), ``metrics_error`` why metrics could not be served
    (only when they could not).
    """
    return TerminationReport(
        preempted=preempted,
        reason=reason,
        step=verified_step,
        trainer_step=trainer_step,
        metrics_error=metrics_error or None,
    )


def write_termination_report(path: Path | None, report: TerminationReport) -> None:
    """Write the report where Kubernetes picks it up; never fails the exit."""
    write_termination_text(path, report.to_text())


def write_termination_text(path: Path | None, text: str) -> None:
    """Write ``text`` as the container's termination message; never fails the exit.

    A sidecar that cannot start leaves its error here (not a JSON report), so
    the pod's failure says what went wrong.
    """
    if path is None:
        return
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        log.warning("could not write the termination report to %s: %s", path, exc)


def run_sidecar(
    agent: CheckpointAgent,
    options: SidecarOptions,
    sources: list[NoticeSource],
    latch: SignalLatch | None = None,
) -> int:
    """The sidecar's main loop. Returns the exit status."""
    latch = latch or SignalLatch()
    if latch.on_signal is None:
        # A classic sidecar hears kubelet's SIGTERM when the trainer does: the heartbeat says so at once.
        latch.on_signal = agent.signalled
    if threading.current_thread() is threading.main_thread():
        latch.install()  # usually done already, before the slow part of startup
    metrics_error: str | None = None
    event: threading.Thread | None = None
    if options.metrics_port is not None:
        # Metrics are secondary: a port taken by another pod on a hostNetwork
        # node is a warning (log, Event, report), and shipping goes on.
        _port, metrics_error = agent.metrics.serve_or_warn(
            options.metrics_port, options.metrics_addr, SIDECAR_PORT_HINT
        )
        if metrics_error is not None and options.post_events:
            event = post_pod_event_async(REASON_METRICS_PORT_UNAVAILABLE, metrics_error)
    watcher = NoticeWatcher(
        sources,
        agent.enqueue_notice,
        options.notice_interval_seconds,
        on_error=lambda _name: agent.metrics.failure("notice"),
    )
    watcher.start()
    agent.shipper.adopt_existing()
    log.info(
        "sidecar watching %s (grace %.0fs, notices: %s)",
        agent.config.checkpoint_dir,
        agent.config.grace_seconds,
        ",".join(s.name for s in sources) or "none",
    )
    agent.interrupt = latch.event
    granting = pod_granting(agent)
    try:
        while not latch.event.is_set():
            agent.step()
            granting.follow()
            state = agent.trainer_state()
            if latch.event.is_set():
                # SIGTERM came during this round (an upload can take a
                # while): it is a preemption even if the trainer, signalled at
                # the same time, has exited by now. Seen as "the trainer
                # finished", the report would say so and no emergency would run.
                break
            if options.exit_with_trainer and state == "gone":
                # The trainer finished (or died): ship what it left and leave,
                # so a classic (non-native) sidecar does not keep the pod alive.
                flushed = agent.flush(agent.config.finish_deadline(time.time()))
                if flushed:
                    log.info("trainer exited; everything committed is shipped")
                granting.end()  # the local copy of what it resumed from is complete (a trainer restarted in place)
                end = agent.run_end(None, trainer_gone_before_signal=True)
                report = _report(agent, options, end, metrics_error)
                if flushed and not end.preempted and not latch.event.is_set():
                    agent.shipper.housekeeping(latch.event.is_set)
                _settle_staging(agent)
                _remove_pod_dir(agent, options, report)
                if event is not None:
                    # A trainer that finished within seconds must not take the
                    # Event with it (bounded by the request timeouts; never on
                    # the way out of a preemption, where the grace period counts).
                    event.join(EVENT_JOIN_SECONDS)
                if not flushed:
                    return EXIT_EMERGENCY_FAILED
                return options.preempted_exit_code if end.preempted else EXIT_OK
            latch.event.wait(agent.config.poll_seconds)
        assert latch.source is not None
        agent.metrics.notice(latch.source)
        trainer_before = agent.trainer_state()
        ok = agent.emergency(latch.source, latch.received_at)
        agent.settle_pending()
        _settle_staging(agent)
        report = _report(
            agent,
            options,
            agent.run_end(latch.source, trainer_gone_before_signal=trainer_before == "gone"),
            metrics_error,
        )
        _remove_pod_dir(agent, options, report)
        # Retention waits for the next routine round (the next pod's sidecar):
        # the grace period is for the checkpoint only.
        return options.preempted_exit_code if ok else EXIT_EMERGENCY_FAILED
    finally:
        watcher.stop()


def pod_granting(agent: CheckpointAgent) -> Granting:
    """The sidecar's part in a resume through the restore grant that the pod's restore init
    container wrote (``spotguard restore --grant``): it follows the trainer's answer, whichever
    grant it names, and restores the local copy (:mod:`spotguard.sidecar.granting`). Without a
    grant no answer comes, and nothing is done."""
    cfg = agent.config
    granting = Granting(
        cfg.control_dir,
        cfg.checkpoint_dir,
        agent.storage,
        agent.shipper,
        partial(vouch_restored, cfg.control_dir),
    )
    granting.expect(None, -1)
    return granting


def _settle_staging(agent: CheckpointAgent) -> None:
    """The memory volume goes with the pod: settle what the trainer staged there
    (``SPOTGUARD_EMERGENCY_STAGING``, set by the operator with ``checkpoint.memoryStaging``)."""
    staging = from_env(EMERGENCY_STAGING)
    if staging and agent.trainer_state() == "gone":
        agent.settle_staging(Path(staging))


def _remove_pod_dir(agent: CheckpointAgent, options: SidecarOptions, report: TerminationReport) -> None:
    """hostPath staging: remove this pod's own directory of its node (``SPOTGUARD_STAGING_POD_DIR``), last.

    Only once the trainer is gone: nothing reads the directory any more (the
    next attempt resumes from storage, as from an emptyDir, which kubelet
    removes with its pod). The report then says so, and the operator runs no
    cleanup of its own; a directory left here (the trainer still running,
    a file this user cannot remove) is the operator's to remove.
    """
    pod_dir = from_env(STAGING_POD_DIR)
    if not pod_dir or agent.trainer_state() != "gone":
        return
    try:
        shutil.rmtree(pod_dir)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove this pod's staging directory %s (the operator will): %s", pod_dir, exc)
        return
    log.info("removed this pod's staging directory %s", pod_dir)
    write_termination_report(options.termination_log, replace(report, pod_dir_removed=True))


def _report(
    agent: CheckpointAgent, options: SidecarOptions, end: RunEnd, metrics_error: str | None
) -> TerminationReport:
    t0 = time.monotonic()
    last = agent.shipper.last_shipped
    report = termination_report(
        end.preempted, end.reason, last.step if last else None, agent.trainer_last_step(), metrics_error
    )
    # The trainer's last save found the checkpoint volume full (None: it did not): the operator says so.
    report = replace(report, staging_full=read_staging_full(agent.config.control_dir))
    write_termination_report(options.termination_log, report)
    log_stage("report", time.monotonic() - t0, preempted=end.preempted, reason=end.reason, step=report.step)
    return report
