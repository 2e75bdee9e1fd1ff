"""Downloading a checkpoint's files and checking them in the same pass.

A restore used to download every file, fsync it, and then read it back from
disk to compare it with the manifest: three passes over the bytes, two of
them serial after the download (about a third of a restore's time on a busy
machine). Here each file is checked while it streams in: the bytes that are
written are the bytes that are checksummed, so the copy on disk matches the
manifest exactly when the stream did (short of a disk that corrupts what it
was given, which is what the re-verification before any reuse is for).

The files are not fsynced: a restored copy is a cache of storage, and every
reader verifies a local checkpoint before using it (``restore_checkpoint``
before reusing one, ``Checkpointer.restore`` before loading one), so a copy
torn by a crash is detected and fetched again, never loaded.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from spotguard.checkpoint.manifest import Manifest
from spotguard.checkpoint.verify import verify_files
from spotguard.storage.base import ProgressCallback, Storage

DEFAULT_WORKERS = 2  # files at once; each already fetches several ranges concurrently


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(fd, view) :]


def fetch_verified(
    storage: Storage,
    name: str,
    manifest: Manifest,
    sizes: Mapping[str, int],
    dest: Path,
    *,
    workers: int = DEFAULT_WORKERS,
    progress: ProgressCallback | None = None,
) -> list[str]:
    """Download the files of checkpoint ``name`` listed in ``manifest`` into
    ``dest`` (relative paths kept), checking size, checksum and pickle safety
    of each as it streams in; returns the problems ("<file>: <reason>"),
    empty when every file matches.

    ``sizes`` maps each file present in storage to its size (from a listing):
    a missing or wrongly sized file is reported without downloading it. Files
    with problems may be left partly written: ``dest`` is a temporary
    directory the caller removes. Storage errors other than a missing object
    propagate (a network failure must not make a good checkpoint look
    broken).
    """
    dest = Path(dest)
    lock = threading.Lock()  # files stream in on several threads; the callback sees one at a time

    def read_chunks(path: str) -> Iterator[bytes]:
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for chunk in storage.iter_chunks(f"{name}/{path}"):
                _write_all(fd, chunk)
                if progress is not None:
                    with lock:
                        progress(len(chunk))
                yield chunk
        finally:
            os.close(fd)

    reader: Callable[[str], Iterator[bytes]] = read_chunks
    problems, _ = verify_files(manifest, sizes, reader, checksums=True, workers=workers)
    return problems


__all__ = ["fetch_verified"]
