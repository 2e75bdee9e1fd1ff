"""A finished trainer's last checkpoint is not lost when the pod ends (real S3, the sidecar as a process).

Classic sidecar: after the trainer exited on its own, a part of a distributed
checkpoint waits for the other nodes' parts as long as they make progress in
storage, and gives up only after no progress for ``--finish-seconds``.
Native sidecar: kubelet stops it once the trainer exits, so the trainer's
``close()`` waits until the sidecar says its last checkpoint is verified.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ckpt_helpers import part_files, s3_options, subprocess_env, write_part
from sidecar_helpers import Proc, base_env, reaping, spotguard_argv, wait_until

from spotguard.checkpoint import checkpoint_name, read_latest_pointer, upload_checkpoint
from spotguard.checkpoint.store.intents import upload_intent
from spotguard.checkpoint.store.parts import commit_progress
from spotguard.contract.control import EXIT_FILE, ControlChannel, ack_answers, read_heartbeat, write_heartbeat
from spotguard.storage import Storage, open_storage
from spotguard.trainer import Checkpointer

pytestmark = pytest.mark.integration

GRACE = 2.0
#: How long the classic sidecar waits without progress (short, so that progress must extend it).
FINISH = 3.0


@pytest.fixture
def store(s3_store: Any, s3_uri: str) -> Storage:
    return open_storage(s3_uri, **s3_options(s3_store))


def finished_part(node: Path, step: int, index: int) -> None:
    """A committed part of a trainer that then exited on its own (its exit file says not preempted)."""
    write_part(node, step, index)
    (node / ".control").mkdir(exist_ok=True)
    (node / ".control" / EXIT_FILE).write_text(json.dumps({"pid": None, "preempted": False, "last_step": step}))


def classic_sidecar(tmp_path: Path, node: Path, s3_store: Any, s3_uri: str) -> Proc:
    return Proc(
        spotguard_argv(
            "sidecar",
            "--checkpoint-dir",
            str(node),
            "--storage",
            s3_uri,
            "--no-incremental",
            "--grace-seconds",
            str(GRACE),
            "--safety-margin",
            "0.5",
            "--finish-seconds",
            str(FINISH),
            "--metrics-port",
            "0",
            "--termination-log",
            str(tmp_path / "termination-log"),
        ),
        base_env(subprocess_env(s3_store)),
        tmp_path / "sidecar.log",
    )


def test_a_finished_part_waits_while_the_other_node_still_uploads(
    tmp_path: Path, store: Storage, s3_store: Any, s3_uri: str
) -> None:
    """The other node stores its part a file at a time, each within the bound but all together well
    past it: the classic sidecar waits for it and ends with the final checkpoint verified. It once
    gave up after a fixed time, failing a gang whose training had finished."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    name = checkpoint_name(20)
    finished_part(node0, 20, 0)
    files = part_files(20, 1, (2, 3), big=256 * 1024)
    with reaping() as procs:
        sidecar = classic_sidecar(tmp_path, node0, s3_store, s3_uri)
        procs.append(sidecar)
        sidecar.wait_for_line(lambda ln: "stage=await" in ln and name in ln)
        started = time.monotonic()
        for path, data in sorted(files.items()):
            time.sleep(FINISH / 2)
            assert sidecar.popen.poll() is None, f"gave up while the other part was uploading:\n{sidecar.tail()}"
            store.write_bytes(f"{name}/{path}", data)  # the slow node's upload, one file at a time
        time.sleep(FINISH / 3)
        assert time.monotonic() - started > GRACE + FINISH  # well past the bound, progress all along
        assert sidecar.popen.poll() is None, f"gave up while the other part was uploading:\n{sidecar.tail()}"
        assert read_latest_pointer(store) is None
        # Its part manifest last: the global commit.
        assert upload_checkpoint(write_part(node1, 20, 1, files=files), store, update_pointer=False).committed
        assert sidecar.wait(60) == 0, sidecar.tail()
    assert read_latest_pointer(store) == 20
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report == {"preempted": False, "reason": "finished", "step": 20, "trainerStep": 20}


def test_a_finished_part_gives_up_after_no_progress_for_the_bound(
    tmp_path: Path, store: Storage, s3_store: Any, s3_uri: str
) -> None:
    """The other node never comes: after ``--finish-seconds`` without progress the sidecar gives up (exit 1),
    and its report still says the training finished (the operator does not run it again)."""
    node0 = tmp_path / "node0"
    finished_part(node0, 30, 0)
    with reaping() as procs:
        sidecar = classic_sidecar(tmp_path, node0, s3_store, s3_uri)
        procs.append(sidecar)
        sidecar.wait_for_line(lambda ln: "stage=await" in ln and checkpoint_name(30) in ln)
        awaiting = time.monotonic()
        assert sidecar.wait(60) == 1, sidecar.tail()
        waited = time.monotonic() - awaiting
    # Bounded: the bound, plus at most one poll of the other parts (5 s) and the exit.
    assert FINISH - 1 <= waited <= FINISH + 10, waited
    assert "the newest checkpoint could not be verified in storage" in sidecar.text()
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report["preempted"] is False and report["reason"] == "finished" and "step" not in report
    assert read_latest_pointer(store) is None
    assert (node0 / checkpoint_name(30)).is_dir()  # nothing lost locally


