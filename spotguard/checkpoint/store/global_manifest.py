"""The global manifest of a distributed checkpoint, built from its part manifests.

Each node of a distributed checkpoint stores its own part manifest
(``parts/<i:05d>.json``); whoever finds every part present writes the global
``manifest.json``. :func:`build_global_manifest` is that computation: pure and
deterministic, so racing uploaders write the same bytes, and strict, so parts
that do not make one checkpoint are refused with the part named. The manifest
format itself (parsing, validation, the part manifests' own rules) is
:mod:`~spotguard.checkpoint.format.manifest`'s; storing parts and the global commit
are :mod:`~spotguard.checkpoint.store.parts`'.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from spotguard.checkpoint.format.manifest import (
    FORMAT_VERSION_CHUNKED,
    FORMAT_VERSION_SHARDED,
    PARTS_DIR,
    FileEntry,
    Manifest,
    ManifestError,
    Sharding,
    parse_manifest,
    part_manifest_path,
)
from spotguard.storage.checksum import checksum_bytes


def build_global_manifest(parts: Iterable[tuple[bytes, Manifest]]) -> Manifest:
    """The global manifest of a distributed checkpoint from its part manifests.

    ``parts`` holds each part manifest's bytes (as stored in
    ``parts/<i>.json``) and its parsed form, in any order. The result is a
    pure, deterministic function of those bytes, so two uploaders that find
    every part present write byte-identical manifests: its files are every
    part's files (part 0's first, in manifest order) followed by one entry per
    ``parts/<i:05d>.json`` (size and checksum of the part manifest's bytes);
    step, epoch, metrics, job, attempt, reason, request_id, writer, timing
    and the checksum algorithm come from part 0; ``created`` is the latest of
    the parts'. Parts stored as chunks (version 3) make a global manifest of
    version 3: their files keep their chunks, the part manifests are whole.

    Raises :class:`ManifestError` naming the offending part when the parts do
    not make one checkpoint: not a part manifest, a part given twice or
    missing, disagreeing step, world size, part count or algorithm,
    overlapping ranks or ranks that do not cover ``0..world_size-1``, a file
    path listed by two parts, or a part listing a ``parts/`` path.
    """
    items = list(parts)
    if not items:
        raise ManifestError("no part manifests")
    by_index: dict[int, tuple[bytes, Manifest]] = {}
    for data, manifest in items:
        sh = manifest.sharding
        if sh is None or sh.part is None:
            raise ManifestError(f"manifest of step {manifest.step} is not a part manifest")
        if parse_manifest(data) != manifest:
            raise ManifestError(f"part {sh.part}: its bytes do not parse to the manifest given")
        if sh.part in by_index:
            raise ManifestError(f"part {sh.part}: given twice")
        by_index[sh.part] = (data, manifest)
    first = by_index[min(by_index)][1]
    assert first.sharding is not None
    world_size, count = first.sharding.world_size, first.sharding.parts
    for index in sorted(by_index):
        m = by_index[index][1]
        assert m.sharding is not None
        if m.step != first.step:
            raise ManifestError(f"part {index}: step {m.step}, but part {min(by_index)} has step {first.step}")
        if m.sharding.world_size != world_size:
            raise ManifestError(
                f"part {index}: world_size {m.sharding.world_size}, but part {min(by_index)} has {world_size}"
            )
        if m.sharding.parts != count:
            raise ManifestError(f"part {index}: {m.sharding.parts} parts, but part {min(by_index)} says {count}")
        if m.sharding.save_id != first.sharding.save_id:
            raise ManifestError(
                f"part {index} is from another save of step {m.step} (save {m.sharding.save_id}, "
                f"part {min(by_index)}'s is {first.sharding.save_id}); waiting for its node "
                "to ship this save's part"
            )
        if m.chunked != first.chunked:
            how = ("stored as chunks", "stored whole") if m.chunked else ("stored whole", "stored as chunks")
            raise ManifestError(f"part {index} is {how[0]}, but part {min(by_index)} is {how[1]}")
        if m.checksum_algorithm != first.checksum_algorithm:
            raise ManifestError(
                f"part {index}: checksum algorithm {m.checksum_algorithm}, "
                f"but part {min(by_index)} uses {first.checksum_algorithm}"
            )
    missing = [i for i in range(count) if i not in by_index]
    if missing:
        raise ManifestError(f"part(s) {', '.join(map(str, missing))} of {count} missing")
    rank_owner: dict[int, int] = {}
    path_owner: dict[str, int] = {}
    files: list[FileEntry] = []
    for index in range(count):
        m = by_index[index][1]
        assert m.sharding is not None
        for rank in m.sharding.ranks:
            if rank in rank_owner:
                raise ManifestError(f"part {index}: rank {rank} is also in part {rank_owner[rank]}")
            rank_owner[rank] = index
        for entry in m.files:
            if entry.path.split("/", 1)[0] == PARTS_DIR:
                raise ManifestError(
                    f"part {index}: file {entry.path!r} is inside {PARTS_DIR}/, where the part manifests go"
                )
            if entry.path in path_owner:
                raise ManifestError(f"part {index}: file {entry.path!r} is also in part {path_owner[entry.path]}")
            path_owner[entry.path] = index
            files.append(entry)
    uncovered = sorted(set(range(world_size)) - set(rank_owner))
    if uncovered:
        raise ManifestError(f"ranks {uncovered} of world_size {world_size} are in no part")
    algorithm = first.checksum_algorithm
    for index in range(count):
        data = by_index[index][0]
        files.append(FileEntry(part_manifest_path(index), len(data), checksum_bytes(data, algorithm)))
    head = by_index[0][1]
    created = max((by_index[i][1] for i in range(count)), key=lambda m: (m.created_at, m.created)).created
    manifest = replace(
        head,  # step, epoch, metrics, job, attempt, reason, request_id, writer, timing, algorithm
        files=tuple(files),
        created=created,
        format_version=FORMAT_VERSION_CHUNKED if first.chunked else FORMAT_VERSION_SHARDED,
        sharding=Sharding(
            world_size=world_size,
            parts=count,
            part=None,
            ranks=tuple(range(world_size)),
            save_id=first.sharding.save_id,
        ),
    )
    return parse_manifest(manifest.to_json())
