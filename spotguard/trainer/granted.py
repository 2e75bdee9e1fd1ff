"""A trainer's resume through the uploader's restore grant, and what it answers.

With a grant in the control directory (``spotguard run`` wrote it:
:mod:`spotguard.contract.grant`), the trainer streams the newest granted
checkpoint from the store straight into its own parameters and optimizer
moments (:func:`~spotguard.checkpoint.restore.grant.load_granted`), each
byte checked against the manifest; the file is removed once read (its URLs
live on in this process's memory only). It then answers: the checkpoint it
loaded (the uploader restores a local copy of it in the background), or none.
With none, a trainer that can reach the store itself resumes as without a
grant; one that cannot asks the uploader for a local copy and waits for it
(:func:`wait_for_copy`) while the uploader's heartbeat says it is alive.

Bytes land in the live tensors before their checksums are known. A walk back
past a damaged checkpoint is safe when the checkpoint finally loaded fills
every such tensor again (:func:`refilled`); otherwise the process must not
train on (:class:`~spotguard.checkpoint.local.inplace.PartlyLoaded`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from spotguard.checkpoint.local.inplace import PartlyLoaded
from spotguard.checkpoint.restore.grant import load_granted
from spotguard.checkpoint.restore.stream import LiveTensors
from spotguard.contract.control import read_heartbeat
from spotguard.contract.grant import RestoreAnswer, read_done, read_grant, remove_grant, write_answer
from spotguard.trainer.state import RestoredState

log = logging.getLogger(__name__)

#: How long a trainer waits for a local copy after the uploader's heartbeat went quiet.
UPLOADER_QUIET_SECONDS = 120.0
_POLL_SECONDS = 0.05


def restore_granted(control: Path, directory: Path, live: Any) -> tuple[RestoredState | None, str | None, list[Any]]:
    """Resume through the grant in ``control``, if there is one: the state loaded (None: none),
    the grant's id (None: no grant), and the live tensors that received bytes."""
    grant = read_grant(control)
    if grant is None:
        return None, None, []
    remove_grant(control)  # read once: the URLs are not left on disk
    into = LiveTensors(live) if live is not None else None
    found = load_granted(grant, into)
    landed = into.landed if into is not None else []
    if found is None:
        return None, grant.id, landed
    manifest, state = found
    restored = RestoredState(
        state,
        step=manifest.step,
        name=manifest.name,
        path=str(directory / manifest.name),
        epoch=manifest.epoch,
        metrics=manifest.metrics,
    )
    restored.checked_bytes = sum(e.size for e in manifest.files)
    restored.in_place_bytes = into.in_place_bytes if into is not None else 0
    log.info("resumed %s through the restore grant (every byte checked on the way)", manifest.name)
    return restored, grant.id, landed


def decline(control: Path, *, wait: bool) -> None:
    """Answer a grant in ``control`` without using it (a distributed trainer loads a local copy on
    every node): with ``wait``, ask the uploader for that copy and wait for it."""
    grant = read_grant(control)
    if grant is None:
        return
    remove_grant(control)
    answer(control, grant.id, None, wait=wait)
    if wait:
        wait_for_copy(control, grant.id)


def answer(control: Path, grant_id: str, name: str | None, *, wait: bool = False) -> None:
    """Tell the uploader what the trainer loaded through grant ``grant_id`` (None: nothing), and
    whether it waits for a local copy (:func:`wait_for_copy`)."""
    try:
        write_answer(control, RestoreAnswer(grant_id, name, wait))
    except OSError as exc:  # the uploader then restores on its next start: slower, never wrong
        log.warning("could not answer the restore grant: %s", exc)


def wait_for_copy(control: Path, grant_id: str, quiet: float = UPLOADER_QUIET_SECONDS) -> str | None:
    """Wait until the uploader restored a checkpoint into the checkpoint directory for this
    trainer (its name, None: it found none). Raises RuntimeError once its heartbeat was quiet for
    ``quiet`` seconds: starting fresh then could lose the checkpoint the grant named."""
    last_alive = time.monotonic()
    log.info("waiting for the uploader to restore a checkpoint into the checkpoint directory")
    while True:
        done, name = read_done(control, grant_id)
        if done:
            return name
        beat = read_heartbeat(control)
        if beat is not None and time.time() - beat.time < quiet:
            last_alive = time.monotonic()
        elif time.monotonic() - last_alive > quiet:
            raise RuntimeError(
                "the uploader granted a checkpoint but did not restore it for this trainer (its heartbeat is "
                "quiet): not starting fresh; start the process again"
            )
        time.sleep(_POLL_SECONDS)


def refilled(landed: Iterable[Any], restored: RestoredState | None) -> None:
    """Raise :class:`PartlyLoaded` unless every live tensor in ``landed`` (bytes of a checkpoint
    that failed landed there) is one the state ``restored`` filled again in place."""
    pending = {id(t) for t in landed}
    if not pending:
        return
    if restored is not None:
        pending -= {id(t) for t in _tensors(restored.state)}
    if pending:
        raise PartlyLoaded(
            f"{len(pending)} of the trainer's tensors hold bytes of a checkpoint that failed its checks"
            + (f", and {restored.name} did not fill them again" if restored is not None else ", and none loaded")
            + ": start the process again (it resumes as without the grant)"
        )


def _tensors(tree: Any) -> Iterable[Any]:
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _tensors(v)


__all__ = ["answer", "decline", "refilled", "restore_granted", "wait_for_copy"]
