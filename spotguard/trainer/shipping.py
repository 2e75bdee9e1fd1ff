"""What follows a commit in the trainer's own process: upload, retention, local pruning.

In a pod the sidecar (or ``spotguard run``) ships checkpoints; with
``upload=True`` the Checkpointer does it itself, after each commit, through
the same publish pipeline as the sidecar
(:mod:`spotguard.checkpoint.store.publish`: upload, global commit, verify, move
the ``latest`` pointer), then applies retention in storage (a preemption's
upload is retried with backoff until its deadline instead).
Local checkpoints are deleted only by whoever uploads them
(:func:`~spotguard.trainer.config.local_pruner`). Whether a save fsyncs
anything (data, manifest, directories) depends on the same question: a
preemption's save that a live uploader ships at once is made durable by the
verified upload (:func:`emergency_save_is_durable`).

A preemption comes first here too: a routine upload asks ``preempting``
before each request and between the parts of a transfer, and stops
(:class:`~spotguard.checkpoint.store.upload.UploadCancelled`) so that the
preemption's save, which waits for the job before it, goes at once; the
next upload of the stopped checkpoint does not send its stored files again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotguard.checkpoint import (
    ManifestError,
    apply_retention,
    list_local_committed,
    prune_local,
    read_local_manifest,
    remove_checkpoint_dir,
    upload_checkpoint,
)
from spotguard.checkpoint.format.manifest import checkpoint_step
from spotguard.checkpoint.store.chunked import KnownChunks
from spotguard.checkpoint.store.known import KnownChunkTable
from spotguard.checkpoint.store.publish import AWAITING, Published, publish, publish_commit
from spotguard.checkpoint.store.retention import RetentionCandidate, plan_local_prune, plan_retention
from spotguard.checkpoint.store.stored import CheckpointCorruptError
from spotguard.checkpoint.store.upload import UploadCancelled
from spotguard.contract.control import uploader_shipping
from spotguard.contract.retry import EMERGENCY_RETRY_INITIAL, EMERGENCY_RETRY_MAX, retry_delay
from spotguard.trainer.channel import Due
from spotguard.trainer.config import PRUNE_LOCAL_ONLY, PRUNE_SELF, CheckpointerConfig
from spotguard.trainer.policy import SaveRecord

log = logging.getLogger(__name__)


def emergency_save_is_durable(preempt: bool, pruner: str, shipping: bool) -> bool:
    """Pure: whether a save is fsynced (data, manifest, directories) before it is acknowledged.

    Every save does, except a preemption's when an uploader ships it at once
    and has said so (``shipping``: the sidecar's or ``spotguard run``'s fresh
    heartbeat, or with ``upload=True`` this process's last upload verified):
    its durability is the verified upload, and the seconds an fsync of
    gigabytes takes are the grace period's. Without a live uploader the local
    copy is all there is.
    """
    return not preempt or pruner == PRUNE_LOCAL_ONLY or not shipping


# A preemption's upload (``upload=True``) without a deadline is retried this long.
EMERGENCY_UPLOAD_SECONDS = 25.0


def emergency_upload_pause(attempt: int, now: float, deadline: float) -> float | None:
    """Pure: seconds to wait before retrying a preemption's upload that failed
    ``attempt`` times (the sidecar's emergency backoff), never past
    ``deadline``; None when no time is left."""
    left = deadline - now
    if left <= 0:
        return None
    return min(retry_delay(attempt, EMERGENCY_RETRY_INITIAL, EMERGENCY_RETRY_MAX), left)


class Shipping:
    """Upload (``upload=True``) and prune after each commit.

    :meth:`open_storage` opens the settings' storage on first use (or
    returns what ``open_storage`` gives, when given). :attr:`verified`
    holds the checkpoints this process knows are verified in storage
    (uploaded and verified here, or restored from storage): only those make
    older local ones safe to delete. ``preempting`` says whether a
    preemption is pending: a routine upload then stops at its next request.
    """

    def __init__(
        self,
        settings: CheckpointerConfig,
        record: SaveRecord,
        open_storage: Callable[[], Any] | None = None,
        preempting: Callable[[], bool] | None = None,
    ) -> None:
        self._settings = settings
        self._record = record
        self._opener = open_storage
        self._storage: Any = None
        self._preempting = preempting
        self.verified: set[str] = set()
        #: Checkpoints whose routine upload a preemption stopped (resumed when uploaded again).
        self.stopped: set[str] = set()
        #: Parts of distributed checkpoints stored here and waiting for the other parts' global commit.
        self.awaiting: set[str] = set()
        # With incremental uploads: the chunks of the newest checkpoint verified here,
        # less those a check found damaged or missing (sent again by the next upload).
        self._chunks = KnownChunkTable()
        # With upload=True: whether this process's last upload was verified.
        self._shipping = False

    def open_storage(self) -> Any:
        """The storage at the settings' ``storage_uri``, opened on first use."""
        if self._opener is not None:
            return self._opener()
        if self._storage is None:
            from spotguard.storage import open_storage  # a backend's client library loads only when used

            assert self._settings.storage_uri is not None
            self._storage = open_storage(self._settings.storage_uri, **self._settings.storage_options)
        return self._storage

    def durable(self, preempt: bool) -> bool:
        """Whether this save is fsynced (see :func:`emergency_save_is_durable`)."""
        pruner = self._settings.local_pruner
        if not preempt or pruner == PRUNE_LOCAL_ONLY:
            return True
        shipping = self._shipping if pruner == PRUNE_SELF else uploader_shipping(self._settings.control_path)
        return emergency_save_is_durable(preempt, pruner, shipping)

    def after_commit(self, path: Path, due: Due) -> None:
        """Upload ``path`` (``upload=True``), then prune local checkpoints as
        :func:`~spotguard.trainer.config.local_pruner` says."""
        s = self._settings
        if s.upload:
            if due.preempt:
                # A preemption's upload is retried until the save's deadline.
                self.upload(path, until=due.deadline or time.time() + EMERGENCY_UPLOAD_SECONDS)
            else:
                self.upload(path)
        try:
            if s.local_pruner == PRUNE_SELF:
                for name in plan_local_prune(
                    [p.name for p in list_local_committed(s.directory)], self.verified, s.keep_local
                ):
                    remove_checkpoint_dir(s.directory / name)
            elif s.local_pruner == PRUNE_LOCAL_ONLY:
                if s.retention is not None and not s.retention.keeps_everything:
                    self._apply_local_retention(path)
                else:
                    prune_local(s.directory, s.keep_local, protect=[path])
            # PRUNE_UPLOADER: the sidecar / ``spotguard run`` prunes what it verified.
        except OSError as exc:
            log.warning("could not prune local checkpoints: %s", exc)

    def upload(self, path: Path, *, until: float | None = None) -> None:
        """Publish (upload, verify, move the pointer), then apply retention in storage.
        With ``until`` (a preemption's save): a failure is retried with
        backoff until then, a part waits (with the same backoff) for the
        other parts' global commit, and retention waits for a routine upload.
        Without (a routine upload): a pending preemption stops it; a part left
        waiting is committed by a later upload's first step."""
        self._retry_awaiting()
        attempt = 0
        should_stop = self._preempting if until is None else None
        while True:
            try:
                verified = self._upload_once(path, should_stop, trust=until is not None)
                self._shipping = True
                break
            except UploadCancelled:
                # Not a failure: the preemption's checkpoint supersedes this one.
                self.stopped.add(path.name)
                log.warning("upload of %s stopped: a preemption came first; what it stored is kept", path.name)
                return
            except Exception as exc:  # noqa: BLE001 - any storage error is retried until the deadline, or reported
                self._shipping = False
                if self._chunks.forget_failed(path.name, exc) and not attempt:
                    # A check named chunks damaged or missing in storage: forgotten now, sent again at once.
                    attempt += 1
                    log.warning("uploading %s again: %s", path.name, exc)
                    continue
                self._record.last_error = exc
                attempt += 1
                pause = None if until is None else emergency_upload_pause(attempt, time.time(), until)
                if pause is None:
                    log.error("upload of %s failed: %s", path.name, exc)
                    return
                log.warning("upload of %s failed (attempt %d): %s; retrying in %.2fs", path.name, attempt, exc, pause)
                time.sleep(pause)
        if not verified and until is not None:
            verified = self._await_commit(path.name, until)
        retention = self._settings.retention
        if not verified or until is not None or retention is None or retention.keeps_everything:
            return
        try:
            apply_retention(self.open_storage(), retention, newest_verified=path.name, should_stop=self._preempting)
        except Exception as exc:  # noqa: BLE001 - retention is best effort: a failure is recorded and logged
            self._record.last_error = exc
            log.error("retention after the upload of %s failed: %s", path.name, exc)

    def _upload_once(self, path: Path, should_stop: Callable[[], bool] | None = None, *, trust: bool = False) -> bool:
        """Publish ``path`` once; True once it is verified in storage (False: one
        node's part, stored, waiting for the others). Raises on failure,
        :class:`UploadCancelled` when ``should_stop`` stopped the upload.
        ``trust`` (a preemption's): reuse the chunks of the checkpoint verified
        last without asking the store of each (see :mod:`spotguard.checkpoint.store.chunked`)."""
        storage = self.open_storage()
        resume = path.name in self.stopped
        incremental: bool | KnownChunks = False
        if self._settings.incremental:
            incremental = self._chunks.for_upload(storage, trust=trust)
        published = publish(
            path.name,
            storage,
            lambda: upload_checkpoint(
                path, storage, update_pointer=False, should_stop=should_stop, resume=resume, incremental=incremental
            ),
        )
        self.stopped.discard(path.name)
        result = published.upload
        assert result is not None
        if published.state == AWAITING:
            # One node's part of a distributed checkpoint: the uploader of the
            # last part to arrive writes the global manifest (or a later try here).
            self.awaiting.add(path.name)
            log.info(
                "uploaded part of %s (%d bytes, %.2fs); %d of %d parts in storage",
                path.name,
                result.bytes,
                result.seconds,
                result.parts_present,
                result.parts_total,
            )
            return False
        self._settle(published)
        log.info("uploaded and verified %s (%d bytes, %.2fs)", result.uri, result.bytes, result.seconds)
        return True

    def _settle(self, published: Published) -> None:
        """A verified checkpoint is known as such; any other outcome raises (the caller's retries)."""
        if not published.verified:
            self._chunks.forget(published.name, published.problems)
            raise CheckpointCorruptError(published.name, published.problems)
        self.verified.add(published.name)
        self.awaiting.discard(published.name)
        verdict = published.verdict
        if verdict is not None and verdict.manifest is not None:
            # What the next incremental upload may reuse, verified here: trusted (see checkpoint.chunked).
            self._chunks.verified(verdict.manifest, verdict.trusted)
        # An older part still waiting would never be resumed from: a newer checkpoint is verified.
        self.awaiting -= {n for n in self.awaiting if checkpoint_step(n) < published.step}
        if published.pointer_error is not None:
            log.warning("could not move the latest pointer to %s: %s", published.name, published.pointer_error)

    def _commit_once(self, name: str) -> bool:
        """One try at the global commit of a part waiting for the others; True once verified."""
        published = publish_commit(self.open_storage(), name)
        if published.state == AWAITING:
            return False
        self._settle(published)
        log.info("committed and verified %s (its parts were all in storage)", name)
        return True

    def _retry_awaiting(self) -> None:
        """One try at the global commit of each part still waiting (a later upload's first step)."""
        for name in sorted(self.awaiting, key=checkpoint_step):
            try:
                self._commit_once(name)
            except Exception as exc:  # noqa: BLE001 - tried again by the next upload
                self._record.last_error = exc
                log.warning("global commit of %s: %s", name, exc)

    def _await_commit(self, name: str, until: float) -> bool:
        """A preemption's part: try its global commit with backoff until ``until``; True once verified."""
        attempt = 0
        while True:
            attempt += 1
            pause = emergency_upload_pause(attempt, time.time(), until)
            if pause is None:
                log.error("%s was not committed before the deadline: not every part is in storage", name)
                return False
            time.sleep(pause)
            try:
                if self._commit_once(name):
                    return True
            except Exception as exc:  # noqa: BLE001 - retried until the deadline
                self._record.last_error = exc
                log.warning("global commit of %s (attempt %d): %s", name, attempt, exc)

    def _apply_local_retention(self, newest: Path) -> None:
        retention = self._settings.retention
        assert retention is not None
        directory = self._settings.directory
        candidates = []
        for p in list_local_committed(directory):
            try:
                m = read_local_manifest(p)
            except (OSError, ManifestError):
                continue
            candidates.append(RetentionCandidate(p.name, m.step, dict(m.metrics)))
        plan = plan_retention(candidates, retention, newest.name)
        for name in plan.delete:
            remove_checkpoint_dir(directory / name)
