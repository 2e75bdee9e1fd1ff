"""What every spotguard command line shares: the usage exit status, one-line errors, the progress switch."""

from __future__ import annotations

import argparse
import logging
import sys

#: argparse's own exit status for a usage error.
EXIT_USAGE = 2


def progress_flag(p: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress`` (default: progress when stderr is a TTY)."""
    p.add_argument("--progress", action="store_true", default=None, help="show progress on stderr (default: if a TTY)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="never show progress")


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
