"""Sending a preemption's checkpoint while the trainer is still writing it.

The emergency path was save, then upload: the upload waited for the last
byte of the local write. An uploader that stores whole files (not chunks)
need not: before a preemption's save writes its data, the trainer says what
it will write (``checkpoint-writing.json``, :class:`~spotguard.contract.control.WritePlan`:
the step, where its temporary directory is, each file's final size), and a
:class:`WriteFollower` sends each large file as a multipart upload whose
parts go as soon as the file holds their bytes
(:meth:`~spotguard.storage.s3.S3Storage.upload_growing`). So the upload
trails the write by a part instead of starting after it.

Nothing is taken on trust: the follower opens each file once (a descriptor
survives the directory's rename at commit, or its removal), reads only below
the size the file has reached, and once the checkpoint is committed the
ordinary upload runs as a resumed one (:func:`~spotguard.checkpoint.store.upload.files_to_send`):
it sends again any file the store does not hold with the manifest's size and
checksum (a file rewritten, a part read early), then the manifest, and
verification checks every file as always. A follower that is stopped (the
save failed or committed another step, the deadline came) aborts its
multipart upload.

An uploader that stores chunks (incremental, the default) follows too. A
chunk is named by the SHA-256 of its bytes, and where chunks begin follows
the file's layout (:mod:`spotguard.checkpoint.format.chunks`), which a safetensors
file declares in its header, written first: so once the header is in, the
follower knows every chunk's place (:func:`~spotguard.checkpoint.format.chunks.plan_safetensors`),
and hashes each as soon as the file holds it, storing those the store does
not hold yet with their CRC32C. A file linked from a kept checkpoint (a
frozen base) is not read: the upload recognizes it without reading. After
the commit the upload takes what was found here
(:class:`~spotguard.checkpoint.store.chunked.Prestored`) instead of reading and
hashing the same place again, and only when the chunks' CRC32Cs combine to
the checksum the trainer recorded for the file; any other file is read and
hashed again. The manifest names them; verification checks them as any new
chunk. A chunk is stored under its own hash, so a chunk stored here that no
manifest names is an orphan for the collector, never a wrong byte in a
checkpoint.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from spotguard.checkpoint.format.chunks import hash_chunk, plan_safetensors, read_range, safetensors_head_size
from spotguard.checkpoint.format.manifest import ChunkRef, checkpoint_name
from spotguard.checkpoint.local.commit import WRITER_TMP_PREFIX
from spotguard.checkpoint.store.chunked import Prestored
from spotguard.checkpoint.store.intents import upload_intent
from spotguard.contract.control import WritePlan, read_write_plan

log = logging.getLogger(__name__)

#: How often the follower looks at the plan, the directory and a file's size.
POLL_SECONDS = 0.005
#: A plan written this long before the request still belongs to it (the trainer's own SIGTERM came first).
PLAN_SLACK_SECONDS = 2.0
#: How long a stopped follower that stores chunks is waited for.
STOP_WAIT_SECONDS = 1.0
#: Chunks read, hashed and stored at once while a checkpoint is written (each holds its bytes meanwhile).
CHUNK_WORKERS = 4


class FollowStopped(Exception):
    """The follower was told to stop (or its deadline came) while it waited for bytes."""


class Growth:
    """A file being written, open as its descriptor, and how far it has grown.

    Every part or chunk of the file waits for its own bytes (:meth:`wait`). One
    thread looks at the size for all of them, every :data:`POLL_SECONDS` while
    any waits, and wakes each once its bytes are in: eight uploads waiting on
    one file cost one look, not eight, and the waiters' wakeups stop taking the
    CPU from the uploads that are sending (on a node whose cores the trainer,
    the uploader and the store share, that CPU is the emergency's time).
    :meth:`close` closes the descriptor, under the lock the looks take, so no
    look reaches a descriptor number that was closed and given to another file.
    """

    def __init__(self, fd: int, stopping: Callable[[], bool]) -> None:
        self.fd = fd
        self._stopping = stopping
        self._lock = threading.Lock()
        self._size = 0
        self._waiting: list[tuple[int, int, threading.Event]] = []  # a heap of (end, order, event)
        self._order = itertools.count()
        self._looking = False
        #: How many times the size was looked at (for tests and measurements).
        self.looks = 0

    def wait(self, end: int) -> None:
        """Return once the file holds ``end`` bytes; raise :class:`FollowStopped` when the follower stops
        (or the file is closed) first."""
        event = threading.Event()
        with self._lock:
            if self._look() >= end:
                return
            heapq.heappush(self._waiting, (end, next(self._order), event))
            if not self._looking:
                self._looking = True
                threading.Thread(target=self._watch, name="spotguard-follow-size", daemon=True).start()
        # The timeout only bounds a wait whose looker died; the looker wakes every waiter when it stops.
        while not event.wait(STOP_WAIT_SECONDS):
            if self._stopping():
                break
        with self._lock:
            if self._size >= end:
                return
        raise FollowStopped()

    def close(self) -> None:
        """Close the descriptor; a waiter still waiting is stopped."""
        with self._lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def _look(self) -> int:
        """The size now (the lock held); -1 once closed."""
        if self.fd < 0:
            return -1
        self.looks += 1
        self._size = max(self._size, os.fstat(self.fd).st_size)
        return self._size

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_SECONDS)
            stop = self._stopping()
            with self._lock:
                try:
                    size = self._look()
                except OSError:
                    size = -1
                while self._waiting and (stop or size < 0 or self._waiting[0][0] <= size):
                    heapq.heappop(self._waiting)[2].set()
                if not self._waiting:
                    self._looking = False
                    return


class WriteFollower:
    """Uploads the files of the preemption's save being written (see the module docstring)."""

    def __init__(
        self,
        storage: Any,
        control_dir: Path,
        since: float,
        deadline: float,
        known: Mapping[str, int] | None = None,
        workers: int = CHUNK_WORKERS,
    ) -> None:
        """``known`` (chunks known stored, digest -> size): store chunks instead of whole files, and not
        those; None: whole files (``storage`` must have ``upload_growing``)."""
        self._storage = storage
        self._control_dir = control_dir
        self._since = since
        self._deadline = deadline
        self._stop = threading.Event()
        # The save is committed: its files are complete, and any not opened yet goes with the ordinary upload.
        self._committed = threading.Event()
        #: The checkpoint being followed, once the plan is read.
        self.name: str | None = None
        #: The files sent (paths in the checkpoint): stored whole, complete; or, storing chunks, read in part
        #: or in full.
        self.sent: list[str] = []
        self._known = dict(known) if known is not None else None
        self._workers = max(1, workers)
        self._lock = threading.Lock()
        self._located: dict[tuple[str, int, int], ChunkRef] = {}
        self._stored: dict[str, int] = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="spotguard-follow", daemon=True)

    def start(self) -> WriteFollower:
        self._thread.start()
        return self

    def finish(self, committed: str | None, timeout: float) -> list[str]:
        """The save ended, committed as ``committed`` (None: not committed). Wait
        (at most ``timeout`` s) for the uploads of it in flight; stop at once when
        the save failed or committed another checkpoint. Returns the files stored
        of ``committed``."""
        if committed is None or (self.name is not None and self.name != committed):
            self._stop.set()
        self._committed.set()
        self._thread.join(max(0.0, timeout))
        if self._thread.is_alive():
            self._stop.set()
            if self._known is None:
                # A whole file's part in flight ends before the upload may send that file itself: a part
                # read before a rewrite must not land after the upload stored the file.
                self._thread.join()
            else:
                # A chunk in flight (a store that stopped answering) is not waited for: its name is its
                # bytes' hash, and the upload takes only what was found before this point.
                self._thread.join(STOP_WAIT_SECONDS)
        return list(self.sent) if committed is not None and self.name == committed else []

    def prestored(self) -> Prestored | None:
        """The chunks found and stored (storing chunks), for the upload once committed; None for whole files."""
        if self._known is None:
            return None
        with self._lock:
            return Prestored(dict(self._located), dict(self._stored), time.monotonic())

    def _stopping(self) -> bool:
        return self._stop.is_set() or time.time() >= self._deadline

    def _waiting_is_over(self) -> bool:
        """Nothing more to wait for before sending: stopped, or the save committed (what is not open yet is
        left to the ordinary upload; the files already open are complete and still go)."""
        return self._stopping() or self._committed.is_set()

    def _run(self) -> None:
        try:
            plan = self._await_plan()
            if plan is None:
                return
            self.name = name = checkpoint_name(plan.step)
            tmp = self._await_tmp(plan)
            if tmp is None:
                return
            with upload_intent(self._storage, name):
                if self._known is not None:
                    self._chunks(tmp, plan)
                    return
                for path, size in plan.files:
                    fd = self._await_file(tmp / path)
                    if fd is None:
                        return
                    growth = Growth(fd, self._stopping)
                    try:
                        sent = self._send(growth, f"{name}/{path}", size)
                    finally:
                        growth.close()
                    if sent:
                        self.sent.append(path)
        except FollowStopped:
            return
        except Exception as exc:  # noqa: BLE001 - the ordinary upload sends whatever is missing
            self.error = exc
            log.warning("sending the checkpoint while it was written failed (%s); it is uploaded once committed", exc)

    def _chunks(self, tmp: Path, plan: WritePlan) -> None:
        """Hash, and store where new, every chunk of the plan's safetensors files as they are written."""
        files: list[Growth] = []
        pending: list[tuple[str, list[Future[None]]]] = []
        try:
            # Leaving the pool waits for every chunk, so no read of a descriptor outlives it.
            with ThreadPoolExecutor(self._workers, thread_name_prefix="spotguard-follow-chunk") as pool:
                for path, size in plan.files:
                    if not path.endswith(".safetensors"):
                        continue  # chunked after the commit, as the format is known then
                    fd = self._await_file(tmp / path)
                    if fd is None:
                        break
                    growth = Growth(fd, self._stopping)
                    files.append(growth)
                    if os.fstat(fd).st_nlink > 1:
                        continue  # linked from a kept checkpoint: the upload knows it without reading it
                    places = plan_safetensors(self._head(growth, size), size)
                    pending.append((path, [pool.submit(self._chunk, growth, path, *at) for at in places]))
        finally:
            for growth in files:
                growth.close()
        for path, futures in pending:
            if any(f.exception() is None for f in futures):
                self.sent.append(path)
        errors = [e for _, futures in pending for f in futures if (e := f.exception()) is not None]
        if errors:
            raise errors[0]

    def _head(self, growth: Growth, size: int) -> bytes:
        """The first bytes of a safetensors file being written, its whole header once it is in."""
        growth.wait(min(8, size))
        need = safetensors_head_size(os.pread(growth.fd, 8, 0))
        if need is None or need > size:
            return b""  # not a header: fixed chunks, as the upload plans them
        growth.wait(need)
        return read_range(growth.fd, 0, need)

    def _chunk(self, growth: Growth, path: str, offset: int, length: int) -> None:
        """Once the file holds it, read the chunk at ``offset``, hash it, and store it unless known."""
        if self._stopping():
            raise FollowStopped()
        growth.wait(offset + length)
        data = read_range(growth.fd, offset, length)
        ref = hash_chunk(data)
        assert self._known is not None
        with self._lock:
            new = self._known.get(ref.hash) != ref.size and ref.hash not in self._stored
        if new:
            self._storage.write_checked(ref.key, data, ref.checksum)
        with self._lock:
            if new:
                self._stored[ref.hash] = ref.size
            self._located[(path, offset, length)] = ref

    def _send(self, growth: Growth, key: str, size: int) -> bool:
        """Upload the file open as ``growth.fd`` (the path survives a rename of its directory) while it grows."""
        return bool(self._storage.upload_growing(Path(f"/proc/self/fd/{growth.fd}"), key, size, growth.wait))

    def _await_plan(self) -> WritePlan | None:
        while not self._waiting_is_over():
            plan = read_write_plan(self._control_dir)
            if plan is not None and plan.time >= self._since - PLAN_SLACK_SECONDS:
                return plan
            time.sleep(POLL_SECONDS)
        return None

    def _await_tmp(self, plan: WritePlan) -> Path | None:
        pattern = f"{WRITER_TMP_PREFIX}{plan.step:012d}-*"
        while not self._waiting_is_over():
            found = [p for d in plan.dirs for p in Path(d).glob(pattern)]
            if found:
                return max(found, key=lambda p: p.stat().st_mtime if p.exists() else 0.0)
            time.sleep(POLL_SECONDS)
        return None

    def _await_file(self, path: Path) -> int | None:
        """A descriptor of ``path`` once the writer has made it; None once its directory is gone (committed,
        or given up: the ordinary upload sends it) or the follower stops."""
        while not self._waiting_is_over():
            try:
                return os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                if not path.parent.exists():
                    return None
            time.sleep(POLL_SECONDS)
        return None
