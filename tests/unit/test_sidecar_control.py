"""The control channel's rules: which acknowledgement answers which request, when to signal."""

from __future__ import annotations

import os
import signal
from types import FrameType

import pytest

from spotguard.sidecar.control import CheckpointAck, CheckpointRequest, ack_answers, signal_trainer

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
        sent = signal_trainer(os.getpid(), {"K": "v"}, check=lambda _pid, _markers: True,
                              still_announced=still_announced)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert sent is want
    assert asked == [os.getpid()]
    assert got == ([signal.SIGUSR1] if want else [])
