"""Table tests of a finished trainer's wait for its last checkpoint (pure, no I/O): how long
it waits, when it leaves, and the heartbeat field it reads."""

from __future__ import annotations

import json

import pytest

from spotguard.contract.control import UploaderHeartbeat, parse_heartbeat
from spotguard.contract.final import FinalWait, decide_final_wait, trainer_final_verify_seconds

STARTED = 1000.0
DEADLINE = 2000.0


def beat(
    time: float = 1500.0, verified: int | None = None, shipping: bool = True, emergency: bool = True
) -> UploaderHeartbeat:
    return UploaderHeartbeat(pid=7, time=time, shipping=shipping, verified=verified, emergency=emergency)


CASES: list[tuple[str, dict[str, object], str]] = [
    # (case, inputs that differ from a trainer at step 40 waiting with time left, action)
    ("verified: leave at once", {"beat": beat(verified=40)}, "verified"),
    ("a newer step verified covers it", {"beat": beat(verified=45)}, "verified"),
    ("an older step verified: wait", {"beat": beat(verified=30)}, "wait"),
    ("nothing verified yet: wait", {"beat": beat(verified=None)}, "wait"),
    ("failing to ship is no reason to leave before the bound", {"beat": beat(verified=30, shipping=False)}, "wait"),
    ("an old heartbeat is not a reason to leave (a long upload)", {"beat": beat(time=1001.0), "now": 1900.0}, "wait"),
    ("the bound passed", {"beat": beat(verified=30), "now": DEADLINE}, "leave"),
    ("verified at the bound still counts", {"beat": beat(verified=40), "now": DEADLINE + 5}, "verified"),
    ("no checkpoint committed", {"final_step": None}, "leave"),
    ("no uploader ever beat", {"beat": None}, "leave"),
    ("a heartbeat of an earlier run", {"beat": beat(time=STARTED - 60, verified=10)}, "leave"),
    ("clock skew within a second", {"beat": beat(time=STARTED - 0.5)}, "wait"),
    # A preemption: the trainer waits only while the uploader is at work on its checkpoint.
    ("a preemption with the uploader at work: wait", {"preempted": True}, "wait"),
    ("a preemption, nothing verified yet: wait", {"preempted": True, "beat": beat(verified=None)}, "wait"),
    ("a preemption verified: leave at once", {"preempted": True, "beat": beat(verified=40)}, "verified"),
    ("a preemption, the uploader fails: leave", {"preempted": True, "beat": beat(shipping=False)}, "leave"),
    ("a preemption, the uploader in its routine loop", {"preempted": True, "beat": beat(emergency=False)}, "leave"),
    (
        "a preemption, routine loop, verified",
        {"preempted": True, "beat": beat(emergency=False, verified=40)},
        "verified",
    ),
    ("a finished trainer waits for a routine loop", {"beat": beat(emergency=False)}, "wait"),
    ("a preemption, the heartbeat stale: leave", {"preempted": True, "now": 1505.5}, "leave"),
    ("a preemption, the heartbeat fresh: wait", {"preempted": True, "now": 1504.5}, "wait"),
    ("a preemption, the heartbeat just ahead (skew): wait", {"preempted": True, "now": 1499.5}, "wait"),
    ("a preemption past its deadline", {"preempted": True, "now": DEADLINE, "beat": beat(time=DEADLINE)}, "leave"),
    ("a preemption without an uploader: leave", {"preempted": True, "beat": None}, "leave"),
    ("a preemption, an earlier run's uploader: leave", {"preempted": True, "beat": beat(time=STARTED - 60)}, "leave"),
]


@pytest.mark.parametrize(("case", "changes", "action"), CASES, ids=[c[0] for c in CASES])
def test_decide_final_wait(case: str, changes: dict[str, object], action: str) -> None:
    inputs: dict[str, object] = {
        "final_step": 40,
        "beat": beat(),
        "started": STARTED,
        "now": 1500.0,
        "deadline": DEADLINE,
        "preempted": False,
        **changes,
    }
    verdict = decide_final_wait(**inputs)  # type: ignore[arg-type]
    assert verdict.action == action, verdict
    assert (verdict.why != "") == (action == "leave")


