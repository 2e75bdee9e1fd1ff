"""Checkpoints in a local directory: atomic commit, listing, verification, loading.

A checkpoint is built in ``<dir>/.tmp-ckpt-<step>-<random>/``: every data
file is written (checksummed while it is written) and fsynced, then
``manifest.json`` is written and fsynced, the directory is fsynced, and it is
renamed to ``<dir>/ckpt-<step:012d>/`` (atomic on POSIX file systems). A
directory named ``ckpt-*`` with a ``manifest.json`` is therefore complete.
One that fails verification when its step is committed again is renamed to
``ckpt-<step>.refused-<UTC time>`` (never deleted; listings ignore it).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Unpack

from spotguard.checkpoint.format.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ManifestError,
    ManifestMeta,
    Sharding,
    checkpoint_name,
    new_manifest,
    parse_checkpoint_name,
    parse_manifest,
)
from spotguard.checkpoint.format.pickle_scan import PICKLE_SUFFIXES, UnsafePickleError, check_pickle_safe
from spotguard.checkpoint.format.verify import VerifyResult, verify_files
from spotguard.checkpoint.local.arena import Arena, linkable
from spotguard.checkpoint.local.codec import (
    KEPT_SUFFIX,
    STATE_FILE,
    Snapshot,
    StateError,
    TensorBlob,
    decode_state,
    drop_spent,
    iter_safetensors,
    load_safetensors,
    pool_committed,
    safetensors_header,
    written_size,
)
from spotguard.checkpoint.local.release import release_tree
from spotguard.checkpoint.local.reserve import MIN_BYTES as RESERVE_MIN_BYTES
from spotguard.checkpoint.local.reserve import give_back
from spotguard.checkpoint.local.reserve import take as take_reserve
from spotguard.storage.checksum import CHUNK, DEFAULT_ALGORITHM, check_algorithm, new_hasher
from spotguard.storage.file import fsync_dir, fsync_file

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
WRITER_TMP_PREFIX = ".tmp-ckpt-"
# A refused checkpoint moved aside: ``ckpt-<step>.refused-<UTC time>``.
REFUSED_MARK = ".refused-"
# A checkpoint committed into a staging directory of its own (memory): its files live in
# ``<staging>/.staged-ckpt-<step>-<random>/``, its name in the checkpoint directory is a link to them.
STAGED_PREFIX = ".staged-ckpt-"


class DeadlineExceeded(TimeoutError):
    """A checkpoint write was abandoned because its deadline passed."""


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


class LocalWriter:
    """Builds one checkpoint in a temporary directory and commits it atomically."""

    def __init__(
        self,
        directory: Path,
        step: int,
        *,
        algorithm: str = DEFAULT_ALGORITHM,
        deadline: float | None = None,
        durable: bool = True,
        tmp: Path | None = None,
        staging: Path | None = None,
    ) -> None:
        self.directory = Path(directory)
        # A directory on another (memory) file system that the uploader also
        # sees: the files are written and kept there, and the checkpoint's
        # name in ``directory`` is committed as a symbolic link to them
        # (:mod:`spotguard.checkpoint.local.staged`). For a preemption's save that
        # is not made durable: the write costs what a copy in memory costs.
        self.staging = Path(staging) if staging is not None else None
        self._held: Path | None = None
        self._link: Path | None = None
        # False: nothing is fsynced, neither data files nor the manifest nor
        # the directories. For an emergency save that an uploader ships at
        # once: the verified upload is what makes it durable, and waiting for
        # the disk would spend the grace period on a copy the node takes with
        # it. Once the data may be torn, a durable manifest protects nothing:
        # a crash leaves either no checkpoint (the rename was lost), or one
        # whose manifest or checksums fail and that is never loaded (local
        # checkpoints are verified with checksums before a restore). And the
        # manifest's fsync is the one that waits longest: it commits the
        # file system's journal, which may be busy freeing a pruned
        # checkpoint of several GiB.
        self.durable = durable
        self.step = step
        self.name = checkpoint_name(step)
        self.algorithm = check_algorithm(algorithm)
        self.deadline = deadline
        self.entries: list[FileEntry] = []
        self.directory.mkdir(parents=True, exist_ok=True)
        if tmp is None:
            home = self.directory if self.staging is None else self.staging
            home.mkdir(parents=True, exist_ok=True)
            self.tmp = home / f"{WRITER_TMP_PREFIX}{step:012d}-{uuid.uuid4().hex[:8]}"
            self.tmp.mkdir()
        else:
            # A temporary directory shared by the writers of one node (a
            # distributed checkpoint): every rank adds its own files to it,
            # one of them commits.
            self.tmp = Path(tmp)
            self.tmp.mkdir(exist_ok=True)
        self.bytes_written = 0
        self.bytes_linked = 0  # files linked from the previous checkpoint (not written)
        self.installed = False  # committed as this writer's own files (not an existing checkpoint kept)

    def _check_deadline(self) -> None:
        if self.deadline is not None and time.time() > self.deadline:
            raise DeadlineExceeded(f"checkpoint {self.name} not finished before its deadline")

    def add_file(self, path: str, chunks: Iterable[bytes | memoryview], size_hint: int = 0) -> FileEntry:
        """Write one data file (relative ``path``), checksumming as it goes. In
        a staging directory, a file of ``size_hint`` bytes or more is written
        into memory set aside there beforehand, when there is some
        (:mod:`spotguard.checkpoint.local.reserve`)."""
        target = self.tmp / path
        target.parent.mkdir(parents=True, exist_ok=True)
        hasher = new_hasher(self.algorithm)
        size = 0
        reserved = None
        if self.staging is not None and size_hint >= RESERVE_MIN_BYTES:
            reserved = take_reserve(self.staging, size_hint, target)
        if reserved is None:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        else:
            fd = os.open(target, os.O_WRONLY)  # its size is 0 and grows as it is written, as a new file's
        try:
            for chunk in chunks:
                self._check_deadline()
                hasher.update(chunk)  # a snapshot's memory, not copied (see Crc32cHasher)
                _write_all(fd, chunk)
                size += len(chunk)
            if reserved is not None:
                give_back(fd, size, reserved)
            if self.durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        entry = FileEntry(path=path, size=size, checksum=hasher.hexdigest())
        self.entries.append(entry)
        self.bytes_written += size
        return entry

    def add_bytes(self, path: str, data: bytes) -> FileEntry:
        """Write one small data file."""
        return self.add_file(path, [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""])

    def add_snapshot(self, snapshot: Snapshot, prefix: str = "") -> None:
        """Write a state snapshot: one safetensors file per part, then
        ``state.json`` (below ``prefix``, e.g. ``ranks/00001/``). A part's file of
        tensors unchanged since the previous committed checkpoint is linked from
        it when it is the same file there (:meth:`_link_kept`), not written again."""
        arenas = linkable(snapshot) if self.staging is not None and not prefix else {}
        for file, blobs in sorted(snapshot.tensors.items()):
            if file in arenas and self._link_arena(file, arenas[file]) is not None:
                continue
            if prefix or self._link_kept(file, blobs, snapshot) is None:
                self.add_file(prefix + file, iter_safetensors(blobs), size_hint=written_size(blobs))
        self.add_bytes(prefix + STATE_FILE, json.dumps(snapshot.doc, separators=(",", ":"), allow_nan=False).encode())

    def _link_arena(self, file: str, arena: Arena) -> FileEntry | None:
        """Make ``file`` by linking the arena that holds its bytes (:mod:`spotguard.checkpoint.local.arena`):
        nothing is written; the checksum is computed from the arena's memory. The link comes
        first, so an uploader that sends files while they are written may start at once.
        None when it cannot be linked (the file is then written)."""
        try:
            arena.link(self.tmp / file)
        except OSError as exc:
            log.warning("writing %s: its host buffers' arena could not be linked (%s)", file, exc)
            return None
        log.info("%s linked from its host buffers (%d bytes, nothing written)", file, arena.size)
        hasher = new_hasher(self.algorithm)
        for start in range(0, arena.size, CHUNK):
            self._check_deadline()
            hasher.update(arena.view(start, min(CHUNK, arena.size - start)))
        if self.durable:
            fsync_file(self.tmp / file)
        entry = FileEntry(path=file, size=arena.size, checksum=hasher.hexdigest())
        self.entries.append(entry)
        return entry

    def _link_kept(self, file: str, blobs: Mapping[str, TensorBlob], snapshot: Snapshot) -> FileEntry | None:
        """Hard-link ``file`` from the previous committed checkpoint when it is, byte for byte, the same.

        It is when every tensor in it is unchanged since the previous snapshot
        (compared byte for byte when the snapshot was taken), each was in that
        checkpoint at the same file and key, and the file there has the same
        safetensors header (so no other tensor, and the same offsets). Its
        checksum is then the one that checkpoint's manifest records. Anything
        else (another algorithm, a missing file, any error) writes the file.
        """
        if snapshot.previous is None or not file.endswith(KEPT_SUFFIX) or not blobs:
            return None
        places = snapshot.previous_places.get(file, {})
        if not all(b.unchanged for b in blobs.values()) or any(places.get(k) != (file, k) for k in blobs):
            return None
        previous = self.directory / snapshot.previous
        source = previous / file
        header, _ = safetensors_header(blobs)
        size = len(header) + sum(b.nbytes for b in blobs.values())
        target = self.tmp / file
        try:
            if manifest_stamp(previous) != snapshot.previous_stamp:
                return None  # not the copy the snapshot compared against (replaced since)
            manifest = read_local_manifest(previous)
            before = next((f for f in manifest.files if f.path == file), None)
            if before is None or before.size != size or manifest.checksum_algorithm != self.algorithm:
                return None
            with open(source, "rb") as f:
                if f.read(len(header)) != header or os.fstat(f.fileno()).st_size != size:
                    return None
            os.link(source, target)
            if self.durable:  # the previous copy may be an emergency save's, not fsynced
                fsync_file(target)
        except (OSError, ManifestError) as exc:
            log.debug("writing %s instead of linking it from %s: %s", file, snapshot.previous, exc)
            with contextlib.suppress(OSError):
                target.unlink()
            return None
        entry = FileEntry(path=file, size=size, checksum=before.checksum)
        self.entries.append(entry)
        self.bytes_linked += size
        return entry

    def add_written(self, path: str) -> FileEntry:
        """Record a data file another library already wrote into the
        temporary directory (checksummed by reading it back)."""
        hasher = new_hasher(self.algorithm)
        size = 0
        with open(self.tmp / path, "rb", buffering=0) as f:
            while chunk := f.read(CHUNK):
                self._check_deadline()
                hasher.update(chunk)
                size += len(chunk)
        entry = FileEntry(path=path, size=size, checksum=hasher.hexdigest())
        self.entries.append(entry)
        self.bytes_written += size
        return entry

    def commit(
        self,
        *,
        sharding: Sharding | None = None,
        entries: Iterable[FileEntry] | None = None,
        check_deadline: bool = True,
        **meta: Unpack[ManifestMeta],
    ) -> Path:
        """Write the manifest last, fsync, and rename into place; returns the
        committed directory. Committing a step that already exists keeps the
        existing checkpoint when it verifies; one that does not (it would be
        refused on restore) is moved aside (:func:`move_aside_refused`) and
        this one takes its place. ``entries`` (default: the files this writer
        wrote) and ``sharding`` describe the part of a distributed checkpoint."""
        if check_deadline:
            self._check_deadline()
        files = list(self.entries) if entries is None else sorted(entries, key=lambda e: e.path)
        manifest = new_manifest(self.step, files, self.algorithm, sharding=sharding, **meta)
        if self.durable:
            # Nested directories (dcp/, ranks/<r>/): their entries must be durable too.
            for sub in sorted({str(Path(f.path).parent) for f in files if "/" in f.path}, reverse=True):
                fsync_dir(self.tmp / sub)
            for sub in sorted({f.path.split("/", 1)[0] for f in files if f.path.count("/") > 1}):
                fsync_dir(self.tmp / sub)
        data = manifest.to_json()
        fd = os.open(self.tmp / MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, data)
            if self.durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if self.durable:
            fsync_dir(self.tmp)
        final = self.directory / self.name
        source = self._stage() if self.staging is not None else self.tmp
        try:
            if source is not self.tmp and os.path.lexists(final):
                # A link would replace an existing checkpoint silently (a directory fails to).
                raise FileExistsError(errno.EEXIST, "checkpoint exists", str(final))
            os.rename(source, final)
        except OSError:
            if (final / MANIFEST_NAME).is_file():
                problem = existing_checkpoint_problem(final)
                if problem is None:
                    log.info("checkpoint %s already exists; keeping it", final)
                    self.abort()
                    return final  # not this writer's files: ``installed`` stays False
                move_aside_refused(final, problem)
            else:
                remove_checkpoint_dir(final)
            os.rename(source, final)
        if self.durable:
            fsync_dir(self.directory)
        self.installed = True
        return final

    def _stage(self) -> Path:
        """The files written in the staging directory: move them to their
        place there, and make the link that commits them (not yet in place)."""
        assert self.staging is not None
        self._held = self.staging / f"{STAGED_PREFIX}{self.step:012d}-{uuid.uuid4().hex[:8]}"
        os.rename(self.tmp, self._held)
        self._link = self.directory / f"{TMP_PREFIX}link-{self.name}-{uuid.uuid4().hex[:8]}"
        os.symlink(self._held, self._link)
        return self._link

    def abort(self) -> None:
        """Remove the temporary directory (the checkpoint never appears)."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self._link is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._link)
        if self._held is not None:
            shutil.rmtree(self._held, ignore_errors=True)