def test_commit_progress_sees_new_objects_and_a_live_uploads_heartbeat(store: Storage) -> None:
    """What the classic sidecar compares between two looks: objects and bytes below the checkpoint,
    and (for an incremental part, whose chunks go elsewhere) its upload intent's heartbeat."""
    name = checkpoint_name(40)
    empty = commit_progress(store, name)
    assert empty == (0, 0, 0.0)
    store.write_bytes(f"{name}/parts/00001.json", b"{}")
    one = commit_progress(store, name)
    assert one[:2] == (1, 2)
    with upload_intent(store, name, lease=0.6):
        first = wait_until(lambda: commit_progress(store, name)[2] or None, 10, "the intent")
        later = wait_until(
            lambda: (p := commit_progress(store, name))[2] > first and p, 10, "the intent's heartbeat to move"
        )
    assert later[:2] == one[:2]
    assert commit_progress(store, f"{name}0") == (0, 0, 0.0)  # another checkpoint's prefix is not this one's


def state(step: int) -> dict[str, object]:
    rng = np.random.default_rng(step)
    return {"model": {"w": rng.standard_normal(4096).astype(np.float32), "b": np.full(7, step, dtype=np.int64)}}


def test_a_finished_trainer_waits_for_a_native_sidecar_to_verify_its_last_checkpoint(
    tmp_path: Path, store: Storage, s3_store: Any, s3_uri: str
) -> None:
    """kubelet stops a native sidecar once the trainer's container exits: the trainer's close() returns,
    and says the trainer is done, only after the sidecar's heartbeat says its last checkpoint is
    verified. The sidecar is held (SIGSTOP, a busy uploader) while the trainer closes; close() once
    returned at once, leaving the checkpoint to a sidecar about to be stopped."""
    ckdir = tmp_path / "ck"
    control = ckdir / ".control"
    with reaping() as procs:
        sidecar = Proc(
            spotguard_argv(
                "sidecar",
                "--checkpoint-dir",
                str(ckdir),
                "--storage",
                s3_uri,
                "--mode",
                "native",
                "--metrics-port",
                "0",
                "--termination-log",
                str(tmp_path / "termination-log"),
            ),
            base_env(subprocess_env(s3_store)),
            tmp_path / "sidecar.log",
        )
        procs.append(sidecar)
        # The trainer's own signal handlers and control files, as in a pod (close() puts the handlers back).
        ck = Checkpointer(ckdir, control_dir=control, async_save=False, handle_signals=True, final_verify_seconds=60)
        held: list[object] = []

        def resume_uploader() -> None:
            # What the trainer had said and what storage held while the uploader was held.
            held.extend([(control / EXIT_FILE).exists(), read_latest_pointer(store)])
            os.kill(sidecar.popen.pid, signal.SIGCONT)

        timer = threading.Timer(3.0, resume_uploader)
        try:
            started = time.time()
            wait_until(
                lambda: (beat := read_heartbeat(control)) is not None and beat.time >= started,
                60,
                "the sidecar's heartbeat while the trainer runs",
            )
            os.kill(sidecar.popen.pid, signal.SIGSTOP)
            ck.save(5, state(5), blocking=True)
            timer.start()
            t0 = time.monotonic()
            ck.close()
            waited = time.monotonic() - t0
        finally:
            timer.cancel()
            os.kill(sidecar.popen.pid, signal.SIGCONT)
            ck.close()
        assert held == [False, None], held  # not done, nothing verified while the uploader was held
        assert waited >= 3.0, f"close() returned after {waited:.2f}s, before the last checkpoint was verified"
        # Verified before the trainer said it is done: what kubelet stops next has nothing left to do.
        assert read_latest_pointer(store) == 5
        beat = read_heartbeat(control)
        assert beat is not None and beat.verified == 5
        assert (control / EXIT_FILE).exists()
        sidecar.signal(signal.SIGTERM)  # kubelet stops the native sidecar after the trainer
        assert sidecar.wait(60) == 0, sidecar.tail()
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report == {"preempted": False, "reason": "finished", "step": 5, "trainerStep": 5}


def preempted_checkpointer(tmp_path: Path, deadline: float | None = None) -> tuple[Checkpointer, Path]:
    """A Checkpointer (no wait when it finishes: 0 s) whose step 6 answered a preemption, with an
    uploader's heartbeat that says it ships and has verified step 5 only."""
    ckdir = tmp_path / "ck"
    control = ckdir / ".control"
    ck = Checkpointer(ckdir, control_dir=control, async_save=False, final_verify_seconds=0)
    ck.save(5, state(5), blocking=True)
    write_heartbeat(control, shipping=True, verified=5)
    ck.request_checkpoint("sigterm", preempt=True, deadline=deadline)
    ck.save(6, state(6), blocking=True)
    assert ck.preempted
    return ck, control


