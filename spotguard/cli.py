"""Command-line entry point: argument parsing only.

Each subsystem registers its own subcommands through a ``register(subparsers)``
function that adds parsers with ``set_defaults(func=handler)``, where
``handler(args) -> int`` is the exit status. Subsystem modules import heavy
dependencies (torch, kopf, boto3) inside their handlers, so ``spotguard --help``
stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from spotguard.version import __version__

_COMMAND_MODULES = (
    "spotguard.checkpoint.tools.cli",  # ckpt ls|verify|restore|gc|average, restore
    "spotguard.sidecar.cli",  # sidecar
    "spotguard.run.cli",  # run
    "spotguard.demo.cli",  # demo
    "spotguard.operator.cli",  # operator
    "spotguard.jobs.cli",  # jobs ls|describe|checkpoints|preempt
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spotguard",
        description="Keep long ML training runs alive on preemptible (spot) GPUs.",
    )
    parser.add_argument("--version", action="version", version=f"spotguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
