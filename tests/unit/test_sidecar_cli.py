"""``spotguard sidecar|run|demo`` argument handling; building the parser stays light."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard.demo import cli as demo_cli
from spotguard.run import cli as run_cli
from spotguard.sidecar import args as shared_args
from spotguard.sidecar import cli


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spotguard")
    sub = p.add_subparsers(dest="command")
    cli.register(sub)
    run_cli.register(sub)
    demo_cli.register(sub)
    return p


def test_building_the_parser_imports_nothing_heavy() -> None:
    code = (
        "import sys, argparse; from spotguard.sidecar import cli; from spotguard.run import cli as run_cli; "
        "p = argparse.ArgumentParser(); sub = p.add_subparsers(); cli.register(sub); run_cli.register(sub); "
        "print(','.join(m for m in ('torch', 'boto3', 'kubernetes', 'kopf', 'prometheus_client') "
        "if m in sys.modules))"
    )
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


RETENTION_ENV = (
    "SPOTGUARD_KEEP_LAST",
    "SPOTGUARD_KEEP_BEST",
    "SPOTGUARD_BEST_METRIC",
    "SPOTGUARD_BEST_MODE",
    "SPOTGUARD_KEEP_EVERY",
    "SPOTGUARD_KEEP_LOCAL",
    "SPOTGUARD_NOTICES",
)


@pytest.mark.parametrize("command", [["sidecar", "--storage", "file:///x"], ["run", "--", "true"]])
def test_run_and_sidecar_share_the_retention_policy(command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from spotguard.checkpoint import RetentionPolicy

    for key in RETENTION_ENV:
        monkeypatch.delenv(key, raising=False)
    assert shared_args.retention_from_args(parser().parse_args(command)) is None  # no rule: keep everything
    monkeypatch.setenv("SPOTGUARD_KEEP_LAST", "1")
    monkeypatch.setenv("SPOTGUARD_KEEP_BEST", "2")
    monkeypatch.setenv("SPOTGUARD_BEST_METRIC", "loss")
    args = parser().parse_args(command)
    assert shared_args.retention_from_args(args) == RetentionPolicy(keep_last=1, keep_best=2, metric="loss")
    # Options override the environment.
    args = parser().parse_args(
        [command[0], "--keep-last", "3", "--keep-every", "100", "--best-mode", "max", *command[1:]]
    )
    assert shared_args.retention_from_args(args) == RetentionPolicy(
        keep_last=3, keep_best=2, metric="loss", mode="max", keep_every=100
    )
    assert args.keep_local == 1


def test_run_turns_on_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in RETENTION_ENV:
        monkeypatch.delenv(key, raising=False)
    assert parser().parse_args(["run", "--", "true"]).notices == ""
    args = parser().parse_args(
        [
            "run",
            "--notices",
            "aws,gce",
            "--aws-imds-endpoint",
            "http://127.0.0.1:1",
            "--notice-interval",
            "0.5",
            "--",
            "true",
        ]
    )
    assert (args.notices, args.aws_imds_endpoint, args.notice_interval) == ("aws,gce", "http://127.0.0.1:1", 0.5)
    monkeypatch.setenv("SPOTGUARD_NOTICES", "azure")
    assert parser().parse_args(["run", "--", "true"]).notices == "azure"


def test_a_retention_rule_without_its_metric_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in RETENTION_ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="keep_best needs a metric name"):
        shared_args.retention_from_args(parser().parse_args(["run", "--keep-best", "2", "--", "true"]))


@pytest.mark.parametrize("command", [["sidecar", "--storage", "file:///x"], ["run", "--", "true"]])
@pytest.mark.parametrize(
    ("env", "flags", "incremental"),
    [
        (None, [], True),  # on by default
        ("", [], True),
        ("1", [], True),
        ("TRUE", [], True),
        (" yes ", [], True),
        ("on", [], True),
        ("0", [], False),
        ("false", [], False),
        ("No", [], False),
        ("off", [], False),
        (None, ["--incremental"], True),
        ("off", ["--incremental"], True),
        ("on", ["--no-incremental"], False),
        ("maybe", ["--no-incremental"], False),  # the option wins; the variable is not read
    ],
)
def test_incremental_from_option_or_environment(
    command: list[str], env: str | None, flags: list[str], incremental: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if env is None:
        monkeypatch.delenv("SPOTGUARD_INCREMENTAL", raising=False)
    else:
        monkeypatch.setenv("SPOTGUARD_INCREMENTAL", env)
    args = parser().parse_args([command[0], *flags, *command[1:]])
    assert shared_args.incremental_from_args(args) is incremental


@pytest.mark.parametrize("command", [["sidecar", "--storage", "file:///x"], ["run", "--", "true"]])
def test_a_bad_incremental_variable_is_an_error_naming_it(command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTGUARD_INCREMENTAL", "maybe")
    p = parser()
    assert p.parse_args(["demo"]).steps == 300  # other commands do not care
    with pytest.raises(ValueError, match=r"SPOTGUARD_INCREMENTAL must be 1/true/yes/on or 0/false/no/off, not 'maybe'"):
        shared_args.incremental_from_args(p.parse_args(command))


@pytest.mark.parametrize("command", ["sidecar", "run"])
def test_a_bad_incremental_variable_stops_the_command_before_anything_runs(command: str, tmp_path: Path) -> None:
    # A subprocess: the sidecar installs its signal handlers first thing.
    log = tmp_path / "termination-log"
    argv = {
        "sidecar": [
            "sidecar",
            "--storage",
            (tmp_path / "store").as_uri(),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--termination-log",
            str(log),
            "--metrics-port",
            "0",
        ],
        "run": ["run", "--workdir", str(tmp_path / "work"), "--", sys.executable, "-c", "raise SystemExit(9)"],
    }[command]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env["SPOTGUARD_INCREMENTAL"] = "sometimes"
    out = subprocess.run(
        [sys.executable, "-m", "spotguard.cli", *argv], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 2, out.stderr
    assert "SPOTGUARD_INCREMENTAL must be 1/true/yes/on or 0/false/no/off, not 'sometimes'" in out.stderr
    if command == "sidecar":
        assert "SPOTGUARD_INCREMENTAL" in log.read_text()  # where the operator reads why
    else:
        assert not (tmp_path / "work").exists()  # nothing started


def test_run_passes_incremental_to_the_agent(tmp_path: Path) -> None:
    from spotguard.run.supervisor import RunConfig, Supervisor
    from spotguard.sidecar.metrics import SidecarMetrics
    from spotguard.storage import open_storage

    storage = open_storage((tmp_path / "store").as_uri())
    for incremental in (False, True):
        config = RunConfig(
            command=["true"],
            workdir=tmp_path,
            storage_uri=(tmp_path / "store").as_uri(),
            checkpoint_dir=tmp_path / "ck",
            incremental=incremental,
        )
        agent = Supervisor(config, storage, SidecarMetrics(namespace="", job="")).agent
        assert agent.config.incremental is incremental and agent.shipper.incremental is incremental


def test_run_hands_the_agent_every_uploader_setting_and_both_take_the_contracts_defaults(tmp_path: Path) -> None:
    from dataclasses import fields

    from spotguard.contract import env
    from spotguard.run.supervisor import RunConfig, Supervisor
    from spotguard.sidecar.metrics import SidecarMetrics
    from spotguard.sidecar.service import AgentConfig, UploaderConfig
    from spotguard.storage import open_storage

    given = {
        "grace_seconds": 7.0,
        "safety_margin_seconds": 1.5,
        "poll_seconds": 0.5,
        "keep_local": 3,
        "notice_stops_training": True,
        "save_every_seconds": 9.0,
        "incremental": True,
    }
    assert set(given) | {"checkpoint_dir"} == {f.name for f in fields(UploaderConfig)}
    uri = (tmp_path / "store").as_uri()
    config = RunConfig(command=["true"], workdir=tmp_path, storage_uri=uri, checkpoint_dir=tmp_path / "ck", **given)
    agent = Supervisor(config, open_storage(uri), SidecarMetrics(namespace="", job="")).agent.config
    assert {name: getattr(agent, name) for name in given} == given
    assert (agent.checkpoint_dir, agent.control_dir) == (tmp_path / "ck", config.control_dir)
    sidecar = AgentConfig(checkpoint_dir=tmp_path, control_dir=tmp_path)
    assert (sidecar.grace_seconds, sidecar.safety_margin_seconds, sidecar.keep_local, sidecar.finish_seconds) == (
        env.GRACE_SECONDS.default,
        env.SAFETY_MARGIN_SECONDS.default,
        env.KEEP_LOCAL.default,
        env.FINISH_SECONDS.default,
    )
