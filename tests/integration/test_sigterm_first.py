"""A preemption comes first: a routine upload in flight gives way to the emergency checkpoint.

Against the real S3 store: the sidecar's shipper is in a routine round,
uploading a large checkpoint, when SIGTERM comes (the signal latch's event);
the round returns, the emergency checkpoint is uploaded and verified without
waiting for the routine one, which never becomes verified (nor pointed to)
unless a later upload completes it, reusing what the stopped one stored. A
chunk sweep in progress stops at its next object and deletes nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sidecar_helpers import s3_storage, small_parts

from spotguard.checkpoint import read_latest_pointer, upload_checkpoint, verify_checkpoint
from spotguard.checkpoint.format.manifest import CHUNKS_DIR, MANIFEST_NAME, checkpoint_name
from spotguard.checkpoint.local.codec import snapshot_state
from spotguard.checkpoint.local.commit import write_checkpoint
from spotguard.checkpoint.store.gc import SWEEP_STOPPED, sweep_chunks
from spotguard.checkpoint.store.publish import UNVERIFIED, Published, publish, verify_and_point
from spotguard.checkpoint.store.upload import UploadCancelled, stopping_storage
from spotguard.sidecar.deadline import ThroughputTracker
from spotguard.sidecar.metrics import SidecarMetrics
from spotguard.sidecar.shipper import CheckpointShipper, Shipped
from spotguard.sidecar.stoppable import with_stored_chunks
from spotguard.storage import open_storage

pytestmark = pytest.mark.integration

MiB = 1 << 20
#: The routine checkpoint: many more parts (and chunks) than are in flight at once, so that stopping
#: it saves most of its requests; small enough for a quick test.
ROUTINE_MB = 24


def commit(directory: Path, step: int, megabytes: int) -> Path:
    """A checkpoint of random bytes (nothing in it deduplicates), distinct per step: one
    tensor (one chunk) per MiB."""
    gen = torch.Generator().manual_seed(step)
    tensors = {f"w{i}": torch.randint(0, 256, (MiB,), dtype=torch.uint8, generator=gen) for i in range(megabytes)}
    return write_checkpoint(directory, step, snapshot_state({"model": tensors, "step": step}))


def drain(name: str, timeout: float = 60.0) -> None:
    """Wait for the stopped upload's last requests (its thread) to end."""
    for thread in threading.enumerate():
        if thread.name == f"spotguard-upload-{name}":
            thread.join(timeout)
            assert not thread.is_alive(), f"the stopped upload of {name} never ended"


@pytest.mark.parametrize("incremental", [False, True], ids=["whole", "chunks"])
def test_sigterm_during_a_routine_upload_ships_the_emergency_checkpoint_first(
    s3_store: Any, s3_uri: str, tmp_path: Path, incremental: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="spotguard")
    storage = small_parts(s3_store, s3_uri)
    local = tmp_path / "ckpt"
    events: list[tuple[str, float]] = []

    def verified(shipped: Shipped) -> None:
        events.append((f"verified {shipped.name}", time.monotonic()))

    shipper = CheckpointShipper(
        local,
        storage,
        SidecarMetrics(),
        ThroughputTracker(30.0, 5.0),
        keep_local=10,
        on_verified=verified,
        incremental=incremental,
    )
    commit(local, 5, ROUTINE_MB)
    assert [s.name for s in shipper.ship(housekeeping=False)] == [checkpoint_name(5)]

    routine = commit(local, 10, ROUTINE_MB)
    sigterm = threading.Event()
    inside = threading.Event()
    sent: list[str] = []
    returned: list[list[Shipped]] = []

    def slow_link(request: Any, **_: Any) -> None:
        """Until SIGTERM, the routine round's requests after its first two wait, as on
        a slow link: SIGTERM comes while it is inside its upload, however fast the store."""
        if sigterm.is_set() or request.method not in ("PUT", "POST"):
            return
        sent.append(request.url)
        if len(sent) > 2:
            inside.set()
            sigterm.wait(60)

    storage.client.meta.events.register("before-send.s3.*", slow_link)

    def routine_round() -> None:
        returned.append(shipper.ship(housekeeping=False, should_stop=sigterm.is_set))

    thread = threading.Thread(target=routine_round)
    thread.start()
    assert inside.wait(60), "the routine upload never started"
    commit(local, 20, 2)  # the trainer's emergency checkpoint
    t_signal = time.monotonic()
    sigterm.set()
    events.append(("sigterm", t_signal))
    shipped = shipper.ship(newest_only=True, housekeeping=False)  # the emergency path
    thread.join(60)
    assert not thread.is_alive() and returned == [[]], returned  # the routine round shipped nothing

    assert [s.name for s in shipped] == [checkpoint_name(20)]
    # The routine round gave way: its checkpoint was not verified first (nor at all). How soon it gives
    # way is a figure of ``make bench`` (preempt-upload), not a timed assertion here.
    assert [e for e, _ in events] == [f"verified {checkpoint_name(5)}", "sigterm", f"verified {checkpoint_name(20)}"]
    assert read_latest_pointer(storage) == 20
    assert verify_checkpoint(storage, checkpoint_name(20)).ok
    # The stop is a stage of its own: every ``stage=upload`` line reports a finished upload and its bytes.
    stages = [r.getMessage() for r in caplog.records if "stage=upload" in r.getMessage()]
    assert any("stage=upload_stopped seconds=" in m and routine.name in m for m in stages), stages
    assert all(" bytes=" in m for m in stages if m.startswith("stage=upload ")), stages

    # The stopped upload wrote no manifest (nothing names an unverified checkpoint)...
    drain(routine.name)
    assert storage.stat(f"{routine.name}/{MANIFEST_NAME}") is None
    assert routine.name not in shipper.shipped and routine.name not in shipper.failed
    # ...and nothing is lost: a later upload completes it, and it verifies.
    if incremental:
        _, stored = shipper.stopped[routine.name]
        assert stored, "the stopped upload stored no chunk before it stopped"
        assert all(storage.stat(f"{CHUNKS_DIR}/{d[:2]}/{d}") is not None for d in stored)
        known = with_stored_chunks(shipper._known_chunks(), shipper.stopped[routine.name], time.monotonic())
        later = upload_checkpoint(routine, storage, update_pointer=False, incremental=known)
        # What the stopped upload stored is not sent again.
        assert later.reused_chunks >= len(stored) and later.reused_bytes >= sum(stored.values())
    else:
        later = upload_checkpoint(routine, storage, update_pointer=False, resume=True)
    assert verify_checkpoint(storage, routine.name).ok
    assert read_latest_pointer(storage) == 20  # the pointer never goes back


