"""What an incremental uploader may take as stored: :class:`KnownChunkTable`, one per uploader.

Every uploader keeps one: the sidecar's shipper (and ``spotguard run``),
for whole checkpoints and for a node's part of a distributed one, and the
Checkpointer's in-process upload (``upload=True``). It holds the chunks of
the newest checkpoint the uploader verified
(:class:`~spotguard.checkpoint.store.chunked.KnownChunks`), refreshed by
:func:`current_known`, and is the one place that hears of a chunk the store
no longer holds correctly: whatever check finds it damaged or missing (the
verification of a checkpoint, or a part's check of its own chunks inside
its upload, :class:`~spotguard.checkpoint.store.stored.CheckpointCorruptError`),
the uploader hands the problems to :meth:`KnownChunkTable.forget` or
:meth:`KnownChunkTable.forget_failed`, and no later upload takes that chunk
as stored until a verified checkpoint holds it again. The next upload that
uses it sends it from local bytes; the same content key then heals every
checkpoint that names it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from spotguard.checkpoint.format.manifest import Manifest, parse_checkpoint_name
from spotguard.checkpoint.store.chunked import KnownChunks, chunks_named
from spotguard.checkpoint.store.gc import DEFAULT_ORPHAN_GRACE
from spotguard.checkpoint.store.stored import CheckpointCorruptError, read_manifest
from spotguard.storage.base import NotFoundError, Storage

log = logging.getLogger(__name__)


def current_known(storage: Storage, known: KnownChunks | None, now: float | None = None) -> KnownChunks:
    """The chunks an incremental upload may reuse without uploading them.

    ``known`` (those of the newest checkpoint this uploader verified) while
    it is younger than half the orphan grace; else read again: the manifest
    of the same checkpoint, or, when there is none (a restart, or it was
    deleted), that of the checkpoint the ``latest`` pointer names (two small
    reads, never a listing of the store). A garbage collection keeps the
    chunks of a checkpoint deleted less than the grace ago (its tombstone),
    so chunks reused within that time cannot be swept under an upload; reused
    chunks are checked to exist before a manifest names them in any case.
    When nothing can be read, nothing is known: every chunk is uploaded.
    """
    now = time.monotonic() if now is None else now
    if known is not None and now - known.since < DEFAULT_ORPHAN_GRACE / 2:
        return known
    try:
        try:
            if known is None or known.source is None:
                raise NotFoundError("no checkpoint known")
            return KnownChunks.of(read_manifest(storage, known.source))
        except NotFoundError:
            return KnownChunks.from_storage(storage)
    except Exception as exc:  # noqa: BLE001 - nothing known: every chunk is uploaded
        log.info("no known chunks (%s); uploading every chunk", " ".join(str(exc).split()))
        return KnownChunks(since=now)


class KnownChunkTable:
    """One uploader's chunks known stored, less those a check found damaged or missing.

    Thread-safe: a write follower asks :meth:`digests` while the shipping
    thread uploads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: KnownChunks | None = None
        #: Chunks a check named (damaged or missing in storage): never taken as stored
        #: until a verified checkpoint holds them again.
        self._suspect: set[str] = set()

    def for_upload(self, storage: Storage, *, trust: bool) -> KnownChunks:
        """What the next incremental upload may reuse (:func:`current_known`), less the
        suspect chunks; ``trust`` (a preemption's upload): reused without a request each
        while the knowledge is fresh, else each is checked first (see
        :mod:`spotguard.checkpoint.store.chunked`)."""
        with self._lock:
            known = self._known
        known = current_known(storage, known)
        with self._lock:
            self._known = known
            usable = known.without(self._suspect)
        return usable if trust else usable.untrusted()

    def verified(self, manifest: Manifest, trusted: int) -> None:
        """``manifest``'s checkpoint was verified, ``trusted`` of its chunks taken as checked
        from the knowledge its upload used: known from now on, its chunks no longer suspect."""
        if not manifest.chunked:
            return
        with self._lock:
            self._known = KnownChunks.verified(manifest, trusted, self._known)
            self._suspect -= self._known.chunks.keys()

    def learn(self, manifest: Manifest) -> None:
        """Know the chunks of a checkpoint found already in storage (not checked by this
        uploader), when it is newer than what is known."""
        if not manifest.chunked:
            return
        with self._lock:
            source = self._known.source if self._known is not None else None
            if self._known is None or (parse_checkpoint_name(source or "") or -1) < manifest.step:
                self._known = KnownChunks.of(manifest)

    def forget(self, name: str, problems: Iterable[str]) -> set[str]:
        """A check of ``name`` found ``problems``: the chunks they name are damaged or missing
        in storage, and the next upload that uses them sends them from local bytes. Returns
        their digests (empty when the problems name no chunk)."""
        damaged = chunks_named(problems)
        with self._lock:
            new = damaged - self._suspect
            self._suspect |= damaged
        if new:  # told again of the same failure (it is raised on): said once
            log.warning(
                "%d chunk(s) named by the check of %s will be uploaded again: %s",
                len(new),
                name,
                ", ".join(sorted(d[:12] for d in new)),
            )
        return damaged

    def forget_failed(self, name: str, exc: BaseException) -> set[str]:
        """An upload of ``name`` raised ``exc``: when its own check of what it stored found
        chunks damaged or missing (a part of a distributed checkpoint checks its chunks
        before its part manifest is stored), forget them as :meth:`forget` does."""
        if isinstance(exc, CheckpointCorruptError):
            return self.forget(name, exc.problems)
        return set()

    def digests(self) -> dict[str, int]:
        """The chunks known stored (digest -> size) as last learnt, less the suspect ones,
        without asking the store."""
        with self._lock:
            if self._known is None:
                return {}
            return {d: n for d, n in self._known.chunks.items() if d not in self._suspect}


__all__ = ["KnownChunkTable", "current_known"]
