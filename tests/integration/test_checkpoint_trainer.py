"""The Checkpointer: intervals, two-phase saves, the control channel, signals, restore."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ckpt_helpers import assert_state_matches, commit_local, s3_options, step_tensors

from spotguard.checkpoint import list_local_committed, read_local_manifest, upload_checkpoint, verify_checkpoint
from spotguard.checkpoint.format.manifest import checkpoint_name
from spotguard.storage import open_storage
from spotguard.trainer import ACK_FILE, EXIT_FILE, PID_FILE, REQUEST_FILE, Checkpointer

pytestmark = pytest.mark.integration


@pytest.fixture
def ckdir(tmp_path: Path) -> Path:
    return tmp_path / "ckpts"


@pytest.fixture
def restore_signals() -> Iterator[None]:
    """Start from the default handlers (the test session's own SIGTERM handler
    would be chained), and put the session's back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def steps_of(directory: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in list_local_committed(directory)]


def write_request(ctl: Path, **doc: Any) -> None:
    ctl.mkdir(parents=True, exist_ok=True)
    tmp = ctl / ".req.tmp"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, ctl / REQUEST_FILE)


def read_ack(ctl: Path) -> dict[str, Any]:
    return json.loads((ctl / ACK_FILE).read_text())


def test_interval_in_steps_and_async_save(ckdir: Path) -> None:
    ck = Checkpointer(ckdir, save_every_steps=5, keep_local=10)
    due = [s for s in range(0, 21) if ck.should_save(s)]
    assert due == [5, 10, 15, 20]
    assert ck.save(5, step_tensors(5), metrics={"loss": 0.5}, epoch=1) is None  # persisted in the background
    assert not ck.should_save(5) and ck.has_saved(5)
    assert ck.wait()
    assert steps_of(ckdir) == [5]
    m = read_local_manifest(ckdir / checkpoint_name(5))
    assert m.metrics == {"loss": 0.5} and m.epoch == 1 and m.checksum_algorithm == "crc32c"
    path = ck.save(10, step_tensors(10), blocking=True)
    assert path == ckdir / checkpoint_name(10)
    assert ck.last_stall_seconds >= 0 and ck.last_error is None
    ck.close()


def test_interval_in_seconds(ckdir: Path) -> None:
    # An interval a loaded machine's blocking save below does not outlast (at 0.05 s it did).
    ck = Checkpointer(ckdir, save_every_seconds=1.0)
    assert not ck.should_save(1)
    time.sleep(1.1)
    assert ck.should_save(2)
    ck.save(2, step_tensors(2), blocking=True)
    assert not ck.should_save(3)  # the clock restarted at the save
    ck.close()


def test_a_new_save_waits_for_the_previous_write_and_keeps_both(ckdir: Path) -> None:
    ck = Checkpointer(ckdir, keep_local=10)
    for step in range(1, 6):
        ck.save(step, step_tensors(step, numel=200_000))
    ck.close()
    assert steps_of(ckdir) == [1, 2, 3, 4, 5]
    for step in range(1, 6):
        from spotguard.checkpoint import load_checkpoint_state

        assert_state_matches(load_checkpoint_state(ckdir / checkpoint_name(step)), step, numel=200_000)


def test_snapshot_is_taken_at_save_time(ckdir: Path) -> None:
    ck = Checkpointer(ckdir)
    arr = np.zeros(1_000_000, dtype=np.float32)
    ck.save(1, {"w": arr})
    arr += 1  # training goes on mutating the live state while the write is in flight
    ck.close()
    from spotguard.checkpoint import load_checkpoint_state

    assert not load_checkpoint_state(ckdir / checkpoint_name(1))["w"].any()


def test_local_pruning_keeps_the_newest(ckdir: Path) -> None:
    ck = Checkpointer(ckdir, keep_local=2)
    for step in range(1, 5):
        ck.save(step, step_tensors(step), blocking=True)
    assert steps_of(ckdir) == [3, 4]


