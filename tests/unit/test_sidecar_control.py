"""The control channel's rules: which acknowledgement answers which request, when to signal."""

from __future__ import annotations

import os
import signal
from types import FrameType

import pytest

from spotguard.contract.control import CheckpointAck, CheckpointRequest, ack_answers
from spotguard.sidecar.trainerproc import signal_trainer

REQ = CheckpointRequest(id="r1", reason="sigterm", deadline=200.0, preempt=True, written_at=100.0)


@pytest.mark.parametrize(
    ("ack", "want"),
    [
        (None, False),
        # Same id: answers, whenever written.
        (CheckpointAck(id="r1", step=7, name="ckpt-000000000007", mtime=50.0), True),
        # Older ack of an earlier request: not an answer.
        (CheckpointAck(id="r0", step=5, name="ckpt-000000000005", mtime=90.0), False),
        # The trainer saved on its own SIGTERM after our request: an answer.
        (CheckpointAck(id=None, step=8, name="ckpt-000000000008", mtime=100.5), True),
        (CheckpointAck(id="sigterm", step=8, name="ckpt-000000000008", mtime=100.0), True),
    ],
)
def test_ack_answers(ack: CheckpointAck | None, want: bool) -> None:
    assert ack_answers(ack, REQ) is want


@pytest.mark.parametrize(("announced", "want"), [(True, True), (False, False)])
def test_signal_trainer_asks_last_whether_the_pid_is_still_announced(announced: bool, want: bool) -> None:
    # This process plays the trainer: it catches SIGUSR1, its identity "checks out".
    got: list[int] = []
    asked: list[int] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        got.append(signum)

    def still_announced(pid: int) -> bool:
        asked.append(pid)
        return announced

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        sent = signal_trainer(
            os.getpid(), {"K": "v"}, check=lambda _pid, _markers: True, still_announced=still_announced
        )
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert sent is want
    assert asked == [os.getpid()]
    assert got == ([signal.SIGUSR1] if want else [])


# -- one protocol for both sides -------------------------------------------------------------


def test_trainer_and_uploader_share_one_protocol_module() -> None:
    import spotguard.contract.control as protocol
    import spotguard.trainer as trainer
    import spotguard.trainer.config as config

    # One request type, one parser, one set of file names: the trainer's are the protocol's.
    assert trainer.CheckpointRequest is protocol.CheckpointRequest
    assert trainer.parse_request is protocol.parse_request
    for name in ("REQUEST_FILE", "ACK_FILE", "PID_FILE", "EXIT_FILE"):
        assert getattr(trainer, name) == getattr(protocol, name)
    assert config.CONTROL_SUBDIR == protocol.CONTROL_SUBDIR
    # A request as the uploader writes it parses back to the same request on the trainer's side.
    req = CheckpointRequest(id="r9", reason="notice:aws", deadline=123.5, preempt=True, written_at=99.0)
    assert protocol.parse_request(__import__("json").dumps(req.to_json())) == req


@pytest.mark.parametrize(
    ("request_id", "committed", "complete", "want"),
    [
        ("r1", "ckpt-000000000007", True, {"id": "r1", "step": 7, "name": "ckpt-000000000007"}),
        ("r1", "ckpt-000000000005", False, {"id": "r1", "step": 5, "name": "ckpt-000000000005", "complete": False}),
        ("r1", None, True, {"id": "r1", "step": None, "name": None, "complete": False}),
    ],
)
def test_ack_json(request_id: str, committed: str | None, complete: bool, want: dict[str, object]) -> None:
    from spotguard.contract.control import ack_json

    assert ack_json(request_id, committed, complete) == want


def _exit(preempted: bool | None) -> object:
    from spotguard.contract.control import TrainerExit

    return TrainerExit(pid=12, preempted=preempted, last_step=40)


