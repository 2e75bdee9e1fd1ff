"""The local two-phase save of one process: snapshot now, write in the background.

Phase one copies the state to host memory (:func:`snapshot_state`; for a
framework's folder, hard-links its files): the only time training waits.
Phase two, on a writer thread, writes (or checksums) the files, the manifest
last, and renames the temporary directory into place
(:mod:`spotguard.checkpoint.local.commit`). At most one write is in flight: a new
save first waits for the previous write (back-pressure, never a dropped
checkpoint). A preemption's save is synchronous and deadline-aware. Once a
write ends, the requests it answers are acknowledged
(:class:`~spotguard.trainer.channel.TrainerChannel`) and the checkpoint is
shipped or pruned (:class:`~spotguard.trainer.shipping.Shipping`).
Under torch.distributed the same writer thread runs the collective phase two
of :mod:`~spotguard.trainer.collective`.

A write that finds the checkpoint volume full (``ENOSPC``, ``EDQUOT``) is a
named failure, :class:`StagingFullError`: the partial checkpoint is removed,
the older committed ones stay, and the save is reported as failed like any
other (``last_error``, the requests' acknowledgement, ``staging-full.json``
for the uploader's report) rather than raised. Training goes on: a write runs
on the writer thread, where an exception could not reach the training loop,
a full volume often frees itself (the uploader prunes shipped checkpoints),
and a preemption's save that raised would skip the orderly stop.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from spotguard.checkpoint.format.manifest import ManifestMeta
from spotguard.checkpoint.local.arena import Plan, plans
from spotguard.checkpoint.local.arena import Stopped as ArenaStopped
from spotguard.checkpoint.local.arena import build as build_arena
from spotguard.checkpoint.local.arena import close_all as close_arenas
from spotguard.checkpoint.local.codec import POOL_ARENAS, POOL_PLACES, Snapshot, snapshot_state, written_size
from spotguard.checkpoint.local.commit import (
    DeadlineExceeded,
    LocalWriter,
    list_local_committed,
    save_timing,
    write_checkpoint,
)
from spotguard.checkpoint.local.reserve import prepare as prepare_reserve
from spotguard.checkpoint.local.staged import MEMORY_MARGIN, choose_staging, may_link_kept, memory_headroom
from spotguard.contract.control import STAGING_FULL_FILE, WRITING_FILE, WritePlan, atomic_write_json
from spotguard.contract.report import StagingFull
from spotguard.trainer import folder as _folder
from spotguard.trainer.channel import Due, TrainerChannel
from spotguard.trainer.config import CheckpointerConfig
from spotguard.trainer.policy import SavePolicy, SaveRecord
from spotguard.trainer.shipping import Shipping

log = logging.getLogger(__name__)

#: The errors a write on a full volume ends in: no space, or the volume's quota reached.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class StagingFullError(OSError):
    """A checkpoint could not be written: its volume (the pod's staging volume) is full.

    The partial checkpoint was removed and the older committed ones are kept.
    ``Checkpointer.last_error`` holds it after such a save.
    """

    def __init__(self, step: int, directory: Path, free_bytes: int | None, cause: BaseException) -> None:
        free = (
            f"{free_bytes} bytes free once the partial checkpoint was removed"
            if free_bytes is not None
            else "free space unknown"
        )
        super().__init__(
            errno.ENOSPC,
            f"checkpoint of step {step} not written: the checkpoint volume at {directory} is full ({free}; {cause})."
            " The older checkpoints are kept. Give the staging volume more room"
            " (spec.checkpoint.staging: sizeLimit or size), or keep fewer local checkpoints",
        )
        self.step = step
        self.directory = directory
        self.free_bytes = free_bytes


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) says the volume is full."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return True
        current = current.__cause__ or current.__context__
    return False


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def write_in_staging(write: Callable[..., Path], staging: Path | None) -> Path:
    """``write(staging=staging)``; when ``staging`` fills up meanwhile, ``write()``
    again in the checkpoint directory (the writer removed what it had staged)."""
    if staging is None:
        return write()
    try:
        return write(staging=staging)
    except OSError as exc:
        if not disk_full(exc):
            raise
        log.warning("emergency staging %s filled up (%s): writing to the checkpoint directory", staging, exc)
        return write()


@dataclass
class PersistJob:
    """One save between its two phases."""

    step: int
    snapshot: Snapshot | None
    epoch: int | None
    metrics: Mapping[str, Any] | None
    due: Due
    snapshot_seconds: float = 0.0
    # Distributed saves: the staged DCP tensors, the shared tmp-dir token,
    # and what the writer thread found.
    sharded: Any = None
    token: int = 0
    plans: int = 0  # the DCP plan-cache generation the ranks agreed on (spotguard.trainer.plancache)
    result: Path | None = None

    def manifest_meta(self, job: str | None, attempt: int | None, persist_seconds: float) -> ManifestMeta:
        """What this save's manifest says about it (of ``attempt`` of ``job``), its phase two having
        taken ``persist_seconds``."""
        return ManifestMeta(
            epoch=self.epoch,
            metrics=self.metrics,
            job=job,
            attempt=attempt,
            reason=self.due.reason,
            request_id=self.due.request_id,
            timing=save_timing(persist_seconds, self.snapshot_seconds),
        )


class LocalPersist:
    """The writer thread and the single-process saves.

    The parts it shares with the Checkpointer: ``settings`` (directory,
    checksum, job and attempt for the manifest), ``policy`` (marks the step
    saved), ``record`` (what the user reads), ``channel`` (answers the
    requests), ``shipping`` (after a commit; durability) and ``pinned``
    (host buffers reused by the next snapshot, None not to keep them).
    """

    def __init__(
        self,
        settings: CheckpointerConfig,
        policy: SavePolicy,
        record: SaveRecord,
        channel: TrainerChannel,
        shipping: Shipping,
        pinned: dict[Any, Any] | None,
    ) -> None:
        self._settings = settings
        self._policy = policy
        self._record = record
        self._channel = channel
        self._shipping = shipping
        self._pinned = pinned
        self.thread: threading.Thread | None = None
        self._reserving: threading.Thread | None = None  # arenas, then memory set aside
        # Held by a snapshot, and by the move of one host buffer into an arena: never both at once.
        self._pool_lock = threading.Lock()
        self._preempting = False  # a preemption's save started: memory is no longer set aside
        self._closing = False

    # -- the writer thread ---------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight write; True when nothing is in flight any more."""
        thread = self.thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            return False
        self.thread = None
        return True

    def wait_until(self, deadline: float | None) -> bool:
        """:meth:`wait`, but not past ``deadline`` (unix time)."""
        return self.wait(None if deadline is None else max(0.0, deadline - time.time()))

    def _start(self, target: Callable[..., Any], args: tuple[Any, ...] = ()) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name="spotguard-persist", daemon=True)
        self.thread = thread
        thread.start()
        return thread

    def answer_with_last(self, due: Due, *, preempt: bool = False) -> Path | None:
        """A save of the step saved last: wait for its write, answer with it
        (a preemption's answer still stops the loop)."""
        self.wait_until(due.deadline)
        self._channel.answer(due.requests, self._record.last_committed if self.thread is None else None)
        if preempt:
            self._channel.preempted = True
        return self._record.last_committed

    def _answered_before(self, step: int, due: Due, doing: str) -> tuple[bool, Path | None]:
        """The prologue of a save of ``step`` in a single process: whether it is answered before it
        begins, and with what. The step saved last is committed, being committed or resumed already
        (a framework saving it again into hard-linked files is never re-linked): its write is waited
        for and answers. A previous write still running at the deadline answers that none was made."""
        if step == self._policy.last_step:
            return True, self.answer_with_last(due)
        if not self.wait_until(due.deadline):
            log.error("previous checkpoint still being written at the deadline; not %s step %d", doing, step)
            self._channel.answer(due.requests, None, deadline_exceeded=True)
            return True, None
        return False, None

    def phase_one_done(self, step: int, start: float) -> None:
        """Phase one of ``step`` ended (it began at ``start``, perf_counter)."""
        self._record.last_stall_seconds = time.perf_counter() - start
        self._policy.saved(step)

    def run_writer(
        self, job: PersistJob, target: Callable[..., None], args: tuple[Any, ...], *, sync: bool
    ) -> Path | None:
        """Start phase two of a distributed save on the writer thread; when
        ``sync``, wait for it, but not past the deadline (a rank that died
        would hold the others in a collective)."""
        thread = self._start(target, args)
        if not sync:
            return None
        timeout = None if job.due.deadline is None else max(0.0, job.due.deadline - time.time()) + 1.0
        thread.join(timeout)
        if not thread.is_alive():
            self.thread = None
        else:
            log.error("checkpoint of step %d not committed by its deadline", job.step)
        if job.due.preempt:
            self._channel.preempted = True
        return job.result

    # -- a state ---------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        due: Due,
        *,
        epoch: int | None,
        metrics: Mapping[str, Any] | None,
        blocking: bool | None,
    ) -> Path | None:
        """:meth:`Checkpointer.save` in a single process."""
        sync = self._policy.synchronous(blocking, due.preempt)
        self._preempting = self._preempting or due.preempt
        answered, answer = self._answered_before(step, due, "starting")
        if answered:
            return answer
        start = time.perf_counter()
        try:
            with self._pool_lock:
                snapshot = snapshot_state(state, pinned=self._pinned)
        except BaseException:  # an interrupt too: the requests are answered, then it is raised again
            # The state cannot be saved (the caller's error); still answer
            # the requests, so a preemption ends the loop instead of looping.
            self._channel.answer(due.requests, None)
            raise
        self.phase_one_done(step, start)
        job = PersistJob(
            step, snapshot, epoch, dict(metrics) if metrics else None, due, self._record.last_stall_seconds
        )
        if sync:
            return self._write(job)
        self._start(self._write, (job,))
        return None

    def _write(self, job: PersistJob) -> Path | None:
        """Phase two of :meth:`save`."""
        record = self._record
        start = time.perf_counter()
        path: Path | None = None
        prepare: tuple[list[Plan], list[int] | None] | None = None
        deadline_exceeded = False
        try:
            assert job.snapshot is not None
            durable = self._shipping.durable(job.due.preempt)
            write = partial(
                write_checkpoint,
                self._settings.directory,
                job.step,
                job.snapshot,
                algorithm=self._settings.checksum,
                epoch=job.epoch,
                metrics=job.metrics,
                job=self._settings.job,
                attempt=self._settings.attempt,
                deadline=job.due.deadline,
                reason=job.due.reason,
                request_id=job.due.request_id,
                snapshot_seconds=job.snapshot_seconds,
                durable=durable,
                pool=self._pinned,  # the next save compares against what this one committed
            )
            staging = None if durable else choose_staging(self._settings.emergency_staging, job.snapshot)
            if not durable:
                self._announce(job, staging)
            path = write_in_staging(write, staging)
            prepare = self._staging_plans(job.snapshot, durable)  # never raises: only a preparation
            record.last_committed = path
            record.last_persist_seconds = time.perf_counter() - start
            log.info("checkpoint %s committed (%.2fs)", path, record.last_persist_seconds)
        except DeadlineExceeded as exc:
            deadline_exceeded = True
            record.last_error = exc
            newest = next(reversed(list_local_committed(self._settings.directory)), None)
            log.error("%s; the newest committed checkpoint is %s", exc, newest.name if newest else "none")
        except Exception as exc:  # noqa: BLE001 - a failed write fails this save, not the writer thread
            record.last_error = self._failed(job.step, exc)
        finally:
            job.snapshot = None  # free host memory before anything slow
        self._channel.answer(job.due.requests, path, deadline_exceeded=deadline_exceeded)
        if path is not None:
            self._staging_ok()
            self._shipping.after_commit(path, job.due)
        if prepare is not None:
            self._prepare_staging(*prepare)
        return path

    def _preempted(self) -> bool:
        """A preemption's save has started or is asked for (or the checkpointer is closing)."""
        return self._closing or self._preempting or any(r.preempt for r in self._channel.pending)

    def close(self) -> None:
        """Stop preparing the staging memory (between two buffers) and close the arenas."""
        self._closing = True
        thread = self._reserving
        if thread is not None:
            thread.join()
        close_arenas(self._pinned)

    def _staging_plans(self, snapshot: Snapshot, durable: bool) -> tuple[list[Plan], list[int] | None] | None:
        """After a routine save of ``snapshot``: the arenas to move its host buffers into
        (:mod:`spotguard.checkpoint.local.arena`), and the sizes of the other files a preemption's
        save would write into the staging memory, to set memory aside for (None when none is:
        off). None when nothing is prepared: no staging memory, or not a routine save. When a
        preemption's save would link a file and stay on the disk, no arena, and no memory set
        aside (what was set aside before is given back)."""
        staging = self._settings.emergency_staging
        if staging is None or not durable:
            return None
        if may_link_kept(snapshot):
            return [], ([] if self._settings.staging_reserve else None)
        try:
            arenas = plans(snapshot) if self._pinned is not None and self._settings.staging_arena else []
        except Exception as exc:  # noqa: BLE001 - the save is committed; an arena is only a way to be faster
            log.warning("staging arena: not planned (%s)", exc)
            arenas = []
        if not self._settings.staging_reserve:
            return arenas, None
        moved = {p.file for p in arenas}
        return arenas, [written_size(blobs) for f, blobs in snapshot.tensors.items() if f not in moved]

    def _prepare_staging(self, arenas: list[Plan], reserve: list[int] | None) -> None:
        """In the background, unless that is under way: move the host buffers into their arenas
        (:func:`spotguard.checkpoint.local.arena.build`), then set aside the staging memory for files
        of the ``reserve`` sizes (:func:`spotguard.checkpoint.local.reserve.prepare`)."""
        staging = self._settings.emergency_staging
        pool = self._pinned
        if staging is None or self._preempted() or (self._reserving is not None and self._reserving.is_alive()):
            return
        places = pool.get(POOL_PLACES) if pool is not None else None

        def run() -> None:
            try:
                if pool is not None and places is not None:
                    self._move_to_arenas(staging, arenas, pool, places)
                if reserve is not None:
                    reserved = prepare_reserve(
                        staging, reserve, headroom=memory_headroom(), margin=MEMORY_MARGIN, stop=self._preempted
                    )
                    log.debug("staging reserve: %d bytes set aside in %s", reserved, staging)
            except ArenaStopped:
                log.info("staging arena: moving host buffers stopped for a preemption's save")
            except Exception as exc:  # noqa: BLE001 - only a preparation: saves write their files without it
                log.warning("staging memory in %s: %s", staging, exc)

        self._reserving = threading.Thread(target=run, name="spotguard-staging-memory", daemon=True)
        self._reserving.start()

    def _move_to_arenas(self, staging: Path, arenas: list[Plan], pool: dict[Any, Any], places: Any) -> None:
        have = pool.get(POOL_ARENAS, {})
        for plan in arenas:
            there = have.get(plan.file)
            if there is not None and there.complete and not there.spent and there.plan == plan:
                continue  # its buffers are already there
            arena = build_arena(
                staging,
                plan,
                pool,
                self._pool_lock,
                places=places,
                headroom=memory_headroom(),
                margin=MEMORY_MARGIN,
                stop=self._preempted,
            )
            if arena is not None and arena.complete:
                log.info("staging arena: %s (%d bytes) in %s", plan.file, plan.size, staging)

    def _announce(self, job: PersistJob, staging: Path | None) -> None:
        """Tell the uploader what a preemption's save is about to write (``checkpoint-writing.json``):
        one that stores whole files may send them while they are written."""
        assert job.snapshot is not None
        if not self._channel.owner:
            return
        dirs = [str(d) for d in (staging, self._settings.directory) if d is not None]
        files = [(f, written_size(blobs)) for f, blobs in sorted(job.snapshot.tensors.items())]
        plan = WritePlan(job.step, time.time(), tuple(dirs), tuple(files))
        try:
            atomic_write_json(self._channel.control_dir / WRITING_FILE, plan.to_json(), durable=False)
        except OSError as exc:
            log.debug("could not announce the checkpoint being written: %s", exc)

    # -- a full volume ---------------------------------------------------------------------
    def _failed(self, step: int, exc: BaseException, source: Path | None = None) -> BaseException:
        """Log a failed write and return the error to record: a :class:`StagingFullError` for a full volume.

        The writer has already removed its partial checkpoint; on a full
        volume the uploader is told (``staging-full.json``) so that the pod's
        end reports it.
        """
        if not disk_full(exc):
            where = f" from {source}" if source is not None else ""
            log.error("checkpoint of step %d%s failed: %s", step, where, exc)
            return exc
        directory = self._settings.directory
        error = StagingFullError(step, directory, _free_bytes(directory), exc)
        newest = next(reversed(list_local_committed(directory)), None)
        log.error("%s; the newest committed checkpoint is %s", error.strerror, newest.name if newest else "none")
        if self._channel.owner:
            full = StagingFull(error=error.strerror, step=step, time=time.time(), free_bytes=error.free_bytes)
            doc = full.to_json()
            try:
                atomic_write_json(self._channel.control_dir / STAGING_FULL_FILE, doc)
            except OSError as why:
                log.warning("could not tell the uploader that the checkpoint volume is full: %s", why)
        return error

    def _staging_ok(self) -> None:
        """A checkpoint was committed: the volume is not full (any more)."""
        if self._channel.owner:
            with contextlib.suppress(OSError):
                os.unlink(self._channel.control_dir / STAGING_FULL_FILE)

    # -- a framework's folder --------------------------------------------------------------
    def commit_folder(
        self,
        step: int,
        source: Path,
        due: Due,
        *,
        epoch: int | None,
        metrics: Mapping[str, Any] | None,
        exclude: Sequence[str],
        blocking: bool | None,
    ) -> Path | None:
        """:meth:`Checkpointer.commit_folder` in a single process."""
        s = self._settings
        answered, answer = self._answered_before(step, due, "committing")
        if answered:
            return answer
        start = time.perf_counter()
        writer = LocalWriter(
            s.directory, step, algorithm=s.checksum, deadline=due.deadline, durable=self._shipping.durable(due.preempt)
        )
        try:
            names = _folder.folder_files(source, exclude)
            for rel in names:
                _folder.link_or_copy(source / rel, writer.tmp / rel)
        except BaseException:  # an interrupt too: no half-linked folder, the requests answered; raised again
            writer.abort()
            self._channel.answer(due.requests, None)
            raise
        # From here on the framework may delete or rotate its folder: the
        # checkpoint holds its own links. Checksums and the manifest are
        # phase two: in the background, or now for a preemption.
        self.phase_one_done(step, start)
        job = PersistJob(step, None, epoch, _folder.metrics_of(metrics), due, self._record.last_stall_seconds)
        if self._policy.synchronous(blocking, due.preempt):
            return self._commit_linked(job, writer, names, source)
        self._start(self._commit_linked, (job, writer, names, source))
        return None

    def _commit_linked(self, job: PersistJob, writer: LocalWriter, names: list[str], source: Path) -> Path | None:
        """Phase two of :meth:`commit_folder`: checksum (and fsync) the linked
        files, write the manifest last, rename; then answer the requests and ship."""
        record = self._record
        start = time.perf_counter()
        try:
            _folder.checksum_linked(writer, names)
            path = writer.commit(
                **job.manifest_meta(self._settings.job, self._settings.attempt, time.perf_counter() - start)
            )
        except DeadlineExceeded as exc:
            writer.abort()
            record.last_error = exc
            log.error("checkpoint of step %d not committed before its deadline", job.step)
            self._channel.answer(job.due.requests, None, deadline_exceeded=True)
            return None
        except Exception as exc:  # noqa: BLE001 - a failed write fails this save, not the writer thread
            writer.abort()
            record.last_error = self._failed(job.step, exc, source)
            self._channel.answer(job.due.requests, None)
            return None
        record.last_committed = path
        record.last_persist_seconds = time.perf_counter() - start
        log.info("checkpoint %s committed from %s (%.2fs)", path, source, record.last_persist_seconds)
        self._channel.answer(job.due.requests, path)
        self._staging_ok()
        self._shipping.after_commit(path, job.due)
        return path
