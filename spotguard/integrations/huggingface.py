"""spotguard for the Hugging Face ``Trainer``: two lines, the same guarantees.

::

    from spotguard.integrations.huggingface import SpotguardCallback, spotguard_resume_path

    trainer = Trainer(..., callbacks=[SpotguardCallback()])
    trainer.train(resume_from_checkpoint=spotguard_resume_path())

The Trainer keeps writing its own ``checkpoint-<step>/`` folders (model,
optimizer, scheduler, every rank's RNG, ``trainer_state.json``); the callback

- asks spotguard at every step end whether a checkpoint is due (its save
  interval, a ``spotguard ckpt`` request, a SIGTERM or an interruption
  notice; under torch.distributed every rank gets the same answer) and turns
  "due" into ``control.should_save``;
- commits every folder the Trainer saves (its own ``save_steps`` too) as a
  spotguard checkpoint (hard links, manifest with checksums written last),
  which the sidecar or ``spotguard run`` uploads and verifies;
- after the checkpoint of a preemption is committed, sets
  ``control.should_training_stop``: ``trainer.train()`` returns and the
  script ends normally.

:func:`spotguard_resume_path` returns the newest verified checkpoint (walking
back past damaged ones, every pickle in it scanned) as a folder the Trainer
resumes from exactly, or None for a fresh start. See docs/huggingface.md.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard.integrations import _core

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "spotguard.integrations.huggingface needs transformers; install it with: pip install 'spotguard[hf]'"
    ) from exc

if TYPE_CHECKING:
    from spotguard.trainer.checkpointer import Checkpointer

__all__ = ["SpotguardCallback", "spotguard_resume_path"]

log = logging.getLogger(__name__)

# The Trainer pickles its TrainingArguments into every checkpoint and never
# reads the file back on resume (it would need arbitrary classes to unpickle):
# left out of spotguard's checkpoint, so nothing unscannable is shipped.
EXCLUDE = ("training_args.bin",)

# Where the folders of steps after the one resumed from are moved (see
# on_train_begin). The Trainer's resume and rotation only look at
# ``checkpoint-*`` names directly in ``output_dir``, and a leading "_" keeps
# the folder out of its uploads to the Hub.
MOVED_DIR = "_spotguard-moved"


def spotguard_resume_path() -> str | None:
    """The checkpoint folder to pass as ``trainer.train(resume_from_checkpoint=...)``,
    or None (a fresh start).

    The newest checkpoint that verifies (sizes, checksums, no pickle that
    would run code, no file its manifest does not list), local or fetched
    from storage (``SPOTGUARD_STORAGE_URI``), walking back past bad ones
    with a warning that names the file. Under torchrun every rank gets the
    same folder: call it on every rank. It may be called before or after the
    ``TrainingArguments`` are built (a process group is initialized from
    torchrun's environment if none exists yet; the Trainer reuses it).
    """
    _core.ensure_process_group()
    path = _core.checkpointer().resume_folder()
    return None if path is None else str(path)


class SpotguardCallback(TrainerCallback):
    """Turns spotguard's save and preemption requests into the Trainer's own
    save and stop, and commits each ``checkpoint-<step>`` folder the Trainer
    writes as a spotguard checkpoint. ``checkpointer_options`` are passed to
    the process-wide :class:`spotguard.Checkpointer` when it is created (by
    default everything comes from the ``SPOTGUARD_*`` environment).

    Refuses ``TrainingArguments(enable_jit_checkpoint=True)``: the Trainer's
    just-in-time checkpoint replaces the SIGTERM handler and saves in the
    middle of a step, rank by rank; spotguard handles SIGTERM itself, at a
    step boundary every rank agrees on.
    """

    def __init__(self, **checkpointer_options: Any) -> None:
        self.checkpointer_options = checkpointer_options
        self._ckpt: Checkpointer | None = None
        self._committed_step: int | None = None
        self._stop_step: int | None = None

    @property
    def checkpointer(self) -> Checkpointer:
        """The process-wide Checkpointer (created on first use)."""
        if self._ckpt is None or self._ckpt.closed:
            _core.ensure_process_group()
            self._ckpt = _core.checkpointer(**self.checkpointer_options)
        return self._ckpt

    @property
    def preempted(self) -> bool:
        """True once a preemption's checkpoint is committed (the same on every
        rank): ``trainer.train()`` returned early and the script should end."""
        return self._ckpt is not None and self._ckpt.preempted

    # -- set-up checks -----------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        check_arguments(args)
        check_directory(output_dir_of(args), self.checkpointer.config.directory)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        check_arguments(args)
        ckpt = self.checkpointer
        check_directory(output_dir_of(args), ckpt.config.directory)
        self._committed_step = None
        self._stop_step = None
        if args.local_process_index == 0:
            # Folders of steps after the one resumed from belong to an attempt
            # this run replaces (a walk-back, a save cut short by a crash, or
            # another run in the same output_dir). The Trainer would write into
            # them again in place (their files may be hard links of a committed
            # checkpoint, which must never change) and its rotation would sort
            # them among the new ones. They may hold work spotguard never
            # committed: moved aside, not deleted.
            moved = move_aside_stale_folders(output_dir_of(args), state.global_step)
            if moved:
                log.warning(
                    "spotguard: moved %d folder(s) newer than the step resumed from (%d) aside, kept: %s",
                    len(moved),
                    state.global_step,
                    ", ".join(f"{old} -> {new}" for old, new in moved),
                )

    # -- the training loop ---------------------------------------------------------
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        ckpt = self.checkpointer
        # Every rank, every step: collective under torch.distributed (one small all_reduce).
        if ckpt.should_save(state.global_step):
            control.should_save = True
            if ckpt.stop_requested:
                # The stop itself waits for the committed checkpoint (on_save):
                # a save the Trainer drops (save_strategy="best" without a new
                # best) is asked for again at the next step instead of lost.
                self._stop_step = state.global_step

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if control.should_save and self._committed_step == state.global_step:
            # The epoch's last step is already saved and committed (a spotguard
            # request, or a stop mid-epoch with save_strategy="epoch"): a second
            # save would rewrite the committed files in place.
            control.should_save = False

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        step = state.global_step
        folder = output_dir_of(args) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        if not folder.is_dir():
            # Every rank must call commit_folder (it is collective): fail on all of them alike.
            raise RuntimeError(
                f"spotguard: the Trainer saved step {step} but {folder} does not exist "
                "(hyperparameter search runs are not supported)"
            )
        ckpt = self.checkpointer
        ckpt.commit_folder(
            step,
            folder,
            epoch=int(state.epoch) if state.epoch is not None else None,
            metrics=last_metrics(state),
            exclude=EXCLUDE,
        )
        self._committed_step = step
        if ckpt.preempted:
            control.should_training_stop = True
            if state.is_world_process_zero:
                log.warning("spotguard: preemption checkpoint of step %d committed; stopping training", step)
        self._stop_step = None

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # The last commit's checksums and manifest may still be in the background.
        if self._ckpt is not None:
            self._ckpt.wait()


def output_dir_of(args: TrainingArguments) -> Path:
    """The Trainer's ``output_dir`` (set by ``TrainingArguments`` when left out)."""
    return Path(args.output_dir or "trainer_output")


