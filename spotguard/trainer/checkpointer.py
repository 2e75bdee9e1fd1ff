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

The class is a facade over parts with one idea each: its configuration
(:mod:`~spotguard.trainer.config`), the control channel and signals
(:mod:`~spotguard.trainer.channel`), when to save
(:mod:`~spotguard.trainer.policy`), the local two-phase save
(:mod:`~spotguard.trainer.persist`), the collective save
(:mod:`~spotguard.trainer.collective`), what follows a commit
(:mod:`~spotguard.trainer.shipping`) and which checkpoint to resume from
(:mod:`~spotguard.trainer.restore`).
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from spotguard import gcpause
from spotguard.checkpoint.format.manifest import checkpoint_name, parse_checkpoint_name
from spotguard.checkpoint.local.commit import WRITER_TMP_PREFIX, clean_stale_tmp
from spotguard.trainer import statedicts
from spotguard.trainer.channel import TrainerChannel
from spotguard.trainer.collective import CollectiveSave
from spotguard.trainer.config import CheckpointerConfig, keyword_parameters
from spotguard.trainer.distributed import DistContext, wants_distributed
from spotguard.trainer.persist import LocalPersist
from spotguard.trainer.policy import SavePolicy, SaveRecord, SaveTrigger
from spotguard.trainer.restore import Restorer
from spotguard.trainer.shipping import Shipping
from spotguard.trainer.state import RestoredState

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves and restores training state through local, atomic checkpoints.

    Its keywords are the fields of one frozen
    :class:`~spotguard.trainer.config.CheckpointerConfig`, whose defaults and
    ``SPOTGUARD_*`` variables come from the contract's table; ``config=``
    takes one built elsewhere (``CheckpointerConfig.from_args`` for a
    script's flags). The configuration is :attr:`config` afterwards, fixed;
    ``ck.directory``, ``ck.keep_local``, ... read it (``ck.control_dir`` is
    its ``control_path``) and ``ck.last_committed``, ``ck.last_error``,
    ``ck.last_stall_seconds``, ``ck.last_persist_seconds`` what the saves left.

    ``directory`` holds committed checkpoints (``ckpt-<step:012d>/``);
    ``storage_uri`` is the job's remote root, used by :meth:`restore` when no
    local checkpoint exists and, with ``upload=True``, to upload each
    checkpoint after it is committed (in a pod the sidecar uploads instead;
    a preemption's upload is retried until its deadline). ``incremental``
    (with ``upload``; on by default): store each checkpoint as
    content-addressed chunks shared with the job's other checkpoints, and
    send only the chunks storage does not hold yet, as the sidecar does
    (``False``: whole files, as ``spotguard sidecar --no-incremental``).
    ``emergency_staging``: a memory file system the uploader also sees,
    where a preemption's checkpoint that an uploader ships at once is
    written (see :mod:`spotguard.checkpoint.local.staged`); ``spotguard run`` and
    the operator set it (``SPOTGUARD_EMERGENCY_STAGING``). ``staging_reserve``:
    after each routine save, set aside in ``emergency_staging`` the memory a
    preemption's save of that size takes, so that it writes into pages
    allocated beforehand (:mod:`spotguard.checkpoint.local.reserve`; holds a
    checkpoint's size of memory between saves; ``SPOTGUARD_STAGING_RESERVE``).
    ``staging_arena`` (on by default): after each routine save, move the host
    buffers of CPU tensors into ``emergency_staging``, laid out as the
    checkpoint's files, so that a preemption's save links them instead of
    writing them (:mod:`spotguard.checkpoint.local.arena`; no memory beyond the
    host buffers; ``SPOTGUARD_STAGING_ARENA``). ``final_verify_seconds``
    (0: off): a trainer that finished (no preemption) waits in
    :meth:`close` or at exit, at most this long, until its uploader says its
    last checkpoint is verified in storage (:mod:`spotguard.contract.final`;
    the operator sets ``SPOTGUARD_FINAL_VERIFY_SECONDS`` beside a native sidecar,
    which kubelet stops once the trainer exits).

    Local checkpoints are deleted only by whoever uploads them (see
    :func:`~spotguard.trainer.config.local_pruner`): with a storage URI and no
    ``upload``, never by the Checkpointer; with ``upload=True``, those older
    than one it verified in storage, keeping the newest ``keep_local``;
    without any storage, all but the newest ``keep_local`` (or as
    ``retention`` says).

    ``distributed``: None (default) makes the Checkpointer collective when
    ``torch.distributed`` is initialized with more than one rank; True forces
    it (one rank included); False never (this process checkpoints alone,
    e.g. rank 0 of a DDP job, with plain state dicts). All ranks of a node
    must use the same ``directory``. A single process restores a
    distributed checkpoint whole (``exact`` False when several ranks wrote it).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        config: CheckpointerConfig | None = None,
        handle_signals: bool = False,
        **settings: Any,
    ) -> None:
        if config is None:
            if directory is None:
                raise TypeError("Checkpointer needs a directory (or config=CheckpointerConfig(...))")
            config = CheckpointerConfig(directory=Path(directory), **settings)
        elif directory is not None or settings:
            raise TypeError("Checkpointer takes config= or a directory and keywords, not both")
        self.config = s = config
        root = s.directory
        self._record = SaveRecord()
        self._policy = SavePolicy(s)
        self._closed = False
        self._save_lock = threading.RLock()
        # Under torch.distributed (see spotguard.trainer.distributed): the process groups.
        self._dist: DistContext | None = None
        if wants_distributed(s.distributed):
            self._dist = DistContext()
            statedicts.enter()
        # Only local rank 0 of a node reads requests and writes the control files.
        owner = self._dist is None or self._dist.leader
        self._channel = TrainerChannel(s, owner=owner)
        self._trigger = SaveTrigger(self._policy, self._channel, self._dist)
        # A pending preemption stops a routine upload (its save waits for that job).
        self._shipping = Shipping(s, self._record, preempting=lambda: any(r.preempt for r in self._channel.pending))
        # Host copies of the tensors, reused by the next snapshot (no page
        # faults on fresh memory); costs one resident copy of the state.
        pinned: dict[Any, Any] | None = {} if s.reuse_host_buffers else None
        self._pinned = pinned  # the one pool, shared by the local and the collective save
        self._local = LocalPersist(s, self._policy, self._record, self._channel, self._shipping, pinned)
        # What saves: the local save, or under torch.distributed the collective one (which writes through it).
        self._saver: LocalPersist | CollectiveSave = self._local
        if self._dist is not None:
            self._saver = CollectiveSave(
                self._dist, s, self._policy, self._record, self._channel, self._local, self._shipping, pinned=pinned
            )
        self._restorer = Restorer(s, self._shipping.open_storage, self._shipping.verified, self._dist)

        root.mkdir(parents=True, exist_ok=True)
        # Only one trainer writes to a checkpoint directory: leftovers of this
        # prefix are from a writer that died, never from a live one.
        if owner:
            clean_stale_tmp(root, WRITER_TMP_PREFIX)
        if self._dist is not None:
            self._dist.check_one_directory(root)
        if handle_signals and self.install_signal_handlers() and owner:
            self._channel.announce()
        atexit.register(_flush_at_exit, weakref.ref(self))

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, handle_signals: bool = True, **overrides: Any
    ) -> Checkpointer:
        """Configure from the ``SPOTGUARD_*`` environment (set by the operator
        or ``spotguard run``); keyword arguments override it. Without
        ``SPOTGUARD_CHECKPOINT_DIR`` checkpoints go to ``./checkpoints``."""
        return cls(config=CheckpointerConfig.from_env(environ, **overrides), handle_signals=handle_signals)

    def __getattr__(self, name: str) -> Any:
        # Read-only views, for the users who read them so: ``ck.directory`` is ``ck.config.directory``
        # (``ck.control_dir`` its control_path), ``ck.last_error`` what the saves left.
        config, record = self.__dict__.get("config"), self.__dict__.get("_record")
        if name in _CONFIG_VIEWS and config is not None:
            return getattr(config, _CONFIG_VIEWS[name])
        if name in _RECORD_VIEWS and record is not None:
            return getattr(record, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CONFIG_VIEWS or name in _RECORD_VIEWS:
            raise AttributeError(f"{name} is fixed when the Checkpointer is built: pass {name}= to it")
        super().__setattr__(name, value)

    # -- signals and requests ------------------------------------------------------------
    def install_signal_handlers(self) -> bool:
        """Install SIGTERM/SIGUSR1 handlers that only set flags (main thread
        only; returns False elsewhere). A previous Python handler is still
        called afterwards; the default action (terminate) is not."""
        return self._channel.install_signal_handlers()

    def uninstall_signal_handlers(self) -> None:
        """Put back the handlers that were there before."""
        self._channel.uninstall_signal_handlers()

    def request_checkpoint(
        self, reason: str = "proactive", *, preempt: bool = False, deadline: float | None = None
    ) -> None:
        """Ask for a checkpoint at the next :meth:`should_save` (in-process)."""
        self._channel.request(reason, preempt=preempt, deadline=deadline)

    # -- the training-loop API -------------------------------------------------------------
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
        return self._channel.preempted

    @property
    def request_pending(self) -> bool:
        """Whether a checkpoint request waits for the next save."""
        self._channel.poll()
        return bool(self._channel.pending)

    def has_saved(self, step: int) -> bool:
        """Whether ``step`` is already checkpointed (committed, being written,
        or restored)."""
        return step == self._policy.last_step

    def should_save(self, step: int) -> bool:
        """True when a checkpoint is due after ``step``: a request is pending,
        ``step`` is a positive multiple of ``save_every_steps``, or
        ``save_every_seconds`` passed since the last save.

        Under torch.distributed with more than one rank, requests, signals
        and the time interval are agreed on without blocking the step: what
        any rank sees makes every rank's ``should_save`` true at the same
        later step, the next one when steps are long, at most about 0.2 s
        later when they are short (see :meth:`SavePolicy.agree`)."""
        return self._trigger.should_save(step)

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
        _check_step(step)
        with self._save_lock:
            due = self._trigger.take(step)
            with gcpause.paused(due.preempt):  # a full collection would wait in the preemption's save
                return self._saver.save(step, state, due, epoch=epoch, metrics=metrics, blocking=blocking)

    # -- checkpoints a framework writes (Hugging Face Trainer, Lightning) -------------------
    @property
    def stop_requested(self) -> bool:
        """Whether the checkpoint due now is a preemption's: save this step,
        then stop. After :meth:`should_save` under torch.distributed, what
        every rank agreed on; otherwise whether a preempting request is
        pending."""
        return self._trigger.stop_requested

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
        _check_step(step)
        source = Path(folder)
        with self._save_lock:
            due = self._trigger.take(step)
            return self._saver.commit_folder(
                step, source, due, epoch=epoch, metrics=metrics, exclude=tuple(exclude), blocking=blocking
            )

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
        path = self._restorer.resume_folder()
        if path is None:
            log.info("no checkpoint to resume from; starting fresh")
            return None
        step = parse_checkpoint_name(path.name)
        self._resumed(path, step)
        log.info("resuming from %s (step %s)", path, step)
        return path

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
        restored = self._restorer.restore(
            model, optimizer, scheduler, restore_rng=restore_rng, strict=strict, objects=objects
        )
        if restored is not None:
            self._resumed(Path(restored.path), restored.step)
        return restored

    def _resumed(self, path: Path, step: int | None) -> None:
        """``path`` (of ``step``) is where training resumes: it counts as saved."""
        self._policy.saved(step)
        self._record.last_committed = path

    # -- the end -----------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight write; True when nothing is in flight any more."""
        return self._local.wait(timeout)

    def close(self) -> None:
        """Finish the in-flight write, tell the sidecar the trainer is done, and
        put back the previous signal handlers."""
        if self._closed:
            return
        self.wait()
        self._finish()
        self._channel.announce_exit(self._policy.last_step)
        if self._dist is not None:
            statedicts.leave()
        self._channel.release_signals()
        self._local.close()
        if isinstance(self._saver, CollectiveSave):
            self._saver.close()
        if self._pinned is not None:
            self._pinned.clear()  # host buffers and the storages tracked: nothing saves from them any more
        self._closed = True

    def _finish(self) -> None:
        """Before the trainer says it is done: no flag exchange pending when the process
        group is destroyed (:meth:`DistContext.settle_at_close`), and its last checkpoint
        verified by the uploader (bounded; see :meth:`TrainerChannel.await_final_verified`)."""
        if self._dist is not None:
            self._dist.settle_at_close()
        last = self._record.last_committed
        final = parse_checkpoint_name(last.name) if last is not None else None
        self._channel.await_final_verified(final, self.config.final_verify_seconds)

    def _atexit(self) -> None:
        with contextlib.suppress(Exception):
            self.wait()
        if not self._closed:
            self._finish()
        self._channel.announce_exit(self._policy.last_step)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# What help() and editors show: the configuration's keywords, not ``**settings``.
_init = inspect.signature(Checkpointer.__init__)
Checkpointer.__signature__ = _init.replace(  # type: ignore[attr-defined]
    parameters=[*list(_init.parameters.values())[1:-1], *keyword_parameters()]
)

#: The attributes that read the configuration (the field, or what it means: control_dir is control_path).
_CONFIG_VIEWS = {f.name: f.name for f in fields(CheckpointerConfig)} | {
    "control_dir": "control_path",
    "local_pruner": "local_pruner",
}
_RECORD_VIEWS = frozenset(f.name for f in fields(SaveRecord))


def _check_step(step: int) -> None:
    """A step must be a non-negative integer that a checkpoint name can hold."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    checkpoint_name(step)  # range check


def _flush_at_exit(ref: weakref.ref[Checkpointer]) -> None:
    """Finish an in-flight write when the interpreter exits normally."""
    checkpointer = ref()
    if checkpointer is not None:
        checkpointer._atexit()