def write_checkpoint(
    directory: Path,
    step: int,
    snapshot: Snapshot,
    *,
    algorithm: str = DEFAULT_ALGORITHM,
    epoch: int | None = None,
    metrics: Mapping[str, Any] | None = None,
    job: str | None = None,
    attempt: int | None = None,
    deadline: float | None = None,
    reason: str | None = None,
    request_id: str | None = None,
    snapshot_seconds: float | None = None,
    durable: bool = True,
    pool: dict[Any, Any] | None = None,
    staging: Path | None = None,
) -> Path:
    """Persist a snapshot as ``<directory>/ckpt-<step>`` atomically (phase two
    of a save). Raises :class:`DeadlineExceeded` (leaving nothing behind) when
    ``deadline`` (unix time) passes first. ``durable=False`` skips the fsync
    of data files (see :class:`LocalWriter`). ``pool``: the host buffers the
    snapshot was taken with; once its files are committed, the next snapshot
    may compare against them (:func:`~spotguard.checkpoint.local.codec.pool_committed`).
    ``staging``: write the files there and commit a link to them (see :class:`LocalWriter`)."""
    start = time.perf_counter()
    writer = LocalWriter(directory, step, algorithm=algorithm, deadline=deadline, durable=durable, staging=staging)
    try:
        try:
            writer.add_snapshot(snapshot)
        finally:
            drop_spent(pool)  # arenas linked into this checkpoint are its own: no snapshot writes them again
        timing = save_timing(time.perf_counter() - start, snapshot_seconds)
        path = writer.commit(
            epoch=epoch, metrics=metrics, job=job, attempt=attempt, reason=reason, request_id=request_id, timing=timing
        )
        if writer.installed:
            pool_committed(pool, path.name, manifest_stamp(path))
        return path
    except BaseException:  # no half-written checkpoint left, an interrupt too; raised again
        writer.abort()
        raise


