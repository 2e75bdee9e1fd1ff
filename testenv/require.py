"""What a test needs from the machine (a tool, a package, root): skip outside CI, fail in CI.

On a developer's machine a test whose tool is missing is skipped, and the skip
says what to install. Under ``CI`` set to a true value (``1``, ``true``,
``yes``, ``on``: what CI services set) the same check fails the test instead:
CI provisions everything, so a missing tool there is a broken setup, never a
reason to report green.

    from testenv.require import require_tool
    helm = require_tool("helm", path=bin_dir() / "helm")

Called at module level (outside a test), a skip skips the whole module and a
failure is a collection error: both are reported.
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

CI_ENV = "CI"
#: How the test environment installs what the tests need.
SETUP_HINT = "run `make setup` (or `bash testenv/provision.sh`)"


def in_ci() -> bool:
    """Whether ``CI`` is set to a true value."""
    return os.environ.get(CI_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def missing(what: str, hint: str = SETUP_HINT) -> NoReturn:
    """``what`` is missing: skip (with ``hint``, what to install or run) outside CI, fail under CI."""
    message = f"{what}: {hint}"
    if in_ci():
        pytest.fail(
            f"{message} ({CI_ENV} is set: a missing requirement fails the test, it is not skipped)", pytrace=False
        )
    pytest.skip(message, allow_module_level=True)


def require(present: bool, what: str, hint: str = SETUP_HINT) -> None:
    """Go on if ``present``; otherwise :func:`missing`."""
    if not present:
        missing(what, hint)


def require_tool(name: str, install_hint: str = SETUP_HINT, path: str | os.PathLike[str] | None = None) -> str:
    """The executable ``name``: ``path`` if given and there, else the one on ``PATH``; missing: :func:`missing`."""
    if path is not None and Path(path).is_file() and os.access(path, os.X_OK):
        return str(path)
    found = shutil.which(name)
    if found is None:
        where = f" (not at {path}, nor on PATH)" if path is not None else " (not on PATH)"
        missing(f"{name} is not installed{where}", install_hint)
    return found


def require_root(what: str, hint: str = "run the tests as root (`sudo make test`)") -> None:
    """``what`` needs root (namespaces, mounts, network devices)."""
    require(os.geteuid() == 0, f"{what} needs root", hint)


def require_module(name: str, install_hint: str = SETUP_HINT) -> ModuleType:
    """Import the module ``name``; not installed: :func:`missing` (like ``pytest.importorskip``, but fails in CI)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"Python package {name} is not installed ({exc})", install_hint)
