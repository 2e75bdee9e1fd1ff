"""``spotguard sidecar|run|demo`` argument handling; building the parser stays light."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from spotguard.sidecar import cli


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spotguard")
    cli.register(p.add_subparsers(dest="command"))
    return p


def test_building_the_parser_imports_nothing_heavy() -> None:
    code = ("import sys, argparse; from spotguard.sidecar import cli; p = argparse.ArgumentParser(); "
            "cli.register(p.add_subparsers()); "
            "print(','.join(m for m in ('torch', 'boto3', 'kubernetes', 'kopf', 'prometheus_client') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_run_takes_the_command_after_double_dash() -> None:
    args = parser().parse_args(["run", "--max-restarts", "5", "--", "python", "train.py", "--lr", "0.1"])
    assert args.command == ["--", "python", "train.py", "--lr", "0.1"]
    assert args.max_restarts == 5


def test_sidecar_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("SPOTGUARD_NOTICES", "SPOTGUARD_GRACE_SECONDS", "SPOTGUARD_SIDECAR_MODE", "SPOTGUARD_METRICS_PORT"):
        monkeypatch.delenv(key, raising=False)
    args = parser().parse_args(["sidecar", "--storage", "file:///x"])
    assert args.notices == ""  # no cloud poller unless asked
    assert args.grace_seconds == 30.0
    assert args.mode == "classic"
    assert args.metrics_port == 9400


def test_sidecar_reads_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTGUARD_NOTICES", "aws,k8s")
    monkeypatch.setenv("SPOTGUARD_GRACE_SECONDS", "120")
    monkeypatch.setenv("SPOTGUARD_SIDECAR_MODE", "native")
    args = parser().parse_args(["sidecar"])
    assert (args.notices, args.grace_seconds, args.mode) == ("aws,k8s", 120.0, "native")


def test_bad_number_in_the_environment_only_affects_its_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPOTGUARD_GRACE_SECONDS", "soon")
    p = parser()
    assert p.parse_args(["demo"]).steps == 300
    with pytest.raises(SystemExit):
        p.parse_args(["sidecar"])
    assert "--grace-seconds: invalid float value: 'soon'" in capsys.readouterr().err
