"""Checkpoints in storage: the layout, and reading, pointing at and deleting what is stored.

Layout below the storage root: ``ckpt-<step:012d>/<data files>``,
``ckpt-<step:012d>/manifest.json`` (uploaded after every data file), and the
advisory ``latest`` pointer (uploaded last). Which checkpoint is usable is
decided from the listing and the manifests alone; the pointer is never
trusted.

This module is what the modules on stored checkpoints share: the names,
listings and manifests in storage, the ``latest`` pointer, deletion, and the
types they report. Writing a checkpoint is :mod:`~spotguard.checkpoint.store.upload`
(a distributed one commits through :mod:`~spotguard.checkpoint.store.parts`),
checking one is :mod:`~spotguard.checkpoint.store.verify_stored`, choosing the
newest verified one is :mod:`~spotguard.checkpoint.store.latest`, downloading one
is :mod:`~spotguard.checkpoint.restore.load`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from spotguard.checkpoint.format.manifest import (
    MANIFEST_NAME,
    POINTER_NAME,
    Manifest,
    ManifestError,
    parse_checkpoint_name,
    parse_manifest,
    parse_pointer,
    pointer_json,
)
from spotguard.checkpoint.store.chunked import tombstone_key
from spotguard.storage.base import NotFoundError, ObjectInfo, PreconditionFailedError, Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint that passed verification."""

    name: str
    step: int
    epoch: int | None
    metrics: dict[str, float | None]
    created: str
    size: int
    uri: str
    manifest: Manifest = field(repr=False)

    @classmethod
    def from_manifest(cls, manifest: Manifest, uri: str) -> CheckpointInfo:
        """Build from a manifest and the checkpoint's URI (or local path)."""
        return cls(
            name=manifest.name,
            step=manifest.step,
            epoch=manifest.epoch,
            metrics=dict(manifest.metrics),
            created=manifest.created,
            size=manifest.total_size,
            uri=uri,
            manifest=manifest,
        )


@dataclass(frozen=True)
class Skipped:
    """A checkpoint passed over while looking for the newest verified one."""

    name: str
    step: int
    reason: str


class CheckpointCorruptError(Exception):
    """A checkpoint failed verification; ``problems`` name file and reason."""

    def __init__(self, name: str, problems: list[str]) -> None:
        super().__init__(f"{name}: " + "; ".join(problems))
        self.name = name
        self.problems = problems


def list_checkpoint_names(storage: Storage) -> list[str]:
    """Names of every ``ckpt-*`` prefix in storage (complete or not), oldest first."""
    names = [n for n in storage.list_dirs("") if parse_checkpoint_name(n) is not None]
    return sorted(names, key=lambda n: parse_checkpoint_name(n) or 0)


def read_manifest_bytes(storage: Storage, name: str) -> bytes:
    """The raw ``manifest.json`` of a checkpoint; raises :class:`NotFoundError`."""
    return storage.read_bytes(f"{name}/{MANIFEST_NAME}")


def read_manifest(storage: Storage, name: str) -> Manifest:
    """Parse a stored checkpoint's manifest; raises :class:`NotFoundError` or
    :class:`ManifestError`."""
    return parse_manifest(read_manifest_bytes(storage, name), expected_name=name)


def stored_files(storage: Storage, name: str) -> dict[str, ObjectInfo]:
    """Every object below checkpoint ``name``, by its path inside the checkpoint."""
    prefix = f"{name}/"
    return {o.key[len(prefix) :]: o for o in storage.list_objects(prefix)}


def read_latest_pointer(storage: Storage) -> int | None:
    """The step the advisory ``latest`` pointer names, or None."""
    try:
        return parse_pointer(storage.read_bytes(POINTER_NAME))
    except NotFoundError:
        return None


def update_latest_pointer(storage: Storage, step: int, *, attempts: int = 8) -> bool:
    """Move the ``latest`` pointer forward to ``step`` (never backwards).

    Uses a conditional write (compare-and-swap on the entity tag) where the
    store supports it, so two writers cannot move it backwards; returns
    whether the pointer was changed.
    """
    for _ in range(attempts):
        current = storage.read_with_etag(POINTER_NAME)
        if current is not None:
            current_step = parse_pointer(current[0])
            if current_step is not None and current_step >= step:
                return False
        try:
            if current is None:
                storage.write_bytes(POINTER_NAME, pointer_json(step), if_none_match=True)
            else:
                storage.write_bytes(POINTER_NAME, pointer_json(step), if_match=current[1])
            return True
        except PreconditionFailedError:
            time.sleep(0.05)
    log.warning("could not update %s after %d attempts (concurrent writers)", storage.uri_for(POINTER_NAME), attempts)
    return False


def delete_checkpoint(storage: Storage, name: str) -> int:
    """Delete a stored checkpoint: its manifest first (so it is never seen
    complete with files missing), then everything else under its prefix.
    A checkpoint stored incrementally leaves a tombstone (its manifest, below
    ``gc/tombstones/``) before its manifest goes; its chunks are removed by
    the chunk sweep once no retained checkpoint uses them. Returns the number
    of objects deleted."""
    if parse_checkpoint_name(name) is None:
        raise ValueError(f"not a checkpoint name: {name!r}")
    try:
        data = read_manifest_bytes(storage, name)
        chunked = parse_manifest(data, expected_name=name).chunked
    except (NotFoundError, ManifestError):
        chunked = False
    if chunked:
        # A garbage collection that read the manifests before this deletion
        # must still count its chunks as used (an upload may be reusing them);
        # see gc.py.
        storage.write_bytes(tombstone_key(name), data)
    storage.delete([f"{name}/{MANIFEST_NAME}"])
    keys = [o.key for o in storage.list_objects(f"{name}/")]
    storage.delete(keys)
    return len(keys) + 1


__all__ = [
    "CheckpointCorruptError",
    "CheckpointInfo",
    "Skipped",
    "delete_checkpoint",
    "list_checkpoint_names",
    "read_latest_pointer",
    "read_manifest",
    "read_manifest_bytes",
    "stored_files",
    "update_latest_pointer",
]
