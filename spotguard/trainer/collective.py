"""The collective save under torch.distributed: every rank, same step, one checkpoint per node.

Phase one (training thread, ``main`` process group): each rank snapshots its
state (model and optimizer tensors staged by DCP's stager, the rest through
the codec; for a framework's folder, each node's local rank 0 links the
files), then one ``all_reduce`` (:meth:`DistContext.start_save`) tells every
rank whether any rank is still busy or failed, and hands out the token that
names the node's shared temporary directory. Phase two (the writer thread of
:class:`~spotguard.trainer.persist.LocalPersist`, ``persist`` group only):
``dcp.save``, each rank's own files, a gather of every rank's
:class:`RankReport`, the node's part manifest committed by its local rank 0,
and a gather of every node's :class:`CommitReport` before any request is
answered. See :mod:`spotguard.trainer.distributed` for the layout.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotguard.checkpoint.format.manifest import DCP_DIR, DCP_METADATA, FileEntry, Sharding, checkpoint_name
from spotguard.checkpoint.local.codec import Snapshot, StateError, snapshot_state
from spotguard.checkpoint.local.commit import WRITER_TMP_PREFIX, DeadlineExceeded, LocalWriter, list_local_committed
from spotguard.trainer import distributed as _distributed
from spotguard.trainer import folder as _folder
from spotguard.trainer.channel import Due, TrainerChannel
from spotguard.trainer.config import CheckpointerConfig
from spotguard.trainer.distributed import DistContext
from spotguard.trainer.persist import LocalPersist, PersistJob
from spotguard.trainer.plancache import PlanCache
from spotguard.trainer.policy import SavePolicy, SaveRecord
from spotguard.trainer.shipping import Shipping

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankReport:
    """What one rank tells every other once its files of a save are written
    and checksummed (the first gather of phase two)."""

    node: int
    leader: bool  # local rank 0: commits the node's part
    entries: list[tuple[str, int, str]] | None  # (path, size, checksum) of its files
    error: str | None
    deadline_exceeded: bool


@dataclass(frozen=True)
class CommitReport:
    """Whether a rank's node part is committed (the second gather of phase two)."""

    committed: bool
    error: str | None


@dataclass
class _RankWrite:
    """This rank's files of one save on the writer thread: its writer (None when it
    could not be made) and what went wrong before the gathers."""

    writer: LocalWriter | None = None
    error: str | None = None
    deadline_exceeded: bool = False