def save_timing(persist_seconds: float, snapshot_seconds: float | None) -> dict[str, float]:
    """Pure: a manifest's ``timing`` of a save whose phase two took ``persist_seconds``
    (and phase one ``snapshot_seconds``, where known)."""
    timing = {"persist_seconds": round(persist_seconds, 6)}
    if snapshot_seconds is not None:
        timing["snapshot_seconds"] = round(snapshot_seconds, 6)
        timing["save_seconds"] = round(snapshot_seconds + timing["persist_seconds"], 6)
    return timing


def manifest_stamp(path: Path) -> tuple[int, int]:
    """What identifies one committed copy of a checkpoint: its manifest's inode and modification time."""
    st = os.stat(path / MANIFEST_NAME)
    return st.st_ino, st.st_mtime_ns


def list_local_committed(directory: Path) -> list[Path]:
    """Committed checkpoints in ``directory`` (``ckpt-*`` with a manifest),
    oldest first."""
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found: list[tuple[int, Path]] = []
    for e in entries:
        step = parse_checkpoint_name(e.name)
        if step is not None and e.is_dir() and os.path.isfile(os.path.join(e.path, MANIFEST_NAME)):
            found.append((step, Path(e.path)))
    return [p for _, p in sorted(found)]


def newest_local_or_none(directory: Path) -> Path | None:
    """The newest committed local checkpoint, if any."""
    committed = list_local_committed(directory)
    return committed[-1] if committed else None


