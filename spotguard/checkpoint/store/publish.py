"""One publish pipeline: upload, global commit, verify, move the pointer.

Both uploaders publish through it: the sidecar's shipper (which ``spotguard
run`` uses too) and the Checkpointer's in-process upload (``upload=True``);
so does a library caller's one-call ``upload_checkpoint(update_pointer=True)``
(steps 3 and 4: no pointer moves to a checkpoint that did not verify).
Each keeps its own retries, metrics and log lines around it; the order of
the steps, and what each outcome means, are decided here once:

1. The upload stores the data files, then the manifest (for a part of a
   distributed checkpoint: the part manifest, then :func:`commit_global`).
   The ``latest`` pointer never moves during it. A storage error or a stop
   (:class:`~spotguard.checkpoint.store.upload.UploadCancelled`) propagates: the
   caller retries, or lets a preemption's checkpoint go first.
2. A checkpoint whose manifest is not in storage yet (other parts are
   missing) is ``awaiting``; :func:`publish_commit` tries the global commit
   again, and continues from step 3 once it is written.
3. The checkpoint is verified in storage (but the chunks its upload reused
   from a checkpoint this uploader verified: trusted, see
   :mod:`~spotguard.checkpoint.store.chunked`). A failed verification is
   ``unverified``; the pointer is not touched.
4. The pointer moves forward (never back). A failure to move it is reported
   and the checkpoint stays verified: the pointer is advisory, and resume
   finds a verified checkpoint the pointer is behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from spotguard.checkpoint.format.manifest import checkpoint_step
from spotguard.checkpoint.format.verify import VerifyResult
from spotguard.checkpoint.store.chunked import ChunkCounts
from spotguard.checkpoint.store.parts import commit_global
from spotguard.checkpoint.store.stored import update_latest_pointer
from spotguard.checkpoint.store.verify_stored import verify_checkpoint
from spotguard.storage.base import Storage

VERIFIED = "verified"
AWAITING = "awaiting"
UNVERIFIED = "unverified"


@dataclass(frozen=True)
class UploadResult(ChunkCounts):
    """What :func:`~spotguard.checkpoint.store.upload.upload_checkpoint` stored (step 1), its
    :class:`~spotguard.checkpoint.store.chunked.ChunkCounts` included."""

    step: int
    name: str
    bytes: int
    seconds: float
    uri: str
    pointer_updated: bool
    #: Whether the checkpoint is complete in storage now (its manifest is
    #: there): always for a single-process checkpoint; for a part of a
    #: distributed one, when the global manifest exists (this uploader wrote
    #: it, or another did).
    committed: bool = True
    #: Parts of the checkpoint found in storage, and how many it has (1 and 1
    #: for a single-process checkpoint).
    parts_present: int = 1
    parts_total: int = 1
    #: Reused chunks taken from a checkpoint the uploader verified (digest -> size): the
    #: verification of this one may take them as checked (:attr:`ChunkedUpload.trusted`).
    trusted_chunks: dict[str, int] = field(default_factory=dict)


@dataclass
class Published:
    """Where one checkpoint's publication got to.

    ``state``: :data:`VERIFIED`, :data:`AWAITING` (a part is stored; the
    checkpoint waits for its other parts) or :data:`UNVERIFIED` (``problems``
    say why). ``upload`` is None after :func:`publish_commit` (the upload was
    an earlier call's). ``pointer_moved`` is None when the pointer was not
    tried, ``pointer_error`` set when moving it failed.
    """

    name: str
    state: str
    upload: UploadResult | None = None
    upload_seconds: float = 0.0
    verify_seconds: float = 0.0
    pointer_seconds: float = 0.0
    verdict: VerifyResult | None = None
    problems: list[str] = field(default_factory=list)
    parts_present: int = 0
    parts_total: int | None = None
    #: Set when this call wrote or found the global manifest (:func:`publish_commit`): its status.
    commit_status: str | None = None
    pointer_moved: bool | None = None
    pointer_error: Exception | None = None

    @property
    def step(self) -> int:
        return checkpoint_step(self.name)

    @property
    def verified(self) -> bool:
        return self.state == VERIFIED


def publish(
    name: str, storage: Storage, upload: Callable[[], UploadResult], *, stop: Callable[[], bool] | None = None
) -> Published:
    """Steps 1, 3 and 4 for checkpoint ``name``: ``upload()`` stores it
    (without moving the pointer; its errors propagate), then it is verified
    and pointed to, or left awaiting its other parts. ``stop``: see
    :func:`verify_and_point`."""
    t0 = time.monotonic()
    result = upload()
    seconds = time.monotonic() - t0
    if not result.committed:
        return Published(
            name,
            AWAITING,
            result,
            seconds,
            parts_present=result.parts_present,
            parts_total=result.parts_total,
        )
    so_far = Published(name, UNVERIFIED, result, seconds)
    return verify_and_point(storage, name, so_far, trusted=result.trusted_chunks, stop=stop)


def publish_commit(storage: Storage, name: str) -> Published:
    """Step 2: the global commit of a distributed checkpoint whose parts were
    awaiting each other, then steps 3 and 4 once it is written (or found
    written). Storage errors propagate."""
    commit = commit_global(storage, name)
    present, total = len(commit.present), commit.total
    if not commit.committed:
        return Published(
            name,
            AWAITING,
            problems=[commit.problem] if commit.problem else [],
            parts_present=present,
            parts_total=total,
        )
    so_far = Published(name, UNVERIFIED, parts_present=present, parts_total=total, commit_status=commit.status)
    return verify_and_point(storage, name, so_far)


def verify_and_point(
    storage: Storage,
    name: str,
    so_far: Published,
    *,
    trusted: Mapping[str, int] | None = None,
    stop: Callable[[], bool] | None = None,
) -> Published:
    """Steps 3 and 4: verify ``name`` in storage and move the pointer to it.
    Any failure to verify (a storage error too) leaves it :data:`UNVERIFIED`.
    ``trusted``: the chunks its upload reused from a checkpoint the uploader
    verified, taken as checked (see :mod:`spotguard.checkpoint.store.chunked`).
    ``stop`` (a routine verification that a preemption may overtake, through a
    ``storage`` that raises once it says yes:
    :func:`~spotguard.checkpoint.store.upload.stopping_storage`): an error raised
    once it says yes is raised again, a stop and not a failure; the checkpoint is
    left unverified and unpointed, for a later upload to verify."""
    t1 = time.monotonic()
    try:
        verdict = verify_checkpoint(storage, name, trusted=trusted)
        ok, problems = bool(verdict.ok), list(verdict.problems)
    except Exception as exc:  # noqa: BLE001 - any failure to verify means not verified; the caller reports it
        if stop is not None and stop():
            raise
        verdict, ok, problems = None, False, [" ".join(str(exc).split()) or type(exc).__name__]
    so_far.verify_seconds = time.monotonic() - t1
    so_far.verdict, so_far.problems = verdict, problems
    if not ok:
        so_far.state = UNVERIFIED
        return so_far
    so_far.state = VERIFIED
    t2 = time.monotonic()
    try:
        so_far.pointer_moved = update_latest_pointer(storage, so_far.step)
    except Exception as exc:  # noqa: BLE001 - the pointer is advisory: verified stays verified; the caller reports it
        so_far.pointer_error = exc
    so_far.pointer_seconds = time.monotonic() - t2
    return so_far
