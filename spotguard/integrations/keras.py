"""spotguard for Keras 3 (torch backend): preemption-safe ``model.fit`` in one line.

::

    from spotguard.integrations.keras import SpotguardCallback

    model.fit(x, y, epochs=10, callbacks=[SpotguardCallback()])

:class:`SpotguardCallback` saves the whole training state as a spotguard
checkpoint (``Checkpointer.save``: safetensors and JSON, manifest with
checksums written last) whenever spotguard wants one (every N steps, a
save-now request, a preemption: ``Checkpointer.should_save``), stops the
fit right after a preemption's checkpoint is committed, and on the next
start makes ``fit`` continue from the newest verified checkpoint: the epoch
(``initial_epoch``) and, mid-epoch, the batch.

A checkpoint holds every variable of the model (weights, non-trainable
state, each ``keras.random.SeedGenerator`` of its layers), of the optimizer
(``iterations`` included) and of the compiled metrics, the position (epoch,
batches done), the global RNGs (python, numpy, torch, Keras's global seed
generator, and the generators handed to the callback) at the save and at
the start of its epoch. A mid-epoch resume replays the epoch's data from
its start without training on the batches already done (the data order
comes out the same when it depends only on those RNGs), then puts back the
RNGs of the save. Loading reads JSON and safetensors only: nothing in a
checkpoint is unpickled or deserialized into objects. See docs/keras.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Keras picks its backend when it is first imported; spotguard needs torch.
os.environ.setdefault("KERAS_BACKEND", "torch")

try:
    import keras
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("spotguard.integrations.keras needs Keras 3.6 or newer: pip install 'spotguard[keras]'") from exc

if keras.backend.backend() != "torch":  # pragma: no cover - depends on the environment
    raise ImportError(
        f"spotguard.integrations.keras needs Keras's torch backend, but Keras uses {keras.backend.backend()!r}: "
        "set KERAS_BACKEND=torch before keras is first imported"
    )

import numpy as np

from spotguard.checkpoint.local.codec import StateError
from spotguard.checkpoint.local.commit import load_checkpoint_state
from spotguard.checkpoint.store.retention import RetentionPolicy
from spotguard.integrations import _core
from spotguard.trainer.checkpointer import Checkpointer
from spotguard.trainer.state import capture_rng, generator_kind, generator_state, restore_rng, set_generator_state

log = logging.getLogger(__name__)

#: The version of the ``keras`` entry of a checkpoint's state.
STATE_FORMAT = 1
#: Where a checkpoint was taken: after a batch inside an epoch, at the end
#: of an epoch (after its validation), or at the end of the fit.
MID_EPOCH = "mid_epoch"
EPOCH_END = "epoch_end"
FINAL = "final"
POSITIONS = (MID_EPOCH, EPOCH_END, FINAL)
#: A mid-epoch checkpoint's metrics carry this prefix: they are the epoch's
#: running values so far, not comparable with an epoch's (keep-best).
RUNNING_PREFIX = "running_"
#: Keras's global seed generator (``keras.random.*`` with ``seed=None``).
_GLOBAL_SEED_GENERATOR = "global_seed_generator"


# -- pure helpers ------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed fit continues: the epoch ``fit`` starts with
    (``initial_epoch``) and how many of its batches are already done."""

    epoch: int
    skip_batches: int

    @classmethod
    def of(cls, position: str, epoch: int, batches_done: int) -> ResumePoint:
        """From a checkpoint's position (pure): mid-epoch, the same epoch
        with its done batches skipped; at an epoch's end or the fit's end,
        the next epoch from its start. Raises ValueError for a position
        this version does not know."""
        if epoch < 0 or batches_done < 0:
            raise ValueError(f"checkpoint position epoch={epoch}, batches_done={batches_done} is negative")
        if position == MID_EPOCH:
            return cls(epoch, batches_done)
        if position in (EPOCH_END, FINAL):
            return cls(epoch + 1, 0)
        raise ValueError(f"unknown checkpoint position {position!r} (written by a newer spotguard?)")

    def skips(self, batch: int) -> bool:
        """Whether ``batch`` (0-based, in the resumed epoch) is one of the done ones."""
        return batch < self.skip_batches

    def last_skipped(self, batch: int) -> bool:
        """Whether ``batch`` is the last done one: the RNGs of the save go back after it."""
        return self.skip_batches > 0 and batch + 1 == self.skip_batches


