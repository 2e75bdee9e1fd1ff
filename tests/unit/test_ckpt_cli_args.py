"""``spotguard ckpt`` argument handling (the commands themselves: tests/integration/test_ckpt_cli.py)."""

from __future__ import annotations

import argparse

import pytest

from spotguard.checkpoint.tools import cli
from spotguard.contract import env


def gc_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotguard")
    cli.register(parser.add_subparsers())
    return parser


def option_strings(parser: argparse.ArgumentParser, *command: str) -> dict[str, argparse.Action]:
    sub = parser
    for name in command:
        choices = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices
        sub = choices[name]
    return {flag: action for action in sub._actions for flag in action.option_strings}


@pytest.fixture(autouse=True)
def no_retention_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in env.RETENTION:
        monkeypatch.delenv(var.name, raising=False)


def test_gc_takes_the_retention_options_of_the_table() -> None:
    """Every retention rule by the table's flag, with the table's help naming its variable;
    ``--metric`` and ``--mode`` stay the short names of ``--best-metric`` and ``--best-mode``."""
    flags = option_strings(gc_parser(), "ckpt", "gc")
    for var in env.RETENTION:
        assert var.option in flags, var.option
        assert var.meaning in flags[var.option].help and var.name in flags[var.option].help
    assert flags["--metric"] is flags["--best-metric"] and flags["--mode"] is flags["--best-mode"]
    assert flags["--mode"].choices == env.BEST_MODE.choices


def test_gc_retention_defaults_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.KEEP_LAST.name, "2")
    monkeypatch.setenv(env.KEEP_BEST.name, "1")
    monkeypatch.setenv(env.BEST_METRIC.name, "loss")
    monkeypatch.setenv(env.BEST_MODE.name, "max")
    monkeypatch.setenv(env.KEEP_EVERY.name, "100")
    args = gc_parser().parse_args(["ckpt", "gc", "file:///x"])
    assert (args.keep_last, args.keep_best, args.metric, args.mode, args.keep_every) == (2, 1, "loss", "max", 100)
    flags = gc_parser().parse_args(["ckpt", "gc", "file:///x", "--keep-last", "5", "--best-metric", "acc"])
    assert (flags.keep_last, flags.metric) == (5, "acc")


def test_gc_without_retention_rules_keeps_everything() -> None:
    args = gc_parser().parse_args(["ckpt", "gc", "file:///x"])
    assert (args.keep_last, args.keep_best, args.metric, args.mode, args.keep_every) == (None, None, None, "min", None)
