"""Resuming through a restore grant: the uploader's side (:func:`make_grant`) and the trainer's
(:func:`load_granted`).

The party with the store's credentials picks the newest checkpoints a
trainer may resume from and signs one GET URL per object each needs
(:mod:`spotguard.contract.grant` is the file's format); it reads no data to
do so. Its check is the cheap one (the manifest, every whole file listed with
its recorded size: :func:`grantable`), because the trainer checks every byte anyway: it streams the
checkpoint through :func:`~spotguard.checkpoint.restore.stream.load_stored_state`,
each range checked (CRC32C) against the granted manifest and placed straight
into its live tensors, and uses nothing unless every file matched. A
checkpoint that fails is walked back past to the next one granted; a grant
that expired, or that the store refuses, ends the walk (the trainer then
resumes as without one).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from spotguard.checkpoint.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    parse_checkpoint_name,
    parse_manifest,
)
from spotguard.checkpoint.restore.stream import LiveTensors, NotStreamable, load_stored_state, streamable
from spotguard.checkpoint.store.stored import CheckpointCorruptError, list_checkpoint_names, stored_files
from spotguard.checkpoint.store.verify_stored import stored_manifest
from spotguard.contract.grant import MAX_GRANTED, GrantedCheckpoint, RestoreGrant, new_grant_id, write_grant
from spotguard.storage.base import Storage, StorageError
from spotguard.storage.presigned import GrantedStorage, GrantRefused, SignsReads

log = logging.getLogger(__name__)

#: How long a grant's URLs live at least; a large checkpoint gets more (:func:`grant_seconds`).
GRANT_SECONDS = 15 * 60
#: The pace a grant's lifetime assumes for the bytes it grants (slower than any store measured).
GRANT_PACE_BYTES_PER_SECOND = 50e6
#: The longest a presigned URL may live (SigV4: seven days).
MAX_GRANT_SECONDS = 7 * 24 * 3600
#: A grant this close to its expiry is not used (a ranged GET is checked when it starts).
EXPIRY_MARGIN_SECONDS = 30.0


def grant_seconds(nbytes: int) -> int:
    """Pure: how long a grant of ``nbytes`` bytes lives."""
    return int(min(MAX_GRANT_SECONDS, GRANT_SECONDS + nbytes / GRANT_PACE_BYTES_PER_SECOND))


def object_sizes(manifest: Manifest) -> dict[str, int]:
    """Pure: every stored object ``manifest``'s checkpoint reads, with its size: ``<name>/<path>``
    of a whole file, the chunk's key of a file stored as chunks."""
    out: dict[str, int] = {}
    for entry in manifest.files:
        if entry.chunks is None:
            out[f"{manifest.name}/{entry.path}"] = entry.size
        else:
            for ref in entry.chunks:
                out[ref.key] = ref.size
    return out


def grantable(storage: Storage, newer_than: int = -1) -> list[tuple[str, bytes, Manifest]]:
    """The checkpoints of ``storage`` newer than step ``newer_than`` a trainer may stream, newest
    first, at most :data:`MAX_GRANTED`: a manifest of the whole checkpoint, of one process's state,
    and (stored as whole files) every file listed with its recorded size; the chunks of a
    checkpoint stored incrementally are not asked about one by one (a missing or damaged one
    fails that checkpoint in the trainer, which walks back). The walk stops at one that is not
    streamable (it is restored to disk, today's path). Storage failures propagate."""
    chosen: list[tuple[str, bytes, Manifest]] = []
    for name in reversed(list_checkpoint_names(storage)):
        if (parse_checkpoint_name(name) or 0) <= newer_than:
            break
        try:
            raw, manifest = stored_manifest(storage, name)
        except CheckpointCorruptError as exc:
            log.warning("not granting checkpoint %s: %s", storage.uri_for(name), "; ".join(exc.problems))
            continue
        if not streamable(manifest):
            break
        problems = [] if manifest.chunked else _listed_problems(storage, manifest)
        if problems:
            log.warning("not granting checkpoint %s: %s", storage.uri_for(name), "; ".join(problems))
            continue
        chosen.append((name, raw, manifest))
        if len(chosen) == MAX_GRANTED:
            break
    return chosen