def read_local_manifest(path: Path) -> Manifest:
    """Parse ``<path>/manifest.json``; raises :class:`ManifestError` or ``FileNotFoundError``."""
    data = (Path(path) / MANIFEST_NAME).read_bytes()
    return parse_manifest(data, expected_name=Path(path).name)


def local_reader(root: Path) -> Callable[[str], Iterable[bytes]]:
    """``read_chunks(path)`` for files below a local directory."""

    def read(path: str) -> Iterator[bytes]:
        with open(root / path, "rb", buffering=0) as f:
            while chunk := f.read(CHUNK):
                yield chunk

    return read


def verify_local_checkpoint(path: Path, *, checksums: bool = True, workers: int = 2) -> VerifyResult:
    """Verify a local checkpoint directory against its manifest."""
    path = Path(path)
    try:
        manifest = read_local_manifest(path)
    except FileNotFoundError:
        return VerifyResult(path.name, False, [f"{MANIFEST_NAME}: missing (checkpoint incomplete)"])
    except ManifestError as exc:
        return VerifyResult(path.name, False, [f"{MANIFEST_NAME}: {exc}"])
    sizes: dict[str, int] = {}
    for entry in manifest.files:
        with contextlib.suppress(OSError):
            p = path / entry.path
            if p.is_file() and not p.is_symlink():
                sizes[entry.path] = p.stat().st_size
    problems, nbytes = verify_files(manifest, sizes, local_reader(path), checksums=checksums, workers=workers)
    return VerifyResult(path.name, not problems, problems, manifest, nbytes)


