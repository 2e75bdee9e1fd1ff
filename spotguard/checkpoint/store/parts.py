"""Distributed checkpoints in storage: part manifests and the global commit.

A distributed checkpoint is uploaded part by part (one part per node): each
uploader stores its part's data files, verifies them in storage, then stores
the part manifest as ``ckpt-<step>/parts/<i:05d>.json``, then tries the
global commit (:func:`commit_global`): whoever finds every part present
writes ``ckpt-<step>/manifest.json``, built from the part manifests alone
(so racing uploaders produce the same bytes), with a conditional put.

The same part manifests explain a prefix that is not a checkpoint yet (which
parts are present, which are missing), name the part a damaged file belongs
to, and check that a global manifest is what its parts make: verification
(:mod:`~spotguard.checkpoint.store.verify_stored`) and restore
(:mod:`~spotguard.checkpoint.restore.load`) report through them. Uploading a part
is :mod:`~spotguard.checkpoint.store.upload`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from spotguard.checkpoint.format.manifest import (
    MANIFEST_NAME,
    PARTS_DIR,
    Manifest,
    ManifestError,
    parse_manifest,
    parse_part_manifest_path,
    part_manifest_path,
)
from spotguard.checkpoint.store.global_manifest import build_global_manifest
from spotguard.checkpoint.store.intents import UPLOADS_DIR
from spotguard.checkpoint.store.stored import read_manifest
from spotguard.storage.base import NotFoundError, PreconditionFailedError, Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GlobalCommit:
    """What :func:`commit_global` found or did.

    ``status``: ``written`` (this call wrote the global manifest), ``exists``
    (it was there already, or another uploader won the race), ``waiting``
    (parts are missing, or the stored parts do not make one checkpoint:
    ``problem`` says why). ``present``: part indices found; ``total``: the
    number of parts (None when no part could be read); ``missing``: indices
    not found.
    """

    status: str
    present: list[int]
    total: int | None
    missing: list[int]
    problem: str | None = None

    @property
    def committed(self) -> bool:
        """The global manifest is in storage."""
        return self.status in ("written", "exists")


def read_parts(storage: Storage, name: str) -> tuple[dict[int, tuple[bytes, Manifest]], list[str]]:
    """The part manifests stored below ``name/parts/``: each readable one by
    part index (its bytes and parsed form), and a problem for each that is
    not (unparsable, another step, a part manifest stored under the wrong
    index)."""
    parts: dict[int, tuple[bytes, Manifest]] = {}
    problems: list[str] = []
    prefix = f"{name}/{PARTS_DIR}/"
    for info in sorted(storage.list_objects(prefix), key=lambda o: o.key):
        rel = info.key[len(f"{name}/") :]
        index = parse_part_manifest_path(rel)
        if index is None:
            continue
        try:
            data = storage.read_bytes(info.key)
        except NotFoundError:
            continue  # deleted meanwhile
        try:
            manifest = parse_manifest(data, expected_name=name)
        except ManifestError as exc:
            problems.append(f"{rel}: {exc}")
            continue
        if manifest.sharding is None or manifest.sharding.part != index:
            problems.append(f"{rel}: not the manifest of part {index}")
            continue
        parts[index] = (data, manifest)
    return parts, problems


def _parts_total(parts: dict[int, tuple[bytes, Manifest]]) -> int | None:
    """The number of parts the stored part manifests declare (part 0's, else the lowest's)."""
    if not parts:
        return None
    sharding = parts[min(parts)][1].sharding
    return sharding.parts if sharding is not None else None


def commit_global(storage: Storage, name: str) -> GlobalCommit:
    """Write the global manifest of distributed checkpoint ``name`` if every
    part manifest is in storage and none is there yet.

    Part manifests are stored only after their part's data files are stored
    and verified, so when all are present the checkpoint is complete. The
    global manifest is :func:`build_global_manifest` of them (a pure function
    of their bytes) and is written with a conditional put (``If-None-Match:
    *``): of uploaders racing, one writes it and the others get ``exists``;
    all would have written the same bytes. Storage errors propagate.
    """
    key = f"{name}/{MANIFEST_NAME}"
    if storage.stat(key) is not None:
        return existing_commit(storage, name)
    parts, problems = read_parts(storage, name)
    present = sorted(parts)
    total = _parts_total(parts)
    missing = [i for i in range(total) if i not in parts] if total is not None else []
    if total is None or missing or problems:
        return GlobalCommit("waiting", present, total, missing, "; ".join(problems) or None)
    try:
        manifest = build_global_manifest(parts.values())
    except ManifestError as exc:
        # Typically a part left by an earlier attempt at the same step; its
        # uploader replaces it when it ships the part again.
        log.warning("cannot commit %s yet: %s", storage.uri_for(name), exc)
        return GlobalCommit("waiting", present, total, missing, str(exc))
    try:
        storage.write_bytes(key, manifest.to_json(), if_none_match=True)
    except PreconditionFailedError:
        return GlobalCommit("exists", present, total, [])
    log.info("committed %s: all %d part(s) present, global manifest written", storage.uri_for(name), total)
    return GlobalCommit("written", present, total, [])


def existing_commit(storage: Storage, name: str) -> GlobalCommit:
    """The :class:`GlobalCommit` of a checkpoint whose global manifest is in storage already."""
    try:
        manifest = read_manifest(storage, name)
    except (NotFoundError, ManifestError):
        return GlobalCommit("exists", [], None, [])
    total = manifest.sharding.parts if manifest.sharding is not None else 1
    return GlobalCommit("exists", list(range(total)), total, [])


def missing_manifest_problems(storage: Storage, name: str) -> tuple[list[str], list[int] | None, int | None]:
    """Why a prefix without ``manifest.json`` is not a checkpoint: an
    interrupted upload, or a distributed checkpoint whose parts are not all
    there (which ones are, which are missing). Also the parts present and total."""
    parts, problems = read_parts(storage, name)
    if not parts and not problems:
        return [f"{MANIFEST_NAME}: missing (upload incomplete or interrupted)"], None, None
    total = _parts_total(parts)
    present = sorted(parts)
    if total is None:
        return [f"{MANIFEST_NAME}: missing; no readable part manifest", *problems], present, None
    missing = [i for i in range(total) if i not in parts]
    line = f"{MANIFEST_NAME}: missing; parts present: {len(present)} of {total}"
    if present:
        line += f" ({_indices('part', present)})"
    if missing:
        line += f"; missing {_indices('part', missing)}"
    else:
        line += "; not committed yet"
        if not problems:
            try:
                build_global_manifest(parts.values())
            except ManifestError as exc:
                problems = [f"parts do not make one checkpoint: {exc}"]
    return [line, *problems], present, total


def _indices(word: str, values: list[int]) -> str:
    shown = ", ".join(str(v) for v in values[:16]) + (", ..." if len(values) > 16 else "")
    return f"{word}{'s' if len(values) > 1 else ''} {shown}"


def _part_of_files(storage: Storage, name: str) -> dict[str, int]:
    """Which part lists each file, from the stored part manifests (those readable)."""
    owners: dict[str, int] = {}
    parts, _ = read_parts(storage, name)
    for index, (_, manifest) in parts.items():
        for entry in manifest.files:
            owners[entry.path] = index
        owners[part_manifest_path(index)] = index
    return owners


def name_parts(storage: Storage, name: str, manifest: Manifest, problems: list[str]) -> list[str]:
    """Problems of a distributed checkpoint's files, each followed by the part
    it belongs to (the part whose manifest lists the file)."""
    if manifest.sharding is None or not problems:
        return problems
    owners = _part_of_files(storage, name)
    for entry in manifest.files:
        index = parse_part_manifest_path(entry.path)
        if index is not None:
            owners.setdefault(entry.path, index)
    out: list[str] = []
    for problem in problems:
        path = next((p for p in sorted(owners, key=len, reverse=True) if problem.startswith(f"{p}: ")), None)
        if path is None:
            out.append(problem)
        elif parse_part_manifest_path(path) is not None:
            out.append(f"{problem} (manifest of part {owners[path]})")
        else:
            out.append(f"{problem} (part {owners[path]})")
    return out


def check_against_parts(storage: Storage, name: str, manifest: Manifest) -> list[str]:
    """A global manifest must be what its (verified) part manifests make: the
    same files and sharding. Reads the part manifests (small)."""
    parts, problems = read_parts(storage, name)
    if problems:
        return problems
    try:
        expected = build_global_manifest(parts.values())
    except ManifestError as exc:
        return [f"{PARTS_DIR}/: {exc}"]
    if expected.sharding != manifest.sharding or set(expected.files) != set(manifest.files):
        extra = sorted({f.path for f in manifest.files} - {f.path for f in expected.files})
        return [
            f"{MANIFEST_NAME}: does not match the part manifests"
            + (f" (lists {extra[0]!r}, which no part lists)" if extra else "")
        ]
    return []


def commit_progress(storage: Storage, name: str) -> tuple[int, int, float]:
    """What storage shows of distributed checkpoint ``name`` while a part waits
    for the others: the objects and bytes below its prefix (other nodes' data
    files and part manifests), and when a live upload of it last said so (its
    intent's heartbeat, :mod:`~spotguard.checkpoint.store.intents`: an incremental
    part stores its chunks elsewhere). Any change between two looks means
    another node is still getting its part there. Storage errors propagate."""
    count = size = 0
    for info in storage.list_objects(f"{name}/"):
        count += 1
        size += info.size
    beat = max((info.modified for info in storage.list_objects(f"{UPLOADS_DIR}/{name}.")), default=0.0)
    return count, size, beat


__all__ = [
    "GlobalCommit",
    "check_against_parts",
    "commit_global",
    "commit_progress",
    "existing_commit",
    "missing_manifest_problems",
    "name_parts",
    "read_parts",
]
