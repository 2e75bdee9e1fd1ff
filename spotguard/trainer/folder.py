"""Checkpoints a training framework writes itself (Hugging Face Trainer, Lightning).

A framework writes its own checkpoint folder (``checkpoint-<step>/`` of the
Trainer, a Lightning ``.ckpt``); spotguard commits the files of that folder
as one of its checkpoints (``ckpt-<step:012d>/``, manifest with checksums
written last, atomic rename) for the uploader, and hands a verified one back
to the framework on resume. See :meth:`Checkpointer.commit_folder` and
:meth:`Checkpointer.resume_folder`.

Files are hard-linked into the checkpoint when the file system allows it
(no copy: the seconds of the grace period go to the upload), else copied.
The framework's folder is never modified; its own rotation
(``save_total_limit``, ``save_top_k``) deleting it later removes only its
names, never the committed copy. A hard link shares the file's contents:
a framework that rewrote a file *in place* at the same path would change
the committed copy too, and its checksum would no longer match (caught by
every verification, never loaded). Both integrations write each save into
a fresh path.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from spotguard.checkpoint.format.manifest import MANIFEST_NAME, FileEntry
from spotguard.checkpoint.local.commit import LocalWriter
from spotguard.storage.file import fsync_file


class FolderError(ValueError):
    """A framework's checkpoint folder cannot be committed as it is."""


def folder_files(folder: Path, exclude: Sequence[str] = ()) -> list[str]:
    """Relative POSIX paths of the regular files under ``folder``, sorted;
    a path matching a glob in ``exclude`` (on the relative path or the file
    name) is left out. Raises :class:`FolderError` for a missing folder or a
    file named ``manifest.json`` at its top (spotguard's own name)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FolderError(f"checkpoint folder {folder} does not exist")
    out: list[str] = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in files:
            rel = (Path(root) / name).relative_to(folder).as_posix()
            if any(fnmatch.fnmatch(rel, g) or fnmatch.fnmatch(name, g) for g in exclude):
                continue
            if not (Path(root) / name).is_file():
                continue  # a dangling link, a socket
            out.append(rel)
    if MANIFEST_NAME in out:
        raise FolderError(f"{folder}/{MANIFEST_NAME}: a framework file with the name of spotguard's manifest")
    return sorted(out)


def link_or_copy(src: Path, dst: Path) -> None:
    """Put ``src``'s contents at ``dst``: a hard link where possible, else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst, follow_symlinks=True)
    except OSError:
        shutil.copyfile(src, dst)


def checksum_linked(writer: LocalWriter, names: Iterable[str]) -> None:
    """Phase two of a commit, off the training thread: checksum each file
    linked into ``writer``'s temporary directory and, for a durable
    checkpoint, flush it to disk (frameworks write without fsync)."""
    for rel in names:
        writer.add_written(rel)
        if writer.durable:
            fsync_file(writer.tmp / rel)


def node_files(
    gathered: Iterable[tuple[int, Sequence[tuple[str, int, str]] | None]], node: int
) -> tuple[list[FileEntry], list[str]]:
    """Pure: which files ``node`` lists in its part of a distributed checkpoint.

    ``gathered`` holds every node's ``(node, [(path, size, checksum), ...])``
    (None for a node that could not read its folder). A file every node must
    load is often written by one rank only (the Trainer's model, Lightning's
    ``.ckpt``) and then present on one node; on a shared file system, or with
    ``save_on_each_node``, several nodes hold it: the lowest node lists it,
    the others leave it out (it is fetched whole on resume). Returns this
    node's entries and the paths it must drop; raises :class:`FolderError`
    when two nodes hold different contents at one path.
    """
    first: dict[str, tuple[int, int, str]] = {}
    for n, entries in sorted(gathered, key=lambda item: item[0]):
        for path, size, checksum in entries or ():
            seen = first.get(path)
            if seen is None:
                first[path] = (n, size, checksum)
            elif (seen[1], seen[2]) != (size, checksum):
                raise FolderError(
                    f"{path}: nodes {seen[0]} and {n} wrote different contents at one path; "
                    "a framework file must be identical wherever it is written"
                )
    mine: list[FileEntry] = []
    drop: list[str] = []
    for n, entries in gathered:
        if n != node:
            continue
        for path, size, checksum in entries or ():
            if first[path][0] == node:
                mine.append(FileEntry(path, size, checksum))
            else:
                drop.append(path)
    return sorted(mine, key=lambda e: e.path), sorted(drop)


def entries_json(entries: Iterable[FileEntry]) -> list[tuple[str, int, str]]:
    """Entries as plain tuples (for a gather between ranks)."""
    return [(e.path, e.size, e.checksum) for e in entries]


def metrics_of(metrics: Mapping[str, object] | None) -> dict[str, float] | None:
    """The numeric metrics a framework reports, as a manifest takes them
    (non-finite and non-numeric values left out)."""
    if not metrics:
        return None
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool | str):
            continue
        if not isinstance(value, int | float):
            try:
                value = float(value)  # type: ignore[arg-type]  # a 0-d tensor
            except (TypeError, ValueError):
                continue
        value = float(value)
        if value == value and value not in (float("inf"), float("-inf")):
            out[str(key)] = value
    return out or None