def test_a_stopped_transfer_starts_no_new_part(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    # A routine upload that a preemption overtakes stops at its next request: the parts on the wire
    # finish, but no queued part is read or sent after the stop (each part asks first). Before, the
    # queued parts kept going until the oldest one in flight ended, sharing the store with the
    # preemption's upload.
    from spotguard.checkpoint.store.upload import UploadCancelled

    storage = small_parts(s3_store, s3_uri)  # 5 MiB parts, two at a time
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(60 * MiB))  # 12 parts
    stop = threading.Event()
    sent: list[int] = []  # parts that reached the store (each reports its bytes once sent)

    def progress(n: int) -> None:
        if n:
            sent.append(n)
            stop.set()  # the preemption comes as the first part ends
        if stop.is_set() and (n == 0 or len(sent) > 1):
            raise UploadCancelled("big.bin")

    with pytest.raises(UploadCancelled):
        storage.upload_files([(big, "stopped/big.bin")], progress=progress)
    # The first part, and at most the one on the wire beside it when the stop came (cut short if the
    # stop reached it before its last MiB); nothing started after it.
    assert 1 <= len(sent) <= 2, sent
    assert storage.stat("stopped/big.bin") is None
    uploads = storage.client.list_multipart_uploads(Bucket=storage.bucket, Prefix=storage._key("stopped/big.bin"))  # noqa: SLF001
    assert uploads.get("Uploads", []) == []  # the incomplete upload was aborted


def test_a_part_on_the_wire_stops_within_a_mib(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    # A part's body asks the progress callback every MiB it sends: a stop that comes while parts are on
    # the wire ends them there, and the stop's own exception comes out (not wrapped, not retried).
    from spotguard.checkpoint.store.upload import UploadCancelled

    storage = small_parts(s3_store, s3_uri)  # 5 MiB parts, two at a time
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(20 * MiB))
    asked: list[int] = []
    sent: list[int] = []

    def progress(n: int) -> None:
        if n:
            sent.append(n)
        else:
            asked.append(n)
        if len(asked) > 3:  # the two parts' first asks, then one MiB into a body: the preemption
            raise UploadCancelled("big.bin")

    with pytest.raises(UploadCancelled):
        storage.upload_files([(big, "cut/big.bin")], progress=progress)
    assert sent == []  # neither part on the wire was sent whole
    assert storage.stat("cut/big.bin") is None


