"""The Trainer's ``checkpoint-<N>`` folders already in ``output_dir`` when
``train()`` starts: those of steps after the one resumed from are moved aside,
never deleted, and out of reach of the Trainer's resume and rotation. An
in-process tiny Trainer; no services."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testenv.require import require_module

transformers = require_module("transformers")

from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints  # noqa: E402

from spotguard.checkpoint.local import list_local_committed  # noqa: E402
from spotguard.demo import train_hf  # noqa: E402
from spotguard.integrations import _core  # noqa: E402
from spotguard.integrations.huggingface import SpotguardCallback  # noqa: E402

LOGGER = "spotguard.integrations.huggingface"


@pytest.fixture(autouse=True)
def fresh_checkpointer() -> Iterator[None]:
    handler = signal.getsignal(signal.SIGTERM)
    yield
    _core.reset()
    signal.signal(signal.SIGTERM, handler)


def tiny_args(out: Path, **kw: Any) -> TrainingArguments:
    base: dict[str, Any] = {"output_dir": str(out), "max_steps": 10, "save_steps": 5, "per_device_train_batch_size": 4,
                            "report_to": "none", "use_cpu": True, "disable_tqdm": True, "logging_steps": 1}  # fmt: skip
    return TrainingArguments(**{**base, **kw})


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
    trainer = Trainer(model=train_hf.build_model(0), args=tiny_args(out, save_total_limit=1),
                      train_dataset=train_hf.TokenDataset(0), callbacks=[spotguard])  # fmt: skip
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
    from spotguard.integrations.huggingface import move_aside_stale_folders

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