def load_checkpoint_state(path: Path, manifest: Manifest | None = None) -> dict[str, Any]:
    """Load the state stored in a local checkpoint directory.

    Reads ``state.json`` and the safetensors files it references; only files
    listed in the manifest are opened. A checkpoint without ``state.json``
    (written by other tools) loads as ``{file stem: tensors}`` for its
    safetensors files and legacy ``torch.save`` files, the latter only after
    their pickle passed inspection and through ``torch.load(weights_only=True)``.
    Raises :class:`StateError` naming the file and the reason.
    """
    path = Path(path)
    if manifest is None:
        try:
            manifest = read_local_manifest(path)
        except (OSError, ManifestError) as exc:
            raise StateError(f"{path.name}/{MANIFEST_NAME}: {exc}") from None
    listed = {f.path for f in manifest.files}
    cache: dict[tuple[str, bool], Mapping[str, Any]] = {}

    def load_file(name: str, as_torch: bool) -> Mapping[str, Any]:
        if name not in listed or not name.endswith(".safetensors"):
            raise StateError(f"state.json references {name!r}, which is not a safetensors file of this checkpoint")
        key = (name, as_torch)
        if key not in cache:
            cache[key] = load_safetensors(path / name, as_torch)
        return cache[key]

    if STATE_FILE in listed:
        try:
            doc = json.loads((path / STATE_FILE).read_bytes())
        except (OSError, ValueError) as exc:
            raise StateError(f"{STATE_FILE}: unreadable ({exc})") from None
        return decode_state(doc, load_file)
    state: dict[str, Any] = {}
    for entry in manifest.files:
        stem = entry.path.rsplit(".", 1)[0]
        if entry.path.endswith(".safetensors"):
            state[stem] = dict(load_file(entry.path, True))
        elif entry.path.endswith(PICKLE_SUFFIXES):
            state[stem] = load_legacy_pickle(path / entry.path)
    return state


