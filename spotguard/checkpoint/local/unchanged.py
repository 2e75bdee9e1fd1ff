"""Chunks of a new checkpoint told apart from the previous one's without hashing them (:class:`Unchanged`).

Used by :func:`~spotguard.checkpoint.store.chunked.upload_chunks`: equal bytes at
the same place as a chunk of the previous verified checkpoint take that
chunk's name from its manifest, at memory speed, instead of a SHA-256.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Mapping
from pathlib import Path

import google_crc32c

from spotguard.checkpoint.format.chunks import read_range
from spotguard.checkpoint.format.manifest import ChunkRef, FileEntry, Manifest
from spotguard.checkpoint.local.codec import StateError, TensorSpan, parse_safetensors_header, safetensors_header_end


class Unchanged:
    """Chunks of a new checkpoint told apart from the previous one's without hashing them.

    The previous checkpoint (``manifest``'s, verified in storage) is still
    on local disk beside the new one. A chunk of the new checkpoint at the
    same file, offset and length as one of the previous checkpoint's (its
    manifest says where each chunk is) is compared byte for byte with the
    previous local copy, at memory speed. When the bytes are equal and their
    CRC32C is the one the previous manifest records for that chunk, the
    chunk *is* that stored chunk: its SHA-256 name is taken from the manifest
    instead of being computed (SHA-256 runs at well under a GB/s per core;
    the comparison and CRC32C at several).

    Why this is as safe as hashing: equal bytes have the same SHA-256, so
    the name is exact as long as the previous local bytes are the bytes
    that were stored under it. The CRC32C check covers a previous local copy
    damaged on disk since it was uploaded (equal to the new bytes but no
    longer to the stored chunk: its CRC32C would differ). Nothing here relies
    on version counters or on ``requires_grad``; any byte that changed is
    seen. "The same place" is the same file and offset, or the same pieces of
    the same tensors of the same state part (a tensor that moved into the
    part's ``.kept`` file when it stopped changing). A chunk the previous
    checkpoint does not have in the same place, or whose stored copy is
    suspect, is hashed as before.

    A file that *is* the previous checkpoint's (the trainer linked it, its
    tensors unchanged: :meth:`linked`) is not even read: the same inode holds
    the same bytes, which were chunked, hashed and stored with that
    checkpoint. Should one of its chunks be missing from storage, its bytes
    are read and hashed before they are sent again. Such a file with the same
    size and checksum takes its chunk list whole (:meth:`linked_file`): one
    step for the file, not one per chunk, and not a read of its layout.
    """

    def __init__(self, local_dir: Path, manifest: Manifest | None, stored: Mapping[str, int]) -> None:
        """``manifest``: the previous verified checkpoint's (None: every chunk is hashed);
        ``stored``: the chunks known stored (digest -> size), the only ones taken."""
        self.directory: Path | None = None
        self._files: dict[str, FileEntry] = {}
        self._at: dict[tuple[str, int, int], ChunkRef] = {}
        self._same_file: dict[str, bool] = {}
        self._lock = threading.Lock()
        source = manifest.name if manifest is not None else None
        if manifest is None or source is None or source == local_dir.name:
            return
        directory = local_dir.parent / source
        if not (directory / "manifest.json").is_file():
            return  # pruned locally, or never here: every chunk is hashed
        # The same chunks by the tensor pieces they hold (part, then (tensor, start, end) each): tensors
        # that moved to another file of their part (``<part>.kept.safetensors``) still have their chunks.
        self._in_tensor: dict[tuple[str, Pieces], tuple[str, int, ChunkRef]] = {}
        for entry in manifest.files:
            spans = _spans(directory / entry.path) if entry.path.endswith(".safetensors") else []
            offset = 0
            for ref in entry.chunks or ():
                if stored.get(ref.hash) == ref.size:
                    self._at[(entry.path, offset, ref.size)] = ref
                    pieces = _pieces(spans, offset, ref.size)
                    if pieces is not None:
                        self._in_tensor[(_part_of(entry.path), pieces)] = (entry.path, offset, ref)
                offset += ref.size
        self.directory = directory
        self._files = {entry.path: entry for entry in manifest.files if entry.chunks is not None}
        self._new_spans: dict[str, list[TensorSpan]] = {}
        self._new_dir = local_dir

    def linked(self, local_dir: Path, path: str, offset: int, length: int) -> ChunkRef | None:
        """The previous checkpoint's chunk at this place when the file *is* the previous
        checkpoint's (a hard link: the trainer did not write it again): no byte is read."""
        ref = self._at.get((path, offset, length))
        if ref is None or self.directory is None:
            return None
        return ref if self._is_linked(local_dir, path) else None

    def linked_file(self, local_dir: Path, entry: FileEntry) -> tuple[ChunkRef, ...] | None:
        """The previous checkpoint's chunks of file ``entry``, whole, when the file *is* the
        previous checkpoint's (a hard link) with the same size and checksum; None otherwise (its
        chunks are then planned and taken one by one). No byte is read, not even to plan its chunks:
        the same bytes were chunked when that checkpoint was made, and its verified manifest's list
        of them (whose sizes add up to the file's, whose CRC32Cs combine to its checksum) is theirs."""
        before = self._files.get(entry.path)
        if before is None or before.chunks is None or (before.size, before.checksum) != (entry.size, entry.checksum):
            return None
        if sum(ref.size for ref in before.chunks) != entry.size:
            return None
        return before.chunks if self._is_linked(local_dir, entry.path) else None

    def _is_linked(self, local_dir: Path, path: str) -> bool:
        """Whether the local file ``path`` is the previous checkpoint's (the same inode)."""
        assert self.directory is not None
        same = self._same_file.get(path)
        if same is None:
            try:
                same = os.path.samefile(local_dir / path, self.directory / path)
            except OSError:
                same = False
            self._same_file[path] = same
        return same

    def match(self, path: str, offset: int, data: bytes) -> ChunkRef | None:
        """The previous checkpoint's chunk with exactly these bytes at this place (the same file
        and offset, or the same part, tensor and offset in it), or None."""
        if self.directory is None:
            return None
        was: tuple[str, int, ChunkRef] | None = None
        ref = self._at.get((path, offset, len(data)))
        if ref is not None:
            was = (path, offset, ref)
        elif path.endswith(".safetensors"):
            with self._lock:
                spans = self._new_spans.get(path)
                if spans is None:
                    spans = self._new_spans[path] = _spans(self._new_dir / path)
            pieces = _pieces(spans, offset, len(data))
            if pieces is not None:
                was = self._in_tensor.get((_part_of(path), pieces))
        if was is None:
            return None
        file, at, ref = was
        try:
            fd = os.open(self.directory / file, os.O_RDONLY)
            try:
                before = read_range(fd, at, len(data))
            finally:
                os.close(fd)
        except OSError:
            return None  # removed meanwhile: hashed instead
        if before != data or f"{google_crc32c.value(data):08x}" != ref.checksum:
            return None
        return ref


