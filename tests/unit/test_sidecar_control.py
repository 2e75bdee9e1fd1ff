"""The control channel's pure rules: which acknowledgement answers which request."""

from __future__ import annotations

import pytest

from spotguard.sidecar.control import CheckpointAck, CheckpointRequest, ack_answers

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
