"""The ``SPOTGUARD_*`` registry (spotguard.contract.env): one parser per type, and every name mentioned is in it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from spotguard.contract import env
from spotguard.contract.env import REGISTRY, Var, cli_default, from_env, option_or_env, parse, to_env

ROOT = Path(__file__).resolve().parents[2]
NAME_RE = re.compile(r"SPOTGUARD_[A-Z0-9_]*(\*)?")


def test_every_variable_is_named_once_with_a_type_a_default_and_a_meaning() -> None:
    assert len(REGISTRY) >= 40
    for name, var in REGISTRY.items():
        assert var.name == name and name.startswith(env.PREFIX) and name == name.upper()
        assert var.type in (str, int, float, bool), name
        assert var.default is None or isinstance(var.default, var.type), name
        assert var.meaning and "\n" not in var.meaning, name
        assert var.bound == "any" or var.type in (int, float), name
    assert env.STORAGE_URI is REGISTRY["SPOTGUARD_STORAGE_URI"]


@pytest.mark.parametrize(
    ("var", "text", "value"),
    [
        (env.STORAGE_URI, "s3://b/p", "s3://b/p"),
        (env.STORAGE_URI, None, None),
        (env.STORAGE_URI, "  ", None),  # blank is unset
        (env.BEST_MODE, None, "min"),
        (env.KEEP_LAST, " 3 ", 3),
        (env.KEEP_LOCAL, "", 1),
        (env.GRACE_SECONDS, "45", 45.0),
        (env.GRACE_SECONDS, "2.5", 2.5),
        (env.SAVE_EVERY_SECONDS, "0", 0.0),
        (env.GC_LEASE_SECONDS, None, 60.0),
        (env.INCREMENTAL, "On", True),
        (env.INCREMENTAL, "YES", True),
        (env.INCREMENTAL, "1", True),
        (env.INCREMENTAL, "off", False),
        (env.NOTICE_STOPS_TRAINING, "on", True),  # one vocabulary for every boolean
        (env.NOTICE_STOPS_TRAINING, None, False),
        (env.READ_CHECKPOINTS, None, True),
        (env.READ_CHECKPOINTS, "no", False),
    ],
)
def test_parse(var: Var[Any, Any], text: str | None, value: object) -> None:
    assert parse(var, text) == value
    assert type(parse(var, text)) is type(value)


@pytest.mark.parametrize(
    ("var", "text", "message"),
    [
        (env.SAVE_EVERY_STEPS, "ten", "SPOTGUARD_SAVE_EVERY_STEPS must be an integer, not 'ten'"),
        (env.ATTEMPT, "1.5", "SPOTGUARD_ATTEMPT must be an integer, not '1.5'"),
        (env.KEEP_LAST, "-1", "SPOTGUARD_KEEP_LAST must not be negative, not '-1'"),
        (env.SAVE_EVERY_SECONDS, "soon", "SPOTGUARD_SAVE_EVERY_SECONDS must be a number, not 'soon'"),
        (env.SAVE_EVERY_SECONDS, "nan", "SPOTGUARD_SAVE_EVERY_SECONDS must be a number, not 'nan'"),
        (env.SAVE_EVERY_SECONDS, "-5", "SPOTGUARD_SAVE_EVERY_SECONDS must not be negative, not '-5'"),
        (env.GC_LEASE_SECONDS, "0", "SPOTGUARD_GC_LEASE_SECONDS must be more than 0, not '0'"),
        (env.INCREMENTAL, "maybe", "SPOTGUARD_INCREMENTAL must be 1/true/yes/on or 0/false/no/off, not 'maybe'"),
        (env.READ_CHECKPOINTS, "enabled", "SPOTGUARD_READ_CHECKPOINTS must be 1/true/yes/on or 0/false/no/off"),
    ],
)
def test_a_bad_value_is_one_error_naming_the_variable_the_value_and_what_it_must_be(
    var: Var[Any, Any], text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse(var, text)


def test_from_env_reads_the_given_mapping_or_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert from_env(env.KEEP_LAST, {"SPOTGUARD_KEEP_LAST": "4"}) == 4
    assert from_env(env.KEEP_LAST, {}) is None
    monkeypatch.setenv("SPOTGUARD_KEEP_LAST", "5")
    assert from_env(env.KEEP_LAST) == 5


@pytest.mark.parametrize(
    ("var", "value", "text"),
    [
        (env.GRACE_SECONDS, 45, "45"),
        (env.GRACE_SECONDS, 45.0, "45"),
        (env.SAVE_EVERY_SECONDS, 1.5, "1.5"),
        (env.SAVE_EVERY_SECONDS, 123.456789, "123.456789"),  # no precision lost
        (env.SAVE_EVERY_SECONDS, 1e6, "1000000"),
        (env.KEEP_LAST, 3, "3"),
        (env.INCREMENTAL, True, "true"),
        (env.READ_CHECKPOINTS, False, "false"),
        (env.STORAGE_URI, "gs://b/p", "gs://b/p"),
    ],
)
def test_to_env_renders_what_from_env_reads_back(var: Var[Any, Any], value: object, text: str) -> None:
    assert to_env(var, value) == text
    assert parse(var, text) == value


@pytest.mark.parametrize(
    ("var", "value"), [(env.KEEP_LAST, "3"), (env.KEEP_LAST, True), (env.INCREMENTAL, 1), (env.STORAGE_URI, 3)]
)
def test_to_env_refuses_a_value_of_another_type(var: Var[Any, Any], value: object) -> None:
    with pytest.raises(TypeError, match=var.name):
        to_env(var, value)


def test_command_line_defaults_stay_text_until_their_command_runs() -> None:
    assert cli_default(env.GRACE_SECONDS, {}) == "30"
    assert cli_default(env.GRACE_SECONDS, {"SPOTGUARD_GRACE_SECONDS": "soon"}) == "soon"  # argparse's to reject
    assert cli_default(env.GRACE_SECONDS, {"SPOTGUARD_GRACE_SECONDS": ""}) == "30"
    assert cli_default(env.STORAGE_URI, {}) is None
    assert cli_default(env.INCREMENTAL, {}) == "true"
    assert option_or_env(env.INCREMENTAL, False) is False  # the option wins
    assert option_or_env(env.INCREMENTAL, None) is True
    assert option_or_env(env.READ_CHECKPOINTS, None) is True
    assert option_or_env(env.READ_CHECKPOINTS, "off") is False
    with pytest.raises(ValueError, match="SPOTGUARD_READ_CHECKPOINTS"):
        option_or_env(env.READ_CHECKPOINTS, "sometimes")


def _mentions(paths: list[Path]) -> dict[str, list[str]]:
    """Every SPOTGUARD_ name (or ``SPOTGUARD_X_*`` family) mentioned, with where."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in NAME_RE.finditer(line):
                found.setdefault(m.group(0), []).append(f"{path.relative_to(ROOT)}:{n}")
    return found