def test_local_retention_policy_without_storage(ckdir: Path) -> None:
    from spotguard.checkpoint import RetentionPolicy

    ck = Checkpointer(ckdir, retention=RetentionPolicy(keep_last=1, keep_best=1, metric="loss"))
    for step, loss in [(1, 0.5), (2, 0.1), (3, 0.4), (4, 0.3)]:
        ck.save(step, step_tensors(step), metrics={"loss": loss}, blocking=True)
    assert steps_of(ckdir) == [2, 4]


def test_preempting_request_file_is_synchronous_and_acknowledged(ckdir: Path) -> None:
    ck = Checkpointer(ckdir, save_every_steps=1000)
    ctl = ckdir / ".control"
    assert not ck.should_save(1)
    write_request(ctl, id="req-1", reason="notice:aws", deadline=time.time() + 60, preempt=True)
    assert ck.request_pending and ck.should_save(2)
    assert not ck.preempted
    path = ck.save(2, step_tensors(2))  # synchronous because a preemption is pending
    assert path == ckdir / checkpoint_name(2)
    assert ck.preempted
    assert read_ack(ctl) == {"id": "req-1", "step": 2, "name": checkpoint_name(2)}
    assert not ck.should_save(3)  # the same request is not served twice
    ck.close()
    # A new trainer (after a restart) does not act on the answered request again.
    again = Checkpointer(ckdir)
    assert not again.should_save(3)
    assert not again.preempted


def test_proactive_request_is_saved_in_the_background_and_acknowledged(ckdir: Path) -> None:
    ck = Checkpointer(ckdir)
    ctl = ckdir / ".control"
    write_request(ctl, id="p1", reason="proactive", deadline=time.time() + 60, preempt=False)
    assert ck.should_save(7)
    assert ck.save(7, step_tensors(7)) is None
    ck.wait()
    assert read_ack(ctl) == {"id": "p1", "step": 7, "name": checkpoint_name(7)}
    assert not ck.preempted


def test_request_for_an_already_saved_step_is_answered_without_rewriting(ckdir: Path) -> None:
    ck = Checkpointer(ckdir)
    ck.save(3, step_tensors(3))
    write_request(ckdir / ".control", id="r", reason="sigterm", preempt=True)
    assert ck.should_save(3)
    assert ck.save(3, step_tensors(3)) == ckdir / checkpoint_name(3)
    assert ck.preempted and read_ack(ckdir / ".control")["step"] == 3


def test_malformed_request_files_are_ignored(ckdir: Path) -> None:
    ck = Checkpointer(ckdir)
    (ckdir / ".control").mkdir(parents=True, exist_ok=True)
    (ckdir / ".control" / REQUEST_FILE).write_text("{torn")
    assert not ck.should_save(1)


def test_deadline_already_passed_abandons_the_write_cleanly(ckdir: Path) -> None:
    ck = Checkpointer(ckdir)
    ck.save(1, step_tensors(1), blocking=True)
    write_request(ckdir / ".control", id="late", reason="notice:gce", deadline=time.time() - 1, preempt=True)
    assert ck.should_save(2)
    assert ck.save(2, step_tensors(2)) is None
    assert ck.preempted
    assert steps_of(ckdir) == [1]
    assert not [p for p in ckdir.iterdir() if p.name.startswith(".tmp-")]
    assert read_ack(ckdir / ".control") == {"id": "late", "step": 1, "name": checkpoint_name(1), "complete": False}