def test_a_preempted_trainer_says_why_it_leaves_before_its_checkpoint_is_verified() -> None:
    stale = decide_final_wait(
        final_step=40, beat=beat(verified=30), started=STARTED, now=1506.0, deadline=DEADLINE, preempted=True
    )
    assert stale == FinalWait("leave", "preempted, and the uploader's heartbeat is 6.0s old")
    failing = decide_final_wait(
        final_step=40, beat=beat(shipping=False), started=STARTED, now=1500.0, deadline=DEADLINE, preempted=True
    )
    assert failing == FinalWait("leave", "preempted, and the uploader's heartbeat says it fails to ship")
    routine = decide_final_wait(
        final_step=40, beat=beat(emergency=False), started=STARTED, now=1500.0, deadline=DEADLINE, preempted=True
    )
    assert routine == FinalWait(
        "leave", "preempted, and the uploader's heartbeat says it is not on its preemption's path"
    )


def test_leaving_at_the_bound_says_which_step_and_the_newest_verified() -> None:
    verdict = decide_final_wait(
        final_step=40, beat=beat(verified=30), started=STARTED, now=DEADLINE, deadline=DEADLINE, preempted=False
    )
    assert verdict == FinalWait("leave", "step 40 not verified in time (newest verified: step 30)")


@pytest.mark.parametrize(
    ("native", "finish", "want"),
    [
        # kubelet stops a native sidecar once the trainer exits: the trainer waits as long as a classic sidecar would.
        (True, 600.0, 600.0),
        (True, 45.0, 45.0),
        # A classic sidecar keeps its pod up itself after the trainer's exit: no wait in the trainer.
        (False, 600.0, 0.0),
        (True, -1.0, 0.0),
    ],
)
def test_trainer_final_verify_seconds(native: bool, finish: float, want: float) -> None:
    assert trainer_final_verify_seconds(native, finish) == want


@pytest.mark.parametrize(
    ("doc", "verified"),
    [
        ({"pid": 1, "time": 5.0, "shipping": True, "verified": 40}, 40),
        ({"pid": 1, "time": 5.0, "shipping": True, "verified": None}, None),
        # An uploader from before the field: nothing verified said.
        ({"pid": 1, "time": 5.0, "shipping": True}, None),
        ({"pid": 1, "time": 5.0, "shipping": True, "verified": True}, None),
        ({"pid": 1, "time": 5.0, "shipping": True, "verified": "40"}, None),
    ],
)
def test_the_heartbeat_says_the_newest_verified_step(doc: dict[str, object], verified: int | None) -> None:
    parsed = parse_heartbeat(json.dumps(doc))
    assert parsed.verified == verified
    assert parse_heartbeat(json.dumps(parsed.to_json())) == parsed


@pytest.mark.parametrize(
    ("doc", "emergency"),
    [
        ({"pid": 1, "time": 5.0, "shipping": True, "emergency": True}, True),
        ({"pid": 1, "time": 5.0, "shipping": True, "emergency": False}, False),
        # An uploader from before the field, or one that says something else: not on its preemption's path.
        ({"pid": 1, "time": 5.0, "shipping": True}, False),
        ({"pid": 1, "time": 5.0, "shipping": True, "emergency": "yes"}, False),
        ({"pid": 1, "time": 5.0, "shipping": True, "emergency": 1}, False),
    ],
)
def test_the_heartbeat_says_whether_the_uploader_is_on_its_preemptions_path(
    doc: dict[str, object], emergency: bool
) -> None:
    parsed = parse_heartbeat(json.dumps(doc))
    assert parsed.emergency is emergency
    assert parse_heartbeat(json.dumps(parsed.to_json())) == parsed