def check_arguments(args: TrainingArguments) -> None:
    """Refuse what cannot work with spotguard; warn about what weakens it."""
    if getattr(args, "enable_jit_checkpoint", False):
        raise ValueError(
            "SpotguardCallback and TrainingArguments(enable_jit_checkpoint=True) both handle SIGTERM: the "
            "Trainer's JIT checkpoint replaces the signal handler and saves in the middle of a step on each rank "
            "alone. Set enable_jit_checkpoint=False; spotguard saves on SIGTERM at a step boundary all ranks "
            "agree on, and uploads and verifies that checkpoint."
        )
    if getattr(args, "save_only_model", False):
        log.warning(
            "spotguard: save_only_model=True keeps optimizer, scheduler and RNG state out of the "
            "Trainer's checkpoints; a resumed run will not continue exactly"
        )


def check_directory(output_dir: Path, checkpoint_dir: Path) -> None:
    """Refuse a spotguard checkpoint directory that the Trainer's rotation
    (``save_total_limit``) could delete: inside one of its ``checkpoint-*`` folders."""
    out = output_dir.resolve()
    for p in (checkpoint_dir.resolve(), *checkpoint_dir.resolve().parents):
        if p.parent == out and fnmatch.fnmatch(p.name, f"{PREFIX_CHECKPOINT_DIR}-*"):
            raise ValueError(
                f"spotguard's checkpoint directory {checkpoint_dir} is inside the Trainer's "
                f"{p}, which its rotation deletes; use a directory outside it"
            )


def stale_folders(output_dir: Path, step: int) -> list[Path]:
    """Pure but for listing: the Trainer's ``checkpoint-<N>`` folders with N > ``step``."""
    found = []
    if output_dir.is_dir():
        for p in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
            tail = p.name[len(PREFIX_CHECKPOINT_DIR) + 1 :]
            if tail.isdigit() and int(tail) > step and p.is_dir():
                found.append(p)
    return sorted(found, key=lambda p: int(p.name.rsplit("-", 1)[1]))


def move_aside_stale_folders(output_dir: Path, step: int) -> list[tuple[Path, Path]]:
    """Move the folders of :func:`stale_folders` into a new
    ``<output_dir>/_spotguard-moved/<UTC time>/``, names unchanged; returns
    (old, new) pairs. A folder gone meanwhile (moved by another node sharing
    the directory) is skipped."""
    stale = stale_folders(output_dir, step)
    if not stale:
        return []
    batch = new_moved_dir(output_dir / MOVED_DIR)
    moved = []
    for old in stale:
        new = batch / old.name
        try:
            os.rename(old, new)
        except FileNotFoundError:
            continue
        moved.append((old, new))
    if not moved:
        with contextlib.suppress(OSError):
            batch.rmdir()
    return moved


def new_moved_dir(parent: Path) -> Path:
    """A new, empty folder in ``parent`` named for the current UTC time."""
    parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for n in range(1, 10_000):
        path = parent / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free folder name for {stamp} in {parent}")


def last_metrics(state: TrainerState) -> dict[str, float] | None:
    """The numbers of the Trainer's newest log entry (loss, learning rate, eval
    metrics), recorded in the manifest for retention by metric."""
    for entry in reversed(state.log_history or []):
        numbers = {
            k: float(v)
            for k, v in entry.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "epoch")
        }
        if numbers:
            return numbers
    return None
