"""Choosing the newest checkpoint in storage that verifies, once or by polling.

Storage may hold checkpoints that are incomplete (an interrupted upload, a
distributed one whose parts are not all there) or damaged: the newest usable
one is found by walking back from the newest name and verifying each
(:func:`latest_verified`), never by trusting the ``latest`` pointer.
:class:`LatestWatch` gives the same answer to a poller (the operator, the
sidecar) at the cost of one conditional read while nothing changed.
Restoring the newest one that restores is
:func:`~spotguard.checkpoint.restore.load.restore_latest`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from spotguard.checkpoint.format.manifest import POINTER_NAME, parse_checkpoint_name, parse_pointer
from spotguard.checkpoint.store.stored import CheckpointInfo, Skipped, list_checkpoint_names
from spotguard.checkpoint.store.verify_stored import verify_checkpoint
from spotguard.storage.base import UNCHANGED, Storage

log = logging.getLogger(__name__)


def latest_verified(
    storage: Storage, *, checksums: bool = True, deep: bool = False, quiet: bool = False
) -> tuple[CheckpointInfo | None, list[Skipped]]:
    """The newest checkpoint that passes verification, and every newer one that
    was passed over with the reason. ``(None, skipped)`` when none passes.
    ``checksums`` and ``deep`` as for
    :func:`~spotguard.checkpoint.store.verify_stored.verify_checkpoint`; ``quiet``
    logs each verification and skipped checkpoint at DEBUG instead of
    INFO/WARNING (for pollers, which report what changed themselves)."""
    skipped: list[Skipped] = []
    for name in reversed(list_checkpoint_names(storage)):
        result = verify_checkpoint(storage, name, checksums=checksums, deep=deep, quiet=quiet)
        if result.ok and result.manifest is not None:
            return CheckpointInfo.from_manifest(result.manifest, storage.uri_for(name)), skipped
        skipped.append(Skipped(name, parse_checkpoint_name(name) or 0, result.reason))
        log.log(
            logging.DEBUG if quiet else logging.WARNING,
            "skipping checkpoint %s: %s",
            storage.uri_for(name),
            result.reason,
        )
    return None, skipped


#: Default of :attr:`LatestWatch.full_read_seconds`.
FULL_READ_SECONDS = 1800.0


class LatestWatch:
    """:func:`latest_verified` for a poller: a full read only when something changed.

    One watch per storage root (per job). Each :meth:`poll` reads the
    ``latest`` pointer conditionally (``If-None-Match`` with the entity tag
    seen at the last full read): while it is unchanged the poll returns the
    last full read's result, at the cost of exactly one request and no data.
    When the pointer changed or is missing, or when a full read is due
    (every ``full_read_seconds``; 0: at every poll, without reading the
    pointer at all, as :func:`latest_verified` alone), it calls
    :func:`latest_verified` and keeps the result with the pointer's tag.

    Why an unchanged pointer may stand for "nothing new": every writer moves
    the pointer (by compare-and-swap, forward only) after the checkpoint is
    complete in storage: the sidecar, ``spotguard run`` and the Checkpointer
    after it verified; :func:`~spotguard.checkpoint.store.upload.upload_checkpoint` after the manifest; the
    distributed commit after the global manifest. So a new checkpoint that
    verifies changes the pointer's entity tag. The result itself never comes
    from the pointer: a full read decides from the listing and the manifests
    as :func:`latest_verified` does. The pointer is still advisory: a writer
    that crashed between its verification and the pointer move, a pointer
    write that failed, or a checkpoint removed or damaged behind spotguard's
    back is not signalled; the periodic full read catches those, at most
    ``full_read_seconds`` late. The pointer is read before the listing and
    its tag is the one kept: a pointer moved in between only costs one more
    full read at the next poll, never a stale result.

    A pointer read without a version tag (an empty entity tag or
    generation: a store or emulator that does not report one) cannot say
    "unchanged" at all: its tag is unknown, never kept, and every poll reads
    in full, as without a watch.

    Because the pointer only moves forward, it cannot signal a new checkpoint
    older than the step it names: when it names a step newer than the newest
    checkpoint that verifies (that one was damaged or removed, and training
    resumed from an older one), or cannot be parsed, it is not trusted and
    every poll reads in full (as without a watch) until a full read finds
    the pointer's checkpoint, or a newer one, verified.

    Storage errors propagate and change nothing kept (the next poll tries
    again). ``clock`` (monotonic seconds) is injectable for tests.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        full_read_seconds: float = FULL_READ_SECONDS,
        checksums: bool = False,
        deep: bool = False,
        quiet: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.storage = storage
        self.full_read_seconds = max(0.0, float(full_read_seconds))
        self.checksums = checksums
        self.deep = deep
        self.quiet = quiet
        self._clock = clock
        self._lock = threading.Lock()
        self._etag: str | None = None
        self._result: tuple[CheckpointInfo | None, list[Skipped]] | None = None
        self._full_at = 0.0
        #: Polls answered by a full read, and by the unchanged pointer alone.
        self.full_reads = 0
        self.unchanged_polls = 0
        #: Whether the last poll made a full read.
        self.last_full = False

    def poll(self, *, full: bool = False) -> tuple[CheckpointInfo | None, list[Skipped]]:
        """The newest verified checkpoint and the newer ones skipped, as :func:`latest_verified`;
        ``full``: a full read now, whatever the pointer says (a last look)."""
        with self._lock:
            if self.full_read_seconds <= 0:
                return self._full_read(None)
            due = self._result is None or self._etag is None or self._clock() - self._full_at >= self.full_read_seconds
            if full or due:
                pointer = self.storage.read_with_etag(POINTER_NAME)
            else:
                found = self.storage.read_if_changed(POINTER_NAME, self._etag)
                if found is UNCHANGED:
                    assert self._result is not None
                    self.unchanged_polls += 1
                    self.last_full = False
                    info, skipped = self._result
                    return info, list(skipped)
                pointer = found
            return self._full_read(pointer)

    def _full_read(self, pointer: tuple[bytes, str] | None) -> tuple[CheckpointInfo | None, list[Skipped]]:
        started = self._clock()
        info, skipped = latest_verified(self.storage, checksums=self.checksums, deep=self.deep, quiet=self.quiet)
        # The pointer's tag is kept (and stands for "nothing new" at the next polls) only when the pointer
        # is not ahead of what verifies; and only once the read succeeded: a failed one changes nothing.
        pointed = parse_pointer(pointer[0]) if pointer is not None else None
        trusted = pointer is not None and pointed is not None and info is not None and pointed <= info.step
        # An empty tag is an unknown one: a conditional read against it would take any pointer for unchanged.
        self._etag = pointer[1] if trusted and pointer is not None and pointer[1] else None
        self._result = (info, list(skipped))
        self._full_at = started
        self.full_reads += 1
        self.last_full = True
        return info, skipped


__all__ = ["FULL_READ_SECONDS", "LatestWatch", "latest_verified"]
