"""``--checkpoint-full-read-seconds``: parsed, defaulted, and carried to the storage probe's watches."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from spotguard.checkpoint.store.latest import FULL_READ_SECONDS
from spotguard.operator.metrics import OperatorMetrics


def parse_args(*args: str) -> argparse.Namespace:
    from spotguard.operator import cli

    top = argparse.ArgumentParser()
    cli.register(top.add_subparsers())
    return top.parse_args(["operator", *args])


def test_flag_default_value_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTGUARD_CHECKPOINT_FULL_READ_SECONDS", raising=False)
    assert parse_args().checkpoint_full_read_seconds == FULL_READ_SECONDS == 1800.0
    assert parse_args("--checkpoint-full-read-seconds", "0").checkpoint_full_read_seconds == 0.0
    monkeypatch.setenv("SPOTGUARD_CHECKPOINT_FULL_READ_SECONDS", "600")
    assert parse_args().checkpoint_full_read_seconds == 600.0


def test_options_carry_it_to_the_probe_and_its_watches(tmp_path: Path) -> None:
    from spotguard.operator.handlers import OperatorOptions
    from spotguard.operator.probe import CheckpointProbe

    assert OperatorOptions().checkpoint_full_read_seconds == FULL_READ_SECONDS
    ctx = SimpleNamespace(metrics=OperatorMetrics())
    probe = CheckpointProbe(ctx, workers=1, full_read_seconds=0)
    try:
        handle = probe._storage(("ns", "job"), f"file://{tmp_path}/job", {})  # noqa: SLF001
        assert handle.watch.full_read_seconds == 0 and handle.watch.storage is handle.storage
        # The same job, the same storage: the same watch (it keeps the pointer's tag).
        assert probe._storage(("ns", "job"), f"file://{tmp_path}/job", {}) is handle  # noqa: SLF001
        # file:// storage sends no requests; nothing is counted.
        assert ctx.metrics.registry.get_sample_value("spotguard_operator_storage_requests_total") == 0.0
    finally:
        probe.shutdown()