def test_sigterm_sets_a_flag_then_the_save_is_synchronous(ckdir: Path, restore_signals: None) -> None:
    calls: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, f: calls.append(s))
    ck = Checkpointer(ckdir, handle_signals=True)
    assert json.loads((ckdir / ".control" / PID_FILE).read_text()) == {"pid": os.getpid()}
    os.kill(os.getpid(), signal.SIGTERM)
    assert calls == [signal.SIGTERM]  # the previous Python handler is still called
    assert ck.should_save(4)
    assert ck.save(4, step_tensors(4)) == ckdir / checkpoint_name(4)
    assert ck.preempted
    ack = read_ack(ckdir / ".control")
    assert ack["step"] == 4 and ack["id"].startswith("sigterm-")
    ck.close()
    # close() announces the exit (a sidecar in another PID namespace cannot see the process
    # go) and withdraws trainer.pid, after which a stray SIGUSR1 is ignored, not fatal.
    assert json.loads((ckdir / ".control" / EXIT_FILE).read_text())["preempted"] is True
    assert not (ckdir / ".control" / PID_FILE).exists()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert signal.getsignal(signal.SIGTERM) is not None and calls == [signal.SIGTERM]


def test_sigterm_during_a_background_write_does_not_break_it(ckdir: Path, restore_signals: None) -> None:
    ck = Checkpointer(ckdir, handle_signals=True, keep_local=2)
    ck.save(1, step_tensors(1, numel=2_000_000))
    os.kill(os.getpid(), signal.SIGTERM)
    assert ck.should_save(2)
    ck.save(2, step_tensors(2))
    assert steps_of(ckdir) == [1, 2]
    assert ck.preempted


def test_sigusr1_without_a_request_asks_for_a_proactive_checkpoint(ckdir: Path, restore_signals: None) -> None:
    ck = Checkpointer(ckdir, handle_signals=True)
    assert not ck.should_save(1)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert ck.should_save(2)
    ck.save(2, step_tensors(2))
    ck.wait()
    assert not ck.preempted and steps_of(ckdir) == [2]
    ck.close()


def test_restore_prefers_local_and_skips_a_broken_newest(ckdir: Path) -> None:
    commit_local(ckdir, 1)
    broken = commit_local(ckdir, 2)
    (broken / "model.safetensors").write_bytes(b"garbage")
    ck = Checkpointer(ckdir)
    state = ck.restore()
    assert state is not None and state.step == 1
    assert_state_matches(dict(state), 1)
    assert ck.has_saved(1) and not ck.should_save(1)


def test_restore_downloads_from_storage_when_no_local_checkpoint(tmp_path: Path, s3_store: Any, s3_uri: str) -> None:
    storage = open_storage(s3_uri, **s3_options(s3_store))
    upload_checkpoint(commit_local(tmp_path / "elsewhere", 12), storage)
    ck = Checkpointer(tmp_path / "fresh", storage_uri=s3_uri, storage_options=s3_options(s3_store))
    state = ck.restore()
    assert state is not None and state.step == 12 and state.name == checkpoint_name(12)
    assert_state_matches(dict(state), 12)
    assert steps_of(tmp_path / "fresh") == [12]


def test_nothing_to_restore(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "empty", storage_uri=f"file://{tmp_path}/remote")
    assert ck.restore() is None


def test_upload_mode_uploads_each_checkpoint(tmp_path: Path, s3_store: Any, s3_uri: str) -> None:
    from spotguard.checkpoint import RetentionPolicy

    ck = Checkpointer(
        tmp_path / "ck",
        storage_uri=s3_uri,
        storage_options=s3_options(s3_store),
        upload=True,
        retention=RetentionPolicy(keep_last=2),
    )
    for step in (1, 2, 3):
        ck.save(step, step_tensors(step))
    ck.close()
    storage = open_storage(s3_uri, **s3_options(s3_store))
    from spotguard.checkpoint import list_checkpoint_names, read_latest_pointer

    assert list_checkpoint_names(storage) == [checkpoint_name(2), checkpoint_name(3)]
    assert verify_checkpoint(storage, checkpoint_name(3)).ok
    assert read_latest_pointer(storage) == 3


def test_stale_temporary_directories_are_removed_at_start(ckdir: Path) -> None:
    leftover = ckdir / ".tmp-ckpt-000000000009-deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"partial")
    Checkpointer(ckdir)
    assert not leftover.exists()