def load_legacy_pickle(path: Path) -> Any:
    """Load a ``torch.save`` file safely: inspect the pickle, then
    ``torch.load(weights_only=True)``."""
    try:
        with open(path, "rb") as f:
            check_pickle_safe(f)
    except UnsafePickleError as exc:
        raise StateError(f"{path.name}: {exc} (refused: loading it could run code)") from None
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many kinds for a refused or damaged file
        raise StateError(f"{path.name}: refused by torch.load(weights_only=True): {exc}") from None


def unlisted_local_files(path: Path, manifest: Manifest) -> list[str]:
    """Files in a local checkpoint directory that its manifest does not list
    (a framework loads whatever it finds by name: such a file was never
    checksummed nor scanned, so the checkpoint is not handed over)."""
    listed = {e.path for e in manifest.files} | {MANIFEST_NAME}
    found = []
    for root, _dirs, files in os.walk(path):
        for name in files:
            rel = (Path(root) / name).relative_to(path).as_posix()
            if rel not in listed:
                found.append(rel)
    return sorted(found)


def existing_checkpoint_problem(path: Path) -> str | None:
    """Why a committed local checkpoint would be refused on restore (None: it
    would not): it fails its manifest (damaged, unsafe pickle, unreadable
    manifest), or holds a file the manifest does not list."""
    result = verify_local_checkpoint(path)
    if not result.ok or result.manifest is None:
        return result.reason
    extra = unlisted_local_files(Path(path), result.manifest)
    if extra:
        return f"{extra[0]}: a file the manifest does not list"
    return None


def refused_name(name: str, when: float) -> str:
    """Pure: the name a refused checkpoint is moved to,
    ``<name>.refused-<UTC time>`` (no listing takes it for a checkpoint)."""
    return f"{name}{REFUSED_MARK}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(when))}"


def move_aside_refused(path: Path, reason: str) -> Path:
    """Rename a refused local checkpoint to a sibling no listing sees, so a new
    save of its step can commit. Never deleted: it stays for a look."""
    path = Path(path)
    aside = path.with_name(refused_name(path.name, time.time()))
    while aside.exists():
        aside = aside.with_name(f"{refused_name(path.name, time.time())}-{uuid.uuid4().hex[:6]}")
    os.rename(path, aside)
    log.warning("local checkpoint %s is refused (%s): moved to %s", path, reason, aside.name)
    return aside


