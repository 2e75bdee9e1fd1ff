"""The uploader's side of the restore grant: offer it, follow the answer, copy in the background.

Where the store signs reads, the checkpoint to resume from is not restored
before the trainer starts: the trainer is granted reads of the newest
checkpoints (:func:`~spotguard.checkpoint.restore.grant.make_grant`,
``restore-grant.json``), and streams one straight into its tensors. Once it
answered which one it loaded, the uploader restores that checkpoint into the
checkpoint directory in the background, checked as it is restored and
recorded verified, as a restore before the start was: a restart on the same
machine resumes from it, and the trainer's next save links the files that did
not change. A trainer that loaded nothing and waits gets the newest
checkpoint that restores, and ``restore-done.json``.

Under ``spotguard run`` the supervisor does all of it (:meth:`Granting.offer`).
In a pod, the restore init container writes the grant
(``spotguard restore --grant``,
:func:`~spotguard.checkpoint.restore.grant.grant_reads`) and exits; the sidecar,
which runs beside the trainer, follows whatever answer comes
(:meth:`Granting.expect` with no grant id).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from spotguard.contract.grant import (
    ANSWER_FILE,
    clear_restore_messages,
    read_answer,
    remove_grant,
    write_done,
)
from spotguard.sidecar.shipper import CheckpointShipper, log_stage, step_of

if TYPE_CHECKING:
    from spotguard.checkpoint import CheckpointInfo
    from spotguard.storage import Storage

log = logging.getLogger(__name__)


def restore_newer_than(storage: Storage, checkpoint_dir: Path, step: int) -> CheckpointInfo | None:
    """Restore into ``checkpoint_dir`` the newest checkpoint in storage newer than ``step`` that
    verifies (walking back past broken ones); None when there is none. Storage errors propagate."""
    from spotguard.checkpoint import CheckpointCorruptError, list_checkpoint_names, restore_checkpoint

    for name in reversed(list_checkpoint_names(storage)):
        if step_of(name) <= step:
            return None
        try:
            return restore_checkpoint(storage, name, checkpoint_dir)
        except CheckpointCorruptError as exc:
            log.warning("skipping checkpoint %s: %s", storage.uri_for(name), "; ".join(exc.problems))
    return None


def vouch_restored(control_dir: Path, path: Path) -> None:
    """Record local checkpoint ``path``, verified as it was restored just now, for the trainer."""
    from spotguard.checkpoint.format.manifest import ManifestError
    from spotguard.checkpoint.restore.load import vouch_restored as record

    try:
        record(control_dir, path)
    except (OSError, ManifestError) as exc:  # the trainer then checksums it again: slower, never wrong
        log.warning("could not record that %s verified: %s", path.name, exc)


class Granting:
    """The grant the trainer has not answered yet, and the local copy restored after its answer.

    ``vouch(path)`` records a local checkpoint verified for the trainer."""

    def __init__(
        self,
        control_dir: Path,
        checkpoint_dir: Path,
        storage: Storage,
        shipper: CheckpointShipper,
        vouch: Callable[[Path], None],
    ) -> None:
        self.control_dir = control_dir
        self.checkpoint_dir = checkpoint_dir
        self.storage = storage
        self.shipper = shipper
        self.vouch = vouch
        self.expected: str | None = None
        self.waiting = False
        self.over = -1
        self.copy: threading.Thread | None = None

    def offer(self, step: int) -> bool:
        """Grant reads of the newest checkpoints newer than ``step``; False when the store cannot
        sign reads or none may be streamed (then restore before the start). Storage errors propagate."""
        from spotguard.checkpoint.restore.grant import grant_reads

        grant = grant_reads(self.storage, self.control_dir, step)
        if grant is None:
            return False
        self.expect(grant.id, step)
        log.info(
            "granted the command reads of %s (it streams the checkpoint itself; a local copy follows)",
            ", ".join(c.name for c in grant.checkpoints),
        )
        return True

    def expect(self, grant: str | None, over: int) -> None:
        """Follow the answer to grant ``grant`` (None: to whichever grant the answer names, one
        that the pod's restore init container wrote); ``over``: the step the grant was newer than."""
        self.expected, self.over, self.waiting = grant, over, True

    def follow(self) -> None:
        """Act on the trainer's answer, once it gave one (called every round of the loop)."""
        if not self.waiting:
            return
        found = read_answer(self.control_dir)
        if found is None or (self.expected is not None and found.grant != self.expected):
            return
        self.waiting = False
        remove_grant(self.control_dir)
        if found.name is None and not found.wait:
            log.info("the trainer loaded nothing through the restore grant and restores by itself")
            self._taken()
            return
        if found.name is not None:
            log.info("the trainer loaded %s through the restore grant: restoring its local copy", found.name)
        else:
            log.info("the trainer loaded nothing through the restore grant and waits: restoring a local copy")
        self.copy = threading.Thread(
            target=self._restore, args=(found.grant, found.name), name="restore-copy", daemon=True
        )
        self.copy.start()

    def _restore(self, grant_id: str, name: str | None) -> None:
        """The local copy of ``name`` (None: of the newest checkpoint that restores, for a command
        that waits for it), verified as it is restored."""
        from spotguard.checkpoint import CheckpointCorruptError, restore_checkpoint

        t0 = time.monotonic()
        info: CheckpointInfo | None = None
        try:
            if name is not None:
                self.shipper.mark_verified(name)  # the command checked every byte: never uploaded again
                info = restore_checkpoint(self.storage, name, self.checkpoint_dir)
            else:
                info = restore_newer_than(self.storage, self.checkpoint_dir, self.over)
        except CheckpointCorruptError as exc:
            log.warning("could not restore a local copy of %s: %s", name, "; ".join(exc.problems))
        except Exception as exc:  # noqa: BLE001 - no local copy: the next save is written whole, never wrong
            log.warning("could not restore a local copy of %s: %s", name or "a checkpoint", " ".join(str(exc).split()))
        if info is not None:
            self.shipper.mark_verified(info.name)
            self.vouch(Path(info.uri))
            log_stage("restore", time.monotonic() - t0, name=info.name, step=info.step)
        if name is None:
            with contextlib.suppress(OSError):  # a command that waits gives up once the heartbeat is quiet
                write_done(self.control_dir, grant_id, info.name if info is not None else None)
        self._taken()

    def _taken(self) -> None:
        """Remove the answer once acted on: an uploader that starts again before (a sidecar restarted
        in its pod) acts on it again, one that starts after does not."""
        with contextlib.suppress(FileNotFoundError):
            (self.control_dir / ANSWER_FILE).unlink()

    def end(self) -> None:
        """Wait for a local copy still being restored, and forget the grant and its messages."""
        if self.copy is not None:
            self.copy.join()
            self.copy = None
        self.waiting = False
        clear_restore_messages(self.control_dir)


__all__ = ["Granting", "restore_newer_than", "vouch_restored"]
