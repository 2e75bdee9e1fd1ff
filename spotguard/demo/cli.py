"""``spotguard demo``: argument parsing only.

The demo sits above every other layer (it drives ``spotguard run`` and the
trainer), so its command registers itself with the top-level parser
(:mod:`spotguard.cli`) instead of riding along with the sidecar's commands.
The runner (:mod:`spotguard.demo.runner`) is imported by the handler only, so
``spotguard --help`` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from spotguard.cliutil import command, options_from


def register(subparsers: Any) -> None:
    """Add ``demo`` to the top-level parser."""
    p = command(subparsers, "demo", _demo)
    p.add_argument("--storage", default=None, help="checkpoint storage (default file:// in a temporary directory)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--preemptions", type=int, default=3, help="preemptions (default 3)")
    p.add_argument("--save-every", type=int, default=50, help="routine checkpoint interval in steps (default 50)")
    p.add_argument("--seed", type=int, default=None, help="seed for the preemption points (default random)")
    p.add_argument(
        "--workdir", type=Path, default=None, help="keep the demo's files here (default a temporary directory, removed)"
    )


def _demo(args: argparse.Namespace) -> int:
    """train a small model, preempt it several times, prove the result is bit-identical

    Train a small model under `spotguard run`, preempt it at random points, train it once uninterrupted,
    and compare the two results byte for byte.
    """
    from spotguard.demo.runner import DemoOptions, run_demo

    return run_demo(options_from(DemoOptions, args))
