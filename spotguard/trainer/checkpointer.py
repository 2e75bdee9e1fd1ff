"""The Checkpointer: the API training code uses.

    ckpt = spotguard.Checkpointer.from_env()
    state = ckpt.restore(model, optimizer, scheduler)   # None on a fresh start
    start = state.step + 1 if state else 0
    for step in range(start, total):
        ...
        if ckpt.should_save(step):
            ckpt.save(step, spotguard.torch_state(model, optimizer, scheduler), metrics={...})
        if ckpt.preempted:
            break

Saves are two-phase: :meth:`Checkpointer.save` copies the state to host
memory (the only time training waits) and a background thread writes it as
an atomic local checkpoint. At most one write is in flight: a new save first
waits for the previous write (back-pressure, never a dropped checkpoint).
A preemption request (SIGTERM, or ``checkpoint-request.json`` with
``"preempt": true`` in the control directory) makes the next save
synchronous and deadline-aware; signal handlers only set flags, so a signal
never interrupts a write.

Under ``torch.distributed`` (a process group of more than one rank, or
``distributed=True``) every rank builds the Checkpointer at the same point
and calls ``should_save`` at every step and ``save``/``restore`` at the same
steps: they are collective. Model and optimizer tensors go through
``torch.distributed.checkpoint``, each node's local rank 0 commits the
node's part; see :mod:`spotguard.trainer.distributed`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from spotguard.checkpoint.checksum import DEFAULT_ALGORITHM, check_algorithm
from spotguard.checkpoint.codec import Snapshot, StateError, snapshot_state
from spotguard.checkpoint.local import (
    WRITER_TMP_PREFIX,
    DeadlineExceeded,
    LocalWriter,
    clean_stale_tmp,
    list_local_committed,
    load_checkpoint_state,
    prune_local,
    read_local_manifest,
    remove_checkpoint_dir,
    verify_local_checkpoint,
    write_checkpoint,
)
from spotguard.checkpoint.manifest import FileEntry, ManifestError, checkpoint_name, parse_checkpoint_name
from spotguard.checkpoint.retention import RetentionCandidate, RetentionPolicy, plan_local_prune, plan_retention
from spotguard.sidecar.control import (
    ACK_FILE,
    CONTROL_SUBDIR,
    EXIT_FILE,
    INTERNAL_REQUEST_PREFIXES,
    PID_FILE,
    REQUEST_FILE,
    CheckpointRequest,
    TrainerExit,
    ack_json,
    parse_request,
    uploader_shipping,
)
from spotguard.sidecar.control import atomic_write_json as _write_json_atomic
from spotguard.trainer import distributed as _distributed
from spotguard.trainer.distributed import DCP_DIR, DCP_METADATA, DistContext, wants_distributed
from spotguard.trainer.state import RestoredState, restore_rng

log = logging.getLogger(__name__)

@dataclass
class _PersistJob:
    step: int
    snapshot: Snapshot | None
    epoch: int | None
    metrics: Mapping[str, Any] | None
    requests: list[CheckpointRequest] = field(default_factory=list)
    deadline: float | None = None
    snapshot_seconds: float = 0.0
    # Distributed saves: the staged DCP tensors, the shared tmp-dir token,
    # whether it is a preemption's save, and what the writer thread found.
    sharded: Any = None
    token: int = 0
    preempt: bool = False
    result: Path | None = None


@dataclass
class _Agreed:
    """What every rank agreed on in ``should_save(step)``."""

    step: int
    requests: list[CheckpointRequest]
    preempt: bool
    deadline: float | None


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{key} must be an integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{key} must not be negative, got {raw!r}")
    return value


def _env_float(env: Mapping[str, str], key: str) -> float | None:
    raw = env.get(key, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{key} must be a number of seconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{key} must not be negative, got {raw!r}")
    return value


PRUNE_SELF = "self"
PRUNE_UPLOADER = "uploader"
PRUNE_LOCAL_ONLY = "local-only"


def local_pruner(upload: bool, storage_uri: str | None, shares_control_dir: bool) -> str:
    """Pure: who deletes this trainer's local checkpoints.

    Only the uploader prunes, and only what is safe in storage:

    - ``self``: the Checkpointer uploads itself (``upload=True``), so it
      prunes checkpoints older than one it verified in storage;
    - ``uploader``: a storage URI or a shared control directory means a
      sidecar or ``spotguard run`` ships the checkpoints; it prunes, the
      trainer never does (a checkpoint deleted before its upload is lost);
    - ``local-only``: nothing ever ships them; a newer local checkpoint
      supersedes an older one by design, so ``keep_local`` / the retention
      policy prune locally.
    """
    if upload:
        return PRUNE_SELF
    if storage_uri or shares_control_dir:
        return PRUNE_UPLOADER
    return PRUNE_LOCAL_ONLY


def emergency_save_is_durable(preempt: bool, pruner: str, shipping: bool) -> bool:
    """Pure: whether a save fsyncs its data files before it is acknowledged.

    Every save does, except a preemption's when an uploader ships it at once
    and has said so (``shipping``: the sidecar's or ``spotguard run``'s fresh
    heartbeat, or with ``upload=True`` this process's last upload verified):
    its durability is the verified upload, and the seconds an fsync of
    gigabytes takes are the grace period's. Without a live uploader the local
    copy is all there is.
    """
    return not preempt or pruner == PRUNE_LOCAL_ONLY or not shipping


# A preemption's upload (``upload=True``) without a deadline is retried this long.
EMERGENCY_UPLOAD_SECONDS = 25.0


def emergency_upload_pause(attempt: int, now: float, deadline: float) -> float | None:
    """Pure: seconds to wait before retrying a preemption's upload that failed
    ``attempt`` times (the sidecar's emergency backoff), never past
    ``deadline``; None when no time is left."""
    from spotguard.sidecar.service import EMERGENCY_RETRY_INITIAL, EMERGENCY_RETRY_MAX
    from spotguard.sidecar.shipper import retry_delay

    left = deadline - now
    if left <= 0:
        return None
    return min(retry_delay(attempt, EMERGENCY_RETRY_INITIAL, EMERGENCY_RETRY_MAX), left)


class Checkpointer:
    """Saves and restores training state through local, atomic checkpoints.

    ``directory`` holds committed checkpoints (``ckpt-<step:012d>/``);
    ``storage_uri`` is the job's remote root, used by :meth:`restore` when no
    local checkpoint exists and, with ``upload=True``, to upload each
    checkpoint after it is committed (in a pod the sidecar uploads instead;
    a preemption's upload is retried until its deadline).

    Local checkpoints are deleted only by whoever uploads them (see
    :func:`local_pruner`): with a storage URI and no ``upload``, never by
    the Checkpointer; with ``upload=True``, those older than one it
    verified in storage, keeping the newest ``keep_local``; without any
    storage, all but the newest ``keep_local`` (or as ``retention`` says).

    ``distributed``: None (default) makes the Checkpointer collective when
    ``torch.distributed`` is initialized with more than one rank; True forces
    it (one rank included); False never (this process checkpoints alone,
    e.g. rank 0 of a DDP job, with plain state dicts). All ranks of a node
    must use the same ``directory``. A single process restores a
    distributed checkpoint whole (``exact`` False when several ranks wrote it).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        storage_uri: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        save_every_steps: int | None = None,
        save_every_seconds: float | None = None,
        checksum: str = DEFAULT_ALGORITHM,
        control_dir: str | os.PathLike[str] | None = None,
        keep_local: int = 2,
        retention: RetentionPolicy | None = None,
        upload: bool = False,
        job: str | None = None,
        attempt: int | None = None,
        async_save: bool = True,
        handle_signals: bool = False,
        reuse_host_buffers: bool = True,
        distributed: bool | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.storage_uri = storage_uri or None
        self.storage_options = dict(storage_options or {})
        if save_every_steps is not None and save_every_steps < 1:
            raise ValueError("save_every_steps must be at least 1")
        if save_every_seconds is not None and save_every_seconds <= 0:
            raise ValueError("save_every_seconds must be positive")
        self.save_every_steps = save_every_steps
        self.save_every_seconds = save_every_seconds
        self.checksum = check_algorithm(checksum)
        self.control_dir = Path(control_dir) if control_dir else self.directory / CONTROL_SUBDIR
        # Looked at every step: the path built once (pathlib costs more than the stat).
        self._request_path = os.fspath(self.control_dir / REQUEST_FILE)
        self.keep_local = keep_local
        self.retention = retention
        self.upload = upload and self.storage_uri is not None
        self.local_pruner = local_pruner(self.upload, self.storage_uri, control_dir is not None)
        # With upload=True: whether this process's last upload was verified.
        self._shipping = False
        # Checkpoints this process knows are verified in storage (uploaded and
        # verified here, or restored from storage).
        self._verified: set[str] = set()
        self.job = job
        self.attempt = attempt
        self.async_save = async_save

        self.last_committed: Path | None = None
        self.last_error: BaseException | None = None
        self.last_stall_seconds = 0.0
        self.last_persist_seconds = 0.0

        self._preempted = False
        self._pending: list[CheckpointRequest] = []
        self._handled: set[str] = set()
        self._request_seen: tuple[int, int, int] | None = None
        self._sigterm = False
        self._sigusr1 = False
        self._signal_count = 0
        self._previous_handlers: dict[int, Any] = {}
        self._save_lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._last_snapshot_step: int | None = None
        self._last_save_time = time.monotonic()
        # Host copies of the tensors, reused by the next snapshot (no page
        # faults on fresh memory); costs one resident copy of the state.
        self._pinned: dict[Any, Any] | None = {} if reuse_host_buffers else None
        self._storage: Any = None
        self._closed = False
        # Under torch.distributed (see spotguard.trainer.distributed): the
        # process groups, the decision of the last should_save, DCP's stager.
        self._dist: DistContext | None = None
        self._agreed: _Agreed | None = None
        self._stager: Any = None
        self._reuse_host_buffers = reuse_host_buffers
        if wants_distributed(distributed):
            self._dist = DistContext()
            _distributed._active += 1
        # Only local rank 0 of a node reads requests and writes the control files.
        self._control_owner = self._dist is None or self._dist.leader

        self.directory.mkdir(parents=True, exist_ok=True)
        # Only one trainer writes to a checkpoint directory: leftovers of this
        # prefix are from a writer that died, never from a live one.
        if self._control_owner:
            clean_stale_tmp(self.directory, WRITER_TMP_PREFIX)
        if self._dist is not None:
            # The ranks of a node share one directory (they build each checkpoint together).
            seen = self._dist.gather((self._dist.info.node, str(self.directory.resolve())), persist=False)
            for node in sorted({n for n, _ in seen}):  # every rank decides alike
                paths = {path for n, path in seen if n == node}
                if len(paths) > 1:
                    raise ValueError(f"the ranks of node {node} must use one checkpoint directory, "
                                     f"got {sorted(paths)}")  # fmt: skip
        self._load_previous_ack()
        self._announced = False
        self._exit_announced = False
        if handle_signals and self.install_signal_handlers() and self._control_owner:
            self._announce()
        atexit.register(_flush_at_exit, weakref.ref(self))

    # -- construction ---------------------------------------------------------
    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, handle_signals: bool = True, **overrides: Any
    ) -> Checkpointer:
        """Configure from the ``SPOTGUARD_*`` environment (set by the operator
        or ``spotguard run``); keyword arguments override it. Without
        ``SPOTGUARD_CHECKPOINT_DIR`` checkpoints go to ``./checkpoints``."""
        env = os.environ if environ is None else environ
        kwargs: dict[str, Any] = {
            "storage_uri": env.get("SPOTGUARD_STORAGE_URI") or None,
            "control_dir": env.get("SPOTGUARD_CONTROL_DIR") or None,
            "save_every_steps": _env_int(env, "SPOTGUARD_SAVE_EVERY_STEPS") or None,
            "save_every_seconds": _env_float(env, "SPOTGUARD_SAVE_EVERY_SECONDS") or None,
            "checksum": env.get("SPOTGUARD_CHECKSUM") or DEFAULT_ALGORITHM,
            "job": env.get("SPOTGUARD_JOB") or None,
            "attempt": _env_int(env, "SPOTGUARD_ATTEMPT"),
            "handle_signals": handle_signals,
        }
        policy = RetentionPolicy.from_env(env)
        if not policy.keeps_everything:
            kwargs["retention"] = policy
        kwargs.update(overrides)
        directory = overrides.pop("directory", None) or env.get("SPOTGUARD_CHECKPOINT_DIR") or "checkpoints"
        kwargs.pop("directory", None)
        return cls(directory, **kwargs)

    # -- signals and the control channel ---------------------------------------
    def install_signal_handlers(self) -> bool:
        """Install SIGTERM/SIGUSR1 handlers that only set flags (main thread
        only; returns False elsewhere). A previous Python handler is still
        called afterwards; the default action (terminate) is not."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("signal handlers can only be installed from the main thread; skipping")
            return False
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            previous = signal.getsignal(signum)
            self._previous_handlers[signum] = previous
            signal.signal(signum, self._make_handler(signum, previous))
        return True

    def uninstall_signal_handlers(self) -> None:
        """Put back the handlers that were there before."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous_handlers.clear()

    def _make_handler(self, signum: int, previous: Any) -> Callable[[int, FrameType | None], None]:
        def handler(sig: int, frame: FrameType | None) -> None:
            if sig == signal.SIGTERM:
                self._sigterm = True
            else:
                self._sigusr1 = True
            if callable(previous) and previous not in (signal.default_int_handler,):
                previous(sig, frame)

        return handler

    def _announce(self) -> None:
        """Tell a sidecar which process to wake with SIGUSR1 (only once our
        handler is installed: SIGUSR1's default action kills)."""
        try:
            self.control_dir.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                (self.control_dir / EXIT_FILE).unlink()  # from an earlier trainer run
            _write_json_atomic(self.control_dir / PID_FILE, {"pid": os.getpid()})
            self._announced = True
        except OSError as exc:
            log.warning("could not write %s: %s", self.control_dir / PID_FILE, exc)

    def _load_previous_ack(self) -> None:
        try:
            doc = json.loads((self.control_dir / ACK_FILE).read_bytes())
            if isinstance(doc, dict) and isinstance(doc.get("id"), str):
                self._handled.add(doc["id"])
        except (OSError, ValueError):
            pass

    def request_checkpoint(
        self, reason: str = "proactive", *, preempt: bool = False, deadline: float | None = None
    ) -> None:
        """Ask for a checkpoint at the next :meth:`should_save` (in-process)."""
        self._signal_count += 1
        self._add_request(CheckpointRequest(f"local-{os.getpid()}-{self._signal_count}", reason, deadline, preempt))

    def _add_request(self, request: CheckpointRequest) -> None:
        if request.id in self._handled or any(r.id == request.id for r in self._pending):
            return
        log.info("checkpoint requested (%s%s)", request.reason, ", preempting" if request.preempt else "")
        self._pending.append(request)

    def _poll_control(self) -> None:
        if self._sigterm:
            self._sigterm = False
            self._signal_count += 1
            self._add_request(CheckpointRequest(f"sigterm-{os.getpid()}-{self._signal_count}", "sigterm", None, True))
        force = self._sigusr1
        self._sigusr1 = False
        if not self._control_owner:
            return
        try:
            st = os.stat(self._request_path)
        except OSError:
            st = None
        found = False
        if st is not None:
            seen = (st.st_mtime_ns, st.st_size, st.st_ino)
            if force or seen != self._request_seen:
                self._request_seen = seen
                path = Path(self._request_path)
                try:
                    request = parse_request(path.read_bytes())
                except (OSError, ValueError) as exc:
                    log.warning("ignoring unreadable %s: %s", path, exc)
                else:
                    found = request.id not in self._handled
                    self._add_request(request)
        if force and not found:
            self._signal_count += 1
            self._add_request(CheckpointRequest(f"sigusr1-{os.getpid()}-{self._signal_count}", "signal", None, False))

    # -- the training-loop API ---------------------------------------------------
    @property
    def distributed(self) -> bool:
        """Whether this Checkpointer is collective (torch.distributed): every
        rank must call should_save, save and restore at the same steps."""
        return self._dist is not None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the Checkpointer saves nothing more)."""
        return self._closed

    @property
    def preempted(self) -> bool:
        """True once a preempting request's checkpoint is committed (or could
        not be before its deadline): the training loop should stop."""
        return self._preempted

    @property
    def request_pending(self) -> bool:
        """Whether a checkpoint request waits for the next save."""
        self._poll_control()
        return bool(self._pending)

    def has_saved(self, step: int) -> bool:
        """Whether ``step`` is already checkpointed (committed, being written,
        or restored)."""
        return step == self._last_snapshot_step

    def should_save(self, step: int) -> bool:
        """True when a checkpoint is due after ``step``: a request is pending,
        ``step`` is a positive multiple of ``save_every_steps``, or
        ``save_every_seconds`` passed since the last save."""
        self._poll_control()
        if self._dist is not None:
            return self._should_save_dist(step)
        if self._pending:
            return True
        return self._interval_due(step)

    def _interval_due(self, step: int) -> bool:
        if step == self._last_snapshot_step:
            return False
        if self.save_every_steps and step > 0 and step % self.save_every_steps == 0:
            return True
        return bool(self.save_every_seconds and time.monotonic() - self._last_save_time >= self.save_every_seconds)

    def _should_save_dist(self, step: int) -> bool:
        """Every rank's flags OR-ed (one all_reduce): the same answer everywhere."""
        assert self._dist is not None
        requests = list(self._pending)
        deadlines = [r.deadline for r in requests if r.deadline is not None]
        preempt, save_now, deadline, due = self._dist.agree(
            any(r.preempt for r in requests), bool(requests), min(deadlines) if deadlines else None,
            self._interval_due(step),
        )  # fmt: skip
        self._agreed = _Agreed(step, requests, preempt, deadline)
        return preempt or save_now or due

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        epoch: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        blocking: bool | None = None,
    ) -> Path | None:
        """Checkpoint ``state`` as the state after ``step``.

        Copies the state to host memory, then persists it in the background
        (returns None) or, when ``blocking`` or a preemption is pending,
        synchronously before the deadline (returns the committed directory,
        or None when it could not be written in time). Pending requests are
        acknowledged in the control directory once their checkpoint is
        committed.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        checkpoint_name(step)  # range check
        if self._dist is not None:
            with self._save_lock:
                return self._save_dist(step, state, epoch, metrics, blocking)
        with self._save_lock:
            requests, preempt, deadline = self._take_pending()
            sync = blocking if blocking is not None else (preempt or not self.async_save)
            if step == self._last_snapshot_step:
                # This step is already committed or being written: wait for it.
                return self._answer_with_last(requests, deadline)
            if not self._wait_until(deadline):
                log.error("previous checkpoint still being written at the deadline; not starting step %d", step)
                self._finish(requests, None, deadline_exceeded=True)
                return None
            start = time.perf_counter()
            try:
                snapshot = snapshot_state(state, pinned=self._pinned)
            except BaseException:
                # The state cannot be saved (the caller's error); still answer
                # the requests, so a preemption ends the loop instead of looping.
                self._finish(requests, None)
                raise
            self.last_stall_seconds = time.perf_counter() - start
            self._last_snapshot_step = step
            self._last_save_time = time.monotonic()
            job = _PersistJob(
                step, snapshot, epoch, dict(metrics) if metrics else None, requests, deadline, self.last_stall_seconds
            )
            if sync:
                return self._persist(job)
            self._thread = threading.Thread(target=self._persist, args=(job,), name="spotguard-persist", daemon=True)
            self._thread.start()
            return None

    # -- checkpoints a framework writes (Hugging Face Trainer, Lightning) -------------
    @property
    def stop_requested(self) -> bool:
        """Whether the checkpoint due now is a preemption's: save this step,
        then stop. After :meth:`should_save` under torch.distributed, what
        every rank agreed on; otherwise whether a preempting request is
        pending."""
        if self._dist is not None:
            return self._agreed is not None and self._agreed.preempt
        self._poll_control()
        return any(r.preempt for r in self._pending)

    def commit_folder(
        self,
        step: int,
        folder: str | os.PathLike[str],
        *,
        epoch: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        exclude: Sequence[str] = (),
        blocking: bool | None = None,
    ) -> Path | None:
        """Commit the checkpoint folder a framework wrote (the Trainer's
        ``checkpoint-<step>/``, a folder holding a Lightning ``.ckpt``) as
        spotguard checkpoint ``ckpt-<step>``: every file (hard-linked where
        possible, else copied; paths matching a glob in ``exclude`` left
        out), the manifest with checksums written last, atomic rename. It
        answers the pending requests like :meth:`save` (so a preemption's
        folder sets :attr:`preempted`), then uploads or prunes like
        :meth:`save`. The framework's folder is never modified.

        Two-phase like :meth:`save`: the files are linked now (the only time
        training waits; the framework may rotate its folder away right
        after), their checksums and the manifest follow in the background
        (returns None; a later save or :meth:`wait` waits for it), or at once
        when ``blocking``, for a preemption, or with ``async_save=False``
        (returns the committed directory, or None when it could not be
        committed before the deadline).

        Collective under torch.distributed: every rank calls it once the
        framework's save returned; each node's local rank 0 links and commits
        the node's part."""
        from spotguard.trainer import folder as _folder

        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        checkpoint_name(step)
        source = Path(folder)
        if self._dist is not None:
            with self._save_lock:
                return self._commit_folder_dist(step, source, epoch, metrics, tuple(exclude), blocking)
        with self._save_lock:
            requests, preempt, deadline = self._take_pending()
            if step == self._last_snapshot_step:
                # Committed, being committed, or resumed already: a framework
                # saving the step again (into hard-linked files) is never re-linked.
                return self._answer_with_last(requests, deadline)
            if not self._wait_until(deadline):
                log.error("previous checkpoint still being written at the deadline; not committing step %d", step)
                self._finish(requests, None, deadline_exceeded=True)
                return None
            start = time.perf_counter()
            writer = LocalWriter(self.directory, step, algorithm=self.checksum, deadline=deadline,
                                 durable=self._durable(preempt))  # fmt: skip
            try:
                names = _folder.folder_files(source, exclude)
                for rel in names:
                    _folder.link_or_copy(source / rel, writer.tmp / rel)
            except BaseException:
                writer.abort()
                self._finish(requests, None)
                raise
            # From here on the framework may delete or rotate its folder: the
            # checkpoint holds its own links. Checksums and the manifest are
            # phase two: in the background, or now for a preemption.
            self.last_stall_seconds = time.perf_counter() - start
            self._last_snapshot_step = step
            self._last_save_time = time.monotonic()
            job = _PersistJob(step, None, epoch, _folder.metrics_of(metrics), requests, deadline,
                              self.last_stall_seconds)  # fmt: skip

            def persist() -> Path | None:
                return self._persist_folder(job, writer, names, source)

            sync = blocking if blocking is not None else (preempt or not self.async_save)
            if sync:
                return persist()
            self._thread = threading.Thread(target=persist, name="spotguard-persist", daemon=True)
            self._thread.start()
            return None

    def _persist_folder(self, job: _PersistJob, writer: LocalWriter, names: list[str], source: Path) -> Path | None:
        """Phase two of ``commit_folder``: checksum (and fsync) the linked
        files, write the manifest last, rename; then answer the requests and ship."""
        from spotguard.trainer import folder as _folder

        start = time.perf_counter()
        try:
            _folder.checksum_linked(writer, names)
            persist = round(time.perf_counter() - start, 6)
            path = writer.commit(epoch=job.epoch, metrics=job.metrics, job=self.job, attempt=self.attempt,
                                 reason=_reason(job.requests),
                                 request_id=next((r.id for r in reversed(job.requests)), None),
                                 timing={"snapshot_seconds": round(job.snapshot_seconds, 6),
                                         "persist_seconds": persist,
                                         "save_seconds": round(job.snapshot_seconds + persist, 6)})  # fmt: skip
        except DeadlineExceeded as exc:
            writer.abort()
            self.last_error = exc
            log.error("checkpoint of step %d not committed before its deadline", job.step)
            self._finish(job.requests, None, deadline_exceeded=True)
            return None
        except Exception as exc:
            writer.abort()
            self.last_error = exc
            log.error("checkpoint of step %d from %s failed: %s", job.step, source, exc)
            self._finish(job.requests, None)
            return None
        self.last_committed = path
        self.last_persist_seconds = time.perf_counter() - start
        log.info("checkpoint %s committed from %s (%.2fs)", path, source, self.last_persist_seconds)
        self._finish(job.requests, path)
        self._after_commit(path, job)
        return path

    def _commit_folder_dist(
        self, step: int, source: Path, epoch: int | None, metrics: Mapping[str, Any] | None,
        exclude: tuple[str, ...], blocking: bool | None,
    ) -> Path | None:
        """``commit_folder`` under torch.distributed (collective): every
        node's local rank 0 links its node's files now; checksums, the part
        manifest and the agreement that every node committed follow on the
        writer thread (its own process group), like a distributed save."""
        from spotguard.trainer import folder as _folder

        d = self._dist
        assert d is not None
        requests, preempt, deadline = self._take_agreed(step)
        sync = blocking if blocking is not None else (preempt or not self.async_save)
        if step == self._last_snapshot_step:  # the same on every rank
            return self._answer_with_last(requests, deadline, preempt=preempt)
        start = time.perf_counter()
        busy = not self._wait_until(deadline)
        writer: LocalWriter | None = None
        names: list[str] = []
        error: BaseException | None = None
        # The token names the node's temporary directory and the save; the
        # all_reduce is also the barrier: every rank's framework save returned.
        any_busy, _, token = d.start_save(busy, False)
        if any_busy:
            log.error("a previous checkpoint is still being written at the deadline; not committing step %d", step)
            self._finish(requests, None, deadline_exceeded=True)
            if preempt:
                self._preempted = True
            return None
        if d.leader:
            try:
                writer = LocalWriter(self.directory, step, algorithm=self.checksum, deadline=deadline,
                                     durable=self._durable(preempt),
                                     tmp=self.directory / f"{WRITER_TMP_PREFIX}{step:012d}-{token:08x}")  # fmt: skip
                names = _folder.folder_files(source, exclude)
                for rel in names:
                    _folder.link_or_copy(source / rel, writer.tmp / rel)
            except BaseException as exc:
                error = exc
        # Every rank may go on once its node's files are linked (the framework may rotate them away).
        linked = d.gather(error is None, persist=False)
        self.last_stall_seconds = time.perf_counter() - start
        self._last_snapshot_step = step
        self._last_save_time = time.monotonic()
        job = _PersistJob(step, None, epoch, _folder.metrics_of(metrics), requests, deadline, self.last_stall_seconds,
                          token=token, preempt=preempt)  # fmt: skip
        failed = None if all(linked) else (f"node {d.info.node}: {error}" if error is not None else "")
        return self._run_writer(job, self._persist_folder_dist, (job, writer, names, source, failed), sync=sync)

    def _persist_folder_dist(
        self, job: _PersistJob, writer: LocalWriter | None, names: list[str], source: Path, failed: str | None
    ) -> None:
        """Phase two of a distributed ``commit_folder`` on the writer thread
        (collectives on the persist group only)."""
        from spotguard.checkpoint.manifest import Sharding
        from spotguard.trainer import folder as _folder

        d = self._dist
        assert d is not None
        start = time.perf_counter()
        listed: list[tuple[str, int, str]] | None = None
        error: str | None = failed
        deadline_exceeded = False
        if writer is not None and error is None:
            try:
                _folder.checksum_linked(writer, names)
                listed = _folder.entries_json(writer.entries)
            except DeadlineExceeded as exc:
                error, deadline_exceeded = f"node {d.info.node}: {exc}", True
            except Exception as exc:
                error = f"node {d.info.node}: {exc}"
        try:
            results = d.gather((d.info.node, d.leader, listed, error, deadline_exceeded), persist=True)
        except Exception as exc:
            log.error("checkpoint of step %d failed: %s", job.step, exc)
            self.last_error = exc
            if writer is not None:
                writer.abort()
            self._finish(job.requests, None)
            return
        errors = [e for _, _, _, e, _ in results if e is not None]
        deadline_exceeded = any(x for *_, x in results)
        committed_here = not d.leader
        if d.leader and writer is not None:
            if not errors:
                try:
                    mine, drop = _folder.node_files([(n, ls) for n, lead, ls, _, _ in results if lead], d.info.node)
                    for rel in drop:
                        (writer.tmp / rel).unlink()
                    persist = round(time.perf_counter() - start, 6)
                    writer.commit(
                        epoch=job.epoch, metrics=job.metrics, job=self.job, attempt=self.attempt,
                        reason=_reason(job.requests) if job.requests or not job.preempt else "sigterm",
                        request_id=next((r.id for r in reversed(job.requests)), None),
                        timing={"snapshot_seconds": round(job.snapshot_seconds, 6), "persist_seconds": persist,
                                "save_seconds": round(job.snapshot_seconds + persist, 6)},
                        sharding=Sharding(world_size=d.world_size, parts=d.parts, part=d.info.node,
                                          ranks=d.node_ranks, save_id=f"{job.token:013x}"),
                        entries=mine, check_deadline=False,
                    )  # fmt: skip
                    committed_here = True
                except Exception as exc:
                    error = f"node {d.info.node}: commit failed: {exc}"
            if not committed_here:
                writer.abort()
        try:
            commits = d.gather((committed_here, error), persist=True)
        except Exception as exc:
            commits = [(False, f"rank {d.rank}: {exc}")]
        problems = [e for e in errors if e] or [e for ok, e in commits if not ok and e]
        final: Path | None = None
        if all(ok for ok, _ in commits) and not errors:
            final = self.directory / checkpoint_name(job.step)
            self.last_committed = final
            self.last_persist_seconds = time.perf_counter() - start
            if d.rank == 0:
                log.info("checkpoint %s committed from %s on every rank (%.2fs)", final, source,
                         self.last_persist_seconds)  # fmt: skip
        else:
            self.last_error = RuntimeError("; ".join(problems) or "commit failed")
            log.error("checkpoint of step %d not committed: %s", job.step, "; ".join(problems) or "commit failed")
        job.result = final
        self._finish(job.requests, final, deadline_exceeded=deadline_exceeded)
        if final is not None and d.leader:
            self._after_commit(final, job)

    def resume_folder(self) -> Path | None:
        """The checkpoint folder to hand to the framework on resume, or None
        (a fresh start): the newest local checkpoint that verifies (sizes,
        checksums, every pickle scanned and refused if it would import
        anything but tensor and array rebuilding, no file the manifest does
        not list), walking back past bad ones with a warning that names the
        file; with a storage URI, the newest verified checkpoint in storage
        instead when it is newer than every good local one (fetched and
        checked again locally; walking back there too).

        Collective under torch.distributed: every rank gets the same folder."""
        if self._dist is not None:
            name = self._choose_restore()
            if name is None:
                log.info("no checkpoint to resume from; starting fresh")
                return None
            path = self.directory / name
        else:
            found: Path | None = None
            for candidate in reversed(list_local_committed(self.directory)):
                problem = self._folder_problem(candidate)
                if problem is None:
                    found = candidate
                    break
                log.warning("not resuming from local checkpoint %s: %s", candidate, problem)
            if self.storage_uri:
                fetched = self._fetch_newer(parse_checkpoint_name(found.name) if found is not None else None)
                found = fetched or found
            if found is None:
                log.info("no checkpoint to resume from; starting fresh")
                return None
            path = found
        step = parse_checkpoint_name(path.name)
        self._last_snapshot_step = step
        self.last_committed = path
        self._last_save_time = time.monotonic()
        log.info("resuming from %s (step %s)", path, step)
        return path

    def _folder_problem(self, path: Path) -> str | None:
        """Why a local checkpoint cannot be handed to a framework (None: it can)."""
        from spotguard.checkpoint.local import unlisted_local_files as unlisted_files

        result = verify_local_checkpoint(path)
        if not result.ok or result.manifest is None:
            return result.reason
        if not result.manifest.locally_complete:
            return "it holds only this node's part"
        extra = unlisted_files(path, result.manifest)
        if extra:
            return f"{extra[0]}: a file the manifest does not list (never checksummed nor scanned; refused)"
        return None

    def _fetch_newer(self, local_step: int | None) -> Path | None:
        """Fetch the newest checkpoint in storage newer than ``local_step``
        that verifies there and again locally, walking back; None if none."""
        from spotguard.checkpoint.remote import CheckpointCorruptError, list_checkpoint_names, restore_checkpoint

        try:
            storage = self._open_storage()
            names = list_checkpoint_names(storage)
        except Exception as exc:
            log.warning("could not look for a checkpoint in storage: %s", exc)
            return None
        for name in reversed(names):
            step = parse_checkpoint_name(name)
            if step is None or (local_step is not None and step <= local_step):
                break
            try:
                info = restore_checkpoint(storage, name, self.directory)
            except CheckpointCorruptError as exc:
                log.warning("not resuming from %s: %s", storage.uri_for(name), "; ".join(exc.problems))
                continue
            except Exception as exc:
                log.warning("could not fetch %s: %s", storage.uri_for(name), exc)
                return None
            path = Path(info.uri)
            problem = self._folder_problem(path)
            if problem is not None:
                log.warning("not resuming from %s: %s", path, problem)
                continue
            self._verified.add(name)
            return path
        return None

    def _take_pending(self) -> tuple[list[CheckpointRequest], bool, float | None]:
        """The pending requests (now taken), whether one preempts, the earliest deadline."""
        self._poll_control()
        requests, self._pending = self._pending, []
        deadlines = [r.deadline for r in requests if r.deadline is not None]
        return requests, any(r.preempt for r in requests), (min(deadlines) if deadlines else None)

    def _take_agreed(self, step: int) -> tuple[list[CheckpointRequest], bool, float | None]:
        """Under torch.distributed, what every rank agreed on in
        ``should_save(step)``: its requests (now taken), whether one preempts,
        the earliest deadline. A request that arrived since waits for the
        next ``should_save``."""
        agreed = self._agreed if self._agreed is not None and self._agreed.step == step else None
        self._agreed = None
        if agreed is None:
            return [], False, None
        ids = {r.id for r in agreed.requests}
        self._pending = [r for r in self._pending if r.id not in ids]
        return agreed.requests, agreed.preempt, agreed.deadline

    def _answer_with_last(self, requests: list[CheckpointRequest], deadline: float | None, *,
                          preempt: bool = False) -> Path | None:  # fmt: skip
        """A save of the step saved last: wait for its write, answer with it
        (a preemption's answer still stops the loop)."""
        self._wait_until(deadline)
        self._finish(requests, self.last_committed if self._thread is None else None)
        if preempt:
            self._preempted = True
        return self.last_committed

    # -- distributed saves -----------------------------------------------------------
    def _save_dist(
        self, step: int, state: Mapping[str, Any], epoch: int | None, metrics: Mapping[str, Any] | None,
        blocking: bool | None,
    ) -> Path | None:
        """``save`` under torch.distributed (collective: every rank, same step)."""
        assert self._dist is not None
        requests, preempt, deadline = self._take_agreed(step)
        sync = blocking if blocking is not None else (preempt or not self.async_save)
        if step == self._last_snapshot_step:
            return self._answer_with_last(requests, deadline, preempt=preempt)
        busy = not self._wait_until(deadline)
        start = time.perf_counter()
        error: BaseException | None = None
        sharded: Any = None
        snapshot: Snapshot | None = None
        if not busy:
            try:
                sharded, snapshot = self._snapshot_dist(state)
            except BaseException as exc:
                error = exc
        any_busy, any_failed, token = self._dist.start_save(busy, error is not None)
        if any_busy or any_failed:
            if any_busy:
                log.error("a previous checkpoint is still being written at the deadline; not starting step %d", step)
            else:
                log.error("a rank could not snapshot its state; not saving step %d", step)
            self._finish(requests, None, deadline_exceeded=any_busy)
            if preempt:
                self._preempted = True
            if error is not None:
                raise error
            return None
        self.last_stall_seconds = time.perf_counter() - start
        self._last_snapshot_step = step
        self._last_save_time = time.monotonic()
        job = _PersistJob(step, snapshot, epoch, dict(metrics) if metrics else None, requests, deadline,
                          self.last_stall_seconds, sharded=sharded, token=token, preempt=preempt)  # fmt: skip
        return self._run_writer(job, self._persist_dist, (job,), sync=sync)

    def _run_writer(self, job: _PersistJob, target: Callable[..., None], args: tuple[Any, ...], *,
                    sync: bool) -> Path | None:  # fmt: skip
        """Start phase two of a distributed save on the writer thread; when
        ``sync``, wait for it, but not past the deadline (a rank that died
        would hold the others in a collective)."""
        thread = threading.Thread(target=target, args=args, name="spotguard-persist", daemon=True)
        self._thread = thread
        thread.start()
        if not sync:
            return None
        timeout = None if job.deadline is None else max(0.0, job.deadline - time.time()) + 1.0
        thread.join(timeout)
        if not thread.is_alive():
            self._thread = None
        else:
            log.error("checkpoint of step %d not committed by its deadline", job.step)
        if job.preempt:
            self._preempted = True
        return job.result

    def _snapshot_dist(self, state: Mapping[str, Any]) -> tuple[Any, Snapshot]:
        """Phase one: the DCP tensors staged in host memory by torch's stager,
        everything else of this rank's state through the codec."""
        if not isinstance(state, Mapping):
            raise StateError(f"the state to save must be a mapping, got {type(state).__name__}")
        tensors, skeleton = _distributed.split_tensors({k: state[k] for k in _distributed.DCP_KEYS if k in state})
        rank_state = {k: (skeleton[k] if k in _distributed.DCP_KEYS else v) for k, v in state.items()}
        staged = None
        if tensors:
            if self._stager is None:
                import torch
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                pin = bool(torch.cuda.is_available())
                options = StagingOptions(use_pinned_memory=pin, use_shared_memory=False, use_async_staging=False,
                                         use_non_blocking_copy=pin)  # fmt: skip
                self._stager = DefaultStager(options)
            staged = self._stager.stage(tensors)
            if not self._reuse_host_buffers:
                self._stager.close()
                self._stager = None
        return staged, snapshot_state(rank_state, pinned=self._pinned)

    def _persist_dist(self, job: _PersistJob) -> None:
        """Phase two on the writer thread: every rank writes its files into the
        node's temporary directory, local rank 0 commits the node's part once
        every rank's files are written and checksummed."""
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        from spotguard.checkpoint.manifest import Sharding

        d = self._dist
        assert d is not None
        start = time.perf_counter()
        tmp = self.directory / f"{WRITER_TMP_PREFIX}{job.step:012d}-{job.token:08x}"
        durable = self._durable(job.preempt)
        error: str | None = None
        writer: LocalWriter | None = None
        deadline_exceeded = False
        try:
            writer = LocalWriter(self.directory, job.step, algorithm=self.checksum, deadline=job.deadline,
                                 durable=durable, tmp=tmp)  # fmt: skip
            assert job.snapshot is not None
            writer.add_snapshot(job.snapshot, prefix=_distributed.rank_prefix(d.rank))
        except DeadlineExceeded as exc:
            error, deadline_exceeded = str(exc), True
        except Exception as exc:
            error = f"rank {d.rank}: {exc}"
        # Every rank takes part in dcp.save, whatever happened above: a rank
        # that skipped a collective would leave the others waiting.
        dcp_dir = tmp / DCP_DIR
        try:
            if job.sharded is not None:
                dcp_save(job.sharded, storage_writer=FileSystemWriter(dcp_dir, sync_files=durable),
                         process_group=d.persist)  # fmt: skip
            if writer is not None and error is None:
                mine = sorted(p.name for p in dcp_dir.glob(f"__{d.rank}_*.distcp")) if dcp_dir.is_dir() else []
                if d.rank == 0 and job.sharded is not None:
                    mine.append(DCP_METADATA)
                for name in mine:
                    writer.add_written(f"{DCP_DIR}/{name}")
        except DeadlineExceeded as exc:
            error, deadline_exceeded = error or str(exc), True
        except Exception as exc:
            error = error or f"rank {d.rank}: {exc}"
        finally:
            job.snapshot = None
            job.sharded = None
        entries = [(e.path, e.size, e.checksum) for e in writer.entries] if writer is not None and error is None else []
        try:
            results = d.gather((d.info.node, entries, error, deadline_exceeded), persist=True)
        except Exception as exc:
            log.error("checkpoint of step %d failed: %s", job.step, exc)
            self.last_error = exc
            self._finish(job.requests, None)
            return
        errors = [e for _, _, e, _ in results if e]
        deadline_exceeded = any(x for _, _, _, x in results)
        path: Path | None = None
        committed_here = not d.leader
        if d.leader:
            if not errors and writer is not None:
                node_entries = [FileEntry(p, n, c) for node, ents, _, _ in results if node == d.info.node
                                for p, n, c in ents]  # fmt: skip
                persist_seconds = round(time.perf_counter() - start, 6)
                timing = {"persist_seconds": persist_seconds, "snapshot_seconds": round(job.snapshot_seconds, 6),
                          "save_seconds": round(job.snapshot_seconds + persist_seconds, 6)}  # fmt: skip
                try:
                    path = writer.commit(
                        epoch=job.epoch, metrics=job.metrics, job=self.job, attempt=self.attempt,
                        reason=_reason(job.requests) if job.requests or not job.preempt else "sigterm",
                        request_id=next((r.id for r in reversed(job.requests)), None), timing=timing,
                        sharding=Sharding(world_size=d.world_size, parts=d.parts, part=d.info.node,
                                          ranks=d.node_ranks, save_id=f"{job.token:013x}"),
                        entries=node_entries, check_deadline=False,
                    )  # fmt: skip
                    committed_here = True
                except Exception as exc:
                    error = f"node {d.info.node}: commit failed: {exc}"
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        try:
            commits = d.gather((committed_here, error), persist=True)
        except Exception as exc:
            commits = [(False, f"rank {d.rank}: {exc}")]
        problems = errors or [e for ok, e in commits if not ok and e]
        final: Path | None = None
        if all(ok for ok, _ in commits) and not errors:
            final = self.directory / checkpoint_name(job.step)
            self.last_committed = final
            self.last_persist_seconds = time.perf_counter() - start
            log.info("checkpoint %s committed on every rank (%.2fs)", final, self.last_persist_seconds)
        else:
            self.last_error = RuntimeError("; ".join(problems) or "commit failed")
            if deadline_exceeded:
                newest = self._newest_local()
                log.error("checkpoint of step %d not finished before its deadline (%s); the newest committed "
                          "checkpoint is %s", job.step, "; ".join(problems),
                          newest.name if newest else "none")  # fmt: skip
            else:
                log.error("checkpoint of step %d failed: %s", job.step, "; ".join(problems))
        job.result = final
        self._finish(job.requests, final, deadline_exceeded=deadline_exceeded)
        if final is not None and d.leader and path is not None:
            self._after_commit(path, job)

    def _wait_until(self, deadline: float | None) -> bool:
        thread = self._thread
        if thread is None:
            return True
        timeout = None if deadline is None else max(0.0, deadline - time.time())
        thread.join(timeout)
        if thread.is_alive():
            return False
        self._thread = None
        return True

    def _persist(self, job: _PersistJob) -> Path | None:
        start = time.perf_counter()
        path: Path | None = None
        deadline_exceeded = False
        try:
            assert job.snapshot is not None
            path = write_checkpoint(
                self.directory,
                job.step,
                job.snapshot,
                algorithm=self.checksum,
                epoch=job.epoch,
                metrics=job.metrics,
                job=self.job,
                attempt=self.attempt,
                deadline=job.deadline,
                reason=_reason(job.requests),
                request_id=next((r.id for r in reversed(job.requests)), None),
                snapshot_seconds=job.snapshot_seconds,
                durable=self._durable(any(r.preempt for r in job.requests)),
            )
            self.last_committed = path
            self.last_persist_seconds = time.perf_counter() - start
            log.info("checkpoint %s committed (%.2fs)", path, self.last_persist_seconds)
        except DeadlineExceeded as exc:
            deadline_exceeded = True
            self.last_error = exc
            newest = self._newest_local()
            log.error("%s; the newest committed checkpoint is %s", exc, newest.name if newest else "none")
        except Exception as exc:
            self.last_error = exc
            log.error("checkpoint of step %d failed: %s", job.step, exc)
        finally:
            job.snapshot = None  # free host memory before anything slow
        self._finish(job.requests, path, deadline_exceeded=deadline_exceeded)
        if path is not None:
            self._after_commit(path, job)
        return path

    def _durable(self, preempt: bool) -> bool:
        """Whether this save fsyncs its data files (see :func:`emergency_save_is_durable`)."""
        if not preempt or self.local_pruner == PRUNE_LOCAL_ONLY:
            return True
        shipping = self._shipping if self.local_pruner == PRUNE_SELF else uploader_shipping(self.control_dir)
        return emergency_save_is_durable(preempt, self.local_pruner, shipping)

    def _after_commit(self, path: Path, job: _PersistJob) -> None:
        if self.upload:
            if job.preempt or any(r.preempt for r in job.requests):
                # A preemption's upload is retried until the save's deadline.
                self._upload(path, until=job.deadline or time.time() + EMERGENCY_UPLOAD_SECONDS)
            else:
                self._upload(path)
        try:
            if self.local_pruner == PRUNE_SELF:
                for name in plan_local_prune([p.name for p in list_local_committed(self.directory)],
                                             self._verified, self.keep_local):
                    remove_checkpoint_dir(self.directory / name)
            elif self.local_pruner == PRUNE_LOCAL_ONLY:
                if self.retention is not None and not self.retention.keeps_everything:
                    self._apply_local_retention(path)
                else:
                    prune_local(self.directory, self.keep_local, protect=[path])
            # PRUNE_UPLOADER: the sidecar / ``spotguard run`` prunes what it verified.
        except OSError as exc:
            log.warning("could not prune local checkpoints: %s", exc)

    def _upload(self, path: Path, *, until: float | None = None) -> None:
        """Upload, verify, move the pointer, then apply retention in storage.
        With ``until`` (a preemption's save): a failure is retried with
        backoff until then, and retention waits for a routine upload."""
        attempt = 0
        while True:
            try:
                verified = self._upload_once(path)
                self._shipping = True
                break
            except Exception as exc:
                self._shipping = False
                self.last_error = exc
                attempt += 1
                pause = None if until is None else emergency_upload_pause(attempt, time.time(), until)
                if pause is None:
                    log.error("upload of %s failed: %s", path.name, exc)
                    return
                log.warning("upload of %s failed (attempt %d): %s; retrying in %.2fs", path.name, attempt, exc,
                            pause)  # fmt: skip
                time.sleep(pause)
        if not verified or until is not None or self.retention is None or self.retention.keeps_everything:
            return
        try:
            from spotguard.checkpoint.gc import apply_retention

            apply_retention(self._open_storage(), self.retention, newest_verified=path.name)
        except Exception as exc:
            self.last_error = exc
            log.error("retention after the upload of %s failed: %s", path.name, exc)

    def _upload_once(self, path: Path) -> bool:
        """Upload, verify and move the pointer; True once the checkpoint is
        verified in storage (False: one node's part, stored). Raises on failure."""
        from spotguard.checkpoint.remote import update_latest_pointer, upload_checkpoint, verify_checkpoint

        storage = self._open_storage()
        result = upload_checkpoint(path, storage, update_pointer=False)
        if not result.committed:
            # One node's part of a distributed checkpoint: the uploader of
            # the last part to arrive writes the global manifest.
            log.info("uploaded part of %s (%d bytes, %.2fs); %d of %d parts in storage", path.name,
                     result.bytes, result.seconds, result.parts_present, result.parts_total)  # fmt: skip
            return False
        verdict = verify_checkpoint(storage, path.name)
        if not verdict.ok:
            raise RuntimeError("verification failed: " + verdict.reason)
        self._verified.add(path.name)
        update_latest_pointer(storage, result.step)
        log.info("uploaded and verified %s (%d bytes, %.2fs)", result.uri, result.bytes, result.seconds)
        return True

    def _apply_local_retention(self, newest: Path) -> None:
        assert self.retention is not None
        candidates = []
        for p in list_local_committed(self.directory):
            try:
                m = read_local_manifest(p)
            except (OSError, ManifestError):
                continue
            candidates.append(RetentionCandidate(p.name, m.step, dict(m.metrics)))
        plan = plan_retention(candidates, self.retention, newest.name)
        for name in plan.delete:
            remove_checkpoint_dir(self.directory / name)

    def _finish(self, requests: list[CheckpointRequest], path: Path | None, *, deadline_exceeded: bool = False) -> None:
        if not requests:
            return
        if not self._control_owner:
            # Another rank of this node answers the uploader.
            self._handled.update(r.id for r in requests)
            if any(r.preempt for r in requests):
                self._preempted = True
            return
        committed = path or self._newest_local()
        # Internal (signal) requests first: the last ack written is the one a
        # sidecar waiting on a file request reads.
        for request in sorted(requests, key=lambda r: not r.id.startswith(INTERNAL_REQUEST_PREFIXES)):
            self._handled.add(request.id)
            doc = ack_json(request.id, committed.name if committed is not None else None,
                           complete=path is not None and not deadline_exceeded)
            try:
                _write_json_atomic(self.control_dir / ACK_FILE, doc)
            except OSError as exc:
                log.warning("could not write %s: %s", self.control_dir / ACK_FILE, exc)
        if any(r.preempt for r in requests):
            self._preempted = True

    def _newest_local(self) -> Path | None:
        committed = list_local_committed(self.directory)
        return committed[-1] if committed else None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight write; True when nothing is in flight any more."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            return False
        self._thread = None
        return True

    def close(self) -> None:
        """Finish the in-flight write, tell the sidecar the trainer is done, and
        put back the previous signal handlers."""
        if self._closed:
            return
        self.wait()
        self._announce_exit()
        if self._dist is not None:
            _distributed._active -= 1
        if self._announced and threading.current_thread() is threading.main_thread():
            # A sidecar that read trainer.pid just before it went may still send
            # SIGUSR1, whose default action would kill us: go straight from our
            # handler to ignoring it, never through the default.
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            self._previous_handlers.pop(signal.SIGUSR1, None)
        self.uninstall_signal_handlers()
        self._closed = True

    def _atexit(self) -> None:
        with contextlib.suppress(Exception):
            self.wait()
        self._announce_exit()

    def _announce_exit(self) -> None:
        """Tell a sidecar that cannot see our process that the trainer is done:
        withdraw ``trainer.pid`` first (no more SIGUSR1), then write the exit file."""
        if not self._announced or self._exit_announced:
            return
        self._exit_announced = True
        with contextlib.suppress(OSError):
            (self.control_dir / PID_FILE).unlink()
        with contextlib.suppress(OSError):
            _write_json_atomic(
                self.control_dir / EXIT_FILE,
                TrainerExit(os.getpid(), self._preempted, self._last_snapshot_step).to_json(),
            )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- restore -------------------------------------------------------------------
    def _open_storage(self) -> Any:
        if self._storage is None:
            from spotguard.storage import open_storage

            assert self.storage_uri is not None
            self._storage = open_storage(self.storage_uri, **self.storage_options)
        return self._storage

    def restore(
        self,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        *,
        restore_rng: bool = True,
        strict: bool = True,
        **objects: Any,
    ) -> RestoredState | None:
        """Load the newest complete local checkpoint (verified against its
        manifest); without one, download the newest verified checkpoint from
        ``storage_uri``. Loads into the given objects and restores the global
        RNGs (call it after building model and optimizer, right before the
        loop). Returns None when there is nothing to restore.

        Under torch.distributed every rank calls it: the ranks agree on the
        newest checkpoint every node can load (or a newer verified one in
        storage) and each loads its part; see :mod:`spotguard.trainer.distributed`."""
        if self._dist is not None:
            return self._restore_dist(model, optimizer, scheduler, restore_rng=restore_rng, strict=strict,
                                      objects=objects)  # fmt: skip
        restored: RestoredState | None = None
        for path in reversed(list_local_committed(self.directory)):
            restored = self._load_local(path)
            if restored is not None:
                break
        if restored is None and self.storage_uri:
            from spotguard.checkpoint.remote import restore_latest

            info = restore_latest(self._open_storage(), self.directory)
            if info is not None:
                self._verified.add(info.name)
                restored = self._load_local(Path(info.uri))
        if restored is None:
            log.info("no checkpoint to restore; starting fresh")
            return None
        if model is not None or optimizer is not None or scheduler is not None or objects:
            restored.load_into(model, optimizer, scheduler, restore_rng=False, strict=strict, **objects)
        if restore_rng and isinstance(restored.state.get("rng"), Mapping):
            restore_rng_state(restored.state["rng"])
        self._last_snapshot_step = restored.step
        self.last_committed = Path(restored.path)
        self._last_save_time = time.monotonic()
        log.info("restored %s (step %d)", restored.path, restored.step)
        return restored

    # -- distributed restore -----------------------------------------------------------
    def _restore_dist(
        self, model: Any, optimizer: Any, scheduler: Any, *, restore_rng: bool, strict: bool,
        objects: Mapping[str, Any],
    ) -> RestoredState | None:
        """``restore`` under torch.distributed (collective)."""
        assert self._dist is not None
        d = self._dist
        name = self._choose_restore()
        if name is None:
            log.info("no checkpoint to restore; starting fresh")
            return None
        path = self.directory / name
        restored: RestoredState = _distributed.load_sharded(path, d, model, optimizer, strict=strict)
        if scheduler is not None or objects:
            restored.load_into(None, None, scheduler, restore_rng=False, strict=strict, **objects)
        if restore_rng and restored.rank_state_own and isinstance(restored.state.get("rng"), Mapping):
            restore_rng_state(restored.state["rng"])
        self._last_snapshot_step = restored.step
        self.last_committed = path
        self._last_save_time = time.monotonic()
        log.info("rank %d restored %s (step %d)%s", d.rank, path, restored.step,
                 "" if restored.exact else f", resharded from {restored.resharded_from} ranks")  # fmt: skip
        return restored

    def _choose_restore(self) -> str | None:
        """The checkpoint every rank restores: the newest that every node
        holds complete and intact locally, unless storage holds a newer
        verified one (then each node fetches it). Collective."""
        d = self._dist
        assert d is not None
        checked: dict[str, bool] = {}

        def loadable(p: Path) -> bool:
            if p.name not in checked:
                why = self._folder_problem(p)
                if why is not None:
                    log.warning("local checkpoint %s cannot be restored here: %s", p, why)
                checked[p.name] = why is None
            return checked[p.name]

        bound: int | None = None
        while True:
            best = -1
            if d.leader:
                for p in reversed(list_local_committed(self.directory)):
                    step = parse_checkpoint_name(p.name)
                    if step is None or (bound is not None and step > bound):
                        continue
                    if loadable(p):
                        best = step
                        break
            bests = [b for b, leader in d.gather((best, d.leader), persist=False) if leader]
            agreed = min(bests)
            if all(b == agreed for b in bests):
                break
            bound = agreed
        local_name = checkpoint_name(agreed) if agreed >= 0 else None
        if not self.storage_uri:
            return local_name
        # Newer checkpoints in storage, newest first (rank 0 looks), each
        # verified there, then fetched by every node and checked again:
        # the first that every node has wins; a bad one is walked past.
        candidates: list[str] = []
        if d.rank == 0:
            try:
                from spotguard.checkpoint.remote import list_checkpoint_names

                candidates = [n for n in reversed(list_checkpoint_names(self._open_storage()))
                              if (parse_checkpoint_name(n) or -1) > agreed]  # fmt: skip
            except Exception as exc:
                log.warning("could not look for a newer checkpoint in storage: %s", exc)
        candidates = d.broadcast(candidates)
        for remote in candidates:
            ok = True
            if d.rank == 0:
                try:
                    from spotguard.checkpoint.remote import verify_checkpoint

                    verdict = verify_checkpoint(self._open_storage(), remote)
                    ok = verdict.ok
                    if not ok:
                        log.warning("not resuming from %s: %s", remote, verdict.reason)
                except Exception as exc:
                    ok = False
                    log.warning("could not verify %s in storage: %s", remote, exc)
            if not d.broadcast(ok):
                continue
            if d.leader:
                try:
                    from spotguard.checkpoint.remote import restore_checkpoint

                    restore_checkpoint(self._open_storage(), remote, self.directory)
                    why = self._folder_problem(self.directory / remote)
                    if why is not None:
                        ok = False
                        log.warning("not resuming from %s: %s", self.directory / remote, why)
                except Exception as exc:
                    ok = False
                    log.error("could not restore %s from storage: %s", remote, exc)
            if all(d.gather(ok, persist=False)):
                self._verified.add(remote)
                return remote
        if candidates:
            log.warning("restoring %s", local_name or "nothing (fresh start)")
        return local_name

    def _load_local(self, path: Path) -> RestoredState | None:
        result = verify_local_checkpoint(path)
        if not result.ok or result.manifest is None:
            log.warning("skipping local checkpoint %s: %s", path, result.reason)
            return None
        m = result.manifest
        if m.sharding is not None:
            # Written under torch.distributed: loaded whole by this one process.
            if not m.locally_complete:
                log.warning("skipping local checkpoint %s: it holds only one node's part", path)
                return None
            try:
                loaded: RestoredState = _distributed.load_sharded_whole(path, m)
            except Exception as exc:
                log.warning("skipping local checkpoint %s: %s", path, exc)
                return None
            return loaded
        try:
            state = load_checkpoint_state(path, m)
        except StateError as exc:
            log.warning("skipping local checkpoint %s: %s", path, exc)
            return None
        return RestoredState(state, step=m.step, name=m.name, path=str(path), epoch=m.epoch, metrics=m.metrics)


restore_rng_state = restore_rng  # restore()'s keyword shadows the name


def _reason(requests: list[CheckpointRequest]) -> str:
    """What caused a save, for the manifest: ``interval`` or the request's reason."""
    if not requests:
        return "interval"
    preempting = [r for r in requests if r.preempt]
    return (preempting or requests)[-1].reason or "requested"


def _flush_at_exit(ref: weakref.ref[Checkpointer]) -> None:
    """Finish an in-flight write when the interpreter exits normally."""
    checkpointer = ref()
    if checkpointer is not None:
        checkpointer._atexit()
