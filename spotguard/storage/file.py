"""``file:///path`` storage: a local disk or a shared volume.

Every write goes to a temporary file in the target directory, is fsynced and
then renamed, so a reader never sees a partial file under its final name.
Temporary files are named ``.sg-tmp-*`` and hidden from listings.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from spotguard.storage.base import (
    UNCHANGED,
    NotFoundError,
    ObjectInfo,
    PendingUpload,
    PreconditionFailedError,
    ProgressCallback,
    StorageError,
    StorageRoot,
    Unchanged,
    check_key,
    too_large,
)

TMP_PREFIX = ".sg-tmp-"
_LOCK_NAME = ".sg-lock"
_COPY_CHUNK = 16 << 20


def fsync_dir(path: Path) -> None:
    """fsync a directory, so renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """fsync a file another writer (or a link) put there, so its data is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


class FileStorage(StorageRoot):
    """Storage rooted at a local directory (created on first write)."""

    def __init__(self, root: Path | str, *, workers: int = 4, max_read_bytes: int | None = None) -> None:
        self.root = Path(root).absolute()
        self._workers = workers
        self._max_read = max_read_bytes

    # -- identity -----------------------------------------------------------
    @property
    def uri(self) -> str:
        return "file://" + str(self.root).rstrip("/")

    @property
    def supports_conditional_writes(self) -> bool:
        return True

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def check(self) -> None:
        if not self.root.is_dir():
            raise NotFoundError(f"directory {self.root} does not exist")
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise StorageError(f"directory {self.root} is not readable")

    # -- reading ------------------------------------------------------------
    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if not self.root.is_dir():
            return
        # Walk only the directory that can hold the prefix.
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self.root / base_rel if base_rel else self.root
        if not base.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(TMP_PREFIX))
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in sorted(filenames):
                if name.startswith(TMP_PREFIX) or name == _LOCK_NAME:
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                yield ObjectInfo(key=key, size=st.st_size, modified=st.st_mtime)

    def list_dirs(self, prefix: str = "") -> list[str]:
        base = self.root / prefix if prefix else self.root
        try:
            entries = list(os.scandir(base))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith(TMP_PREFIX))

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return ObjectInfo(key=key, size=st.st_size, modified=st.st_mtime)

    def read_bytes(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                # Bounded by a read of limit + 1: a device or a growing file says nothing true in stat().
                data = f.read() if self._max_read is None else f.read(self._max_read + 1)
        except (FileNotFoundError, NotADirectoryError):
            raise self.missing(key) from None
        except IsADirectoryError:
            raise NotFoundError(f"{self.uri_for(key)} is a directory") from None
        if self._max_read is not None and len(data) > self._max_read:
            raise too_large(self.uri_for(key), None, self._max_read)
        return data

    def read_with_etag(self, key: str) -> tuple[bytes, str] | None:
        try:
            data = self.read_bytes(key)
        except NotFoundError:
            return None
        return data, _etag(data)

    def read_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | Unchanged | None:
        """As :meth:`read_with_etag`, or :data:`UNCHANGED` when the content's tag is still ``etag``."""
        found = self.read_with_etag(key)
        if found is not None and etag is not None and found[1] == etag:
            return UNCHANGED
        return found

    def iter_chunks(self, key: str, chunk_size: int = 8 << 20) -> Iterator[bytes]:
        try:
            f = open(self._path(key), "rb", buffering=0)  # noqa: SIM115 (generator owns it)
        except (FileNotFoundError, NotADirectoryError):
            raise self.missing(key) from None
        with f:
            while chunk := f.read(chunk_size):
                yield chunk

    # -- writing ------------------------------------------------------------
    def _tmp_for(self, target: Path) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        return target.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}"

    def _publish(self, tmp: Path, target: Path) -> None:
        os.replace(tmp, target)
        fsync_dir(target.parent)

    @contextlib.contextmanager
    def _atomic(self, target: Path) -> Iterator[BinaryIO]:
        """A file for the caller to write that appears under ``target`` only complete and fsynced."""
        tmp = self._tmp_for(target)
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            self._publish(tmp, target)
        except BaseException:  # no temporary file left, an interrupt too; raised again
            tmp.unlink(missing_ok=True)
            raise

    def _write_atomic(self, target: Path, data: bytes) -> None:
        with self._atomic(target) as f:
            f.write(data)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / _LOCK_NAME, "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def write_bytes(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        target = self._path(key)
        if if_match is None and not if_none_match:
            self._write_atomic(target, data)
            return _etag(data)
        with self._locked():
            current = self.read_with_etag(key)
            if if_none_match and current is not None:
                raise PreconditionFailedError(f"{self.uri_for(key)} already exists")
            if if_match is not None and (current is None or current[1] != if_match):
                raise PreconditionFailedError(f"{self.uri_for(key)} changed since it was read")
            self._write_atomic(target, data)
        return _etag(data)

    def write_checked(self, key: str, data: bytes, crc32c: str | None = None) -> None:
        """Store ``data`` (atomically, fsynced); a file keeps no checksum."""
        self._write_atomic(self._path(key), data)

    def _copy(self, src: Path, dst: Path, progress: ProgressCallback | None) -> None:
        with open(src, "rb") as fin, self._atomic(dst) as fout:
            if progress is None:
                shutil.copyfileobj(fin, fout, _COPY_CHUNK)
            else:
                while chunk := fin.read(_COPY_CHUNK):
                    fout.write(chunk)
                    progress(len(chunk))

    def _run_all(self, jobs: list[tuple[Path, Path]], progress: ProgressCallback | None) -> None:
        if len(jobs) <= 1:
            for src, dst in jobs:
                self._copy(src, dst, progress)
            return
        with ThreadPoolExecutor(max_workers=min(self._workers, len(jobs))) as pool:
            for fut in [pool.submit(self._copy, s, d, progress) for s, d in jobs]:
                fut.result()

    def upload_files(self, items: Iterable[tuple[Path, str]], progress: ProgressCallback | None = None) -> None:
        jobs = [(Path(src), self._path(key)) for src, key in items]
        self._run_all(jobs, progress)

    def download_files(self, items: Iterable[tuple[str, Path]], progress: ProgressCallback | None = None) -> None:
        jobs: list[tuple[Path, Path]] = []
        for key, dst in items:
            src = self._path(key)
            if not src.is_file():
                raise self.missing(key)
            jobs.append((src, Path(dst)))
        try:
            self._run_all(jobs, progress)
        except FileNotFoundError as exc:
            raise NotFoundError(f"{exc.filename} disappeared while downloading") from None

    def delete(self, keys: Iterable[str]) -> None:
        parents: set[Path] = set()
        for key in keys:
            path = self._path(key)
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                path.unlink()
            parents.add(path.parent)
        # Remove directories left empty, so deleted prefixes disappear from listings.
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            p = parent
            while p != self.root and self.root in p.parents:
                try:
                    p.rmdir()
                except OSError:
                    break
                p = p.parent

    def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        if not self.root.is_dir():
            return []
        found: list[PendingUpload] = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames + dirnames:
                if not name.startswith(TMP_PREFIX):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                if not key.startswith(prefix):
                    continue
                try:
                    started = os.stat(os.path.join(dirpath, name)).st_mtime
                except FileNotFoundError:
                    continue
                found.append(PendingUpload(key=key, upload_id=key, started=started))
        return sorted(found, key=lambda u: u.key)

    def abort_upload(self, upload: PendingUpload) -> None:
        path = self.root / upload.upload_id
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