def variable_keys(paths: Sequence[str]) -> list[str]:
    """Keys for variables in order (pure): each variable's path, a repeated
    path numbered (``path#2``) so that every variable has its own key."""
    seen: dict[str, int] = {}
    keys: list[str] = []
    for path in paths:
        n = seen.get(path, 0) + 1
        seen[path] = n
        keys.append(path if n == 1 else f"{path}#{n}")
    return keys


def checkpoint_metrics(logs: Mapping[str, Any] | None, position: str) -> dict[str, float]:
    """The numbers of Keras's ``logs`` to record in a checkpoint's manifest
    (pure): under their Keras names (``loss``, ``val_loss``, ``accuracy``)
    at an epoch's end, prefixed ``running_`` mid-epoch, where they are the
    epoch's running averages so far (what keep-best by ``loss`` must not
    compare with whole epochs). Non-numeric and non-finite values are left out."""
    prefix = RUNNING_PREFIX if position == MID_EPOCH else ""
    out: dict[str, float] = {}
    for key, value in (logs or {}).items():
        if isinstance(value, bool | str):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if np.isfinite(number):
            out[prefix + str(key)] = number
    return out


def best_metric_retention(monitor: str, mode: str = "auto", save_freq: str | int = "epoch") -> RetentionPolicy:
    """spotguard's keep-best retention for Keras's
    ``ModelCheckpoint(monitor=..., mode=..., save_best_only=True, save_freq=...)``
    (pure): ``keepBest: 1``, ``bestMetric`` the monitored name (prefixed
    ``running_`` for ``save_freq`` in batches, whose checkpoints are taken
    mid-epoch), ``bestMode`` the mode. ``mode="auto"`` is resolved for
    losses only (``min``); for other metrics pass ``"min"`` or ``"max"``."""
    if mode == "auto":
        if monitor.removeprefix("val_").removeprefix(RUNNING_PREFIX).endswith("loss"):
            mode = "min"
        else:
            raise ValueError(f"cannot tell whether {monitor!r} is better low or high: pass mode='min' or mode='max'")
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
    metric = monitor if save_freq == "epoch" else RUNNING_PREFIX + monitor
    return RetentionPolicy(keep_best=1, metric=metric, mode=mode)


# -- RNG state ---------------------------------------------------------------------------


_KERAS_SEED = "keras_seed"


def _generator_kind(obj: Any) -> str:
    kind = generator_kind(obj)
    if kind is not None:
        return kind
    if isinstance(obj, keras.random.SeedGenerator):
        return _KERAS_SEED
    raise TypeError(
        f"cannot save the state of a {type(obj).__module__}.{type(obj).__qualname__}: generators= takes "
        "torch.Generator, numpy.random.Generator or RandomState, random.Random and keras.random.SeedGenerator"
    )


def _generator_state(obj: Any) -> Any:
    kind = _generator_kind(obj)
    return obj.state.value.detach().clone() if kind == _KERAS_SEED else generator_state(obj, kind)


def _set_generator_state(obj: Any, state: Any) -> None:
    kind = _generator_kind(obj)
    if kind == _KERAS_SEED:
        obj.state.assign(state)
    else:
        set_generator_state(obj, kind, state)


def _keras_global_seed() -> Any:
    """The state of Keras's global seed generator, None while it does not exist
    (looked up without creating it: creating one draws from python's RNG)."""
    try:
        from keras.src.backend.common import global_state
    except ImportError:  # pragma: no cover - a Keras that moved it
        return None
    gen = global_state.get_global_attribute(_GLOBAL_SEED_GENERATOR)
    return None if gen is None else gen.state.value.detach().clone()


