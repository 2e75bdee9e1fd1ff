"""``spotguard run``'s start-up recovery, in-process: what it keeps, ships, drops and restores.

Real SeaweedFS; "storage refuses" is a client whose credentials the store
rejects (an answer without retries, so the test stays quick).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import s3_options, step_tensors

from spotguard.checkpoint import latest_verified, list_local_committed, upload_checkpoint, verify_local_checkpoint
from spotguard.checkpoint.format.manifest import checkpoint_name
from spotguard.contract.grant import RestoreAnswer, read_grant, write_answer
from spotguard.run.supervisor import RunConfig, SetupError, Supervisor
from spotguard.sidecar.metrics import SidecarMetrics
from spotguard.storage import open_storage
from spotguard.trainer import Checkpointer

pytestmark = pytest.mark.integration


def local_steps(ckdir: Path) -> list[int]:
    return [int(p.name.rsplit("-", 1)[1]) for p in list_local_committed(ckdir)]


def supervisor(tmp_path: Path, s3_uri: str, storage: Any) -> Supervisor:
    config = RunConfig(
        command=["true"],
        workdir=tmp_path / "work",
        storage_uri=s3_uri,
        checkpoint_dir=tmp_path / "work" / "checkpoints",
    )
    return Supervisor(config, storage, SidecarMetrics())


def answered(sup: Supervisor, newest: int) -> None:
    """The command's answer to the restore grant ``recover`` wrote (the store signs reads): it
    loaded the newest granted checkpoint, which must be ``newest``; the supervisor then restores
    its local copy (waited for here)."""
    grant = read_grant(sup.config.control_dir)
    assert grant is not None and grant.checkpoints[0].name == checkpoint_name(newest)
    write_answer(sup.config.control_dir, RestoreAnswer(grant.id, checkpoint_name(newest)))
    sup.granting.follow()
    sup.granting.end()


def test_recover_keeps_what_storage_could_not_take_and_ships_it_later(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    good = open_storage(s3_uri, **s3_options(s3_store))
    refusing = open_storage(s3_uri, **{**s3_options(s3_store), "secret_key": "revoked"})
    ckdir = tmp_path / "work" / "checkpoints"
    # A run committed three checkpoints; only the first reached storage.
    ck = Checkpointer(ckdir, storage_uri=s3_uri)
    for step in (1, 2, 3):
        ck.save(step, step_tensors(step), blocking=True)
    ck.close()
    upload_checkpoint(ckdir / checkpoint_name(1), good)
    # The newest one rotted on disk: it fails its own manifest and cannot be loaded.
    data = next(p for p in (ckdir / checkpoint_name(3)).iterdir() if p.name.endswith(".safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))

    # Storage refuses: the complete, newer local checkpoint is kept (and resumed from).
    supervisor(tmp_path, s3_uri, refusing).recover()
    assert local_steps(ckdir) == [1, 2]
    # The rotten one, never in storage, is kept aside for a look, out of every listing.
    aside = [p.name for p in ckdir.iterdir() if p.name.startswith(f"{checkpoint_name(3)}.refused-")]
    assert len(aside) == 1, sorted(p.name for p in ckdir.iterdir())
    info, _ = latest_verified(good)
    assert info is not None and info.step == 1

    # Storage answers again: the next start ships it before anything else.
    sup = supervisor(tmp_path, s3_uri, good)
    sup.recover()
    info, _ = latest_verified(good)
    assert info is not None and info.step == 2
    assert sup.agent.shipper.last_shipped is not None and sup.agent.shipper.last_shipped.step == 2


def test_recover_with_nothing_local_and_storage_refusing_stops(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    refusing = open_storage(s3_uri, **{**s3_options(s3_store), "secret_key": "revoked"})
    # Starting from scratch could throw away progress that storage holds.
    with pytest.raises(SetupError, match="cannot restore"):
        supervisor(tmp_path, s3_uri, refusing).recover()


def test_recover_restores_from_storage_only_what_is_newer(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    good = open_storage(s3_uri, **s3_options(s3_store))
    other = tmp_path / "elsewhere"
    ck = Checkpointer(other, storage_uri=s3_uri)
    for step in (4, 6):
        ck.save(step, step_tensors(step), blocking=True)
    ck.close()
    upload_checkpoint(other / checkpoint_name(6), good)
    ckdir = tmp_path / "work" / "checkpoints"
    ck = Checkpointer(ckdir, storage_uri=s3_uri)
    ck.save(5, step_tensors(5), blocking=True)
    ck.close()
    sup = supervisor(tmp_path, s3_uri, good)
    sup.recover()
    # 6 (in storage) is newer than 5 (local, now shipped too): granted to the command, which streams it;
    # then staged, and known verified without a re-read.
    assert local_steps(ckdir) == [5]
    answered(sup, 6)
    assert local_steps(ckdir) == [5, 6]
    assert sup.agent.shipper.last_shipped is not None and sup.agent.shipper.last_shipped.step == 6


def test_recover_fetches_again_a_damaged_local_copy_of_a_stored_checkpoint(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    """A restored copy is not fsynced: after a machine crash it may be torn. The
    newest local copy is checked even when storage holds it, and fetched again."""
    good = open_storage(s3_uri, **s3_options(s3_store))
    ckdir = tmp_path / "work" / "checkpoints"
    ck = Checkpointer(ckdir, storage_uri=s3_uri)
    for step in (7, 8):
        ck.save(step, step_tensors(step), blocking=True)
    ck.close()
    for step in (7, 8):
        upload_checkpoint(ckdir / checkpoint_name(step), good)
    data = next(p for p in (ckdir / checkpoint_name(8)).iterdir() if p.name.endswith(".safetensors"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # torn by a crash

    sup = supervisor(tmp_path, s3_uri, good)
    sup.recover()
    answered(sup, 8)  # the damaged copy is gone: 8 is granted, then restored after the command's answer
    assert local_steps(ckdir) == [7, 8]
    assert verify_local_checkpoint(ckdir / checkpoint_name(8)).ok  # the stored copy, fetched again
    assert sup.agent.shipper.last_shipped is not None and sup.agent.shipper.last_shipped.step == 8
