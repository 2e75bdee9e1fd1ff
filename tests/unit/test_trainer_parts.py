"""The Checkpointer's pure parts: its environment, what a save answers, when a save is due."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotguard.checkpoint.store.retention import RetentionPolicy
from spotguard.contract.control import CheckpointRequest
from spotguard.trainer.channel import Due
from spotguard.trainer.config import CheckpointerConfig
from spotguard.trainer.policy import SavePolicy

SIGTERM = CheckpointRequest("sigterm-1-1", "sigterm", None, True)
NOTICE = CheckpointRequest("r1", "notice:aws", 120.0, True)
ASKED = CheckpointRequest("r2", "proactive", 90.0, False)
UNNAMED = CheckpointRequest("r3", "", None, False)


@pytest.mark.parametrize(
    ("requests", "preempt", "deadline", "reason", "request_id"),
    [
        ([], False, None, "interval", None),
        ([ASKED], False, 90.0, "proactive", "r2"),
        ([NOTICE, ASKED], True, 90.0, "notice:aws", "r2"),  # the preempting request names the save
        ([SIGTERM, NOTICE], True, 120.0, "notice:aws", "r1"),
        ([UNNAMED], False, None, "requested", "r3"),
    ],
)
def test_what_a_save_answers(
    requests: list[CheckpointRequest], preempt: bool, deadline: float | None, reason: str, request_id: str | None
) -> None:
    due = Due.of(requests)
    assert (due.preempt, due.deadline, due.reason, due.request_id) == (preempt, deadline, reason, request_id)


def test_a_preemption_another_rank_saw_is_named_sigterm() -> None:
    # Under torch.distributed every rank saves when one rank was preempted; on
    # a rank without a request of its own the manifest says why all the same.
    assert Due([], True, 30.0).reason == "sigterm"


def settings(**changes: object) -> CheckpointerConfig:
    fields: dict[str, object] = {"directory": Path("ck"), "checksum": "sha256", "keep_local": 2}
    fields.update(changes)
    return CheckpointerConfig(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"save_every_steps": 0}, "save_every_steps must be at least 1"),
        ({"save_every_seconds": 0.0}, "save_every_seconds must be positive"),
        ({"checksum": "md5"}, "md5"),
        ({"keep_local": -1}, "keep_local must not be negative"),
        ({"final_verify_seconds": -1.0}, "final_verify_seconds must not be negative"),
    ],
)
def test_settings_refuse_what_cannot_work(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings(**changes)


def test_the_interval_counts_steps_and_seconds() -> None:
    policy = SavePolicy(settings(save_every_steps=5))
    assert [s for s in range(0, 16) if policy.interval_due(s)] == [5, 10, 15]
    policy.saved(10)
    assert not policy.interval_due(10)  # saved already
    by_time = SavePolicy(settings(save_every_seconds=60.0))
    assert not by_time.interval_due(1)
    by_time.last_save_time -= 61.0
    assert by_time.interval_due(1)


@pytest.mark.parametrize(
    ("blocking", "preempt", "async_save", "sync"),
    [
        (None, False, True, False),
        (None, True, True, True),  # a preemption's save waits for its write
        (None, False, False, True),
        (False, True, True, False),  # the caller's word wins
        (True, False, True, True),
    ],
)
def test_when_a_save_waits_for_its_write(blocking: bool | None, preempt: bool, async_save: bool, sync: bool) -> None:
    assert SavePolicy(settings(async_save=async_save)).synchronous(blocking, preempt) is sync


def test_the_environment_sets_only_what_it_names() -> None:
    config = CheckpointerConfig.from_env(
        {
            "SPOTGUARD_CHECKPOINT_DIR": "/ck",
            "SPOTGUARD_SAVE_EVERY_STEPS": "0",
            "SPOTGUARD_ATTEMPT": "0",
            "SPOTGUARD_KEEP_LAST": "3",
        }
    )
    assert config.directory == Path("/ck")
    assert config.save_every_steps is None  # 0: no step interval
    assert config.attempt == 0
    assert isinstance(config.retention, RetentionPolicy) and config.retention.keep_last == 3
    assert CheckpointerConfig.from_env({}) == CheckpointerConfig()  # nothing set: every default
    assert CheckpointerConfig.from_env({}).retention is None  # keeping everything is the default
    assert CheckpointerConfig.from_env({}, directory=None).directory == Path("checkpoints")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SPOTGUARD_SAVE_EVERY_STEPS": "ten"}, "SPOTGUARD_SAVE_EVERY_STEPS must be an integer"),
        ({"SPOTGUARD_SAVE_EVERY_SECONDS": "-1"}, "SPOTGUARD_SAVE_EVERY_SECONDS must not be negative"),
        ({"SPOTGUARD_ATTEMPT": "1.5"}, "SPOTGUARD_ATTEMPT must be an integer"),
    ],
)
def test_a_malformed_environment_names_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointerConfig.from_env(env)
