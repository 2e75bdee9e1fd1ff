"""The trainer's end of the control channel: signals, requests, acknowledgements.

What asks the Checkpointer for a checkpoint, and how it answers: SIGTERM and
SIGUSR1 (handlers that only set flags, so a signal never interrupts a
write), ``checkpoint-request.json`` in the control directory (written by a
sidecar or ``spotguard run``), and :meth:`Checkpointer.request_checkpoint`.
Requests wait in :class:`TrainerChannel` until a save takes them as one
:class:`Due`; once that save is committed (or could not be) each is
acknowledged in ``checkpoint-ack.json``. The channel also writes
``trainer.pid`` (which process to wake) and, at the end, ``trainer-exit.json``.
The wire protocol itself is documented in :mod:`spotguard.contract.control`;
when a save is due is :mod:`~spotguard.trainer.policy`'s question.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from spotguard.checkpoint.local.commit import list_local_committed
from spotguard.contract.control import (
    ACK_FILE,
    EXIT_FILE,
    INTERNAL_REQUEST_PREFIXES,
    PID_FILE,
    REQUEST_FILE,
    CheckpointRequest,
    TrainerExit,
    ack_json,
    parse_request,
    read_heartbeat,
)
from spotguard.contract.control import atomic_write_json as _write_json_atomic
from spotguard.contract.final import FINAL_POLL_SECONDS, PREEMPTED_WAIT_SECONDS, decide_final_wait
from spotguard.trainer.config import CheckpointerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Due:
    """The requests one save answers: whether one preempts (the save is then
    synchronous and the loop stops after it) and the earliest deadline."""

    requests: list[CheckpointRequest]
    preempt: bool
    deadline: float | None

    @classmethod
    def of(cls, requests: list[CheckpointRequest]) -> Due:
        deadlines = [r.deadline for r in requests if r.deadline is not None]
        return cls(requests, any(r.preempt for r in requests), min(deadlines) if deadlines else None)

    @property
    def reason(self) -> str:
        """What caused the save, for the manifest: ``interval``, the
        preempting (else the last) request's reason, or ``sigterm`` for a
        preemption another rank saw."""
        if not self.requests:
            return "sigterm" if self.preempt else "interval"
        preempting = [r for r in self.requests if r.preempt]
        return (preempting or self.requests)[-1].reason or "requested"

    @property
    def request_id(self) -> str | None:
        """The last request's id (the manifest's ``request_id``)."""
        return self.requests[-1].id if self.requests else None


class TrainerChannel:
    """Pending requests, the ids already answered, and the control files.

    Only the ``owner`` (local rank 0 of a node; every single process) reads
    the request file and writes the control files; the other ranks of a node
    take part through the collective agreement in ``should_save``. An
    answer without a new checkpoint names the newest one in the settings'
    ``directory``.
    """

    def __init__(self, settings: CheckpointerConfig, *, owner: bool) -> None:
        self._settings = settings
        self.owner = owner
        # Looked at every step: the path built once (pathlib costs more than the stat).
        self._request_path = os.fspath(settings.control_path / REQUEST_FILE)
        self.pending: list[CheckpointRequest] = []
        #: True once a preempting request is answered: the training loop should stop.
        self.preempted = False
        #: The earliest deadline of the preempting requests answered (unix time; None: none said).
        self.preempt_deadline: float | None = None
        self._handled: set[str] = set()
        self._request_seen: tuple[int, int, int] | None = None
        self._sigterm = False
        #: A SIGTERM came at some point (the flag above is cleared once it is a request).
        self.sigterm_seen = False
        #: When this trainer started: an uploader heartbeat from before is an earlier run's.
        self.started = time.time()
        self._sigusr1 = False
        self._signal_count = 0
        self._previous_handlers: dict[int, Any] = {}
        self._announced = False
        self._exit_announced = False
        self._load_previous_ack()

    @property
    def control_dir(self) -> Path:
        return self._settings.control_path

    # -- signals ---------------------------------------------------------------------
    def install_signal_handlers(self) -> bool:
        """See :meth:`Checkpointer.install_signal_handlers`."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("signal handlers can only be installed from the main thread; skipping")
            return False
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            previous = signal.getsignal(signum)
            self._previous_handlers[signum] = previous
            signal.signal(signum, self._make_handler(signum, previous))
        return True

    def uninstall_signal_handlers(self) -> None:
        """Put back the handlers that were there before."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous_handlers.clear()

    def _make_handler(self, signum: int, previous: Any) -> Callable[[int, FrameType | None], None]:
        def handler(sig: int, frame: FrameType | None) -> None:
            if sig == signal.SIGTERM:
                self._sigterm = True
                self.sigterm_seen = True
            else:
                self._sigusr1 = True
            if callable(previous) and previous not in (signal.default_int_handler,):
                previous(sig, frame)

        return handler

    def release_signals(self) -> None:
        """At close: put back the previous handlers, except that SIGUSR1 is
        ignored once announced. A sidecar that read trainer.pid just before
        it went may still send SIGUSR1, whose default action would kill us:
        go straight from our handler to ignoring it, never through the default."""
        if self._announced and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            self._previous_handlers.pop(signal.SIGUSR1, None)
        self.uninstall_signal_handlers()

    # -- trainer.pid and trainer-exit.json -----------------------------------------------
    def announce(self) -> None:
        """Tell a sidecar which process to wake with SIGUSR1 (only once our
        handler is installed: SIGUSR1's default action kills)."""
        try:
            self.control_dir.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                (self.control_dir / EXIT_FILE).unlink()  # from an earlier trainer run
            _write_json_atomic(self.control_dir / PID_FILE, {"pid": os.getpid()})
            self._announced = True
        except OSError as exc:
            log.warning("could not write %s: %s", self.control_dir / PID_FILE, exc)

    def announce_exit(self, last_step: int | None) -> None:
        """Tell a sidecar that cannot see our process that the trainer is done:
        withdraw ``trainer.pid`` first (no more SIGUSR1), then write the exit file."""
        if not self._announced or self._exit_announced:
            return
        self._exit_announced = True
        with contextlib.suppress(OSError):
            (self.control_dir / PID_FILE).unlink()
        with contextlib.suppress(OSError):
            _write_json_atomic(
                self.control_dir / EXIT_FILE, TrainerExit(os.getpid(), self.preempted, last_step).to_json()
            )

    def await_final_verified(self, final_step: int | None, seconds: float) -> bool:
        """On the way out: wait until the uploader's heartbeat says checkpoint
        ``final_step`` is verified in storage
        (:func:`~spotguard.contract.final.decide_final_wait`). A trainer that
        finished waits at most ``seconds``, on the rank that owns the control
        files; a preempted one on every rank, while the uploader is at work on
        it, until the preemption's deadline (else
        :data:`~spotguard.contract.final.PREEMPTED_WAIT_SECONDS`). True when it
        is verified; False at once without an uploader."""
        preempted = self.preempted or self.sigterm_seen
        if preempted:
            deadline = self.preempt_deadline or time.time() + max(seconds, PREEMPTED_WAIT_SECONDS)
        elif not self.owner or seconds <= 0:
            return False
        else:
            deadline = time.time() + seconds
        said = False
        while True:
            now = time.time()
            verdict = decide_final_wait(
                final_step=final_step,
                beat=read_heartbeat(self.control_dir),
                started=self.started,
                now=now,
                deadline=deadline,
                preempted=preempted,
            )
            if verdict.action == "verified":
                if said or preempted:
                    log.info("checkpoint of step %s verified in storage", final_step)
                return True
            if verdict.action == "leave":
                if said:
                    log.warning("leaving without the last checkpoint verified in storage: %s", verdict.why)
                return False
            if not said:
                said = True
                log.info(
                    "waiting up to %.0fs for the uploader to verify the checkpoint of step %s%s",
                    deadline - now,
                    final_step,
                    " (preempted: only while it is at work on it)" if preempted else "",
                )
            self._answer_on_the_way_out()
            time.sleep(FINAL_POLL_SECONDS)

    def _answer_on_the_way_out(self) -> None:
        """A request that comes while the trainer waits on its way out is answered at once with the
        newest committed checkpoint: it saves nothing more, and the uploader that asked waits for the
        answer (or the trainer's exit) before it ships, so neither would move until the wait's bound.
        So it goes when kubelet's SIGTERM reaches the trainer before its sidecar's request: the trainer
        saves and acknowledges its own signal first, and the request that comes after is answered here."""
        self.poll()
        if not self.pending:
            return
        requests, self.pending = self.pending, []
        committed = next(reversed(list_local_committed(self._settings.directory)), None)
        log.info(
            "answering %s on the way out with %s",
            ", ".join(r.id for r in requests),
            committed.name if committed is not None else "no checkpoint",
        )
        self.answer(requests, committed)

    # -- requests ----------------------------------------------------------------------
    def _load_previous_ack(self) -> None:
        try:
            doc = json.loads((self.control_dir / ACK_FILE).read_bytes())
            if isinstance(doc, dict) and isinstance(doc.get("id"), str):
                self._handled.add(doc["id"])
        except (OSError, ValueError):
            pass

    def request(self, reason: str, *, preempt: bool, deadline: float | None) -> None:
        """An in-process request (:meth:`Checkpointer.request_checkpoint`)."""
        self._signal_count += 1
        self.add(CheckpointRequest(f"local-{os.getpid()}-{self._signal_count}", reason, deadline, preempt))

    def add(self, request: CheckpointRequest) -> None:
        if request.id in self._handled or any(r.id == request.id for r in self.pending):
            return
        log.info("checkpoint requested (%s%s)", request.reason, ", preempting" if request.preempt else "")
        self.pending.append(request)

    def poll(self) -> None:
        """Turn the signals seen since the last poll and a new request file into pending requests."""
        if self._sigterm:
            self._sigterm = False
            self._signal_count += 1
            self.add(CheckpointRequest(f"sigterm-{os.getpid()}-{self._signal_count}", "sigterm", None, True))
        force = self._sigusr1
        self._sigusr1 = False
        if not self.owner:
            return
        try:
            st = os.stat(self._request_path)
        except OSError:
            st = None
        found = False
        if st is not None:
            seen = (st.st_mtime_ns, st.st_size, st.st_ino)
            if force or seen != self._request_seen:
                self._request_seen = seen
                path = Path(self._request_path)
                try:
                    request = parse_request(path.read_bytes())
                except (OSError, ValueError) as exc:
                    log.warning("ignoring unreadable %s: %s", path, exc)
                else:
                    found = request.id not in self._handled
                    self.add(request)
        if force and not found:
            self._signal_count += 1
            self.add(CheckpointRequest(f"sigusr1-{os.getpid()}-{self._signal_count}", "signal", None, False))

    def take(self) -> Due:
        """The pending requests (now taken) as one save's :class:`Due`."""
        self.poll()
        requests, self.pending = self.pending, []
        return Due.of(requests)

    def drop(self, requests: list[CheckpointRequest]) -> None:
        """Take ``requests`` out of the pending ones (a save every rank agreed on answers them)."""
        ids = {r.id for r in requests}
        self.pending = [r for r in self.pending if r.id not in ids]

    def answer(self, requests: list[CheckpointRequest], path: Path | None, *, deadline_exceeded: bool = False) -> None:
        """Acknowledge ``requests``: with ``path`` committed (complete unless
        ``deadline_exceeded``), or with the newest committed checkpoint when
        their save failed. A preempting request answered sets :attr:`preempted`."""
        if not requests:
            return
        self._note_preemption(requests)
        if not self.owner:
            # Another rank of this node answers the uploader.
            self._handled.update(r.id for r in requests)
            return
        committed = path or next(reversed(list_local_committed(self._settings.directory)), None)
        # Internal (signal) requests first: the last ack written is the one a
        # sidecar waiting on a file request reads.
        for request in sorted(requests, key=lambda r: not r.id.startswith(INTERNAL_REQUEST_PREFIXES)):
            self._handled.add(request.id)
            doc = ack_json(
                request.id,
                committed.name if committed is not None else None,
                complete=path is not None and not deadline_exceeded,
            )
            try:
                _write_json_atomic(self.control_dir / ACK_FILE, doc)
            except OSError as exc:
                log.warning("could not write %s: %s", self.control_dir / ACK_FILE, exc)

    def _note_preemption(self, requests: list[CheckpointRequest]) -> None:
        """A preempting request answered: :attr:`preempted`, and the earliest deadline said."""
        preempting = [r for r in requests if r.preempt]
        if not preempting:
            return
        self.preempted = True
        deadlines = [r.deadline for r in preempting if r.deadline is not None]
        if self.preempt_deadline is not None:
            deadlines.append(self.preempt_deadline)
        self.preempt_deadline = min(deadlines) if deadlines else None
