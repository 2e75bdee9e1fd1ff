"""Splitting checkpoint files into content-addressed chunks (pure planning and hashing).

A checkpoint stored incrementally keeps each file as a sequence of chunks
named by the SHA-256 of their bytes, shared by every checkpoint of the job
that has the same bytes. For that sharing to happen, an unchanged tensor must
give the same chunks from one save to the next, wherever it sits in the file
and whatever changed around it. So chunk boundaries follow the file's own
layout where the format declares one:

- ``.safetensors``: the header, then every tensor's bytes (the header gives
  each tensor's offsets);
- a zip archive (what ``torch.save`` writes: ``.pt``, ``.bin``, Lightning's
  ``.ckpt``): every stored entry's bytes (a tensor storage each), and the
  local headers between them, whose padding depends on the entry's offset;
- a ``torch.distributed.checkpoint`` data file (``.distcp``): every item DCP
  wrote into it (one ``torch.save`` archive each, back to back, at the
  offsets its metadata records), found from the file's end backwards by each
  archive's end records, so a node needs no other node's metadata: an item
  whose tensor did not change is the same bytes wherever DCP put it;
- anything else: fixed offsets from the start of the file.

A region of at least :data:`MIN_CHUNK` bytes starts a chunk of its own and is
cut into pieces of at most :data:`MAX_CHUNK`, counted from the region's
start, so a frozen tensor always yields the same chunks. Smaller regions are
grouped with their neighbours up to :data:`MIN_CHUNK`, so a model with
thousands of small tensors does not become thousands of objects; a change to
a small tensor costs at most one such group.

Why SHA-256 names: two different chunks must never share a name, or a
checkpoint would silently load another's bytes. SHA-256's collision
resistance (2^128 work) makes an accidental collision impossible in practice
and a deliberate one infeasible; it is in the standard library, hardware
accelerated on current x86 (SHA-NI) and ARM CPUs, and the hash S3 itself
offers for additional checksums. CRC32C (32 bits) names nothing: among a
million chunks two would share a CRC32C with probability about 10^-4. It is
still recorded per chunk, because the store checks it on receipt and keeps
it, which verifies a chunk without reading it back. ``bench/incremental.py``
measures both hashes' speeds.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import google_crc32c

from spotguard.checkpoint.format.manifest import ChunkRef

MAX_CHUNK = 16 << 20
MIN_CHUNK = 1 << 20
_SAFETENSORS_MAX_HEADER = 100 << 20
_ZIP_LOCAL_HEADER = 30
_ZIP_EOCD = 22
_ZIP64_LOCATOR = 20
_ZIP64_EOCD = 56
#: Items of one DCP data file beyond which it is chunked at fixed offsets.
_MAX_ITEMS = 1 << 20


def hash_chunk(data: bytes | memoryview) -> ChunkRef:
    """The chunk reference of ``data``: SHA-256 name, size, CRC32C."""
    return ChunkRef(hashlib.sha256(data).hexdigest(), len(data), f"{google_crc32c.value(data):08x}")


def group_regions(
    regions: Sequence[tuple[int, int]], size: int, *, max_chunk: int = MAX_CHUNK, min_chunk: int = MIN_CHUNK
) -> list[tuple[int, int]]:
    """Chunks ``(offset, length)`` covering ``[0, size)`` given the file's
    layout: ``regions`` are the ``(start, end)`` byte ranges the format
    declares (tensors, archive entries), in any order; the bytes between them
    become regions too. Pure; see the module doc for the rule. Overlapping or
    out-of-range regions fall back to fixed offsets."""
    ordered = sorted(regions)
    spans: list[tuple[int, int]] = []
    at = 0
    for start, end in ordered:
        if start < at or end < start or end > size:
            return fixed_chunks(size, max_chunk)
        if start > at:
            spans.append((at, start))
        if end > start:
            spans.append((start, end))
        at = end
    if at < size:
        spans.append((at, size))
    chunks: list[tuple[int, int]] = []
    group_start, group_end = 0, 0
    for start, end in spans:
        if end - start >= min_chunk:
            if group_end > group_start:
                chunks.append((group_start, group_end - group_start))
            for offset in range(start, end, max_chunk):
                chunks.append((offset, min(max_chunk, end - offset)))
            group_start = group_end = end
            continue
        if group_end - group_start + (end - start) > min_chunk and group_end > group_start:
            chunks.append((group_start, group_end - group_start))
            group_start = start
        group_end = end
    if group_end > group_start:
        chunks.append((group_start, group_end - group_start))
    return chunks


def fixed_chunks(size: int, max_chunk: int = MAX_CHUNK) -> list[tuple[int, int]]:
    """Chunks at fixed offsets: ``[0, max_chunk)``, ``[max_chunk, 2 max_chunk)``, ..."""
    return [(offset, min(max_chunk, size - offset)) for offset in range(0, size, max_chunk)]


def safetensors_regions(head: bytes, size: int) -> list[tuple[int, int]] | None:
    """The header and every tensor's byte range of a safetensors file, from its
    first bytes (``head`` must hold the whole header); None when ``head`` is
    not a safetensors header."""
    if len(head) < 8:
        return None
    (length,) = struct.unpack("<Q", head[:8])
    if length > _SAFETENSORS_MAX_HEADER or 8 + length > min(size, len(head)):
        return None
    try:
        header = json.loads(head[8 : 8 + length])
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    base = 8 + length
    regions = [(0, base)]
    for key, info in header.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return None
        regions.append((base + offsets[0], base + offsets[1]))
    return regions


def zip_regions(path: Path, size: int) -> list[tuple[int, int]] | None:
    """The byte range of every stored entry's data in a zip archive (as
    ``torch.save`` writes them); None when it is not a readable zip."""
    try:
        with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
            regions = []
            for info in archive.infolist():
                raw.seek(info.header_offset)
                local = raw.read(_ZIP_LOCAL_HEADER)
                if len(local) < _ZIP_LOCAL_HEADER or local[:4] != b"PK\x03\x04":
                    return None
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                start = info.header_offset + _ZIP_LOCAL_HEADER + name_len + extra_len
                regions.append((start, start + info.compress_size))
            return regions
    except (OSError, zipfile.BadZipFile, ValueError, struct.error):
        return None


def distcp_regions(path: Path, size: int) -> list[tuple[int, int]] | None:
    """Every item's byte range in a DCP data file: ``torch.save`` archives
    written back to back (each ends with zip64 end records: the end of
    central directory, its locator, its zip64 record). Read from the end: an
    archive's end records give its central directory's size and offset from
    the archive's start, hence the start, which is where the item before it
    ends. A few small reads per item; None when the file is not such a
    sequence (an item of another kind, a comment, a damaged record)."""
    regions: list[tuple[int, int]] = []
    tail_len = _ZIP64_EOCD + _ZIP64_LOCATOR + _ZIP_EOCD
    try:
        with open(path, "rb") as f:
            end = size
            while end > 0:
                if end < _ZIP_LOCAL_HEADER + tail_len or len(regions) >= _MAX_ITEMS:
                    return None
                f.seek(end - tail_len)
                tail = f.read(tail_len)
                record, locator, eocd = tail[:_ZIP64_EOCD], tail[_ZIP64_EOCD:-_ZIP_EOCD], tail[-_ZIP_EOCD:]
                if eocd[:4] != b"PK\x05\x06" or eocd[20:22] != b"\0\0":
                    return None
                if locator[:4] != b"PK\x06\x07" or record[:4] != b"PK\x06\x06":
                    return None
                (record_len,) = struct.unpack("<Q", record[4:12])
                cd_size, cd_offset = struct.unpack("<QQ", record[40:56])
                (record_at,) = struct.unpack("<Q", locator[8:16])
                record_pos = end - tail_len
                start = record_pos - cd_size - cd_offset
                if record_len != _ZIP64_EOCD - 12 or start < 0 or record_at != record_pos - start:
                    return None
                f.seek(start)
                if f.read(4) != b"PK\x03\x04":
                    return None
                regions.append((start, end))
                end = start
    except (OSError, struct.error):
        return None
    regions.reverse()
    return regions


def plan_file(path: Path, *, max_chunk: int = MAX_CHUNK, min_chunk: int = MIN_CHUNK) -> list[tuple[int, int]]:
    """The chunks ``(offset, length)`` of a local file (see the module doc)."""
    size = path.stat().st_size
    regions: list[tuple[int, int]] | None = None
    if size >= 8:
        with open(path, "rb") as f:
            head = f.read(8)
            if path.suffix == ".safetensors":
                # The header's own length, not the largest a header may be: a 14 GiB file's plan reads its
                # header (kilobytes), not its first 100 MiB.
                need = safetensors_head_size(head)
                if need is not None and need > 8:
                    head += f.read(min(size, need) - 8)
        if path.suffix == ".safetensors":
            return plan_safetensors(head, size, max_chunk=max_chunk, min_chunk=min_chunk)
        if path.suffix == ".distcp":
            regions = distcp_regions(path, size)
        elif head[:4] == b"PK\x03\x04":
            regions = zip_regions(path, size)
    if regions is None:
        return fixed_chunks(size, max_chunk)
    return group_regions(regions, size, max_chunk=max_chunk, min_chunk=min_chunk)


def safetensors_head_size(first: bytes) -> int | None:
    """Pure: how many bytes of a safetensors file hold its header (the 8-byte length and the header), from
    its first 8 bytes; None when they cannot start one."""
    if len(first) < 8:
        return None
    (length,) = struct.unpack("<Q", first[:8])
    return 8 + length if length <= _SAFETENSORS_MAX_HEADER else None


def plan_safetensors(
    head: bytes, size: int, *, max_chunk: int = MAX_CHUNK, min_chunk: int = MIN_CHUNK
) -> list[tuple[int, int]]:
    """Pure: the chunks of a ``.safetensors`` file of ``size`` bytes from its first bytes (``head``, the
    whole header): what :func:`plan_file` gives once the file is complete, known as soon as its header is
    written (:mod:`spotguard.sidecar.follow` hashes and sends the chunks of a file being written)."""
    regions = safetensors_regions(head, size)
    if regions is None:
        return fixed_chunks(size, max_chunk)
    return group_regions(regions, size, max_chunk=max_chunk, min_chunk=min_chunk)


def read_range(fd: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` of an open file (raises on a short file)."""
    parts: list[bytes] = []
    while length:
        data = os.pread(fd, length, offset)
        if not data:
            raise OSError(f"file ended {length} bytes early")
        parts.append(data)
        offset += len(data)
        length -= len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def iter_file_chunks(path: Path) -> Iterator[tuple[ChunkRef, bytes]]:
    """Each chunk of a local file with its bytes, in order."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, length in plan_file(path):
            data = read_range(fd, offset, length)
            yield hash_chunk(data), data
    finally:
        os.close(fd)


__all__ = [
    "MAX_CHUNK",
    "MIN_CHUNK",
    "distcp_regions",
    "fixed_chunks",
    "group_regions",
    "hash_chunk",
    "iter_file_chunks",
    "plan_file",
    "plan_safetensors",
    "read_range",
    "safetensors_head_size",
    "safetensors_regions",
    "zip_regions",
]
