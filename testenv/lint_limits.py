"""Size limits and broad excepts of the product, checked by ``make lint``.

    python -m testenv.lint_limits [ROOT]     # ROOT: the package to check, ``spotguard`` by default

Fails (exit 1, one line per finding) on:
- a module of more than :data:`MAX_MODULE_LINES` lines;
- the ``Checkpointer`` class (``trainer/checkpointer.py``) over :data:`MAX_CHECKPOINTER_LINES`
  lines: the facade delegates to the parts beside it and must stay readable whole;
- an ``except Exception``, ``except BaseException`` or bare ``except:`` (alone or in a
  tuple) with no comment on its line or on the line above saying why it must be broad.

Only ``spotguard/`` is in scope: it is what users install and read. ``testenv/``,
``bench/`` and ``tests/`` are the test world and the benchmark drivers (never imported
by the product); some of their modules are long tables of scenarios over 700 lines,
and they catch broadly on purpose (polling, best-effort cleanup), as ruff's per-file
ignores already say for ``tests/``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE_LINES = 700
MAX_CHECKPOINTER_LINES = 400
#: Where the Checkpointer class lives, relative to the package root.
CHECKPOINTER_MODULE = Path("trainer") / "checkpointer.py"
_BROAD = frozenset({"Exception", "BaseException"})
BROAD_WITHOUT_REASON = "broad except with no reason: narrow it, or say on its line why it must be broad"


def _is_broad(kind: ast.expr | None) -> bool:
    if kind is None:  # bare ``except:``
        return True
    if isinstance(kind, ast.Name):
        return kind.id in _BROAD
    if isinstance(kind, ast.Attribute):  # builtins.Exception
        return kind.attr in _BROAD
    if isinstance(kind, ast.Tuple):
        return any(_is_broad(e) for e in kind.elts)
    return False


def _has_reason(lines: list[str], lineno: int) -> bool:
    """A comment on the ``except`` line (after the code) or a comment line right above it."""
    here = lines[lineno - 1]
    above = lines[lineno - 2].strip() if lineno > 1 else ""
    comment = here.partition("#")[2].strip() if "#" in here else ""
    # ruff's BLE001 suppression alone silences the rule without saying why.
    reason = comment.removeprefix("noqa: BLE001").strip(" -:")
    return bool(reason) or (above.startswith("#") and len(above.lstrip("# ")) > 0)


def check_source(source: str, relpath: Path) -> list[str]:
    """Pure: the findings for one module's text (``relpath`` relative to the package root)."""
    findings: list[str] = []
    lines = source.splitlines()
    if len(lines) > MAX_MODULE_LINES:
        findings.append(f"{relpath}: {len(lines)} lines, over the limit of {MAX_MODULE_LINES}")
    tree = ast.parse(source, filename=str(relpath))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ClassDef)
            and node.name == "Checkpointer"
            and relpath == CHECKPOINTER_MODULE
            and node.end_lineno is not None
        ):
            size = node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1
            if size > MAX_CHECKPOINTER_LINES:
                findings.append(
                    f"{relpath}:{node.lineno}: class Checkpointer has {size} lines, "
                    f"over the limit of {MAX_CHECKPOINTER_LINES}"
                )
        elif isinstance(node, ast.ExceptHandler) and _is_broad(node.type) and not _has_reason(lines, node.lineno):
            findings.append(f"{relpath}:{node.lineno}: {BROAD_WITHOUT_REASON}")
    return findings


def check_tree(root: Path) -> list[str]:
    """The findings for every module under ``root``, in path order."""
    findings: list[str] = []
    for path in sorted(root.rglob("*.py")):
        findings += check_source(path.read_text(encoding="utf-8"), path.relative_to(root))
    return findings


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0] if args else "spotguard")
    findings = check_tree(root)
    for line in findings:
        print(f"{root}/{line}", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