def beating(control: Path, seconds: float, then_verified: int | None) -> threading.Thread:
    """An uploader at work: a fresh heartbeat every 0.2 s for ``seconds``, then ``then_verified`` said once."""

    def run() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            write_heartbeat(control, shipping=True, verified=5, emergency=True)
            time.sleep(0.2)
        if then_verified is not None:
            write_heartbeat(control, shipping=True, verified=then_verified, emergency=True)

    write_heartbeat(control, shipping=True, verified=5, emergency=True)  # on its preemption's path from now on
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_preempted_trainer_leaves_once_its_checkpoint_is_verified(tmp_path: Path) -> None:
    """Its exit (memory freed, the interpreter torn down) would take the upload's CPU: it waits
    while the uploader is at work on its checkpoint, and leaves as soon as it is verified."""
    ck, control = preempted_checkpointer(tmp_path)
    beats = beating(control, 1.5, then_verified=6)
    t0 = time.monotonic()
    ck.close()
    waited = time.monotonic() - t0
    beats.join()
    assert 1.5 <= waited < 5.0, waited


@pytest.mark.parametrize(
    ("case", "age", "shipping", "emergency"),
    [
        ("the uploader fails to ship", 0.0, False, True),
        ("the uploader's heartbeat is stale", 6.0, True, True),
        # A native sidecar learns of the preemption only when kubelet stops it, after the trainer.
        ("the uploader is in its routine loop", 0.0, True, False),
    ],
)
def test_a_preempted_trainer_does_not_wait_for_an_uploader_not_at_work(
    tmp_path: Path, case: str, age: float, shipping: bool, emergency: bool
) -> None:
    """The uploader ships within its grace period whatever the trainer does: one that stopped
    beating, fails, or is not on its preemption's path, is not waited for."""
    ck, control = preempted_checkpointer(tmp_path)
    ck._channel.started -= 10  # so that the heartbeat is this run's uploader's
    write_heartbeat(control, shipping=shipping, verified=5, now=time.time() - age, emergency=emergency)
    t0 = time.monotonic()
    ck.close()
    assert time.monotonic() - t0 < 1.0, case


def test_a_preempted_trainer_leaves_when_the_uploader_stops_beating(tmp_path: Path) -> None:
    """An uploader that stops beating mid-way (killed, or stuck) is waited for no longer than its
    heartbeat stays fresh (5 s)."""
    ck, control = preempted_checkpointer(tmp_path)
    ck._channel.started -= 10  # a trainer that started before the uploader's last beat
    write_heartbeat(control, shipping=True, verified=5, now=time.time() - 4.0, emergency=True)  # fresh for 1 s more
    t0 = time.monotonic()
    ck.close()
    assert 0.8 <= time.monotonic() - t0 < 3.0


def test_a_request_that_comes_while_a_preempted_trainer_waits_is_answered(tmp_path: Path) -> None:
    """kubelet's SIGTERM reaches the trainer and its sidecar at once: the trainer saves and answers
    its own signal, then its sidecar, busy a moment longer, writes its request. The uploader waits for
    an answer to that request (or the trainer's exit) before it ships; the trainer, waiting for the
    uploader, answers it with its newest committed checkpoint, and leaves once that is verified.
    Without the answer both would wait until the preemption's deadline (here 20 s)."""
    ck, control = preempted_checkpointer(tmp_path, deadline=time.time() + 20.0)
    time.sleep(0.2)  # the trainer's own acknowledgement is well before the request: it does not answer it
    channel = ControlChannel(control)
    req = channel.request_checkpoint("sigterm", time.time() + 20.0, preempt=True)
    answered: list[Any] = []

    def uploader() -> None:
        end = time.monotonic() + 20.0
        while time.monotonic() < end:
            write_heartbeat(control, shipping=True, verified=5, emergency=True)
            ack = channel.read_ack()
            if ack_answers(ack, req):
                answered.append(ack)
                write_heartbeat(control, shipping=True, verified=6, emergency=True)  # shipped and verified
                return
            time.sleep(0.05)

    write_heartbeat(control, shipping=True, verified=5, emergency=True)  # at work before the trainer looks
    thread = threading.Thread(target=uploader, daemon=True)
    thread.start()
    t0 = time.monotonic()
    ck.close()
    waited = time.monotonic() - t0
    thread.join()
    assert answered and answered[0].id == req.id, answered
    assert answered[0].name == checkpoint_name(6) and answered[0].complete, answered
    assert waited < 5.0, waited


def test_a_preempted_trainer_leaves_at_the_preemptions_deadline(tmp_path: Path) -> None:
    """An uploader at work that has not verified the checkpoint by the preemption's deadline: the
    trainer leaves then (the uploader gives up then too)."""
    ck, control = preempted_checkpointer(tmp_path, deadline=time.time() + 2.0)
    beats = beating(control, 6.0, then_verified=None)
    t0 = time.monotonic()
    ck.close()
    waited = time.monotonic() - t0
    beats.join()
    assert 1.0 <= waited < 4.0, waited