@pytest.mark.parametrize(
    ("exit_preempted", "newest_reason", "stop_reason", "want"),
    [
        (True, "interval", None, True),  # the exit file wins
        (False, "sigterm", None, False),
        ("absent", "sigterm", None, True),  # no exit file: the newest save's reason
        ("absent", "interval", None, False),
        ("absent", "notice:aws", None, False),  # a notice's save does not stop training...
        ("absent", "notice:aws", "notice:aws", True),  # ...unless the notice asked it to
        ("absent", None, None, None),  # nothing to go on
        (None, "sigterm", None, True),  # an exit file that does not say: the manifest
    ],
)
def test_trainer_said_preempted(
    exit_preempted: object, newest_reason: str | None, stop_reason: str | None, want: bool | None
) -> None:
    from spotguard.contract.control import trainer_said_preempted

    exit_doc = None if exit_preempted == "absent" else _exit(exit_preempted)  # type: ignore[arg-type]
    assert trainer_said_preempted(exit_doc, newest_reason, stop_reason) is want  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("signal_source", "gone_before", "trainer_preempted", "stop_reason", "want"),
    [
        # A signal while the trainer runs: a preemption, whatever else.
        ("sigterm", False, False, None, (True, "sigterm")),
        ("sigint", False, None, None, (True, "sigint")),
        # A native sidecar stopped after a trainer that simply finished.
        ("sigterm", True, False, None, (False, "finished")),
        ("sigterm", True, True, None, (True, "sigterm")),
        ("sigterm", True, None, None, (True, "sigterm")),  # unknown: never a wrong "finished"
        # The trainer exited first (no signal for us, yet).
        (None, True, True, None, (True, "sigterm")),
        (None, True, False, None, (False, "finished")),
        (None, True, None, None, (False, "finished")),
        (None, True, True, "notice:gce", (True, "notice:gce")),
        (None, True, False, "notice:gce", (True, "notice:gce")),
    ],
)
def test_decide_run_end(
    signal_source: str | None,
    gone_before: bool,
    trainer_preempted: bool | None,
    stop_reason: str | None,
    want: tuple[bool, str],
) -> None:
    from spotguard.contract.control import RunEnd, decide_run_end

    got = decide_run_end(
        signal_source=signal_source,
        trainer_gone_before_signal=gone_before,
        trainer_preempted=trainer_preempted,
        stop_reason=stop_reason,
    )
    assert got == RunEnd(*want)


def test_a_checkpoint_request_is_written_whole_without_waiting_for_the_disk(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An fsync waits for the filesystem's journal (tens of milliseconds behind a large delete); the
    # request is a message to the trainer on this node, made visible whole by the rename.
    from pathlib import Path

    from spotguard.contract import control

    def no_fsync(fd: int) -> None:
        raise AssertionError("the checkpoint request was fsynced")

    channel = control.ControlChannel(Path(str(tmp_path)) / ".control")
    monkeypatch.setattr(control.os, "fsync", no_fsync)
    req = channel.request_checkpoint("sigterm", 123.0, True)
    assert control.parse_request(channel.request_path.read_bytes()).id == req.id
    assert [p.name for p in channel.request_path.parent.iterdir()] == [channel.request_path.name]  # no temporary left
    with pytest.raises(AssertionError, match="fsynced"):
        control.atomic_write_json(channel.dir / "other.json", {"a": 1})  # durable by default


# -- checkpoint-writing.json: what a preemption's save is about to write ------------------


def test_a_write_plan_round_trips() -> None:
    import json

    from spotguard.contract.control import WritePlan, parse_write_plan

    plan = WritePlan(12, 1000.5, ("/dev/shm/sg", "/ck"), (("model.safetensors", 1 << 30), ("opt.safetensors", 0)))
    assert parse_write_plan(json.dumps(plan.to_json())) == plan


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"step": -1, "time": 1.0, "dirs": ["/d"], "files": []},
        {"step": True, "time": 1.0, "dirs": ["/d"], "files": []},
        {"step": 1, "time": "now", "dirs": ["/d"], "files": []},
        {"step": 1, "time": 1.0, "dirs": [""], "files": []},
        {"step": 1, "time": 1.0, "dirs": ["/d"], "files": [["../x", 1]]},  # escapes the checkpoint
        {"step": 1, "time": 1.0, "dirs": ["/d"], "files": [["/etc/passwd", 1]]},
        {"step": 1, "time": 1.0, "dirs": ["/d"], "files": [["m", -1]]},
        {"step": 1, "time": 1.0, "dirs": ["/d"], "files": [["m"]]},
    ],
)
def test_a_malformed_write_plan_is_refused(doc: object) -> None:
    import json

    from spotguard.contract.control import parse_write_plan

    with pytest.raises(ValueError):
        parse_write_plan(json.dumps(doc))