def _listed_problems(storage: Storage, manifest: Manifest) -> list[str]:
    """What the listing says is wrong with ``manifest``'s files (missing, another size)."""
    listing = stored_files(storage, manifest.name)
    out: list[str] = []
    for entry in manifest.files:
        found = listing.get(entry.path)
        if found is None:
            out.append(f"{entry.path}: missing")
        elif found.size != entry.size:
            out.append(f"{entry.path}: size {found.size} bytes, manifest says {entry.size}")
    return out


def make_grant(storage: Storage, newer_than: int = -1, *, now: float | None = None) -> RestoreGrant | None:
    """A grant to read the newest checkpoints of ``storage`` newer than step ``newer_than``
    (:func:`grantable`), or None: a store that cannot sign reads, nothing newer, or a newest
    checkpoint that must be restored to disk. Storage failures propagate."""
    if not isinstance(storage, SignsReads):
        return None
    chosen = grantable(storage, newer_than)
    if not chosen:
        return None
    sizes = [object_sizes(m) for _, _, m in chosen]
    seconds = grant_seconds(sum(sum(s.values()) for s in sizes))
    granted = tuple(
        GrantedCheckpoint(name, raw, {key: storage.presign_read(key, seconds) for key in objects})
        for (name, raw, _), objects in zip(chosen, sizes, strict=True)
    )
    start = time.time() if now is None else now
    return RestoreGrant(new_grant_id(), storage.uri, start + seconds, granted)


def grant_reads(storage: Storage, control_dir: Path, newer_than: int = -1) -> RestoreGrant | None:
    """Write a grant of reads of the newest checkpoints newer than ``newer_than`` into
    ``control_dir`` (:func:`make_grant`, mode 0600); the grant (None: the store cannot sign reads,
    or none may be streamed: nothing written). Storage errors propagate."""
    grant = make_grant(storage, newer_than)
    if grant is not None:
        write_grant(control_dir, grant)
    return grant


def granted_storage(store: str, granted: GrantedCheckpoint) -> GrantedStorage:
    """The read-only storage of one granted checkpoint: its objects by their URLs, its manifest
    from the grant. Raises :class:`CheckpointCorruptError` for a manifest that does not parse."""
    try:
        manifest = parse_manifest(granted.manifest, expected_name=granted.name)
    except ManifestError as exc:
        raise CheckpointCorruptError(granted.name, [f"{MANIFEST_NAME}: {exc}"]) from None
    sizes = object_sizes(manifest)
    return GrantedStorage(
        store,
        {k: v for k, v in granted.objects.items() if k in sizes},
        sizes,
        {f"{granted.name}/{MANIFEST_NAME}": granted.manifest},
    )


def load_granted(
    grant: RestoreGrant, into: LiveTensors | None = None, *, now: float | None = None
) -> tuple[Manifest, dict[str, Any]] | None:
    """The state of the newest granted checkpoint that loads, each tensor's bytes placed in
    ``into``'s live tensors where they fit; None when none does (each failure logged, never a
    URL). ``into.landed`` then still names the live tensors that received bytes."""
    landed: list[Any] = []
    try:
        if (time.time() if now is None else now) > grant.expires - EXPIRY_MARGIN_SECONDS:
            log.warning("the restore grant for %s has expired: resuming without it", grant.store)
            return None
        for granted in grant.checkpoints:
            where = f"{grant.store}/{granted.name}"
            storage: GrantedStorage | None = None
            try:
                storage = granted_storage(grant.store, granted)
                return load_stored_state(storage, granted.name, into=into)
            except CheckpointCorruptError as exc:
                log.warning("skipping checkpoint %s: %s", where, "; ".join(exc.problems))
            except GrantRefused as exc:
                log.warning("the restore grant was refused (%s): resuming without it", exc)
                return None
            except (StorageError, NotStreamable) as exc:
                log.warning("could not read checkpoint %s through the restore grant: %s", where, exc)
            finally:
                if storage is not None:
                    storage.close()
                if into is not None:
                    landed.extend(into.landed)
        return None
    finally:
        if into is not None:
            into.landed = landed


__all__ = ["grant_reads", "grant_seconds", "grantable", "granted_storage", "load_granted", "make_grant", "object_sizes"]