def _set_keras_global_seed(state: Any) -> None:
    try:
        from keras.src.backend.common import global_state
    except ImportError:  # pragma: no cover
        return
    if state is None:
        # It did not exist yet at the save: created on first use, as then.
        global_state.set_global_attribute(_GLOBAL_SEED_GENERATOR, None)
        return
    gen = global_state.get_global_attribute(_GLOBAL_SEED_GENERATOR)
    if gen is None:
        gen = keras.random.SeedGenerator(seed=0)
        global_state.set_global_attribute(_GLOBAL_SEED_GENERATOR, gen)
    gen.state.assign(state)


def capture_rngs(generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every RNG a Keras fit on torch draws from: python, numpy, torch (CPU,
    and CUDA when initialized), Keras's global seed generator, and the named
    ``generators``; copies, as a tree the checkpoint codec stores."""
    return {
        "global": capture_rng(),
        "keras_global_seed": _keras_global_seed(),
        "generators": {name: _generator_state(g) for name, g in (generators or {}).items()},
    }


def restore_rngs(state: Mapping[str, Any], generators: Mapping[str, Any] | None = None) -> None:
    """Put back what :func:`capture_rngs` returned (a generator the state
    does not name keeps its state, with a warning)."""
    restore_rng(state["global"])
    _set_keras_global_seed(state.get("keras_global_seed"))
    saved = state.get("generators") or {}
    for name, gen in (generators or {}).items():
        if name in saved:
            _set_generator_state(gen, saved[name])
        else:
            log.warning(
                "the checkpoint holds no state of generator %r: it is not restored, the resume is not exact", name
            )


# -- variables ---------------------------------------------------------------------------


def _variables_state(variables: Sequence[Any]) -> dict[str, Any]:
    """``{key: torch tensor}`` of Keras variables (the codec copies them to host memory)."""
    keys = variable_keys([str(v.path) for v in variables])
    return {key: v.value for key, v in zip(keys, variables, strict=True)}


def _load_variables(variables: Sequence[Any], saved: Mapping[str, Any], what: str, where: Path) -> None:
    """Assign saved values to ``variables``: the same keys and shapes, or a
    ValueError that says what differs (before anything is assigned)."""
    keys = variable_keys([str(v.path) for v in variables])
    if set(keys) != set(saved):
        missing = sorted(set(saved) - set(keys))[:3]
        extra = sorted(set(keys) - set(saved))[:3]
        raise ValueError(
            f"{where}: the checkpoint's {what} variables do not match this fit's (only in the checkpoint: {missing}, "
            f"only here: {extra}); it was written by another model or optimizer: build the same model, or start "
            "with another SPOTGUARD_CHECKPOINT_DIR and storage prefix"
        )
    for key, v in zip(keys, variables, strict=True):
        value = saved[key]
        if tuple(value.shape) != tuple(v.shape):
            raise ValueError(
                f"{where}: {what} variable {key} has shape {tuple(value.shape)} in the checkpoint, "
                f"{tuple(v.shape)} here: build the same model"
            )
    for key, v in zip(keys, variables, strict=True):
        v.assign(saved[key])


# -- the callback ------------------------------------------------------------------------


class SpotguardCallback(keras.callbacks.Callback):  # type: ignore[misc]  # keras has no types
    """Checkpoints a Keras fit through spotguard, stops it on a preemption,
    and resumes it where the newest verified checkpoint left off.

    At every batch end it asks ``Checkpointer.should_save(step)`` (``step``:
    the optimizer's iterations); when due it saves the state after that
    batch. A checkpoint due at the last batch of an epoch is taken at the
    epoch's end instead (after validation, so it records ``val_*``
    metrics), except for a preemption, which saves at once. On a
    preemption the fit stops right after the checkpoint is committed
    (``model.stop_training``; the partial epoch's validation is skipped)
    and :attr:`preempted` is True.

    At the start of ``fit`` it loads the newest verified checkpoint
    (``Checkpointer.resume_folder``: local, or a newer one from storage,
    walking back past bad ones) into the model, optimizer and metrics and
    sets the epoch ``fit`` starts with; mid-epoch, the batches already
    done are read again but not trained on. The model must be compiled
    with an optimizer (``fit`` builds its variables, the optimizer's and
    the metrics' before ``on_train_begin``).

    ``checkpointer``: a :class:`spotguard.Checkpointer` (default the
    process-wide one of :mod:`spotguard.integrations`, from the
    ``SPOTGUARD_*`` environment, which also handles SIGTERM).
    ``save_every_epochs``: also save at the end of every N-th epoch
    (``ModelCheckpoint``'s ``save_freq="epoch"`` is 1). ``save_final``:
    save the state at the end of the fit (a later start has nothing left
    to train). ``generators``: named RNGs of the data pipeline that the
    global ones do not cover (``torch.Generator``, numpy ``Generator`` /
    ``RandomState``, ``random.Random``, ``keras.random.SeedGenerator``),
    saved and restored with them.
    """

    def __init__(
        self,
        checkpointer: Checkpointer | None = None,
        *,
        save_every_epochs: int | None = None,
        save_final: bool = True,
        generators: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if save_every_epochs is not None and save_every_epochs < 1:
            raise ValueError(f"save_every_epochs must be at least 1, got {save_every_epochs}")
        self.generators = dict(generators or {})
        for gen in self.generators.values():
            _generator_kind(gen)  # a TypeError now rather than at the first save
        self._given = checkpointer
        self._ckpt: Checkpointer | None = checkpointer
        self.save_every_epochs = save_every_epochs
        self.save_final = save_final
        #: True once a preemption's checkpoint is committed and the fit stops.
        self.preempted = False
        #: The step (optimizer iterations) of the last checkpoint saved by this fit.
        self.last_saved_step: int | None = None
        #: The step of the checkpoint this fit resumed from; None for a fresh start.
        self.resumed_from: int | None = None
        #: Optimizer steps so far (the checkpoints' step).
        self.step = 0
        self._epoch = 0
        self._batches_done = 0
        self._batch_begin = 0
        self._num_batches: int | None = None
        self._deferred = False
        self._epoch_start_rng: dict[str, Any] | None = None
        self._resume: _PendingResume | None = None
        self._train_function: Callable[..., Any] | None = None

    # -- setup ---------------------------------------------------------------------------
    @property
    def checkpointer(self) -> Checkpointer:
        """The Checkpointer in use (created on first use)."""
        if self._ckpt is None or self._ckpt.closed:
            self._ckpt = _core.checkpointer()
        return self._ckpt

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        ckpt = self.checkpointer
        self.preempted = False
        self.last_saved_step = None
        self.resumed_from = None
        self._deferred = False
        self._resume = None
        steps = (self.params or {}).get("steps")
        self._num_batches = int(steps) if steps else None
        self._check_model()
        folder = ckpt.resume_folder()
        if folder is not None:
            self.step = self._load(folder)
        else:
            self.step = int(self.model.optimizer.iterations.value)

    def _check_model(self) -> None:
        model = self.model
        if getattr(model, "optimizer", None) is None:
            raise ValueError("SpotguardCallback needs a compiled model: call model.compile(optimizer=...) before fit")
        if not model.built or not model.optimizer.built:
            raise ValueError(
                "SpotguardCallback needs a built model: build it before fit (keras.Input(...) in a "
                "Sequential, model.build(shape), or call it on a batch)"
            )

    def _load(self, folder: Path) -> int:
        """Load the checkpoint in ``folder``; returns its step."""
        try:
            state = load_checkpoint_state(folder)
        except StateError as exc:
            raise ValueError(f"{folder}: cannot load the checkpoint: {exc}") from None
        meta = state.get("keras")
        if not isinstance(meta, Mapping) or meta.get("format") != STATE_FORMAT:
            raise ValueError(
                f"{folder} is a spotguard checkpoint not written by SpotguardCallback for Keras "
                f"(format {STATE_FORMAT}); restore it yourself, or start with another checkpoint "
                "directory and storage prefix"
            )
        model = self.model
        _load_variables(model.variables, state["model"], "model", folder)
        _load_variables(model.optimizer.variables, state["optimizer"], "optimizer", folder)
        point = ResumePoint.of(str(meta["position"]), int(meta["epoch"]), int(meta["batches_done"]))
        saved_batches = meta.get("num_batches")
        if point.skip_batches and saved_batches is not None and saved_batches != self._num_batches:
            log.warning(
                "the checkpoint's epochs had %s batches, this fit's have %s: the mid-epoch resume is not "
                "exact (same data and batch_size needed)",
                saved_batches,
                self._num_batches,
            )
        self.resumed_from = int(meta["step"])
        if point.epoch:
            # What fit reads after on_train_begin (as keras.callbacks.BackupAndRestore does).
            model._initial_epoch = point.epoch
        if point.skip_batches:
            self._resume = _PendingResume(
                point,
                state["rng"]["epoch_start"],
                state["rng"]["now"],
                state.get("metrics") or {},
                dict(meta.get("logs") or {}),
                folder,
            )
            self._wrap_train_function()
        else:
            # Before anything of the next epoch draws (its loader's shuffle).
            restore_rngs(state["rng"]["now"], self.generators)
        log.info(
            "resuming from %s (step %d): epoch %d%s",
            folder,
            self.resumed_from,
            point.epoch + 1,
            f" after its first {point.skip_batches} batches" if point.skip_batches else "",
        )
        return self.resumed_from

    # -- skipping the batches of a mid-epoch resume ----------------------------------------
    def _wrap_train_function(self) -> None:
        """Replace the model's train function until the done batches are
        read: the fit loop calls ``model.train_function(data)`` per batch,
        and a done batch returns the checkpoint's logs without training."""
        model = self.model
        original = model.train_function
        if original is None:  # pragma: no cover - fit makes it before on_train_begin
            original = model.make_train_function()
        self._train_function = original

        def train_or_skip(data: Any) -> Any:
            resume = self._resume
            if resume is not None and resume.point.skips(self._batch_begin):
                return dict(resume.logs)
            self._unwrap_train_function()
            return original(data)

        model.train_function = train_or_skip

    def _unwrap_train_function(self) -> None:
        if self._train_function is not None:
            self.model.train_function = self._train_function
            self._train_function = None

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._epoch = epoch
        self._batches_done = 0
        self._deferred = False
        resume = self._resume
        if resume is not None:
            if epoch == resume.point.epoch:
                # The loader draws this epoch's order after this hook, from the
                # RNGs of the epoch's start; Keras reset the metrics just before.
                restore_rngs(resume.epoch_start_rng, self.generators)
                _load_variables(self.model.metrics_variables, resume.metrics, "metrics", resume.folder)
            else:
                log.warning(
                    "the fit starts with epoch %d, the checkpoint is in epoch %d: its done batches are not "
                    "skipped, the resume is not exact",
                    epoch + 1,
                    resume.point.epoch + 1,
                )
                self._resume = None
                self._unwrap_train_function()
        self._epoch_start_rng = capture_rngs(self.generators)

    def on_train_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._batch_begin = batch

    # -- saving ----------------------------------------------------------------------------
    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._batches_done = batch + 1
        ckpt = self.checkpointer
        resume = self._resume
        if resume is not None and resume.point.skips(batch):
            if resume.point.last_skipped(batch):
                # The next batch is the first to train: from here on the
                # numbers the interrupted fit drew after its checkpoint.
                restore_rngs(resume.now_rng, self.generators)
                self._resume = None
                self._unwrap_train_function()
            if ckpt.should_save(self.step) and ckpt.stop_requested and ckpt.has_saved(self.step):
                # The state is the checkpoint's: answering with it stops the fit.
                ckpt.save(self.step, {}, blocking=True)
                self._stop("the checkpoint resumed from")
            return
        self.step += 1
        if not ckpt.should_save(self.step):
            return
        stop = ckpt.stop_requested
        if not stop and self._num_batches is not None and batch + 1 >= self._num_batches:
            self._deferred = True  # saved by on_epoch_end, with the epoch's validation metrics
            return
        self._save(MID_EPOCH, logs)
        if stop or ckpt.preempted:
            self._stop(f"step {self.step}")

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self.preempted:
            return
        ckpt = self.checkpointer
        due = ckpt.should_save(self.step) or self._deferred
        if self.save_every_epochs and (epoch + 1) % self.save_every_epochs == 0:
            due = True
        self._deferred = False
        if not due or (ckpt.has_saved(self.step) and not ckpt.request_pending):
            return
        stop = ckpt.stop_requested
        self._save(EPOCH_END, logs)
        if stop or ckpt.preempted:
            self._stop(f"step {self.step}")

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        self._unwrap_train_function()
        self._resume = None
        model = self.model
        model.__dict__.pop("_should_eval", None)
        model._initial_epoch = None
        try:
            if self.save_final and not self.preempted and self.step > 0:
                ckpt = self.checkpointer
                if not ckpt.has_saved(self.step) or ckpt.request_pending:
                    self._save(FINAL, logs)
        finally:
            if self._given is None:
                _core.reset()  # finish writes and uploads; a later fit gets a fresh one
            else:
                self._given.wait()

    def _stop(self, what: str) -> None:
        """Stop the fit after this batch; its partial epoch is not validated
        (the checkpoint is committed, the grace period is short)."""
        self.preempted = True
        model = self.model
        model.stop_training = True
        if hasattr(model, "_should_eval"):
            model._should_eval = lambda *args, **kwargs: False  # removed in on_train_end
        log.info("preempted: checkpoint of %s committed, stopping the fit", what)

    def _save(self, position: str, logs: Mapping[str, Any] | None) -> None:
        model = self.model
        ckpt = self.checkpointer
        clean_logs = checkpoint_metrics(logs, EPOCH_END)
        rng: dict[str, Any] = {"now": capture_rngs(self.generators)}
        if position == MID_EPOCH:
            rng["epoch_start"] = self._epoch_start_rng
        state = {
            "model": _variables_state(model.variables),
            "optimizer": _variables_state(model.optimizer.variables),
            "metrics": _variables_state(model.metrics_variables) if position == MID_EPOCH else {},
            "rng": rng,
            "keras": {
                "format": STATE_FORMAT,
                "position": position,
                "epoch": self._epoch,
                "step": self.step,
                "batches_done": self._batches_done if position == MID_EPOCH else 0,
                "num_batches": self._num_batches,
                "logs": clean_logs,
                "keras_version": keras.__version__,
            },
        }
        ckpt.save(self.step, state, epoch=self._epoch, metrics=checkpoint_metrics(logs, position))
        self.last_saved_step = self.step


@dataclass
class _PendingResume:
    """What a mid-epoch resume still has to do once its epoch begins."""

    point: ResumePoint
    epoch_start_rng: Mapping[str, Any]
    now_rng: Mapping[str, Any]
    metrics: Mapping[str, Any]
    logs: dict[str, float]
    folder: Path


__all__ = [
    "EPOCH_END",
    "FINAL",
    "MID_EPOCH",
    "ResumePoint",
    "SpotguardCallback",
    "best_metric_retention",
    "capture_rngs",
    "checkpoint_metrics",
    "restore_rngs",
    "variable_keys",
]