class CollectiveSave:
    """``save`` and ``commit_folder`` under torch.distributed (collective: every rank, same step)."""

    def __init__(
        self,
        dist: DistContext,
        settings: CheckpointerConfig,
        policy: SavePolicy,
        record: SaveRecord,
        channel: TrainerChannel,
        local: LocalPersist,
        shipping: Shipping,
        *,
        pinned: dict[Any, Any] | None,
    ) -> None:
        self._d = dist
        self._settings = settings
        self._policy = policy
        self._record = record
        self._channel = channel
        self._local = local
        self._shipping = shipping
        self._pinned = pinned
        self._stager: Any = None  # DCP's stager, kept with its host buffers unless pinned is None
        self._dcp: Any = None  # what a sharded save tells the next (dcpwriter.DcpSaves; torch imported at first use)
        self._plans = PlanCache()  # DCP's plan caches, agreed between the ranks (spotguard.trainer.plancache)

    def close(self) -> None:
        """Once the writer thread is done: the plans cached for DCP dropped."""
        self._plans.drop()

    def _tmp(self, step: int, token: int) -> Path:
        """The temporary directory the ranks of a node share for one save."""
        return self._settings.directory / f"{WRITER_TMP_PREFIX}{step:012d}-{token:08x}"

    def _sharding(self, token: int) -> Sharding:
        d = self._d
        return Sharding(
            world_size=d.world_size, parts=d.parts, part=d.info.node, ranks=d.node_ranks, save_id=f"{token:013x}"
        )

    # -- a state -------------------------------------------------------------------------
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
        """:meth:`Checkpointer.save` under torch.distributed."""
        sync = self._policy.synchronous(blocking, due.preempt)
        if step == self._policy.last_step:
            return self._local.answer_with_last(due, preempt=due.preempt)
        busy = not self._local.wait_until(due.deadline)
        start = time.perf_counter()
        error: BaseException | None = None
        sharded: Any = None
        snapshot: Snapshot | None = None
        if not busy:
            try:
                sharded, snapshot = self._snapshot(state)
            except BaseException as exc:  # noqa: BLE001 - every rank must reach start_save; raised after it
                error = exc
        begun = self._d.start_save(busy, error is not None, self._plans.held)
        if begun.any_busy or begun.any_failed:
            if begun.any_busy:
                log.error("a previous checkpoint is still being written at the deadline; not starting step %d", step)
            else:
                log.error("a rank could not snapshot its state; not saving step %d", step)
            self._channel.answer(due.requests, None, deadline_exceeded=begun.any_busy)
            if due.preempt:
                self._channel.preempted = True
            if error is not None:
                raise error
            return None
        self._local.phase_one_done(step, start)
        job = PersistJob(
            step,
            snapshot,
            epoch,
            dict(metrics) if metrics else None,
            due,
            self._record.last_stall_seconds,
            sharded=sharded,
            token=begun.token,
            plans=begun.plans,
        )
        return self._local.run_writer(job, self._persist, (job,), sync=sync)

    def _snapshot(self, state: Mapping[str, Any]) -> tuple[Any, Snapshot]:
        """Phase one: the DCP tensors staged in host memory by torch's stager,
        everything else of this rank's state through the codec."""
        if not isinstance(state, Mapping):
            raise StateError(f"the state to save must be a mapping, got {type(state).__name__}")
        tensors, skeleton = _distributed.split_tensors({k: state[k] for k in _distributed.DCP_KEYS if k in state})
        rank_state = {k: (skeleton[k] if k in _distributed.DCP_KEYS else v) for k, v in state.items()}
        staged = self._dcp_saves().stage(tensors, self._stage, keep=self._pinned is not None) if tensors else None
        return staged, snapshot_state(rank_state, pinned=self._pinned)

    def _dcp_saves(self) -> Any:
        """What one sharded save tells the next (:class:`~spotguard.trainer.dcpwriter.DcpSaves`)."""
        if self._dcp is None:
            from spotguard.trainer.dcpwriter import DcpSaves

            self._dcp = DcpSaves()
        return self._dcp

    def _stage(self, tensors: dict[str, Any]) -> Any:
        """DCP's tensors copied into host memory (pinned where CUDA is) by torch's
        stager, whose host buffers are kept for the next save unless
        ``reuse_host_buffers=False``."""
        import torch

        pin = bool(torch.cuda.is_available())
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            options = StagingOptions(
                use_pinned_memory=pin, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=pin
            )
            self._stager = DefaultStager(options)
        # Some torch releases (2.11) close the DefaultStager's StateDictStager after
        # every stage: its host buffers are dropped, and the next stage fails
        # (KeyError: <class 'type'>, its copy table cleared). Where there is one,
        # stage through it as DefaultStager does, without that close.
        inner = getattr(self._stager, "_state_dict_stager", None)
        if inner is not None and callable(getattr(inner, "stage", None)):
            staged = inner.stage(tensors, non_blocking=pin)
            if pin:
                torch.cuda.synchronize()  # the copies enqueued above are done
        else:
            staged = self._stager.stage(tensors)
        if self._pinned is None:  # reuse_host_buffers=False
            self._stager.close()
            self._stager = None
        return staged

    def _persist(self, job: PersistJob) -> None:
        """Phase two on the writer thread: every rank writes its files into the
        node's temporary directory, local rank 0 commits the node's part once
        every rank's files are written and checksummed. Every rank takes part in
        each collective (``dcp.save``, the two gathers) whatever failed before it:
        a rank that skipped one would leave the others waiting."""
        start = time.perf_counter()
        tmp = self._tmp(job.step, job.token)
        durable = self._shipping.durable(job.due.preempt)
        mine = self._write_own_files(job, tmp, durable)
        self._save_dcp(job, tmp, durable, mine)
        reports = self._gather_ranks(job, mine)
        if reports is None:
            return
        errors = [r.error for r in reports if r.error]
        deadline_exceeded = any(r.deadline_exceeded for r in reports)
        path, committed_here, commit_error = self._commit_part(job, mine.writer, reports, errors, tmp, start)
        commits = self._gather_commits(committed_here, commit_error or mine.error)
        self._conclude(job, errors, commits, deadline_exceeded, path, start)

    def _write_own_files(self, job: PersistJob, tmp: Path, durable: bool) -> _RankWrite:
        """This rank's own files (its state outside DCP) written and checksummed in
        the node's temporary directory."""
        d, s = self._d, self._settings
        mine = _RankWrite()
        try:
            mine.writer = LocalWriter(
                s.directory, job.step, algorithm=s.checksum, deadline=job.due.deadline, durable=durable, tmp=tmp
            )
            assert job.snapshot is not None
            mine.writer.add_snapshot(job.snapshot, prefix=_distributed.rank_prefix(d.rank))
        except DeadlineExceeded as exc:
            mine.error, mine.deadline_exceeded = str(exc), True
        except Exception as exc:  # noqa: BLE001 - every rank must reach dcp.save; the error fails the save
            mine.error = f"rank {d.rank}: {exc}"
        return mine

    def _save_dcp(self, job: PersistJob, tmp: Path, durable: bool, mine: _RankWrite) -> None:
        """``dcp.save`` of the model and optimizer shards (collective), and this
        rank's files of it added to its writer; the host copies dropped after."""
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        d = self._d
        dcp_dir = tmp / DCP_DIR
        try:
            if job.sharded is not None:
                # Unchanged items in a file linked from the previous save (spotguard.trainer.dcpwriter).
                committed = self._settings.directory / checkpoint_name(job.step) / DCP_DIR
                writer = self._dcp_saves().writer(dcp_dir, committed, durable=durable)
                # The unchanged items' write items reused from the previous save (only where the stager
                # keeps its host copies: otherwise nothing is unchanged, and nothing is held for the next).
                unchanged = self._dcp_saves().unchanged if self._pinned is not None else None
                # The stage's own flattening of what it staged, taken once (it holds the host copies).
                flattened, self._dcp_saves().flattened = self._dcp_saves().flattened, None
                planner = self._plans.planner(job.plans, unchanged, flattened)
                try:
                    dcp_save(job.sharded, storage_writer=writer, planner=planner, process_group=d.persist)
                except BaseException:  # noqa: BLE001 - re-raised: whatever failed, the next save exchanges every plan
                    self._plans.drop()
                    raise
                finally:
                    # The global metadata, pickled for DCP's broadcast as its written bytes, is torch's again.
                    sent = getattr(writer, "sent", None)
                    if sent is not None:
                        sent()
                self._plans.saved(job.plans)
            if mine.writer is not None and mine.error is None:
                names = sorted(p.name for p in dcp_dir.glob(f"__{d.rank}_*.distcp")) if dcp_dir.is_dir() else []
                if d.rank == 0 and job.sharded is not None:
                    names.append(DCP_METADATA)
                self._dcp_saves().add_files(mine.writer, dcp_dir, names)
        except DeadlineExceeded as exc:
            mine.error, mine.deadline_exceeded = mine.error or str(exc), True
        except Exception as exc:  # noqa: BLE001 - every rank must reach the gather; the error fails the save
            mine.error = mine.error or f"rank {d.rank}: {exc}"
        finally:
            job.snapshot = None
            job.sharded = None

    def _gather_ranks(self, job: PersistJob, mine: _RankWrite) -> list[RankReport] | None:
        """Every rank's :class:`RankReport` (persist group); None when the gather
        failed (then the save failed, its requests answered)."""
        d = self._d
        entries: list[tuple[str, int, str]] = []
        if mine.writer is not None and mine.error is None:
            entries = [(e.path, e.size, e.checksum) for e in mine.writer.entries]
        try:
            reports: list[RankReport] = d.gather(
                RankReport(d.info.node, d.leader, entries, mine.error, mine.deadline_exceeded), persist=True
            )
        except Exception as exc:  # noqa: BLE001 - a failed gather fails this save, not the writer thread
            log.error("checkpoint of step %d failed: %s", job.step, exc)
            self._record.last_error = exc
            self._channel.answer(job.due.requests, None)
            return None
        return reports

    def _commit_part(
        self,
        job: PersistJob,
        writer: LocalWriter | None,
        reports: list[RankReport],
        errors: list[str],
        tmp: Path,
        start: float,
    ) -> tuple[Path | None, bool, str | None]:
        """Local rank 0: the node's part (every local rank's files) committed, or its
        temporary directory removed when a rank failed. Returns the committed
        directory, whether this rank's part is done, and why not."""
        d, s = self._d, self._settings
        if not d.leader:
            return None, True, None
        if errors or writer is None:
            shutil.rmtree(tmp, ignore_errors=True)
            return None, False, None
        node_entries = [FileEntry(p, n, c) for r in reports if r.node == d.info.node for p, n, c in r.entries or ()]
        try:
            path = writer.commit(
                **job.manifest_meta(s.job, s.attempt, time.perf_counter() - start),
                sharding=self._sharding(job.token),
                entries=node_entries,
                check_deadline=False,
            )
        except Exception as exc:  # noqa: BLE001 - every rank must reach the commit gather
            return None, False, f"node {d.info.node}: commit failed: {exc}"
        return path, True, None

    def _conclude(
        self,
        job: PersistJob,
        errors: list[str],
        commits: list[CommitReport],
        deadline_exceeded: bool,
        path: Path | None,
        start: float,
    ) -> None:
        """Once every node said whether its part is committed: the save recorded and
        logged, its requests answered, and the node's part shipped by local rank 0."""
        d, s, record = self._d, self._settings, self._record
        problems = errors or [c.error for c in commits if not c.committed and c.error]
        final: Path | None = None
        if all(c.committed for c in commits) and not errors:
            final = s.directory / checkpoint_name(job.step)
            record.last_committed = final
            record.last_persist_seconds = time.perf_counter() - start
            log.info("checkpoint %s committed on every rank (%.2fs)", final, record.last_persist_seconds)
        else:
            record.last_error = RuntimeError("; ".join(problems) or "commit failed")
            if deadline_exceeded:
                newest = next(reversed(list_local_committed(s.directory)), None)
                log.error(
                    "checkpoint of step %d not finished before its deadline (%s); the newest committed "
                    "checkpoint is %s",
                    job.step,
                    "; ".join(problems),
                    newest.name if newest else "none",
                )
            else:
                log.error("checkpoint of step %d failed: %s", job.step, "; ".join(problems))
        job.result = final
        self._channel.answer(job.due.requests, final, deadline_exceeded=deadline_exceeded)
        if final is not None and d.leader and path is not None:
            self._shipping.after_commit(path, job.due)

    def _gather_commits(self, committed_here: bool, error: str | None) -> list[CommitReport]:
        """Every rank's :class:`CommitReport` (persist group); a failed gather is one failed report."""
        try:
            reports: list[CommitReport] = self._d.gather(CommitReport(committed_here, error), persist=True)
            return reports
        except Exception as exc:  # noqa: BLE001 - a failed gather, whatever the cause, is one failed report
            return [CommitReport(False, f"rank {self._d.rank}: {exc}")]

    # -- a framework's folder ---------------------------------------------------------------
    def commit_folder(
        self,
        step: int,
        source: Path,
        due: Due,
        *,
        epoch: int | None,
        metrics: Mapping[str, Any] | None,
        exclude: tuple[str, ...],
        blocking: bool | None,
    ) -> Path | None:
        """:meth:`Checkpointer.commit_folder` under torch.distributed: every
        node's local rank 0 links its node's files now; checksums, the part
        manifest and the agreement that every node committed follow on the
        writer thread (its own process group), like a distributed save."""
        d, s = self._d, self._settings
        sync = self._policy.synchronous(blocking, due.preempt)
        if step == self._policy.last_step:  # the same on every rank
            return self._local.answer_with_last(due, preempt=due.preempt)
        start = time.perf_counter()
        busy = not self._local.wait_until(due.deadline)
        writer: LocalWriter | None = None
        names: list[str] = []
        error: BaseException | None = None
        # The token names the node's temporary directory and the save; the
        # all_reduce is also the barrier: every rank's framework save returned.
        begun = d.start_save(busy, False)
        if begun.any_busy:
            log.error("a previous checkpoint is still being written at the deadline; not committing step %d", step)
            self._channel.answer(due.requests, None, deadline_exceeded=True)
            if due.preempt:
                self._channel.preempted = True
            return None
        if d.leader:
            try:
                writer = LocalWriter(
                    s.directory,
                    step,
                    algorithm=s.checksum,
                    deadline=due.deadline,
                    durable=self._shipping.durable(due.preempt),
                    tmp=self._tmp(step, begun.token),
                )
                names = _folder.folder_files(source, exclude)
                for rel in names:
                    _folder.link_or_copy(source / rel, writer.tmp / rel)
            except BaseException as exc:  # noqa: BLE001 - every rank must reach the gather; the error fails the save
                error = exc
        # Every rank may go on once its node's files are linked (the framework may rotate them away).
        linked = d.gather(error is None, persist=False)
        self._local.phase_one_done(step, start)
        job = PersistJob(
            step, None, epoch, _folder.metrics_of(metrics), due, self._record.last_stall_seconds, token=begun.token
        )
        failed = None if all(linked) else (f"node {d.info.node}: {error}" if error is not None else "")
        return self._local.run_writer(job, self._persist_folder, (job, writer, names, source, failed), sync=sync)

    def _persist_folder(
        self, job: PersistJob, writer: LocalWriter | None, names: list[str], source: Path, failed: str | None
    ) -> None:
        """Phase two of a distributed ``commit_folder`` on the writer thread
        (collectives on the persist group only)."""
        d, s, record = self._d, self._settings, self._record
        start = time.perf_counter()
        listed: list[tuple[str, int, str]] | None = None
        error: str | None = failed
        deadline_exceeded = False
        if writer is not None and error is None:
            try:
                _folder.checksum_linked(writer, names)
                listed = _folder.entries_json(writer.entries)
            except DeadlineExceeded as exc:
                error, deadline_exceeded = f"node {d.info.node}: {exc}", True
            except Exception as exc:  # noqa: BLE001 - every rank must reach the gather; the error fails the save
                error = f"node {d.info.node}: {exc}"
        try:
            reports: list[RankReport] = d.gather(
                RankReport(d.info.node, d.leader, listed, error, deadline_exceeded), persist=True
            )
        except Exception as exc:  # noqa: BLE001 - a failed gather fails this save, not the writer thread
            log.error("checkpoint of step %d failed: %s", job.step, exc)
            record.last_error = exc
            if writer is not None:
                writer.abort()
            self._channel.answer(job.due.requests, None)
            return
        errors = [r.error for r in reports if r.error is not None]
        deadline_exceeded = any(r.deadline_exceeded for r in reports)
        committed_here = not d.leader
        if d.leader and writer is not None:
            if not errors:
                try:
                    mine, drop = _folder.node_files([(r.node, r.entries) for r in reports if r.leader], d.info.node)
                    for rel in drop:
                        (writer.tmp / rel).unlink()
                    writer.commit(
                        **job.manifest_meta(s.job, s.attempt, time.perf_counter() - start),
                        sharding=self._sharding(job.token),
                        entries=mine,
                        check_deadline=False,
                    )
                    committed_here = True
                except Exception as exc:  # noqa: BLE001 - every rank must reach the commit gather
                    error = f"node {d.info.node}: commit failed: {exc}"
            if not committed_here:
                writer.abort()
        commits = self._gather_commits(committed_here, error)
        problems = [e for e in errors if e] or [c.error for c in commits if not c.committed and c.error]
        final: Path | None = None
        if all(c.committed for c in commits) and not errors:
            final = s.directory / checkpoint_name(job.step)
            record.last_committed = final
            record.last_persist_seconds = time.perf_counter() - start
            if d.rank == 0:
                log.info(
                    "checkpoint %s committed from %s on every rank (%.2fs)", final, source, record.last_persist_seconds
                )
        else:
            record.last_error = RuntimeError("; ".join(problems) or "commit failed")
            log.error("checkpoint of step %d not committed: %s", job.step, "; ".join(problems) or "commit failed")
        job.result = final
        self._channel.answer(job.due.requests, final, deadline_exceeded=deadline_exceeded)
        if final is not None and d.leader:
            self._shipping.after_commit(final, job.due)