def test_from_env(tmp_path: Path) -> None:
    env = {
        "SPOTGUARD_CHECKPOINT_DIR": str(tmp_path / "ck"),
        "SPOTGUARD_STORAGE_URI": f"file://{tmp_path}/remote/ns/job",
        "SPOTGUARD_CONTROL_DIR": str(tmp_path / "ctl"),
        "SPOTGUARD_SAVE_EVERY_STEPS": "50",
        "SPOTGUARD_SAVE_EVERY_SECONDS": "600",
        "SPOTGUARD_CHECKSUM": "sha256",
        "SPOTGUARD_KEEP_LAST": "3",
        "SPOTGUARD_JOB": "ns/job",
        "SPOTGUARD_ATTEMPT": "4",
    }
    ck = Checkpointer.from_env(env, handle_signals=False)
    assert ck.directory == tmp_path / "ck" and ck.control_dir == tmp_path / "ctl"
    assert ck.storage_uri == f"file://{tmp_path}/remote/ns/job"
    assert (ck.save_every_steps, ck.save_every_seconds, ck.checksum) == (50, 600.0, "sha256")
    assert ck.retention is not None and ck.retention.keep_last == 3
    ck.save(1, step_tensors(1), blocking=True)
    m = read_local_manifest(tmp_path / "ck" / checkpoint_name(1))
    assert (m.job, m.attempt, m.checksum_algorithm) == ("ns/job", 4, "sha256")
    override = Checkpointer.from_env(env, handle_signals=False, save_every_steps=7)
    assert override.save_every_steps == 7