def test_a_chunk_sweep_stops_at_its_next_object_and_deletes_nothing(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    storage = s3_storage(s3_store, s3_uri)
    path = commit(tmp_path / "ckpt", 10, 16)
    upload_checkpoint(path, storage, incremental=True)
    # The checkpoint is gone (only its chunks are left): a sweep without grace would delete them all.
    storage.delete([f"{path.name}/{MANIFEST_NAME}"])
    chunks = sorted(o.key for o in storage.list_objects(f"{CHUNKS_DIR}/"))
    assert len(chunks) >= 2
    asked: list[int] = []

    def preempted_after_first_object() -> bool:
        asked.append(1)
        return len(asked) > 1

    swept = sweep_chunks(storage, grace=0.0, now=time.time() + 1, should_stop=preempted_after_first_object)
    assert swept.aborted == SWEEP_STOPPED and swept.deleted == []
    assert sorted(o.key for o in storage.list_objects(f"{CHUNKS_DIR}/")) == chunks
    # Without the preemption the same sweep deletes them (the test can fail).
    assert sorted(sweep_chunks(storage, grace=0.0, now=time.time() + 1).deleted) == chunks


def test_a_local_prune_leaves_its_caller_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Freeing a file of several GiB holds the deleting thread in the kernel for a noticeable time; in the
    # supervisor's main thread that was time no SIGTERM handler ran. The shipper's prune (background=True)
    # renames the checkpoint away at once and deletes it in a thread of its own, at the lowest CPU
    # priority (the kernel's work of freeing it must not take a core from a preemption's save).
    from spotguard.checkpoint.local import commit as local

    directory = tmp_path / "ck"
    path = commit(directory, 1, 1)
    release, ran_in = threading.Event(), []
    real = local.release_tree

    niceness: list[int] = []

    def held(p: Any) -> None:
        ran_in.append(threading.current_thread().name)
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        assert release.wait(30), "the prune's delete ran in its caller's thread"
        real(p)

    monkeypatch.setattr(local, "release_tree", held)
    local.remove_checkpoint_dir(path, background=True)  # returns while the delete is held
    assert not path.exists()
    assert local.list_local_committed(directory) == []
    for _ in range(300):
        if ran_in:
            break
        time.sleep(0.01)
    assert ran_in == ["spotguard-prune"]
    assert niceness == [19]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != 19  # the caller's thread is not lowered
    release.set()
    for _ in range(300):
        if not list(directory.iterdir()):
            break
        time.sleep(0.01)
    assert list(directory.iterdir()) == []


def test_a_routine_verification_by_read_back_stops_at_its_next_request(tmp_path: Path) -> None:
    # A store without checksums (file://) is verified by reading every chunk back, a frozen base's
    # with the rest: seconds per GiB. A preemption during that read-back of a routine checkpoint
    # gets the shipper back at the verification's next request, a stop and not a failure: nothing
    # is pointed to, and a later verification of the same checkpoint passes.
    storage = open_storage(f"file://{tmp_path / 'store'}")
    local = tmp_path / "ckpt"
    first = commit(local, 5, 2)
    upload_checkpoint(first, storage, incremental=True)
    assert read_latest_pointer(storage) == 5
    routine = commit(local, 10, ROUTINE_MB)
    sigterm = threading.Event()

    def upload() -> Any:
        result = upload_checkpoint(routine, storage, update_pointer=False, incremental=True)
        sigterm.set()  # the preemption comes once the upload is done, while the checkpoint is verified
        return result

    verifier = stopping_storage(storage, sigterm.is_set, routine.name)
    with pytest.raises(UploadCancelled):
        publish(routine.name, verifier, upload, stop=sigterm.is_set)
    assert read_latest_pointer(storage) == 5  # not verified, not pointed to
    # Nothing is lost: its chunks and manifest are stored, and a later verification passes.
    later = verify_and_point(storage, routine.name, Published(routine.name, UNVERIFIED))
    assert later.verified and read_latest_pointer(storage) == 10


def test_a_routine_round_gives_way_while_it_verifies(tmp_path: Path) -> None:
    # The shipper's routine round asks the same question of its verification: a preemption that comes
    # once the checkpoint is stored (its manifest written) ends the round with nothing verified, a stop
    # and not a failure; the next round verifies it.
    storage = open_storage(f"file://{tmp_path / 'store'}")
    local = tmp_path / "ckpt"
    shipper = CheckpointShipper(
        local, storage, SidecarMetrics(), ThroughputTracker(30.0, 5.0), keep_local=10, incremental=True
    )
    commit(local, 5, 2)
    assert [s.name for s in shipper.ship(housekeeping=False)] == [checkpoint_name(5)]
    routine = commit(local, 10, ROUTINE_MB)

    def preempted() -> bool:
        return storage.stat(f"{routine.name}/{MANIFEST_NAME}") is not None

    assert shipper.ship(housekeeping=False, should_stop=preempted) == []
    assert routine.name not in shipper.shipped and routine.name not in shipper.failed
    assert read_latest_pointer(storage) == 5
    assert [s.name for s in shipper.ship(housekeeping=False)] == [routine.name]
    assert read_latest_pointer(storage) == 10
