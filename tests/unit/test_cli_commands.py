"""How spotguard's commands are added: each one's words come from its handler's docstring."""

from __future__ import annotations

import argparse

from spotguard import cli
from spotguard.cliutil import command


def subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:  # type: ignore[type-arg]
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_a_command_is_said_once_in_its_handlers_docstring() -> None:
    def handler(args: argparse.Namespace) -> int:
        """do the thing: what the parent's
        --help lists

        What the command's own --help
        says.

        And more of it.
        """
        return 7

    def terse(args: argparse.Namespace) -> int:
        """only a summary"""
        return 0

    parser = argparse.ArgumentParser(prog="spotguard")
    sub = parser.add_subparsers()
    p = command(sub, "thing", handler, usage="spotguard thing X")
    command(sub, "terse", terse)
    listed = {a.dest: a.help for a in sub._choices_actions}
    assert listed == {"thing": "do the thing: what the parent's --help lists", "terse": "only a summary"}
    assert p.description == "What the command's own --help says. And more of it."
    assert sub.choices["terse"].description is None
    assert p.format_usage().strip() == "usage: spotguard thing X"
    args = parser.parse_args(["thing"])
    assert args.func(args) == 7


def test_every_spotguard_command_has_its_help() -> None:
    """No command of the real parser lost its words on the way (a handler without a docstring)."""
    sub = subcommands(cli.build_parser())
    groups = [sub, subcommands(sub.choices["ckpt"]), subcommands(sub.choices["jobs"])]
    listed = {a.dest: a.help for group in groups for a in group._choices_actions}
    expected = {"ckpt", "restore", "sidecar", "run", "demo", "jobs", "ls", "verify", "gc", "average", "export"}
    expected |= {"describe", "checkpoints", "preempt"}
    assert expected <= set(listed)
    assert all(help and help == help.strip() and "\n" not in help for help in listed.values()), listed
    for name in ("run", "sidecar", "demo"):
        assert sub.choices[name].description, name
