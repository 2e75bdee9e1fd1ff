"""Downloading a checkpoint from storage into a local directory, verified.

A restored checkpoint appears under its final name only once every file is
downloaded and matches the manifest (checked as it streams in:
:mod:`~spotguard.checkpoint.restore.fetch`, or assembled from chunks:
:mod:`~spotguard.checkpoint.store.chunked`); the local copy is then what
:mod:`~spotguard.checkpoint.local.commit` reads. :func:`restore_latest` walks back
to the newest checkpoint that restores, as
:func:`~spotguard.checkpoint.store.latest.latest_verified` does without
downloading. :func:`restore_latest_state` does the same without a local
copy: the state is read from the store straight into memory, verified.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from spotguard.checkpoint.format.manifest import (
    MANIFEST_NAME,
    parse_checkpoint_name,
    to_plain,
)
from spotguard.checkpoint.local.codec import StateError
from spotguard.checkpoint.local.commit import (
    TMP_PREFIX,
    load_checkpoint_state,
    read_local_manifest,
    remove_checkpoint_dir,
    verify_local_checkpoint,
)
from spotguard.checkpoint.local.inplace import file_stamps
from spotguard.checkpoint.restore.fetch import fetch_chunks, fetch_verified
from spotguard.checkpoint.restore.stream import NotStreamable, load_stored_state
from spotguard.checkpoint.store.parts import name_parts
from spotguard.checkpoint.store.stored import (
    CheckpointCorruptError,
    CheckpointInfo,
    Skipped,
    list_checkpoint_names,
    stored_files,
)
from spotguard.checkpoint.store.verify_stored import stored_manifest
from spotguard.contract.control import write_verified_local
from spotguard.storage.base import ProgressCallback, Storage
from spotguard.storage.file import fsync_dir

log = logging.getLogger(__name__)
_T = TypeVar("_T")


RESTORE_TMP_PREFIX = f"{TMP_PREFIX}restore-"


def restore_checkpoint(
    storage: Storage,
    name: str,
    dest: Path,
    *,
    progress: ProgressCallback | None = None,
    plain: bool = False,
) -> CheckpointInfo:
    """Download one checkpoint into ``dest/<name>`` and verify it there.

    The directory appears only when every file is downloaded and matches the
    manifest. A matching local copy that already verifies is reused. A
    checkpoint stored incrementally is assembled from its chunks; with
    ``plain`` its copy gets the manifest of whole files (version 1), a
    self-contained checkpoint any spotguard reads (otherwise the stored
    manifest is kept, so the copy is recognized as the stored checkpoint).
    Raises :class:`CheckpointCorruptError` (with the problems) or
    :class:`StorageError`.
    """
    dest = Path(dest)
    manifest_bytes, manifest = stored_manifest(storage, name)
    if not manifest.locally_complete:
        raise CheckpointCorruptError(name, [f"{MANIFEST_NAME}: the manifest of one part, not of the whole checkpoint"])
    stored = manifest
    if plain and manifest.chunked:
        manifest = to_plain(manifest)
        manifest_bytes = manifest.to_json()
    final = dest / name
    if (
        (final / MANIFEST_NAME).is_file()
        and (final / MANIFEST_NAME).read_bytes() == manifest_bytes
        and verify_local_checkpoint(final).ok
    ):
        return CheckpointInfo.from_manifest(manifest, str(final))
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / f"{RESTORE_TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if stored.chunked:
            problems = fetch_chunks(storage, stored, tmp, progress=progress)
            if problems:
                raise CheckpointCorruptError(name, problems)
        else:
            listing = stored_files(storage, name)
            missing = [e.path for e in manifest.files if e.path not in listing]
            if missing:
                raise CheckpointCorruptError(
                    name, name_parts(storage, name, manifest, [f"{p}: missing" for p in missing])
                )
            # One pass: each file is checked as it streams in; not fsynced, as
            # every reader verifies a local copy before using it.
            sizes = {path: info.size for path, info in listing.items()}
            problems = fetch_verified(storage, name, manifest, sizes, tmp, progress=progress, seen=listing)
            if problems:
                raise CheckpointCorruptError(name, name_parts(storage, name, manifest, problems))
        (tmp / MANIFEST_NAME).write_bytes(manifest_bytes)
        fsync_dir(tmp)
        if final.exists():
            remove_checkpoint_dir(final)
        os.rename(tmp, final)
        fsync_dir(dest)
    except BaseException:  # no half-staged checkpoint left, an interrupt too; raised again
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return CheckpointInfo.from_manifest(manifest, str(final))


def restore_latest(
    storage: Storage,
    dest: Path,
    *,
    progress: ProgressCallback | None = None,
    on_skip: Callable[[Skipped], None] | None = None,
) -> CheckpointInfo | None:
    """Stage the newest verified checkpoint into ``dest/ckpt-<step>/``.

    Walks back past checkpoints that are incomplete or fail verification
    (logging each, and reporting it to ``on_skip``). Returns None when storage
    holds no usable checkpoint. Storage failures propagate.
    """
    return _newest_usable(storage, lambda name: restore_checkpoint(storage, name, dest, progress=progress), on_skip)


def restore_state(
    storage: Storage,
    name: str,
    *,
    progress: ProgressCallback | None = None,
    scratch: Path | None = None,
) -> tuple[CheckpointInfo, dict[str, Any]]:
    """The state of stored checkpoint ``name``, verified, without a local copy.

    One process's state is read from the store straight into its tensors and
    checked on the way (:func:`~spotguard.checkpoint.restore.stream.load_stored_state`);
    any other checkpoint is restored into a temporary directory below
    ``scratch`` (the system's default when None), loaded and removed. Raises
    :class:`CheckpointCorruptError` (nothing is returned from a checkpoint that
    does not verify) or :class:`StorageError`.
    """
    try:
        manifest, state = load_stored_state(storage, name, progress=progress)
        return CheckpointInfo.from_manifest(manifest, storage.uri_for(name)), state
    except NotStreamable:
        pass
    with tempfile.TemporaryDirectory(prefix=RESTORE_TMP_PREFIX, dir=scratch) as tmp:
        info = restore_checkpoint(storage, name, Path(tmp), progress=progress)
        try:
            state = load_checkpoint_state(Path(info.uri))
        except StateError as exc:
            raise CheckpointCorruptError(name, [str(exc)]) from None
    return dataclasses.replace(info, uri=storage.uri_for(name)), state


def restore_latest_state(
    storage: Storage,
    *,
    progress: ProgressCallback | None = None,
    on_skip: Callable[[Skipped], None] | None = None,
    scratch: Path | None = None,
) -> tuple[CheckpointInfo, dict[str, Any]] | None:
    """The state of the newest verified checkpoint, read straight into memory
    (:func:`restore_state`), walking back past checkpoints that are
    incomplete or fail verification exactly as :func:`restore_latest` does.
    Returns None when storage holds no usable checkpoint; storage failures
    propagate."""
    return _newest_usable(
        storage, lambda name: restore_state(storage, name, progress=progress, scratch=scratch), on_skip
    )


def _newest_usable(
    storage: Storage, restore: Callable[[str], _T], on_skip: Callable[[Skipped], None] | None
) -> _T | None:
    """``restore(name)`` of the newest checkpoint it succeeds on, walking back past each that
    raises :class:`CheckpointCorruptError` (logged, and reported to ``on_skip``)."""
    for name in reversed(list_checkpoint_names(storage)):
        try:
            return restore(name)
        except CheckpointCorruptError as exc:
            skipped = Skipped(name, parse_checkpoint_name(name) or 0, "; ".join(exc.problems))
            log.warning("skipping checkpoint %s: %s", storage.uri_for(name), skipped.reason)
            if on_skip is not None:
                on_skip(skipped)
    return None


def vouch_restored(control_dir: Path, path: Path) -> None:
    """Record local checkpoint ``path``, verified whole as it was restored just now, for the
    trainer (its files' stamps, :func:`~spotguard.contract.control.write_verified_local`), so that
    it does not checksum it again (:mod:`spotguard.checkpoint.local.inplace`). Raises OSError or
    ManifestError when it cannot be recorded (the trainer then checksums it: slower, never wrong)."""
    write_verified_local(control_dir, path.name, file_stamps(path, read_local_manifest(path)))


__all__ = [
    "RESTORE_TMP_PREFIX",
    "restore_checkpoint",
    "restore_latest",
    "restore_latest_state",
    "restore_state",
    "vouch_restored",
]
