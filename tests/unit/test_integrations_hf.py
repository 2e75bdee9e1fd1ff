"""SpotguardCallback inside a real (tiny, in-process) transformers.Trainer, and
its pure helpers. No services: the Checkpointer writes to a temporary directory."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from testenv.require import require_module

transformers = require_module("transformers")

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints  # noqa: E402

from spotguard.checkpoint.local.commit import list_local_committed, verify_local_checkpoint  # noqa: E402
from spotguard.demo import train_hf  # noqa: E402
from spotguard.integrations import _core  # noqa: E402
from spotguard.integrations.huggingface import (  # noqa: E402
    SpotguardCallback,
    check_directory,
    last_metrics,
    move_aside_stale_folders,
    stale_folders,
)


@pytest.fixture(autouse=True)
def fresh_checkpointer() -> Iterator[None]:
    handler = signal.getsignal(signal.SIGTERM)
    yield
    _core.reset()
    signal.signal(signal.SIGTERM, handler)


def tiny_args(out: Path, **kw: Any) -> TrainingArguments:
    # 96 samples, 4 per step: 24 steps per epoch.
    base: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": 30,
        "per_device_train_batch_size": 4,
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "logging_steps": 1,
    }
    return TrainingArguments(**{**base, **kw})


class Saves(TrainerCallback):
    """Counts the Trainer's saves and asks for a preemption after ``at``."""

    def __init__(self, spotguard: SpotguardCallback, at: int) -> None:
        self.spotguard, self.at, self.saved = spotguard, at, []  # type: ignore[var-annotated]

    def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.saved.append(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if state.global_step == self.at:
            # What spotguard's SIGTERM handler does, without signalling the test process.
            self.spotguard.checkpointer.request_checkpoint("sigterm", preempt=True)


def test_enable_jit_checkpoint_is_refused_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="enable_jit_checkpoint=False"):
        Trainer(
            model=train_hf.build_model(0),
            args=tiny_args(tmp_path / "out", enable_jit_checkpoint=True),
            train_dataset=train_hf.TokenDataset(0),
            callbacks=[SpotguardCallback(directory=str(tmp_path / "ck"), handle_signals=False)],
        )


def test_preemption_mid_epoch_saves_once_commits_and_stops(tmp_path: Path) -> None:
    """save_strategy="epoch": the Trainer would save the stopped step a second
    time at the epoch end, rewriting the committed (hard-linked) files in
    place; the callback keeps it to one save. A folder of a later step left by
    an earlier attempt is moved aside before training (it would be rewritten)."""
    out = tmp_path / "out"
    (out / "checkpoint-99").mkdir(parents=True)
    (out / "checkpoint-99" / "optimizer.pt").write_bytes(b"stale")
    spotguard = SpotguardCallback(directory=str(tmp_path / "ck"), handle_signals=False)
    saves = Saves(spotguard, at=6)
    trainer = Trainer(
        model=train_hf.build_model(0),
        args=tiny_args(out, save_strategy="epoch"),
        train_dataset=train_hf.TokenDataset(0),
        callbacks=[spotguard, saves],
    )
    trainer.train()
    # Asked after spotguard's own check of step 6: the next step saves and stops.
    assert saves.saved == [7] and trainer.state.global_step == 7 and spotguard.preempted
    assert not (out / "checkpoint-99").exists()
    committed = list_local_committed(tmp_path / "ck")
    assert [p.name for p in committed] == ["ckpt-000000000007"]
    verdict = verify_local_checkpoint(committed[0])
    assert verdict.ok, verdict.reason
    assert verdict.manifest is not None
    files = {f.path for f in verdict.manifest.files}
    assert "training_args.bin" not in files and {"optimizer.pt", "rng_state.pth", "trainer_state.json"} <= files
    assert verdict.manifest.metrics and "loss" in verdict.manifest.metrics


def test_every_trainer_save_is_committed_and_resume_path_returns_the_newest(tmp_path: Path) -> None:
    from spotguard.integrations.huggingface import spotguard_resume_path

    out, ck = tmp_path / "out", tmp_path / "ck"
    spotguard = SpotguardCallback(directory=str(ck), handle_signals=False, keep_local=10)
    trainer = Trainer(
        model=train_hf.build_model(0),
        args=tiny_args(out, max_steps=12, save_steps=5),
        train_dataset=train_hf.TokenDataset(0),
        callbacks=[spotguard],
    )
    assert spotguard_resume_path() is None
    trainer.train()
    assert [p.name for p in list_local_committed(ck)] == [f"ckpt-{s:012d}" for s in (5, 10, 12)]
    assert spotguard_resume_path() == str(ck / "ckpt-000000000012")


