"""What an incremental uploader may take as stored: :func:`current_known`, shared by every uploader.

The sidecar's shipper (and ``spotguard run``) and the Checkpointer's
in-process upload keep the chunks of the newest checkpoint they verified
(:class:`~spotguard.checkpoint.chunked.KnownChunks`) and ask here before
each upload whether that knowledge still holds.
"""

from __future__ import annotations

import logging
import time

from spotguard.checkpoint.chunked import KnownChunks
from spotguard.checkpoint.gc import DEFAULT_ORPHAN_GRACE
from spotguard.checkpoint.stored import read_manifest
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
