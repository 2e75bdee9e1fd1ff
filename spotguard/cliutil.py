"""What every spotguard command line shares: a command added with its words from its handler's docstring,
the usage exit status, one-line errors, the progress and verification depth switches, a command's options
as the dataclass its handler takes."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: argparse's own exit status for a usage error.
EXIT_USAGE = 2


def command(
    subparsers: Any, name: str, handler: Callable[[argparse.Namespace], int], **parser: Any
) -> argparse.ArgumentParser:
    """Add the subcommand ``name``, carried out by ``handler``; its parser, for the options.

    What a command is for is said once, in its handler's docstring: the first
    paragraph is the help the parent's ``--help`` lists, the rest the
    description of the command's own ``--help``. ``parser`` goes to
    ``add_parser`` as is (``usage``).
    """
    summary, _, rest = (inspect.getdoc(handler) or "").partition("\n\n")
    p: argparse.ArgumentParser = subparsers.add_parser(
        name, help=" ".join(summary.split()), description=" ".join(rest.split()) or None, **parser
    )
    p.set_defaults(func=handler)
    return p


def progress_flag(p: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress`` (default: progress when stderr is a TTY)."""
    p.add_argument("--progress", action="store_true", default=None, help="show progress on stderr (default: if a TTY)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="never show progress")


def depth_flags(p: argparse.ArgumentParser, *, quick: bool = True, deep_finds: str = "") -> None:
    """How deep a verification reads: ``--quick`` (sizes only; where ``quick``) and ``--deep``
    (every byte back; ``deep_finds`` says what it finds, where a command says it)."""
    if quick:
        p.add_argument("--quick", action="store_true", help="check sizes only, do not read the data")
    finds = f" ({deep_finds})" if deep_finds else ""
    p.add_argument(
        "--deep",
        action="store_true",
        help=f"read every byte back instead of trusting checksums the store computed on receipt{finds}",
    )


def usage(parser: argparse.ArgumentParser) -> int:
    """Print the help of a command given no subcommand; the usage exit status."""
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def error(message: str) -> None:
    """One line on stderr, as argparse writes its own errors."""
    print(f"spotguard: error: {message}", file=sys.stderr)


def configure_logging(verbose: bool = False) -> None:
    """One structured line per event on stderr."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s spotguard %(levelname)s %(message)s",
    )


def options_from(cls: type[T], *sources: object, **given: Any) -> T:
    """The dataclass ``cls`` a command hands its work to: each field as ``given``, else the attribute
    of the same name of the first of ``sources`` that has one (the parsed options, or options
    already checked), else the field's default: options and fields are named alike once."""
    names = {f.name for f in dataclasses.fields(cls) if f.init} - given.keys()  # type: ignore[arg-type]
    found = {name: getattr(src, name) for name in names for src in reversed(sources) if hasattr(src, name)}
    return cls(**found, **given)
