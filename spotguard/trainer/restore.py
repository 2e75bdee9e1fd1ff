"""Which checkpoint a trainer resumes from, and loading it.

Local first: the newest local checkpoint that verifies against its manifest,
walking back past bad ones with a warning; storage (the settings'
``storage_uri``) when no local one is good, or, for a framework's folder,
when storage holds a newer verified one (fetched and checked again
locally). Under torch.distributed the ranks agree on one checkpoint that
every node can load (collective; :meth:`Restorer.agreed_name`) and each
loads its part (:func:`spotguard.trainer.distributed.load_sharded`).
Whatever is handed to a framework is verified whole first
(:func:`folder_problem`): sizes, checksums, every pickle scanned, no file
the manifest does not list. Loading never runs code from a checkpoint.

One process resumes first through the uploader's restore grant, if it left
one (:mod:`~spotguard.trainer.granted`): the checkpoint streamed from the
store straight into the live tensors, checked on the way, no local copy
first. Otherwise, and from local copies, one process loads the saved bytes
straight into the model's parameters and
the optimizer's state where shapes and dtypes match
(:mod:`spotguard.checkpoint.local.inplace`), and does not checksum again a
checkpoint whose files are still those the uploader verified whole just
before the trainer started (``spotguard run``'s record in the control
directory; sizes are still checked).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from spotguard.checkpoint import (
    CheckpointCorruptError,
    list_checkpoint_names,
    restore_checkpoint,
    restore_latest,
    verify_checkpoint,
)
from spotguard.checkpoint.format.manifest import ManifestError, checkpoint_name, parse_checkpoint_name
from spotguard.checkpoint.local.codec import STATE_FILE, StateError
from spotguard.checkpoint.local.commit import (
    list_local_committed,
    load_checkpoint_state,
    read_local_manifest,
    unlisted_local_files,
    verify_local_checkpoint,
)
from spotguard.checkpoint.local.inplace import file_stamps, load_state_into, vouched
from spotguard.contract.control import CONTROL_SUBDIR, read_verified_local
from spotguard.trainer import distributed as _distributed
from spotguard.trainer.config import CheckpointerConfig
from spotguard.trainer.distributed import DistContext
from spotguard.trainer.granted import answer, decline, refilled, restore_granted, wait_for_copy
from spotguard.trainer.state import RestoredState
from spotguard.trainer.state import restore_rng as restore_rng_state  # restore()'s keyword shadows the name

log = logging.getLogger(__name__)


def folder_problem(path: Path) -> str | None:
    """Why a local checkpoint cannot be handed to a framework (None: it can)."""
    result = verify_local_checkpoint(path)
    if not result.ok or result.manifest is None:
        return result.reason
    if not result.manifest.locally_complete:
        return "it holds only this node's part"
    extra = unlisted_local_files(path, result.manifest)
    if extra:
        return f"{extra[0]}: a file the manifest does not list (never checksummed nor scanned; refused)"
    return None


def load_local(path: Path, *, into: Any = None, stamps: Mapping[str, Any] | None = None) -> RestoredState | None:
    """The state of local checkpoint ``path`` after verifying it (None, with
    a warning, when it does not verify or cannot be loaded by this process).

    ``into``: the trainer's live state (``{"model": model.state_dict(),
    "optimizer": optimizer.state_dict()}``), whose tensors receive the saved
    bytes in place where they fit
    (:func:`~spotguard.checkpoint.local.inplace.load_state_into`; a failure
    after the first byte landed raises
    :class:`~spotguard.checkpoint.local.inplace.PartlyLoaded`). ``stamps``:
    what the uploader recorded when it verified this checkpoint whole
    (:func:`~spotguard.contract.control.read_verified_local`); when every
    file still has them, sizes are checked and checksums are not computed
    again. :attr:`RestoredState.checked_bytes` says how many bytes were."""
    checksums = True
    if stamps:
        try:
            checksums = not vouched(path, read_local_manifest(path), stamps)
        except (OSError, ManifestError):
            checksums = True
    result = verify_local_checkpoint(path, checksums=checksums)
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
        except Exception as exc:  # noqa: BLE001 - a checkpoint this process cannot load is skipped, whatever the cause
            log.warning("skipping local checkpoint %s: %s", path, exc)
            return None
        return loaded
    in_place = 0
    try:
        if into is not None and any(f.path == STATE_FILE for f in m.files):
            state, in_place = load_state_into(path, m, into)
        else:
            state = load_checkpoint_state(path, m)
    except StateError as exc:
        log.warning("skipping local checkpoint %s: %s", path, exc)
        return None
    restored = RestoredState(state, step=m.step, name=m.name, path=str(path), epoch=m.epoch, metrics=m.metrics)
    restored.checked_bytes = result.checked_bytes
    restored.in_place_bytes = in_place
    return restored


def _live_state(model: Any, optimizer: Any) -> dict[str, Any] | None:
    """The trainer's state as :func:`~spotguard.trainer.state.torch_state` saves it, its
    tensors the live ones (what a restore may load into in place), or None."""
    live: dict[str, Any] = {}
    if model is not None and callable(getattr(model, "state_dict", None)):
        live["model"] = model.state_dict()
    if optimizer is not None and callable(getattr(optimizer, "state_dict", None)):
        live["optimizer"] = optimizer.state_dict()
    return live or None


def _stamps_now(path: Path) -> dict[str, list[int]] | None:
    try:
        return file_stamps(path, read_local_manifest(path))
    except (OSError, ManifestError):
        return None


class Restorer:
    """Chooses and loads the checkpoint to resume from.

    ``open_storage`` opens (once) the settings' storage; ``verified``
    collects the names restored from storage (verified there: see
    :class:`~spotguard.trainer.shipping.Shipping`); ``dist``: the process
    groups of a collective Checkpointer (then :meth:`restore` and
    :meth:`resume_folder` are collective), None for one process.
    """

    def __init__(
        self,
        settings: CheckpointerConfig,
        open_storage: Callable[[], Any],
        verified: set[str],
        dist: DistContext | None = None,
    ) -> None:
        self._settings = settings
        self._open_storage = open_storage
        self._verified = verified
        self._dist = dist

    def restore(
        self, model: Any, optimizer: Any, scheduler: Any, *, restore_rng: bool, strict: bool, objects: Mapping[str, Any]
    ) -> RestoredState | None:
        """:meth:`Checkpointer.restore`."""
        if self._dist is not None:
            return self.restore_collective(
                self._dist, model, optimizer, scheduler, restore_rng=restore_rng, strict=strict, objects=objects
            )
        return self._restore_alone(model, optimizer, scheduler, restore_rng=restore_rng, strict=strict, objects=objects)

    def resume_folder(self) -> Path | None:
        """:meth:`Checkpointer.resume_folder`'s choice (collective under torch.distributed)."""
        if self._dist is not None:
            name = self.agreed_name(self._dist)
            return None if name is None else self._settings.directory / name
        return self._resume_folder_alone()

    # -- one process -----------------------------------------------------------------------
    def _restore_alone(
        self, model: Any, optimizer: Any, scheduler: Any, *, restore_rng: bool, strict: bool, objects: Mapping[str, Any]
    ) -> RestoredState | None:
        """:meth:`Checkpointer.restore` in a single process."""
        directory = self._settings.directory
        restored: RestoredState | None = None
        # The saved bytes go straight into the live tensors where they fit (no copy after).
        live = _live_state(model, optimizer)
        # The control directory as the channel resolves it (unset: the checkpoint directory's own).
        control = Path(self._settings.control_dir or directory / CONTROL_SUBDIR)
        # Through the uploader's restore grant first: from the store into the live tensors.
        restored, grant_id, landed = restore_granted(control, directory, live)
        if grant_id is not None:
            # Without storage of its own, the trainer asks the uploader for a local copy.
            wait = restored is None and not self._settings.storage_uri
            answer(control, grant_id, restored.name if restored is not None else None, wait=wait)
            if restored is not None:
                self._verified.add(restored.name)
            elif wait:
                wait_for_copy(control, grant_id)
        record = read_verified_local(control)
        for path in [] if restored is not None else reversed(list_local_committed(directory)):
            restored = load_local(path, into=live, stamps=record.get(path.name))
            if restored is not None:
                break
        if restored is None and self._settings.storage_uri:
            info = restore_latest(self._open_storage(), directory)
            if info is not None:
                self._verified.add(info.name)
                path = Path(info.uri)
                # Verified whole as it was restored, just now: not checksummed again.
                restored = load_local(path, into=live, stamps=_stamps_now(path))
        refilled(landed, restored)  # no bytes of a checkpoint that failed are trained on
        if restored is None:
            log.info("no checkpoint to restore; starting fresh")
            return None
        if model is not None or optimizer is not None or scheduler is not None or objects:
            restored.load_into(model, optimizer, scheduler, restore_rng=False, strict=strict, **objects)
        if restore_rng and isinstance(restored.state.get("rng"), Mapping):
            restore_rng_state(restored.state["rng"])
        log.info("restored %s (step %d)", restored.path, restored.step)
        return restored

    def _resume_folder_alone(self) -> Path | None:
        """:meth:`Checkpointer.resume_folder`'s choice in a single process."""
        # A framework loads its folder from the checkpoint directory: a grant's checkpoint is copied there.
        directory = self._settings.directory
        decline(Path(self._settings.control_dir or directory / CONTROL_SUBDIR), wait=not self._settings.storage_uri)
        found: Path | None = None
        for candidate in reversed(list_local_committed(self._settings.directory)):
            problem = folder_problem(candidate)
            if problem is None:
                found = candidate
                break
            log.warning("not resuming from local checkpoint %s: %s", candidate, problem)
        if self._settings.storage_uri:
            fetched = self._fetch_newer(parse_checkpoint_name(found.name) if found is not None else None)
            found = fetched or found
        return found

    def _fetch_newer(self, local_step: int | None) -> Path | None:
        """Fetch the newest checkpoint in storage newer than ``local_step``
        that verifies there and again locally, walking back; None if none."""
        try:
            storage = self._open_storage()
            names = list_checkpoint_names(storage)
        except Exception as exc:  # noqa: BLE001 - storage unusable: the local checkpoint (if any) is used
            log.warning("could not look for a checkpoint in storage: %s", exc)
            return None
        for name in reversed(names):
            step = parse_checkpoint_name(name)
            if step is None or (local_step is not None and step <= local_step):
                break
            try:
                info = restore_checkpoint(storage, name, self._settings.directory)
            except CheckpointCorruptError as exc:
                log.warning("not resuming from %s: %s", storage.uri_for(name), "; ".join(exc.problems))
                continue
            except Exception as exc:  # noqa: BLE001 - a failed fetch: the local checkpoint (if any) is used
                log.warning("could not fetch %s: %s", storage.uri_for(name), exc)
                return None
            path = Path(info.uri)
            problem = folder_problem(path)
            if problem is not None:
                log.warning("not resuming from %s: %s", path, problem)
                continue
            self._verified.add(name)
            return path
        return None

    # -- under torch.distributed -------------------------------------------------------------
    def restore_collective(
        self,
        d: DistContext,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        *,
        restore_rng: bool,
        strict: bool,
        objects: Mapping[str, Any],
    ) -> RestoredState | None:
        """:meth:`Checkpointer.restore` under torch.distributed (collective)."""
        if d.leader:  # a grant is for one process's state: this node gets a local copy instead
            directory = self._settings.directory
            decline(Path(self._settings.control_dir or directory / CONTROL_SUBDIR), wait=not self._settings.storage_uri)
        name = self.agreed_name(d)
        if name is None:
            log.info("no checkpoint to restore; starting fresh")
            return None
        path = self._settings.directory / name
        restored: RestoredState = _distributed.load_sharded(path, d, model, optimizer, strict=strict)
        if scheduler is not None or objects:
            restored.load_into(None, None, scheduler, restore_rng=False, strict=strict, **objects)
        if restore_rng and restored.rank_state_own and isinstance(restored.state.get("rng"), Mapping):
            restore_rng_state(restored.state["rng"])
        log.info(
            "rank %d restored %s (step %d)%s",
            d.rank,
            path,
            restored.step,
            "" if restored.exact else f", resharded from {restored.resharded_from} ranks",
        )
        return restored

    def agreed_name(self, d: DistContext) -> str | None:
        """The checkpoint every rank restores: the newest that every node
        holds complete and intact locally, unless storage holds a newer
        verified one (then each node fetches it). Collective."""
        directory = self._settings.directory
        checked: dict[str, bool] = {}

        def loadable(p: Path) -> bool:
            if p.name not in checked:
                why = folder_problem(p)
                if why is not None:
                    log.warning("local checkpoint %s cannot be restored here: %s", p, why)
                checked[p.name] = why is None
            return checked[p.name]

        bound: int | None = None
        while True:
            best = -1
            if d.leader:
                for p in reversed(list_local_committed(directory)):
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
        if not self._settings.storage_uri:
            return local_name
        # Newer checkpoints in storage, newest first (rank 0 looks), each
        # verified there, then fetched by every node and checked again:
        # the first that every node has wins; a bad one is walked past.
        candidates: list[str] = []
        if d.rank == 0:
            try:
                candidates = [
                    n
                    for n in reversed(list_checkpoint_names(self._open_storage()))
                    if (parse_checkpoint_name(n) or -1) > agreed
                ]
            except Exception as exc:  # noqa: BLE001 - storage unusable: the agreed local checkpoint is used
                log.warning("could not look for a newer checkpoint in storage: %s", exc)
        candidates = d.broadcast(candidates)
        for remote in candidates:
            ok = True
            if d.rank == 0:
                try:
                    verdict = verify_checkpoint(self._open_storage(), remote)
                    ok = verdict.ok
                    if not ok:
                        log.warning("not resuming from %s: %s", remote, verdict.reason)
                except Exception as exc:  # noqa: BLE001 - every rank must still reach the broadcast
                    ok = False
                    log.warning("could not verify %s in storage: %s", remote, exc)
            if not d.broadcast(ok):
                continue
            if d.leader:
                try:
                    restore_checkpoint(self._open_storage(), remote, directory)
                    why = folder_problem(directory / remote)
                    if why is not None:
                        ok = False
                        log.warning("not resuming from %s: %s", directory / remote, why)
                except Exception as exc:  # noqa: BLE001 - every rank must still reach the gather
                    ok = False
                    log.error("could not restore %s from storage: %s", remote, exc)
            if all(d.gather(ok, persist=False)):
                self._verified.add(remote)
                return remote
        if candidates:
            log.warning("restoring %s", local_name or "nothing (fresh start)")
        return local_name
