"""spotguard for PyTorch Lightning: preemption-safe ``Trainer.fit`` in two lines.

::

    trainer = lightning.Trainer(..., callbacks=[SpotguardCallback()])
    trainer.fit(model, datamodule, ckpt_path=spotguard_ckpt_path())

:class:`SpotguardCallback` lets Lightning write its own checkpoint
(``trainer.save_checkpoint``) whenever spotguard wants one (every N steps,
a save-now request, a preemption: ``Checkpointer.should_save``) and commits
it as a spotguard checkpoint (manifest with checksums written last) for the
uploader. A preemption stops the fit right after that checkpoint is
committed. :func:`spotguard_ckpt_path` hands Lightning the newest verified
checkpoint on the next start (every pickle in it scanned first), or None.

Lightning's checkpoint alone does not resume exactly: it holds neither the
random number generators nor the position of a plain ``DataLoader``. The
callback adds, per rank, every RNG (python, numpy, torch CPU and CUDA) and
the state of a :class:`ResumableSampler` (or Lightning saves a torchdata
``StatefulDataLoader``'s), restored at the point where an uninterrupted fit
would have drawn the same numbers. See docs/lightning.md.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import random
import shutil
import signal
from collections.abc import Iterator, Mapping, Sized
from pathlib import Path
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _Stateful
    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "spotguard.integrations.lightning needs PyTorch Lightning 2.5 or newer: pip install 'spotguard[lightning]'"
    ) from exc

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from spotguard.integrations import _core
from spotguard.trainer.checkpointer import Checkpointer

log = logging.getLogger(__name__)

#: The name of Lightning's checkpoint file inside a spotguard checkpoint.
CKPT_NAME = "lightning.ckpt"
#: Each rank's state (RNG, samplers): JSON, never a pickle.
RANK_FILE = "spotguard-rank-{rank:05d}.json"
RANK_FORMAT = 1
#: Where Lightning writes a checkpoint before it is committed (inside the
#: checkpoint directory: the same file system, so committing hard-links).
STAGING_DIR = ".lightning-staging"


# -- the resumable sampler ---------------------------------------------------------


class ResumableSampler(DistributedSampler[int]):
    """A shuffling sampler whose position can be saved and restored mid-epoch.

    Each epoch's order is a permutation drawn from a generator of its own,
    seeded from (``seed``, epoch): no global RNG is touched, and the order
    of an epoch is the same whether or not the run was interrupted. Under
    several ranks it shards like ``DistributedSampler`` (padded to equal
    lengths, or trimmed with ``drop_last``); being one, Lightning keeps it
    (no sampler of its own injected) and calls :meth:`set_epoch`.

    :meth:`state_dict` / :meth:`load_state_dict` save and restore (epoch,
    samples consumed in it); a restored sampler's next iteration starts
    after the consumed samples. :class:`SpotguardCallback` does this for
    the samplers of the training loaders. ``num_replicas`` and ``rank``
    default to torch.distributed's, else torchrun's ``WORLD_SIZE``/``RANK``,
    else one rank.
    """

    def __init__(
        self,
        data_source: Sized,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None:
            num_replicas = (
                dist.get_world_size()
                if dist.is_available() and dist.is_initialized()
                else (_core.torchrun_world_size())
            )
        if rank is None:
            rank = (
                dist.get_rank()
                if dist.is_available() and dist.is_initialized()
                else int(os.environ.get("RANK", "0") or 0)
            )
        super().__init__(
            data_source,  # type: ignore[arg-type]
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.size = len(data_source)
        self._resume_at = 0  # samples of self.epoch to skip at the next iteration
        self._yielded = 0  # samples of self.epoch yielded by the current iteration
        self.started = False  # whether an iteration has drawn its first sample

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's samples of ``epoch``, in order (pure)."""
        if self.shuffle:
            gen = torch.Generator().manual_seed(_mix(self.seed, epoch))
            order = torch.randperm(self.size, generator=gen).tolist()
        else:
            order = list(range(self.size))
        if self.drop_last:
            order = order[: self.total_size]
        elif order and len(order) < self.total_size:
            pad = self.total_size - len(order)
            order += (order * math.ceil(pad / len(order)))[:pad]
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        # A generator: the resume position is taken when the first sample
        # is drawn, not when the loader builds its iterator.
        start, self._resume_at = self._resume_at, 0
        self._yielded = start
        self.started = True
        for index in self.epoch_indices(self.epoch)[start:]:
            self._yielded += 1
            yield index

    def __len__(self) -> int:
        # The whole epoch's length, also when resumed mid-epoch: Lightning
        # counts the batches of an epoch from it.
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next iteration (Lightning calls it at
        every epoch start; the same epoch keeps a restored position)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._resume_at = 0

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The position: ``consumed`` samples of the current epoch are done
        (default: those yielded so far; the callback passes what training
        actually consumed, which a loader's prefetching may trail)."""
        done = self._yielded if consumed is None else consumed
        return {
            "epoch": int(self.epoch),
            "consumed": int(min(max(done, 0), self.num_samples)),
            "seed": int(self.seed),
            "size": int(self.size),
            "num_replicas": int(self.num_replicas),
            "shuffle": bool(self.shuffle),
            "drop_last": bool(self.drop_last),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after the saved position (an epoch whose samples were
        all consumed continues with the next epoch). Raises ValueError when
        the state is of a sampler over other data or another setup."""
        for key, mine in (
            ("seed", self.seed),
            ("size", self.size),
            ("num_replicas", self.num_replicas),
            ("shuffle", self.shuffle),
            ("drop_last", self.drop_last),
        ):
            if key in state and state[key] != mine:
                raise ValueError(f"sampler state has {key}={state[key]!r}, this sampler {mine!r}")
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if consumed >= self.num_samples:
            epoch, consumed = epoch + 1, 0
        self.epoch = epoch
        self._resume_at = consumed
        self._yielded = consumed


#: The name the contract and the docs also use for it.
ResumableRandomSampler = ResumableSampler


def _mix(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch), distinct for distinct pairs in practice."""
    return (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


# -- RNG state as JSON ----------------------------------------------------------------


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.detach().cpu().contiguous().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """Every RNG of this process (python, numpy, torch CPU, each CUDA
    device when present) as JSON-ready data."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    assert isinstance(np_state, dict)
    out: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": np_state["state"]["key"].tolist(),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`rng_state` returned."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": npst["bit_generator"],
            "state": {"key": np.asarray(npst["key"], dtype=np.uint32), "pos": npst["pos"]},
            "has_gauss": npst["has_gauss"],
            "gauss": npst["gauss"],
        }
    )
    torch.set_rng_state(_unb64(state["torch"]))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            log.warning(
                "checkpoint holds the RNG of %d CUDA devices, this process sees %d: restoring the first ones",
                len(cuda),
                torch.cuda.device_count(),
            )
        for device, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_unb64(s), device)


# -- the callback ---------------------------------------------------------------------


def _flat_loaders(obj: Any) -> list[Any]:
    """The loaders of ``trainer.train_dataloader`` (one, or a list/dict of them)."""
    if isinstance(obj, Mapping):
        return [x for v in obj.values() for x in _flat_loaders(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _flat_loaders(v)]
    return [obj] if obj is not None else []


def _resumable_sampler(loader: Any) -> ResumableSampler | None:
    batch_sampler = getattr(loader, "batch_sampler", None)
    for candidate in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(candidate, ResumableSampler):
            return candidate
    return None


def _batch_size(loader: Any) -> int | None:
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return int(size) if size else None


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class SpotguardCallback(pl.Callback):
    """Saves through Lightning when spotguard asks, commits each checkpoint,
    stops the fit on a preemption, and makes ``ckpt_path`` resumes exact.

    At every batch end that completes an optimizer step, every rank asks
    ``Checkpointer.should_save(trainer.global_step)`` (collective under
    torch.distributed: all ranks agree). When due, Lightning writes
    ``lightning.ckpt`` (``trainer.save_checkpoint``) and each rank its RNG
    and sampler state (``spotguard-rank-NNNNN.json``) into a staging folder,
    which is then committed as spotguard checkpoint ``ckpt-<global_step>``.
    On a preemption the fit stops right after that batch.

    ``checkpointer``: a :class:`spotguard.Checkpointer` to use (default the
    process-wide one of :mod:`spotguard.integrations`, from the
    ``SPOTGUARD_*`` environment). ``save_final``: also commit the state at
    the end of the fit (a later start then has nothing left to train).
    ``take_over_sigterm``: stop Lightning's own SIGTERM handler for the fit
    (see docs/lightning.md; spotguard's flag-only handler stays).
    """

    def __init__(
        self,
        checkpointer: Checkpointer | None = None,
        *,
        save_final: bool = True,
        take_over_sigterm: bool = True,
    ) -> None:
        self._given = checkpointer
        self._ckpt: Checkpointer | None = checkpointer
        self.save_final = save_final
        self.take_over_sigterm = take_over_sigterm
        self.preempted = False
        self.last_saved_step: int | None = None
        self._pending: dict[str, Any] | None = None
        self._deferred: tuple[int, bool] | None = None
        self._saved_world_size: int | None = None

    # -- setup ----------------------------------------------------------------------
    @property
    def checkpointer(self) -> Checkpointer:
        """The Checkpointer in use (created on first use)."""
        if self._ckpt is None or self._ckpt.closed:
            self._ckpt = _core.checkpointer()
        return self._ckpt

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        ckpt = self.checkpointer  # the process group exists by now: collective under DDP
        self.preempted = False
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
            # Staging folders of a process that died mid-save.
            shutil.rmtree(ckpt.config.directory / STAGING_DIR, ignore_errors=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.take_over_sigterm:
            self._quiet_lightning_sigterm(trainer)
        pending, self._pending = self._pending, None
        if pending is None:
            return
        loaders = _flat_loaders(trainer.train_dataloader)
        samplers = pending.get("samplers") or []
        for i, loader in enumerate(loaders):
            sampler = _resumable_sampler(loader)
            if sampler is not None and i < len(samplers) and samplers[i] is not None:
                if sampler.started:
                    # Worker processes took indices when the iterator was built.
                    log.warning(
                        "the training loader's ResumableSampler was iterated before the resume "
                        "(num_workers > 0?): its position cannot be restored; the resumed fit is "
                        "not exact (use num_workers=0, or a StatefulDataLoader)"
                    )
                    continue
                sampler.load_state_dict(samplers[i])
        if pending["position"] == "epoch_end" and any(isinstance(dl, _Stateful) for dl in loaders):
            log.warning(
                "resumed at an epoch end with a StatefulDataLoader: Lightning 2.6 does not load a "
                "loader's state from a checkpoint taken at the end of an epoch, so the next epoch's "
                "order starts from the loader's initial state; the resumed fit is not exact "
                "(spotguard's ResumableSampler is)"
            )
        if pending["position"] == "mid_epoch":
            # The loader's iterator for the rest of the epoch is built by now
            # (it drew its workers' base seed, which the uninterrupted fit drew
            # at the epoch's start): from here on the same numbers.
            set_rng_state(pending["rng"])

    def _quiet_lightning_sigterm(self, trainer: pl.Trainer) -> None:
        """Remove Lightning's SIGTERM notifier from the handler it installed
        for the fit (its other handlers, spotguard's among them, stay).

        Lightning's notifier runs a collective (``dist.broadcast``) inside
        the signal handler under DDP and makes the loops raise
        ``SIGTERMException`` after the batch; spotguard's handler only sets
        a flag, and the checkpoint of the agreed step comes first. Put back
        by Lightning at the end of the fit."""
        handler = signal.getsignal(signal.SIGTERM)
        if not isinstance(handler, _HandlersCompose):
            return
        connector = trainer._signal_connector
        kept = [h for h in handler.signal_handlers if getattr(h, "__self__", None) is not connector]
        if kept and len(kept) < len(handler.signal_handlers):
            handler.signal_handlers = kept
            log.debug("Lightning's SIGTERM notifier removed for this fit; spotguard handles SIGTERM")

    # -- saving -------------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.fit_loop._should_accumulate():
            return  # no optimizer step at this batch: not a step boundary
        step = int(trainer.global_step)
        ckpt = self.checkpointer
        if not ckpt.should_save(step):  # collective: every rank, every step
            return
        stop = ckpt.stop_requested
        at_epoch_end = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch) or (
            batch_idx + 1 >= trainer.num_training_batches
        )
        if at_epoch_end:
            # Saved from on_train_epoch_end instead, where Lightning's own
            # epoch-end checkpoints are taken: a checkpoint of the last batch's
            # end resumes with epoch counters one short in Lightning 2.6, and
            # the checkpoint after that resume would resume in the wrong epoch.
            self._deferred = (step, stop)
            return
        self._save(trainer, step, "mid_epoch", batch_idx)
        if stop or ckpt.preempted:
            self._stopping(trainer, step)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        step, stop = deferred
        self._save(trainer, step, "epoch_end", None)
        if stop or self.checkpointer.preempted:
            self._stopping(trainer, step)

    def _stopping(self, trainer: pl.Trainer, step: int) -> None:
        self.preempted = True
        self._stop_now(trainer)
        if _rank() == 0:
            log.info("preempted: checkpoint of step %d committed, stopping the fit", step)

    def _stop_now(self, trainer: pl.Trainer) -> None:
        """Stop after this batch; ``min_steps``/``min_epochs`` would keep
        Lightning going, so they are lowered for the rest of this fit (the
        checkpoint is committed; the next start uses the Trainer's own)."""
        trainer.should_stop = True
        fit_loop = trainer.fit_loop
        if fit_loop.min_epochs:
            fit_loop.min_epochs = 0
        if fit_loop.epoch_loop.min_steps:
            fit_loop.epoch_loop.min_steps = 0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = int(trainer.global_step)
        if self.save_final and not self.preempted and step > 0 and not self.checkpointer.has_saved(step):
            self._save(trainer, step, "final", None)

    def _save(self, trainer: pl.Trainer, step: int, position: str, batch_idx: int | None) -> None:
        ckpt = self.checkpointer
        rank, world = _rank(), _world_size()
        staging = ckpt.config.directory / STAGING_DIR / f"step-{step:012d}"
        staging.mkdir(parents=True, exist_ok=True)
        loaders = _flat_loaders(trainer.train_dataloader)
        samplers: list[dict[str, Any] | None] = []
        for loader in loaders:
            sampler = _resumable_sampler(loader)
            consumed = None
            size = _batch_size(loader)
            if sampler is not None and position != "mid_epoch":
                consumed = sampler.num_samples  # the epoch is done
            elif sampler is not None and batch_idx is not None and size is not None:
                consumed = (batch_idx + 1) * size  # what training took, whatever was prefetched
            samplers.append(sampler.state_dict(consumed) if sampler is not None else None)
        doc = {
            "format": RANK_FORMAT,
            "step": step,
            "rank": rank,
            "world_size": world,
            "position": position,
            "epoch": int(trainer.current_epoch),
            "rng": rng_state(),
            "samplers": samplers,
        }
        tmp = staging / (RANK_FILE.format(rank=rank) + ".tmp")
        tmp.write_text(json.dumps(doc), encoding="utf-8")
        os.replace(tmp, staging / RANK_FILE.format(rank=rank))
        # Every rank calls it; global rank 0 writes; it ends with a barrier.
        trainer.save_checkpoint(staging / CKPT_NAME, weights_only=False)
        metrics = {
            k: float(v)
            for k, v in trainer.callback_metrics.items()
            if isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1)
        }
        ckpt.commit_folder(step, staging, epoch=int(trainer.current_epoch), metrics=metrics)
        self.last_saved_step = step
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
            # Committed by hard links (or copies): the staging names can go.
            shutil.rmtree(staging, ignore_errors=True)

    def state_dict(self) -> dict[str, Any]:
        return {"format": RANK_FORMAT, "world_size": _world_size()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved_world_size = state_dict.get("world_size")

    # -- resuming -----------------------------------------------------------------
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        path = trainer.ckpt_path
        if not path:
            return
        rank, world = _rank(), _world_size()
        rank_file = Path(path).parent / RANK_FILE.format(rank=rank)
        try:
            doc = json.loads(rank_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            log.warning(
                "%s has no %s: RNG and sampler position not restored, the resumed fit is not exact",
                Path(path).parent,
                rank_file.name,
            )
            return
        if doc.get("format") != RANK_FORMAT or doc.get("world_size") != world:
            log.warning(
                "%s was written by %s rank(s), this fit has %d: RNG and sampler position not restored, "
                "the resumed fit is not exact",
                rank_file,
                doc.get("world_size"),
                world,
            )
            return
        self._pending = doc
        if doc["position"] in ("epoch_end", "final"):
            # Before the loader's next-epoch iterator is built (it draws from
            # the global generator, as it did at that epoch's start).
            set_rng_state(doc["rng"])

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._pending = None
        if self._given is None:
            _core.reset()  # finish writes and uploads; a later fit gets a fresh one
        else:
            self._given.wait()


def spotguard_ckpt_path(checkpointer: Checkpointer | None = None) -> str | None:
    """The ``ckpt_path`` to pass to ``trainer.fit``: Lightning's checkpoint
    in the newest verified spotguard checkpoint (walking back past bad ones;
    fetched from storage when it holds a newer one), or None for a fresh
    start. Under torchrun it first joins the process group Lightning will
    reuse, so that every rank resumes the same checkpoint."""
    _core.ensure_process_group()
    ckpt = checkpointer if checkpointer is not None else _core.checkpointer()
    folder = ckpt.resume_folder()
    if folder is None:
        return None
    path = folder / CKPT_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} is a spotguard checkpoint without {CKPT_NAME}: not written by "
            "SpotguardCallback; pass it to Lightning yourself if it is yours"
        )
    return str(path)


__all__ = [
    "CKPT_NAME",
    "ResumableRandomSampler",
    "ResumableSampler",
    "SpotguardCallback",
    "rng_state",
    "set_rng_state",
    "spotguard_ckpt_path",
]