def test_every_variable_mentioned_in_the_code_and_the_docs_is_registered() -> None:
    # docs/testing.md describes the test world, whose variables (SPOTGUARD_CACHE, SPOTGUARD_TEST_*) the product
    # never reads: they belong to testenv/, not to the contract.
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md")) if p.name != "testing.md"]
    paths = sorted((ROOT / "spotguard").rglob("*.py")) + docs
    mentions = _mentions(paths)
    assert "SPOTGUARD_STORAGE_URI" in mentions  # the scan sees them
    unknown = {}
    for name, where in mentions.items():
        if name.endswith("*"):  # a family, e.g. SPOTGUARD_KEEP_*: some variable must be in it
            ok = any(v.startswith(name[:-1]) for v in REGISTRY)
        else:
            ok = name in REGISTRY or name == env.PREFIX
        if not ok:
            unknown[name] = where
    assert not unknown, f"not in spotguard/contract/env.py (a typo, or a variable to register there): {unknown}"


def test_nothing_outside_the_registry_reads_a_variable_by_its_name() -> None:
    reading = re.compile(r"""(environ|env)(\.get\(|\[)\s*["']SPOTGUARD_""")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "spotguard").rglob("*.py"))
        if path.parent.name != "contract"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if reading.search(line)
    ]
    assert not offenders, f"read through spotguard.contract.env.from_env instead: {offenders}"


def _sidecar_table() -> list[tuple[str, str, str]]:
    """(option, variable, default) of each row of docs/sidecar.md's option table."""
    rows = []
    for line in (ROOT / "docs" / "sidecar.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 3 and cells[1].startswith("`SPOTGUARD_"):
            rows.append((cells[0], cells[1].strip("`"), cells[2]))
    return rows


def test_the_sidecar_docs_option_table_agrees_with_the_registry() -> None:
    rows = _sidecar_table()
    assert len(rows) >= 20
    for _option, name, documented in rows:
        assert name in REGISTRY, f"docs/sidecar.md lists {name}, which is not registered"
        var = REGISTRY[name]
        text = documented.strip("`").split(" ")[0]
        if var.default is None or var.type is str and not var.default:
            continue  # the reader's own default (or none), which the table words for people
        if var.type is bool:
            assert text == ("on" if var.default else "off"), (name, documented)
        elif var.type is str:
            assert text == var.default, (name, documented)
        else:
            assert float(text) == var.default, (name, documented)
    documented_names = {name for _, name, _ in rows}
    # Each variable the sidecar's own options read is in the table.
    sidecar_vars = {
        env.GRACE_SECONDS,
        env.SAFETY_MARGIN_SECONDS,
        env.FINISH_SECONDS,
        env.SIDECAR_MODE,
        env.METRICS_PORT,
        env.METRICS_ADDR,
        env.NOTICES,
        env.NOTICE_INTERVAL,
        env.NOTICE_STOPS_TRAINING,
        env.PROACTIVE_INTERVAL,
        env.KEEP_LAST,
        env.KEEP_BEST,
        env.BEST_METRIC,
        env.BEST_MODE,
        env.KEEP_EVERY,
        env.KEEP_LOCAL,
        env.INCREMENTAL,
        env.TERMINATION_LOG,
        env.STORAGE_URI,
        env.CHECKPOINT_DIR,
        env.CONTROL_DIR,
    }
    assert {v.name for v in sidecar_vars} <= documented_names


def test_the_trainers_environment_carries_incremental() -> None:
    from spotguard.trainer.config import CheckpointerConfig

    assert CheckpointerConfig.from_env({}).incremental is True  # on by default
    assert CheckpointerConfig.from_env({"SPOTGUARD_INCREMENTAL": "0"}).incremental is False
    assert CheckpointerConfig.from_env({"SPOTGUARD_INCREMENTAL": "1"}).incremental is True
    with pytest.raises(ValueError, match="SPOTGUARD_INCREMENTAL"):
        CheckpointerConfig.from_env({"SPOTGUARD_INCREMENTAL": "maybe"})