def remove_checkpoint_dir(path: Path, *, background: bool = False) -> None:
    """Remove a local checkpoint so that it disappears at once (rename, then delete).

    ``background``: the delete runs in a thread of its own. Freeing a file of
    several GiB takes the kernel a noticeable fraction of a second, during
    which the caller's thread would run nothing, not even a signal handler:
    a preemption must not wait behind a routine prune. A process that ends
    meanwhile leaves the renamed directory, a temporary one, for the next
    clean-up."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    doomed = path.parent / f"{TMP_PREFIX}del-{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    staged = doomed.is_symlink()
    if staged:
        # A checkpoint staged elsewhere (see LocalWriter's ``staging``): the link goes, then its files.
        held = Path(os.readlink(doomed))
        os.unlink(doomed)
        if not held.name.startswith(STAGED_PREFIX):
            return  # not a link this package made: what it points to is not ours to delete
        doomed = held
    if background:
        threading.Thread(target=_remove_meekly, args=(doomed, not staged), name="spotguard-prune", daemon=True).start()
    else:
        shutil.rmtree(doomed, ignore_errors=True)


def _remove_meekly(doomed: Path, shrink: bool) -> None:
    """Delete ``doomed`` at the lowest CPU priority (this thread only, Linux).

    Freeing a large file is kernel work done on the deleting thread's time
    (dropping its cached pages, its extents). A preemption's save that comes
    meanwhile must have the CPU first; on a small machine the two share a
    core or two. ``shrink``: its large files are freed a step at a time, so
    that the file system's commits, which the save's fsyncs wait for, stay
    short (:mod:`~spotguard.checkpoint.local.release`; not for a staged
    checkpoint, whose files may be a trainer's mapped host buffers)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    if shrink:
        release_tree(doomed)
    else:
        shutil.rmtree(doomed, ignore_errors=True)


def prune_local(directory: Path, keep: int, *, protect: Iterable[Path] = ()) -> list[Path]:
    """Remove all but the newest ``keep`` (at least 1) committed local checkpoints."""
    committed = list_local_committed(directory)
    protected = {Path(p).resolve() for p in protect}
    doomed = [p for p in committed[: max(0, len(committed) - max(1, keep))] if p.resolve() not in protected]
    for p in doomed:
        remove_checkpoint_dir(p)
    return doomed


def clean_stale_tmp(directory: Path, prefix: str = TMP_PREFIX, older_than: float = 0.0) -> list[Path]:
    """Remove leftover temporary directories (from a writer that crashed)."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    now = time.time()
    for e in entries:
        if e.name.startswith(prefix):
            try:
                if now - e.stat(follow_symlinks=False).st_mtime < older_than:
                    continue
            except FileNotFoundError:
                continue
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
            removed.append(Path(e.path))
    return removed


def load_rank_state(path: Path, manifest: Manifest, prefix: str) -> dict[str, Any]:
    """Load the codec state stored below ``prefix`` (``ranks/<rank:05d>/``)
    of a local checkpoint: its ``state.json`` and the safetensors files it
    references, only files listed in the manifest. Raises :class:`StateError`."""
    path = Path(path)
    listed = {f.path for f in manifest.files}
    cache: dict[tuple[str, bool], Mapping[str, Any]] = {}

    def load_file(name: str, as_torch: bool) -> Mapping[str, Any]:
        full = prefix + name
        if "/" in name or full not in listed or not name.endswith(".safetensors"):
            raise StateError(
                f"{prefix}{STATE_FILE} references {name!r}, which is not a safetensors file of this checkpoint"
            )
        key = (full, as_torch)
        if key not in cache:
            cache[key] = load_safetensors(path / full, as_torch)
        return cache[key]

    if prefix + STATE_FILE not in listed:
        raise StateError(f"{path.name}: no {prefix}{STATE_FILE}")
    try:
        doc = json.loads((path / (prefix + STATE_FILE)).read_bytes())
    except (OSError, ValueError) as exc:
        raise StateError(f"{prefix}{STATE_FILE}: unreadable ({exc})") from None
    return decode_state(doc, load_file)