def _spans(path: Path) -> list[TensorSpan]:
    """The tensors of a local safetensors file by their byte ranges ([] when it cannot be read as one)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            end = safetensors_header_end(f.read(8), size)
            return parse_safetensors_header(f.read(end - 8), size)
    except (OSError, StateError):
        return []


Pieces = tuple[tuple[str, int, int], ...]


def _pieces(spans: list[TensorSpan], offset: int, length: int) -> Pieces | None:
    """Pure: what ``[offset, offset + length)`` of a safetensors file holds, as tensor pieces
    ``(tensor, start, end)`` (offsets inside the tensor), or None when it holds anything else
    (the header)."""
    end = offset + length
    i = bisect.bisect_right([s.start for s in spans], offset) - 1
    if length <= 0 or i < 0:
        return None
    out = []
    at = offset
    while at < end:
        if i >= len(spans) or not spans[i].start <= at < spans[i].end:
            return None
        span = spans[i]
        stop = min(end, span.end)
        out.append((span.key, at - span.start, stop - span.start))
        at, i = stop, i + 1
    return tuple(out)


def _part_of(path: str) -> str:
    """Pure: the state part a tensor file holds (``model.kept.safetensors`` -> ``model``)."""
    return path.removesuffix(".safetensors").removesuffix(".kept")
