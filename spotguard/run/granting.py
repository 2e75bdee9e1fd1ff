"""``spotguard run``'s side of the restore grant: offer it, follow the answer, copy in the background.

Where the store signs reads, the supervisor does not restore the checkpoint
to resume from before the command starts: it grants the command reads of the
newest checkpoints (:func:`~spotguard.checkpoint.restore.grant.make_grant`,
``restore-grant.json``), and the command streams one straight into its
tensors. Once the command answered which one it loaded, the supervisor
restores that checkpoint into the checkpoint directory in the background,
checked as it is restored and recorded verified, as a restore before the
start was: a restart on the same machine resumes from it, and the command's
next save links the files that did not change. A command that loaded nothing
and waits gets the newest checkpoint that restores, and ``restore-done.json``.
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
    RestoreGrant,
    clear_restore_messages,
    read_answer,
    remove_grant,
    write_done,
    write_grant,
)
from spotguard.sidecar.shipper import CheckpointShipper, log_stage

if TYPE_CHECKING:
    from spotguard.checkpoint import CheckpointInfo
    from spotguard.storage import Storage

log = logging.getLogger(__name__)


class Granting:
    """The grant the command has not answered yet, and the local copy restored after its answer.

    ``vouch(path)`` records a local checkpoint verified for the command;
    ``restore_newer_than(step)`` restores the newest checkpoint newer than ``step`` that
    verifies (None: none)."""

    def __init__(
        self,
        control_dir: Path,
        checkpoint_dir: Path,
        storage: Storage,
        shipper: CheckpointShipper,
        vouch: Callable[[Path], None],
        restore_newer_than: Callable[[int], CheckpointInfo | None],
    ) -> None:
        self.control_dir = control_dir
        self.checkpoint_dir = checkpoint_dir
        self.storage = storage
        self.shipper = shipper
        self.vouch = vouch
        self.restore_newer_than = restore_newer_than
        self.grant: RestoreGrant | None = None
        self.over = -1
        self.copy: threading.Thread | None = None

    def offer(self, step: int) -> bool:
        """Grant reads of the newest checkpoints newer than ``step``; False when the store cannot
        sign reads or none may be streamed (then restore before the start). Storage errors propagate."""
        from spotguard.checkpoint.restore.grant import make_grant

        grant = make_grant(self.storage, step)
        if grant is None:
            return False
        write_grant(self.control_dir, grant)
        self.grant, self.over = grant, step
        log.info(
            "granted the command reads of %s (it streams the checkpoint itself; a local copy follows)",
            ", ".join(c.name for c in grant.checkpoints),
        )
        return True

    def follow(self) -> None:
        """Act on the command's answer, once it gave one (called every round of the loop)."""
        if self.grant is None:
            return
        found = read_answer(self.control_dir)
        if found is None or found.grant != self.grant.id:
            return
        grant, self.grant = self.grant, None
        remove_grant(self.control_dir)
        if found.name is None and not found.wait:
            return  # the command restored by itself
        self.copy = threading.Thread(
            target=self._restore, args=(grant.id, found.name), name="restore-copy", daemon=True
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
                info = self.restore_newer_than(self.over)
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

    def end(self) -> None:
        """Wait for a local copy still being restored, and forget the grant and its messages."""
        if self.copy is not None:
            self.copy.join()
            self.copy = None
        self.grant = None
        clear_restore_messages(self.control_dir)


__all__ = ["Granting"]