@pytest.mark.parametrize(
    "key, value, problem",
    [
        ("SPOTGUARD_SAVE_EVERY_STEPS", "ten", "SPOTGUARD_SAVE_EVERY_STEPS must be an integer"),
        ("SPOTGUARD_SAVE_EVERY_SECONDS", "-5", "must not be negative"),
        ("SPOTGUARD_CHECKSUM", "md5", "unknown checksum algorithm 'md5'"),
        ("SPOTGUARD_ATTEMPT", "x", "SPOTGUARD_ATTEMPT must be an integer"),
    ],
)
def test_from_env_rejects_bad_values(tmp_path: Path, key: str, value: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        Checkpointer.from_env({"SPOTGUARD_CHECKPOINT_DIR": str(tmp_path), key: value}, handle_signals=False)


def test_manifest_records_reason_and_timing(ckdir: Path) -> None:
    ck = Checkpointer(ckdir, keep_local=2)
    ck.save(1, step_tensors(1), blocking=True)
    write_request(ckdir / ".control", id="n1", reason="notice:azure", preempt=True)
    assert ck.should_save(2)
    ck.save(2, step_tensors(2))
    first, second = (read_local_manifest(ckdir / checkpoint_name(s)) for s in (1, 2))
    assert (first.reason, first.request_id) == ("interval", None)
    assert (second.reason, second.request_id) == ("notice:azure", "n1")
    assert first.timing is not None and set(first.timing) == {"snapshot_seconds", "persist_seconds", "save_seconds"}


def test_a_state_that_cannot_be_saved_still_ends_a_preemption(ckdir: Path) -> None:
    from spotguard.checkpoint import StateError

    ck = Checkpointer(ckdir)
    write_request(ckdir / ".control", id="x", reason="sigterm", preempt=True)
    assert ck.should_save(1)
    with pytest.raises(StateError, match="cannot be checkpointed"):
        ck.save(1, {"bad": object()})
    assert ck.preempted and read_ack(ckdir / ".control")["id"] == "x"


# -- only the uploader prunes, and only what is safe in storage --------------------------------


def test_a_trainer_with_an_uploader_never_prunes(ckdir: Path, s3_store: Any, s3_uri: str) -> None:
    # In a pod or under `spotguard run` the sidecar ships the checkpoints; a
    # checkpoint the trainer deleted before its upload (a keep-every or
    # keep-best candidate) would be gone for good.
    ck = Checkpointer(ckdir, storage_uri=s3_uri, storage_options=s3_options(s3_store), keep_local=1)
    for step in range(1, 6):
        ck.save(step, step_tensors(step), blocking=True)
    ck.close()
    assert steps_of(ckdir) == [1, 2, 3, 4, 5]


def test_an_uploading_trainer_prunes_only_what_it_verified(tmp_path: Path, s3_store: Any, s3_uri: str) -> None:
    ckdir = tmp_path / "ck"
    ck = Checkpointer(ckdir, storage_uri=s3_uri, storage_options=s3_options(s3_store), upload=True, keep_local=1)
    ck.save(1, step_tensors(1), blocking=True)
    ck.save(2, step_tensors(2), blocking=True)
    assert steps_of(ckdir) == [2]  # 1 is superseded by 2, which is verified in storage
    # Storage refuses every request from now on (the credentials were
    # revoked): nothing newer is verified, so nothing is pruned.
    revoked = {**s3_options(s3_store), "secret_key": "revoked"}
    ck._shipping._storage = open_storage(s3_uri, **revoked)  # noqa: SLF001 - the configuration is fixed
    for step in (3, 4, 5):
        ck.save(step, step_tensors(step), blocking=True)
    ck.close()
    assert steps_of(ckdir) == [2, 3, 4, 5]
    assert ck.last_error is not None


@pytest.mark.parametrize("durable", [True, False])
def test_non_durable_save_skips_every_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool) -> None:
    """An emergency save that an uploader ships does not wait for the disk at
    all: not for its data, nor its manifest, nor its directories (a manifest
    fsync commits the journal, which a prune's delete of several GiB holds).
    The checkpoint verifies either way; a durable save fsyncs all of them."""
    import stat

    import spotguard.checkpoint.local.commit as local_mod
    from spotguard.checkpoint import snapshot_state, verify_local_checkpoint, write_checkpoint

    synced: list[str] = []  # names of the files and directories fsynced
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
        synced.append(name + "/" if stat.S_ISDIR(os.fstat(fd).st_mode) else name)
        real_fsync(fd)

    monkeypatch.setattr(local_mod.os, "fsync", counting_fsync)
    snap = snapshot_state(step_tensors(3))
    path = write_checkpoint(tmp_path, 3, snap, durable=durable)
    assert verify_local_checkpoint(path).ok
    if not durable:
        assert synced == []
        return
    assert "manifest.json" in synced
    assert f"{tmp_path.name}/" in synced  # the rename into place
    assert [n for n in synced if not n.endswith("/") and n != "manifest.json"], synced  # data files


def test_a_preemptions_save_runs_no_full_collection(ckdir: Path, restore_signals: None) -> None:
    import gc

    collections: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    thresholds = gc.get_threshold()
    enabled = gc.isenabled()
    ck = Checkpointer(ckdir, handle_signals=True)
    gc.enable()
    gc.set_threshold(50, 1, 1)  # a collection every few dozen allocations
    gc.callbacks.append(seen)
    try:
        states = [{**step_tensors(s), "many": [{"i": i} for i in range(2000)]} for s in (1, 2)]
        collections.clear()
        ck.save(1, states[0], blocking=True)
        routine = list(collections)
        os.kill(os.getpid(), signal.SIGTERM)
        assert ck.should_save(2)
        collections.clear()
        assert ck.save(2, states[1]) == ckdir / checkpoint_name(2)
        preempted = list(collections)
        assert gc.isenabled()  # enabled again once the save returned
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*thresholds)
        (gc.enable if enabled else gc.disable)()
    assert len(routine) > 10  # the same save without a preemption: collections all along
    # None while it saved (a full one visits every object of the process); the collector, enabled
    # again as the save returns, may run once there.
    assert len(preempted) <= 1, preempted
    ck.close()