def test_stale_folders_are_the_later_steps_only(tmp_path: Path) -> None:
    for name in ("checkpoint-5", "checkpoint-10", "checkpoint-40", "checkpoint-x", "other-50"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-60").write_text("a file, not a folder")
    assert [p.name for p in stale_folders(tmp_path, 10)] == ["checkpoint-40"]
    assert stale_folders(tmp_path / "missing", 0) == []


@pytest.mark.parametrize(
    ("ckpt", "ok"),
    [
        ("spotguard", True),
        ("out", True),
        ("out/ckpts", True),
        ("out/checkpoint-10", False),
        ("out/checkpoint-10/sub", False),
        ("out/sub/checkpoint-10", True),
    ],
)
def test_checkpoint_directory_must_be_out_of_reach_of_the_rotation(tmp_path: Path, ckpt: str, ok: bool) -> None:
    if ok:
        check_directory(tmp_path / "out", tmp_path / ckpt)
    else:
        with pytest.raises(ValueError, match="rotation"):
            check_directory(tmp_path / "out", tmp_path / ckpt)


def test_last_metrics_takes_the_newest_numeric_log_entry() -> None:
    state = SimpleNamespace(
        log_history=[
            {"loss": 2.0, "step": 1},
            {"loss": 1.5, "learning_rate": 1e-3, "epoch": 0.5, "step": 2, "note": "x", "flag": True},
        ]
    )
    assert last_metrics(state) == {"loss": 1.5, "learning_rate": 1e-3}  # type: ignore[arg-type]
    assert last_metrics(SimpleNamespace(log_history=[])) is None  # type: ignore[arg-type]


# -- the Trainer's own folders already in output_dir: moved aside, never deleted --------------

LOGGER = "spotguard.integrations.huggingface"


def plant(out: Path, step: int) -> bytes:
    """A ``checkpoint-<step>`` folder from an earlier run; returns its mark."""
    mark = f"earlier run, step {step}".encode()
    folder = out / f"checkpoint-{step}"
    (folder / "sub").mkdir(parents=True)
    (folder / "optimizer.pt").write_bytes(mark)
    (folder / "sub" / "notes.txt").write_bytes(mark + b" notes")
    return mark


def found(out: Path, mark: bytes) -> list[Path]:
    """The folders under ``out`` holding a planted folder's content intact."""
    notes = mark + b" notes"
    return [
        p.parent
        for p in out.rglob("optimizer.pt")
        if p.read_bytes() == mark and (p.parent / "sub" / "notes.txt").read_bytes() == notes
    ]


def test_fresh_start_moves_earlier_folders_aside_and_keeps_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fresh start in an ``output_dir`` holding folders spotguard never
    committed: they are kept (content intact) under ``output_dir``, named in one
    log line, and neither the Trainer's resume nor its rotation
    (``save_total_limit=1``) sees them; training saves and commits as usual."""
    out, ck = tmp_path / "out", tmp_path / "ck"
    marks = {step: plant(out, step) for step in (5, 40)}
    spotguard = SpotguardCallback(directory=str(ck), handle_signals=False, keep_local=10)
    args = tiny_args(out, max_steps=10, save_steps=5, save_total_limit=1)
    trainer = Trainer(
        model=train_hf.build_model(0), args=args, train_dataset=train_hf.TokenDataset(0), callbacks=[spotguard]
    )
    with caplog.at_level(logging.INFO, logger=LOGGER):
        trainer.train()

    assert trainer.state.global_step == 10
    assert [p.name for p in list_local_committed(ck)] == ["ckpt-000000000005", "ckpt-000000000010"]
    assert [Path(p).name for p in sort_checkpoints(str(out))] == ["checkpoint-10"]
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-10")

    kept = {}
    for step, mark in marks.items():
        where = found(out, mark)
        assert len(where) == 1, f"checkpoint-{step}'s content is gone: {sorted(out.rglob('*'))}"
        kept[step] = where[0]
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER and "moved" in r.getMessage()]
    assert len(lines) == 1, lines
    for step, where in kept.items():
        assert f"checkpoint-{step}" in lines[0] and str(where) in lines[0], lines[0]


def test_only_later_folders_move_and_a_second_move_does_not_collide(tmp_path: Path) -> None:
    """Resumed at step 10: ``checkpoint-5`` and ``-10`` stay; ``-20`` moves.
    A later start that finds ``-20`` again moves it to a new place."""
    out = tmp_path / "out"
    for step in (5, 10, 20):
        plant(out, step)
    first = move_aside_stale_folders(out, 10)
    assert [(old.name, new.name) for old, new in first] == [("checkpoint-20", "checkpoint-20")]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-5"]
    mark = plant(out, 20)
    second = move_aside_stale_folders(out, 10)
    assert len(second) == 1 and second[0][1] != first[0][1]
    assert sorted(found(out, mark)) == sorted([first[0][1], second[0][1]])
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-10")
    assert move_aside_stale_folders(out, 10) == [] and move_aside_stale_folders(tmp_path / "missing", 0) == []
