"""The Checkpointer's configuration, written once: a keyword, a variable and a flag land in the same field."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from spotguard.checkpoint.store.retention import RetentionPolicy
from spotguard.cliutil import options_from
from spotguard.contract import env
from spotguard.demo import cli as demo_cli
from spotguard.operator import cli as operator_cli
from spotguard.run import cli as run_cli
from spotguard.sidecar import cli as sidecar_cli
from spotguard.trainer import Checkpointer
from spotguard.trainer.config import CheckpointerConfig, reference

ROOT = Path(__file__).resolve().parents[2]

#: A value other than the default for every field the contract's table names.
SAMPLES: dict[str, Any] = {
    "directory": Path("/data/ck"),
    "storage_uri": "s3://bucket/jobs/llama",
    "save_every_steps": 50,
    "save_every_seconds": 600.0,
    "checksum": "sha256",
    "control_dir": Path("/run/spotguard/control"),
    "keep_local": 3,
    "job": "llama",
    "attempt": 4,
    "incremental": False,
    "emergency_staging": Path("/dev/shm/spotguard"),
    "staging_reserve": True,
    "staging_arena": False,
    "final_verify_seconds": 45.0,
}


def _variables() -> dict[str, env.Var[Any, Any]]:
    return {f.name: f.metadata["spotguard.var"] for f in dataclasses.fields(CheckpointerConfig) if f.metadata}


def _flags(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    CheckpointerConfig.add_arguments(parser, environ={} if environ is None else environ)
    return parser


def _text(value: object) -> str:
    return str(value) if isinstance(value, Path) else value if isinstance(value, str) else repr(value)


def test_every_field_with_a_variable_has_a_sample() -> None:
    assert set(_variables()) == set(SAMPLES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_value_given_as_a_keyword_a_variable_or_a_flag_reaches_the_same_field(name: str) -> None:
    var, value = _variables()[name], SAMPLES[name]
    by_keyword = CheckpointerConfig(**{name: value})
    as_text = env.to_env(var, str(value) if isinstance(value, Path) else value)
    by_variable = CheckpointerConfig.from_env({var.name: as_text})
    if isinstance(value, bool):
        flags = [var.option if value else "--no-" + var.option.removeprefix("--")]
    else:
        flags = [var.option, _text(value)]
    by_flag = CheckpointerConfig.from_args(_flags().parse_args(flags))
    assert getattr(by_keyword, name) == getattr(by_variable, name) == getattr(by_flag, name) == value
    assert by_keyword == by_variable == by_flag
    assert by_keyword != CheckpointerConfig()  # the sample is no default


def test_retention_given_three_ways_is_the_same_policy() -> None:
    policy = RetentionPolicy(keep_last=2, keep_best=1, metric="loss", mode="max", keep_every=100)
    by_variable = CheckpointerConfig.from_env(policy.to_env()).retention
    flags = ["--keep-last", "2", "--keep-best", "1", "--best-metric", "loss", "--best-mode", "max", "--keep-every"]
    by_flag = CheckpointerConfig.from_args(_flags().parse_args([*flags, "100"])).retention
    assert CheckpointerConfig(retention=policy).retention == by_variable == by_flag == policy
    assert CheckpointerConfig.from_args(_flags().parse_args([])).retention is None  # no rule: keep everything


def test_a_flag_wins_over_the_environment_which_wins_over_the_default() -> None:
    environ = {env.KEEP_LOCAL.name: "4", env.INCREMENTAL.name: "false"}
    from_environment = CheckpointerConfig.from_args(_flags(environ).parse_args([]))
    assert (from_environment.keep_local, from_environment.incremental) == (4, False)
    flagged = CheckpointerConfig.from_args(_flags(environ).parse_args(["--keep-local", "7", "--incremental"]))
    assert (flagged.keep_local, flagged.incremental) == (7, True)
    with pytest.raises(ValueError, match="SPOTGUARD_INCREMENTAL must be"):
        CheckpointerConfig.from_args(_flags({env.INCREMENTAL.name: "maybe"}).parse_args([]))


def test_the_checkpointer_reads_keep_local_from_its_environment(tmp_path: Path) -> None:
    # SPOTGUARD_KEEP_LOCAL was never read by the Checkpointer, whose own default (2) disagreed with the table's (1).
    environ = {env.CHECKPOINT_DIR.name: str(tmp_path / "a"), env.KEEP_LOCAL.name: "3"}
    with Checkpointer.from_env(environ, handle_signals=False) as ck:
        assert ck.keep_local == 3
    with Checkpointer(tmp_path / "b") as ck:
        assert ck.keep_local == env.KEEP_LOCAL.default == 1


def test_the_checkpointers_defaults_are_the_tables() -> None:
    config = CheckpointerConfig()
    for name, var in _variables().items():
        if var.default is not None:
            assert getattr(config, name) == var.default, name


def test_a_checkpointer_built_three_ways_has_one_configuration(tmp_path: Path) -> None:
    keywords = {"storage_uri": "file:///nowhere", "save_every_steps": 5, "keep_local": 3, "job": "j"}
    by_keyword = Checkpointer(tmp_path, **keywords)
    by_variable = Checkpointer.from_env(
        {
            env.CHECKPOINT_DIR.name: str(tmp_path),
            env.STORAGE_URI.name: "file:///nowhere",
            env.SAVE_EVERY_STEPS.name: "5",
            env.KEEP_LOCAL.name: "3",
            env.JOB.name: "j",
        },
        handle_signals=False,
    )
    flags = ["--checkpoint-dir", str(tmp_path), "--storage", "file:///nowhere", "--save-every-steps", "5"]
    args = _flags().parse_args([*flags, "--keep-local", "3", "--job", "j"])
    by_flag = Checkpointer(config=CheckpointerConfig.from_args(args))
    try:
        assert by_keyword.config == by_variable.config == by_flag.config
        assert by_keyword.keep_local == 3 and by_keyword.control_dir == tmp_path / ".control"
    finally:
        for ck in (by_keyword, by_variable, by_flag):
            ck.close()


def test_the_configuration_is_fixed_once_built(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, keep_local=3) as ck:
        with pytest.raises(AttributeError, match="keep_local is fixed"):
            ck.keep_local = 5  # type: ignore[misc]
        with pytest.raises(dataclasses.FrozenInstanceError):
            ck.config.keep_local = 5  # type: ignore[misc]
        with pytest.raises(TypeError):
            ck.config.storage_options["secret_key"] = "x"  # type: ignore[index]
        assert ck.keep_local == 3
    with pytest.raises(TypeError, match="keep_locals"):
        Checkpointer(tmp_path, keep_locals=3)
    with pytest.raises(TypeError, match="not both"):
        Checkpointer(tmp_path, config=CheckpointerConfig())


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for p in sub.choices.values() for a in p._actions]


def test_every_command_line_option_of_a_variable_is_made_from_the_table() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    for cli in (sidecar_cli, run_cli, operator_cli, demo_cli):
        cli.register(sub)
    seen = set()
    for action in _options(parser):
        named = [v for v in env.REGISTRY.values() if f"env {v.name}" in (action.help or "")]
        if not named:
            continue
        (var,) = named
        seen.add(var.name)
        assert var.option in action.option_strings, (var.name, action.option_strings)
        if var.type is bool:
            assert isinstance(action, argparse.BooleanOptionalAction), var.name
        if var.choices:
            assert tuple(action.choices or ()) == var.choices, var.name
    # The shared ones: notices, retention, incremental, storage.
    assert {v.name for v in (*env.RETENTION, env.KEEP_LOCAL, env.NOTICES, env.INCREMENTAL, env.STORAGE_URI)} <= seen


def test_the_configuration_reference_in_the_docs_is_the_tables() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert reference() in text, "regenerate docs/configuration.md's table from spotguard.trainer.config.reference()"


def test_a_commands_options_are_the_fields_of_its_dataclass() -> None:
    @dataclasses.dataclass
    class Options:
        steps: int
        workdir: Path | None = None
        seed: int = 7

    args = argparse.Namespace(steps=5, workdir=Path("w"), verbose=True)
    assert options_from(Options, args) == Options(steps=5, workdir=Path("w"))  # an option it lacks: the default
    assert options_from(Options, args, steps=9, seed=1) == Options(steps=9, workdir=Path("w"), seed=1)


def test_the_checkpointers_signature_shows_the_configurations_keywords() -> None:
    import inspect

    parameters = inspect.signature(Checkpointer).parameters
    names = {f.name for f in dataclasses.fields(CheckpointerConfig)}
    assert names <= set(parameters) and "settings" not in parameters
    assert parameters["keep_local"].default == env.KEEP_LOCAL.default
    assert parameters["handle_signals"].default is False


def test_the_init_containers_restore_takes_its_directory_as_dest_or_checkpoint_dir() -> None:
    from spotguard.checkpoint.tools import cli as tools_cli

    parser = argparse.ArgumentParser()
    tools_cli.register(parser.add_subparsers())
    assert parser.parse_args(["restore", "--dest", "/a"]).dest == Path("/a")
    assert parser.parse_args(["restore", "--checkpoint-dir", "/b"]).dest == Path("/b")
