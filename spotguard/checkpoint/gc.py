"""Applying retention in storage, and removing what crashed uploads leave behind.

Deleting a checkpoint removes its manifest first, so at no instant is a
checkpoint listed as complete while its files are going away. Nothing
deletes a distributed checkpoint's prefix that waits for its other parts
while it is newer than the newest verified checkpoint (see
:func:`find_orphans`); retention plans over complete (global) manifests as
for a single process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spotguard.checkpoint.manifest import PARTS_DIR, ManifestError, parse_checkpoint_name
from spotguard.checkpoint.remote import (
    delete_checkpoint,
    latest_verified,
    list_checkpoint_names,
    read_manifest,
)
from spotguard.checkpoint.retention import (
    RetentionCandidate,
    RetentionPlan,
    RetentionPolicy,
    plan_retention,
)
from spotguard.storage.base import NotFoundError, ObjectInfo, PendingUpload, Storage

log = logging.getLogger(__name__)

DEFAULT_ORPHAN_GRACE = 3600.0
DEFAULT_STALE_UPLOAD_AGE = 6 * 3600.0


@dataclass
class GcReport:
    """What a garbage collection did (or, with ``dry_run``, would do)."""

    plan: RetentionPlan
    deleted: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    aborted_uploads: list[PendingUpload] = field(default_factory=list)
    newest_verified: str | None = None
    #: Distributed checkpoints newer than the newest verified one whose parts
    #: are not all stored yet: kept, whatever their age.
    waiting: list[str] = field(default_factory=list)


def plan_storage_retention(
    storage: Storage, policy: RetentionPolicy, newest_verified: str | None = None
) -> tuple[RetentionPlan, str | None]:
    """Build the retention plan for a storage root: candidates are checkpoints
    with a readable manifest; the newest verified one is found by verification
    unless the caller knows it (an uploader that just verified it)."""
    if newest_verified is None:
        info, _ = latest_verified(storage)
        newest_verified = info.name if info else None
    candidates: list[RetentionCandidate] = []
    for name in list_checkpoint_names(storage):
        try:
            manifest = read_manifest(storage, name)
        except (NotFoundError, ManifestError):
            continue  # incomplete or broken: the orphan sweep's business
        candidates.append(RetentionCandidate(name, manifest.step, dict(manifest.metrics)))
    return plan_retention(candidates, policy, newest_verified), newest_verified


def apply_retention(
    storage: Storage,
    policy: RetentionPolicy,
    dry_run: bool = False,
    *,
    newest_verified: str | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[str]:
    """Delete the checkpoints the policy does not keep; returns their names
    (the names that would be deleted, with ``dry_run``). ``newest_verified``
    spares a verification the caller has just done; ``should_stop`` is asked
    before each deletion (a preemption stops housekeeping at once)."""
    plan, _ = plan_storage_retention(storage, policy, newest_verified)
    if dry_run:
        return list(plan.delete)
    deleted: list[str] = []
    for name in plan.delete:
        if should_stop is not None and should_stop():
            break
        log.info("retention: deleting %s", storage.uri_for(name))
        delete_checkpoint(storage, name)
        deleted.append(name)
    return deleted


def _holds_parts(objects: list[ObjectInfo], name: str) -> bool:
    prefix = f"{name}/{PARTS_DIR}/"
    return any(o.key.startswith(prefix) for o in objects)


def find_orphans(
    storage: Storage,
    *,
    grace: float = DEFAULT_ORPHAN_GRACE,
    newest_verified: str | None = None,
    now: float | None = None,
    waiting: list[str] | None = None,
) -> list[str]:
    """Checkpoint prefixes without a usable manifest whose newest object is
    older than ``grace`` seconds (interrupted uploads), never the newest verified.

    A prefix holding part manifests of a distributed checkpoint but no global
    manifest is waiting for its other parts (another node's uploader may be
    slow, or down for a while): it is never an orphan while its step is newer
    than the newest verified checkpoint (``newest_verified``; None: there is
    none, so every such prefix waits), whatever its age; such prefixes are
    appended to ``waiting`` when given. Older ones can no longer become the
    checkpoint to resume from and are orphans as before.
    """
    now = time.time() if now is None else now
    newest_step = parse_checkpoint_name(newest_verified) if newest_verified else None
    orphans: list[str] = []
    for name in list_checkpoint_names(storage):
        if name == newest_verified:
            continue
        try:
            read_manifest(storage, name)
            continue
        except NotFoundError:
            pass
        except ManifestError:
            pass
        objects = list(storage.list_objects(f"{name}/"))
        step = parse_checkpoint_name(name) or 0
        if _holds_parts(objects, name) and (newest_step is None or step > newest_step):
            if waiting is not None:
                waiting.append(name)
            continue  # a distributed checkpoint waiting for its other parts
        if objects and now - max(o.modified for o in objects) < grace:
            continue  # possibly still being uploaded
        orphans.append(name)
    return orphans


def stale_uploads(
    storage: Storage, *, max_age: float = DEFAULT_STALE_UPLOAD_AGE, now: float | None = None
) -> list[PendingUpload]:
    """Unfinished (multipart) uploads started more than ``max_age`` seconds ago."""
    now = time.time() if now is None else now
    return [u for u in storage.list_pending_uploads("") if now - u.started >= max_age]


def collect_garbage(
    storage: Storage,
    policy: RetentionPolicy,
    *,
    orphan_grace: float = DEFAULT_ORPHAN_GRACE,
    stale_upload_age: float = DEFAULT_STALE_UPLOAD_AGE,
    dry_run: bool = False,
) -> GcReport:
    """Apply retention, delete orphaned prefixes, abort stale multipart uploads."""
    plan, newest = plan_storage_retention(storage, policy)
    report = GcReport(plan=plan, newest_verified=newest)
    report.orphans = find_orphans(storage, grace=orphan_grace, newest_verified=newest, waiting=report.waiting)
    report.aborted_uploads = stale_uploads(storage, max_age=stale_upload_age)
    report.deleted = list(plan.delete)
    if dry_run:
        return report
    for name in plan.delete:
        log.info("gc: deleting %s (retention)", storage.uri_for(name))
        delete_checkpoint(storage, name)
    for name in report.orphans:
        if parse_checkpoint_name(name) is None:
            continue
        log.info("gc: deleting %s (orphaned: no manifest)", storage.uri_for(name))
        storage.delete([o.key for o in storage.list_objects(f"{name}/")])
    for upload in report.aborted_uploads:
        log.info("gc: aborting stale upload of %s", storage.uri_for(upload.key))
        storage.abort_upload(upload)
    return report
