"""Ship committed local checkpoints to storage: upload, verify, pointer; then housekeeping.

Used by the sidecar's loop and by ``spotguard run``. Upload and verification
are ``spotguard.checkpoint``'s; this module decides *which* checkpoints to
ship and when, and keeps the books (metrics, throughput, structured logs).

Shipping one checkpoint is upload (data, then manifest) -> verify -> move
the ``latest`` pointer. Housekeeping (retention in storage, pruning local
copies) is separate: the routine loop runs it after shipping, the
emergency path never does. This shipper is the only one that deletes local
checkpoints, and only those older than one it verified in storage.

A preemption comes first. A routine round's ``should_stop`` is watched
while an upload is in flight (every :data:`~spotguard.sidecar.stoppable.STOP_POLL_SECONDS`): once it says
yes the upload is told to stop at its next request
(:class:`~spotguard.checkpoint.store.upload.UploadCancelled`), the round returns
at once and the emergency upload may start while the stopped one's last
requests drain. A stopped upload writes no manifest and moves no pointer;
what it stored is kept, and the next upload of the same checkpoint skips
it (its chunks are taken as known, its complete files are not sent again).
Housekeeping (retention, the chunk sweep) runs outside the shipping lock and
stops at its next object, so it never holds an emergency upload back.

A part of a distributed checkpoint (one node's files) is shipped by
uploading it and then trying the global commit. When other parts are not
in storage yet the part is *awaiting* (:attr:`CheckpointShipper.awaiting`):
not a failure, no backoff; each later round tries the global commit again
(nothing is uploaded again), and the part counts as shipped only when the
global manifest is in storage and the whole checkpoint verifies. An
awaiting part is never pruned locally.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard.checkpoint import (
    MANIFEST_NAME,
    apply_retention,
    list_local_committed,
    read_local_manifest,
    remove_checkpoint_dir,
    verify_checkpoint,
)
from spotguard.checkpoint.format.manifest import (
    checkpoint_step,
    parse_manifest,
    part_manifest_path,
    stored_as,
)
from spotguard.checkpoint.store.chunked import KnownChunks, Prestored
from spotguard.checkpoint.store.gc import DEFAULT_ORPHAN_GRACE, sweep_chunks
from spotguard.checkpoint.store.known import KnownChunkTable
from spotguard.checkpoint.store.publish import AWAITING, Published, publish, publish_commit
from spotguard.checkpoint.store.retention import plan_local_prune
from spotguard.checkpoint.store.upload import UploadCancelled, stopping_storage
from spotguard.contract.control import save_reason_label
from spotguard.contract.retry import retry_delay
from spotguard.sidecar.deadline import ThroughputTracker
from spotguard.sidecar.metrics import SidecarMetrics
from spotguard.sidecar.stoppable import upload_stoppable
from spotguard.storage import NotFoundError

if TYPE_CHECKING:
    from spotguard.checkpoint import RetentionPolicy
    from spotguard.storage import Storage

log = logging.getLogger(__name__)

#: Seconds between two sweeps of unused chunks when retention deleted nothing.
SWEEP_INTERVAL = 900.0


@dataclass(frozen=True)
class Shipped:
    """One checkpoint uploaded and verified."""

    name: str
    step: int
    nbytes: int
    upload_seconds: float
    verify_seconds: float
    verified_at: float


step_of = checkpoint_step  # ``ckpt-000000000042`` → 42 (the manifest module owns checkpoint names)


def plan_shipping(committed: list[str], shipped: set[str], newest_only: bool) -> list[str]:
    """Pure: which committed checkpoints to upload next, in order.

    Normally every not-yet-shipped checkpoint, oldest first (retention may
    want them). Against a deadline only the newest one: it supersedes the
    rest and every second counts. Checkpoints older than the newest shipped
    one are never uploaded: they could only make storage look older.
    """
    ordered = sorted(committed, key=step_of)
    newest_shipped = max((step_of(n) for n in shipped), default=-1)
    pending = [n for n in ordered if n not in shipped and step_of(n) > newest_shipped]
    if newest_only and pending:
        return pending[-1:]
    return pending


def observed_interval(times: list[float]) -> float | None:
    """Pure: the median gap between consecutive routine checkpoint times (None with fewer than two)."""
    ordered = sorted(times)
    gaps = sorted(b - a for a, b in zip(ordered, ordered[1:], strict=False) if b > a)
    if not gaps:
        return None
    mid = len(gaps) // 2
    return gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2


def log_stage(stage: str, seconds: float, **fields: Any) -> None:
    """One structured line per stage: ``stage=upload seconds=1.234 name=... step=...``."""
    extra = "".join(f" {k}={v}" for k, v in fields.items() if v is not None)
    log.info("stage=%s seconds=%.3f%s", stage, seconds, extra)


class CheckpointShipper:
    """Uploads new committed checkpoints from ``checkpoint_dir`` to ``storage``.

    Thread-safe: the sidecar's loop and its emergency path may both call
    :meth:`ship`; one runs at a time.
    """

    def __init__(
        self,
        checkpoint_dir: Path,
        storage: Storage,
        metrics: SidecarMetrics,
        tracker: ThroughputTracker,
        retention: RetentionPolicy | None = None,
        keep_local: int = 1,
        on_verified: Callable[[Shipped], None] | None = None,
        configured_interval: float | None = None,
        incremental: bool = False,
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.storage = storage
        self.metrics = metrics
        self.tracker = tracker
        self.retention = retention
        self.keep_local = keep_local
        self.on_verified = on_verified
        self.shipped: dict[str, Shipped] = {}
        self.failed: dict[str, str] = {}
        #: Parts of distributed checkpoints uploaded and verified, waiting for
        #: the other parts: name -> what is missing.
        self.awaiting: dict[str, str] = {}
        self._awaiting_since: dict[str, tuple[float, int, float]] = {}
        self._lock = threading.Lock()
        self._failures: dict[str, int] = {}
        self._seen_saves: set[str] = set()
        self._routine_times: list[float] = []
        self.configured_interval = configured_interval
        if configured_interval:
            metrics.set_interval(configured_interval)
        self._retry_at: dict[str, float] = {}
        #: Store checkpoints as shared chunks (format version 3); ``_chunks``: those
        #: of the newest checkpoint verified, not uploaded again, less those a check
        #: found damaged or missing (sent again from local bytes).
        self.incremental = incremental
        self._chunks = KnownChunkTable()
        self._last_sweep = 0.0
        #: Uploads a preemption stopped: name -> (when, chunks they stored), for
        #: the next upload of the same checkpoint to skip what is stored.
        self.stopped: dict[str, tuple[float, dict[str, int]]] = {}
        self._stopped_lock = threading.Lock()
        #: Chunks of a checkpoint stored while it was written: name -> them, for its upload.
        self._prestored: dict[str, Prestored] = {}
        #: Serializes housekeeping runs; shipping never waits for it.
        self._housekeeping_lock = threading.Lock()

    @property
    def last_shipped(self) -> Shipped | None:
        """The newest checkpoint verified in storage by this shipper."""
        if not self.shipped:
            return None
        return max(self.shipped.values(), key=lambda s: s.step)

    def committed(self) -> list[Path]:
        """Committed local checkpoints, oldest first."""

        if not self.checkpoint_dir.is_dir():
            return []
        return list(list_local_committed(self.checkpoint_dir))

    def forget(self, name: str) -> None:
        """Stop counting a local copy as shipped (it is about to be removed
        because it is damaged; the stored checkpoint is untouched)."""
        with self._lock:
            self.shipped.pop(name, None)

    def mark_verified(self, name: str) -> None:
        """Record ``name`` as verified in storage without reading it again.

        For a checkpoint restored from storage just now: the restore checked
        every byte it downloaded against the stored manifest.
        """
        with self._lock:
            if name in self.shipped:
                return
            now = time.time()
            self.shipped[name] = Shipped(name, step_of(name), 0, 0.0, 0.0, now)
            self.failed.pop(name, None)
            self.metrics.observe_verified(0.0, step_of(name), now)

    def adopt_existing(self) -> None:
        """Mark local checkpoints that are already complete in storage as shipped.

        After a restore (init container, restart) the local directory holds a
        checkpoint that came *from* storage; uploading it again is wasted
        time, and so is reading it back: the restore verified every byte it
        downloaded. A local checkpoint counts as stored when storage holds a
        byte-identical manifest (written only after every data file was
        stored) and every file with its recorded size. Stops at the first
        storage error: an unreachable store is not asked once per checkpoint.
        """

        with self._lock:
            for path in reversed(self.committed()):
                if path.name in self.shipped:
                    continue
                try:
                    local = (path / MANIFEST_NAME).read_bytes()
                    key = f"{path.name}/{MANIFEST_NAME}"
                    index = _part_index(local)
                    if index is not None:
                        # A part: the same part manifest stored, and the checkpoint committed.
                        key = f"{path.name}/{part_manifest_path(index)}"
                    stored = self.storage.read_bytes(key)
                    same = stored_as(stored, local) and verify_checkpoint(self.storage, path.name, checksums=False).ok
                    if (
                        index is not None
                        and stored_as(stored, local)
                        and not same
                        and self.storage.stat(f"{path.name}/{MANIFEST_NAME}") is None
                    ):
                        # This part is stored (after its files verified); the others are not all there.
                        self._await(path.name, 1, 0, 0, 0.0)
                        continue
                except (NotFoundError, OSError):
                    continue
                except Exception as exc:  # noqa: BLE001 - unreachable store: ship later
                    log.warning("cannot check storage for %s: %s", path.name, _one_line(exc))
                    return
                if same:
                    self._learn_chunks(stored)
                    now = time.time()
                    self.shipped[path.name] = Shipped(path.name, step_of(path.name), 0, 0.0, 0.0, now)
                    self.metrics.observe_verified(0.0, step_of(path.name), now)
                    log.info("already in storage: %s", path.name)

    def ship(
        self,
        newest_only: bool = False,
        upto_step: int | None = None,
        housekeeping: bool = True,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Shipped]:
        """Upload, verify and point to what is pending; then, with
        ``housekeeping``, apply retention and prune local copies.

        ``newest_only`` (against a deadline) ships only the newest pending
        checkpoint and ignores the retry backoff; ``upto_step`` restricts to
        checkpoints at or below a step. Failures are logged and counted,
        never raised: the next call tries again. A round stops at its first
        failure (the store is likely down for the rest too). ``should_stop``
        is asked before each checkpoint and, while one is uploaded, every
        :data:`~spotguard.sidecar.stoppable.STOP_POLL_SECONDS`: a preemption in the middle of a backlog (a
        slow store) or of a large upload gets the shipper back at once, for
        the emergency path to ship only the newest; the stopped upload's
        checkpoint is neither failed nor backed off.
        """
        with self._lock:
            paths = {p.name: p for p in self.committed()}
            self._observe_saves(paths)
            done: list[Shipped] = []
            # Parts waiting for the other nodes' parts: try the global commit
            # again (cheap: a listing and the part manifests), every round,
            # also against a deadline.
            for name in sorted(self.awaiting, key=step_of):
                if upto_step is not None and step_of(name) > upto_step:
                    continue
                shipped = self._retry_commit(name)
                if shipped is not None:
                    done.append(shipped)
            candidates = [n for n in paths if n not in self.awaiting]
            names = plan_shipping(candidates, set(self.shipped), newest_only)
            if upto_step is not None:
                names = [n for n in names if step_of(n) <= upto_step]
            if not newest_only:
                # After a failure, wait before trying the same checkpoint again
                # (a missing bucket must not produce four errors a second).
                now = time.monotonic()
                names = [n for n in names if self._retry_at.get(n, 0.0) <= now]
            for name in names:
                if should_stop is not None and should_stop():
                    break
                shipped = self._ship_one(paths[name], should_stop, trust=newest_only)
                if shipped is None:
                    if should_stop is not None and should_stop():
                        break  # a preemption: the emergency path ships the newest
                    if self.failed.get(name, "").startswith("upload:"):
                        break  # the store is likely down for the rest too
                    # Stored but not verified (a damaged chunk): a newer checkpoint
                    # sends the chunks it named again, and may verify.
                    continue
                done.append(shipped)
        if done and housekeeping:
            self.housekeeping()
        return done

    def housekeeping(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Retention in storage, then local pruning; never part of the emergency path.

        Retention and the chunk sweep run outside the shipping lock (an
        emergency :meth:`ship` never waits for them) against the newest
        checkpoint verified when they start: nothing newer is deleted.
        ``should_stop`` is asked before each manifest read, listed chunk and
        deletion: a preemption that comes meanwhile gets the shipper back at once.
        """
        with self._housekeeping_lock:
            with self._lock:
                last = self.last_shipped
            self._retention(last, should_stop)
            if should_stop():
                return
            with self._lock:
                self._prune_local()

    def _observe_saves(self, paths: dict[str, Path]) -> None:
        """Record each new checkpoint's save time, as its manifest reports it."""

        for name, path in paths.items():
            if name in self._seen_saves:
                continue
            self._seen_saves.add(name)
            try:
                manifest = read_local_manifest(path)
            except (OSError, ValueError):
                continue
            if save_reason_label(manifest.reason) == "interval":
                self._note_routine_checkpoint(manifest.created)
            seconds = (manifest.timing or {}).get("save_seconds")
            if seconds is None:
                continue
            self.metrics.observe_save(seconds, save_reason_label(manifest.reason))
            self.tracker.record_save(manifest.total_size, seconds)

    def _note_routine_checkpoint(self, created: str) -> None:
        if self.configured_interval:
            return
        try:
            when = datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return
        self._routine_times = sorted([*self._routine_times, when])[-6:]
        interval = observed_interval(self._routine_times)
        if interval is not None:
            self.metrics.set_interval(interval)

    def _ship_one(
        self, path: Path, should_stop: Callable[[], bool] | None = None, *, trust: bool = False, again: bool = True
    ) -> Shipped | None:
        """Publish ``path``; ``trust`` (against a deadline): reuse the chunks of the checkpoint
        verified last without asking the store of each (see :mod:`spotguard.checkpoint.store.chunked`).
        ``again``: a part whose own check finds chunks damaged or missing is published once more."""

        name = path.name
        t0 = time.monotonic()
        try:
            # A routine verification gives way to a preemption too, at its next request.
            verifier = self.storage if should_stop is None else stopping_storage(self.storage, should_stop, name)
            published = publish(name, verifier, lambda: self._upload(path, should_stop, trust), stop=should_stop)
        except UploadCancelled:
            log.warning(
                # Its own stage: ``stage=upload`` lines report a finished upload and its bytes.
                "stage=upload_stopped seconds=%.3f name=%s: a preemption came first; what it stored is "
                "kept for a later upload of it",
                time.monotonic() - t0,
                name,
            )
            return None
        except Exception as exc:  # noqa: BLE001 - storage errors are retried later
            if not (path / "manifest.json").exists():
                # Removed locally meanwhile (only a newer verified one supersedes it).
                log.info("skipped %s: removed locally while uploading (superseded)", name)
                return None
            if self._chunks.forget_failed(name, exc):
                if again:
                    # A part's own check of its chunks named them: forgotten now, so sent again at once.
                    log.warning("sending the part of %s again: %s", name, _one_line(exc))
                    return self._ship_one(path, should_stop, trust=trust, again=False)
                # A verification failure, not the store's.
                self.failed[name] = f"verify: {_one_line(exc)}"
                self._backoff(name)
                self.metrics.observe_upload_failed("verify")
                log.error("check of the part of %s failed: %s", name, _one_line(exc))
                return None
            self.failed[name] = f"upload: {_one_line(exc)}"
            self._backoff(name)
            self.metrics.observe_upload_failed("upload")
            log.error("upload of %s failed after %.3fs: %s", name, time.monotonic() - t0, _one_line(exc))
            return None
        result = published.upload
        assert result is not None
        upload_seconds = published.upload_seconds
        nbytes = int(getattr(result, "bytes", 0))
        self.metrics.observe_upload(upload_seconds, nbytes, int(getattr(result, "reused_bytes", 0)))
        if self.incremental:
            log_stage(
                "upload",
                upload_seconds,
                name=name,
                bytes=nbytes,
                new_chunks=result.new_chunks,
                reused_chunks=result.reused_chunks,
                reused_bytes=result.reused_bytes,
                unchanged_chunks=result.unchanged_chunks,
            )
        else:
            log_stage("upload", upload_seconds, name=name, bytes=nbytes)
        with self._stopped_lock:
            self.stopped.pop(name, None)
        self._prestored.pop(name, None)
        if published.state == AWAITING:
            # A part, uploaded and verified; the other parts are not all there yet.
            self._await(name, published.parts_present, published.parts_total or 0, nbytes, upload_seconds)
            return None
        return self._settle(published, nbytes, upload_seconds)

    def _upload(self, path: Path, should_stop: Callable[[], bool] | None, trust: bool) -> Any:
        """Upload ``path`` with :func:`upload_stoppable` (the pointer moves only after verification),
        resuming an earlier stopped upload of the same checkpoint; a stop is recorded in :attr:`stopped`."""
        name = path.name
        with self._stopped_lock:
            earlier = self.stopped.get(name)
        known = self._chunks.for_upload(self.storage, trust=trust) if self.incremental else None
        prestored = self._prestored.get(name)
        if prestored is not None and not prestored.fresh(time.monotonic(), DEFAULT_ORPHAN_GRACE):
            prestored = None
        return upload_stoppable(
            path,
            self.storage,
            known,
            earlier,
            should_stop,
            lambda chunks: self._note_stopped(name, chunks),
            prestored=prestored if known is not None else None,
        )

    def note_prestored(self, name: str, chunks: Prestored | None = None) -> None:
        """Data of ``name`` was stored before it was committed (sent while written). Whole files: its
        upload resumes, as a stopped one does, and sends only what the store lacks. Chunks
        (``chunks``): its upload takes them as found and stored (see
        :func:`~spotguard.checkpoint.store.chunked.upload_chunks`)."""
        if chunks is not None:
            # What was found for a checkpoint never shipped (a newer one came first) is no use once
            # too old to name: it goes, so that a long run's preemptions do not pile up here.
            now = time.monotonic()
            self._prestored = {
                n: p for n, p in self._prestored.items() if p.fresh(now, DEFAULT_ORPHAN_GRACE) or n == name
            }
            self._prestored[name] = chunks
            return
        self._note_stopped(name, {})

    def known_digests(self) -> dict[str, int]:
        """The chunks this uploader knows stored (digest -> size), as it last learnt them, without asking
        the store: those a write follower need not send (the upload still decides what to reuse)."""
        return self._chunks.digests()

    def _note_stopped(self, name: str, chunks: dict[str, int]) -> None:
        with self._stopped_lock:
            _, before = self.stopped.get(name, (0.0, {}))
            self.stopped[name] = (time.monotonic(), {**before, **chunks})

    def _await(self, name: str, present: int, total: int, nbytes: int, upload_seconds: float) -> None:
        first = name not in self.awaiting
        self.awaiting[name] = f"parts {present}/{total or '?'} in storage"
        self.failed.pop(name, None)
        self._failures.pop(name, None)
        self._retry_at.pop(name, None)
        if first:
            self._awaiting_since[name] = (time.monotonic(), nbytes, upload_seconds)
            log.info(
                "stage=await name=%s parts=%d/%d: this part is stored and verified; waiting for the "
                "other parts before the global commit",
                name,
                present,
                total,
            )

    def _retry_commit(self, name: str) -> Shipped | None:
        """One more try at the global commit of an awaiting part."""
        newest = self.last_shipped
        if newest is not None and newest.step >= step_of(name):
            # Superseded by a newer verified checkpoint: it would never be resumed from.
            self.awaiting.pop(name, None)
            self._awaiting_since.pop(name, None)
            log.info("no longer waiting for the parts of %s: %s is verified", name, newest.name)
            return None
        try:
            published = publish_commit(self.storage, name)
        except Exception as exc:  # noqa: BLE001 - storage errors: the next round tries again
            log.warning("global commit of %s: %s", name, _one_line(exc))
            return None
        if published.state == AWAITING:
            total = published.parts_total if published.parts_total is not None else "?"
            self.awaiting[name] = f"parts {published.parts_present}/{total} in storage" + (
                f" ({published.problems[0]})" if published.problems else ""
            )
            return None
        log.info("stage=commit name=%s status=%s parts=%d", name, published.commit_status, published.parts_total or 0)
        _, nbytes, upload_seconds = self._awaiting_since.get(name, (0.0, 0, 0.0))
        shipped = self._settle(published, nbytes, upload_seconds)
        if shipped is not None or name in self.failed:
            self.awaiting.pop(name, None)
            self._awaiting_since.pop(name, None)
        return shipped

    def _settle(self, published: Published, nbytes: int, upload_seconds: float) -> Shipped | None:
        """Record a verification's outcome (the pipeline verified, and moved the pointer when it passed)."""
        name, verify_seconds, problems = published.name, published.verify_seconds, published.problems
        if not published.verified:
            self.failed[name] = "verify: " + "; ".join(problems)
            # Sent again from local bytes by the next upload that uses them: the
            # same content key then heals every checkpoint that names it.
            self._chunks.forget(name, problems)
            self._backoff(name)
            self.metrics.observe_upload_failed("verify")
            log.error("verification of %s failed after %.3fs: %s", name, verify_seconds, "; ".join(problems))
            return None
        verdict = published.verdict
        log_stage("verify", verify_seconds, name=name, trusted_chunks=verdict.trusted if verdict is not None else None)
        if verdict is not None and verdict.manifest is not None:
            # Trusted by the next upload for a while: see checkpoint.chunked.
            self._chunks.verified(verdict.manifest, verdict.trusted)
        now = time.time()
        shipped = Shipped(name, published.step, nbytes, upload_seconds, verify_seconds, now)
        self.shipped[name] = shipped
        self.failed.pop(name, None)
        self._failures.pop(name, None)
        self._retry_at.pop(name, None)
        self.metrics.observe_verified(verify_seconds, shipped.step, now)
        self.tracker.record_upload(nbytes, upload_seconds + verify_seconds)
        self.metrics.set_deadline(self.tracker.assessment(), self.tracker.grace_seconds)
        if published.pointer_error is None:
            log_stage("pointer", published.pointer_seconds, name=name, moved=published.pointer_moved)
        else:
            self.metrics.failure("pointer")
            log.warning("could not move the latest pointer to %s: %s", name, _one_line(published.pointer_error))
        if self.on_verified is not None:
            self.on_verified(shipped)
        return shipped

    def _known_chunks(self) -> KnownChunks:
        """The chunks an incremental upload may reuse (:func:`~spotguard.checkpoint.store.known.current_known`),
        less those a check found damaged or missing."""
        return self._chunks.for_upload(self.storage, trust=True)

    def _learn_chunks(self, manifest_bytes: bytes) -> None:
        """Know the chunks of a checkpoint found already in storage."""

        try:
            manifest = parse_manifest(manifest_bytes)
        except ValueError:
            return
        self._chunks.learn(manifest)

    def _backoff(self, name: str) -> None:
        self._failures[name] = self._failures.get(name, 0) + 1
        delay = retry_delay(self._failures[name])
        self._retry_at[name] = time.monotonic() + delay

    def _retention(self, last: Shipped | None, should_stop: Callable[[], bool]) -> None:
        """Delete what the policy does not keep.

        The plan is built from the manifests in storage and ``last``, the
        newest checkpoint this shipper verified (nothing is read back to
        verify it again); everything newer than that one is kept by the planner.
        """
        if self.retention is None or last is None:
            return

        t0 = time.monotonic()
        deleted: list[str] = []
        try:
            deleted = apply_retention(self.storage, self.retention, newest_verified=last.name, should_stop=should_stop)
        except Exception as exc:  # noqa: BLE001 - retention is best effort: a failure is counted and logged
            self.metrics.failure("retention")
            log.error("retention failed: %s", _one_line(exc))
        if deleted:
            log_stage("retention", time.monotonic() - t0, deleted=",".join(deleted))
        if should_stop():
            return
        if self.incremental and (deleted or time.monotonic() - self._last_sweep > SWEEP_INTERVAL):
            self._sweep_chunks(should_stop)

    def _sweep_chunks(self, should_stop: Callable[[], bool]) -> None:
        """Remove chunks no retained checkpoint uses (mark-and-sweep; chunks
        younger than the grace and those of recently deleted checkpoints are
        kept, see ``spotguard.checkpoint.store.gc.sweep_chunks``). Lists the store's
        chunks, so at most every ``SWEEP_INTERVAL`` and after retention
        deleted something; never on the emergency path."""

        self._last_sweep = time.monotonic()
        t0 = time.monotonic()
        try:
            swept = sweep_chunks(self.storage, should_stop=should_stop)
        except Exception as exc:  # noqa: BLE001 - the next round tries again
            self.metrics.failure("retention")
            log.error("chunk sweep failed: %s", _one_line(exc))
            return
        if swept.deleted or swept.aborted:
            log_stage(
                "sweep",
                time.monotonic() - t0,
                chunks_deleted=len(swept.deleted),
                bytes_freed=swept.freed_bytes,
                aborted=swept.aborted or "",
            )

    def _prune_local(self) -> None:
        # An awaiting part is never pruned: the other nodes' parts may still come.
        names = [p.name for p in self.committed() if p.name not in self.awaiting]

        for name in plan_local_prune(names, set(self.shipped), self.keep_local):
            try:
                remove_checkpoint_dir(self.checkpoint_dir / name, background=True)
            except OSError as exc:
                log.warning("could not prune local %s: %s", name, exc)
                continue
            self.metrics.deleted_local.labels(**self.metrics.labels).inc()
            log.info("pruned local %s (a newer checkpoint is verified in storage)", name)


def _part_index(manifest_bytes: bytes) -> int | None:
    """The part index of a part manifest's bytes, None for any other manifest."""

    try:
        sharding = parse_manifest(manifest_bytes).sharding
    except ValueError:
        return None
    return sharding.part if sharding is not None else None


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())
