"""The size limits and broad-except rule that ``make lint`` checks (testenv/lint_limits.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import spotguard
from testenv import lint_limits
from testenv.lint_limits import (
    BROAD_WITHOUT_REASON,
    MAX_CHECKPOINTER_LINES,
    MAX_MODULE_LINES,
    check_source,
    check_tree,
)

PACKAGE = Path(spotguard.__file__).parent


def test_the_product_is_within_its_limits() -> None:
    assert check_tree(PACKAGE) == []


@pytest.mark.parametrize(("lines", "over"), [(MAX_MODULE_LINES, False), (MAX_MODULE_LINES + 1, True)])
def test_module_length(lines: int, over: bool) -> None:
    findings = check_source("x = 1\n" * lines, Path("storage/big.py"))
    assert bool(findings) is over
    if over:
        assert findings == [f"storage/big.py: {lines} lines, over the limit of {MAX_MODULE_LINES}"]


def _class(name: str, lines: int) -> str:
    body = "\n".join(f"    a{i} = {i}" for i in range(lines - 1))
    return f"class {name}:\n{body}\n"


@pytest.mark.parametrize(("lines", "over"), [(MAX_CHECKPOINTER_LINES, False), (MAX_CHECKPOINTER_LINES + 1, True)])
def test_checkpointer_class_length(lines: int, over: bool) -> None:
    findings = check_source(_class("Checkpointer", lines), Path("trainer/checkpointer.py"))
    assert bool(findings) is over
    if over:
        assert "class Checkpointer has 401 lines" in findings[0]


def test_the_class_limit_is_the_checkpointers_alone() -> None:
    long = MAX_CHECKPOINTER_LINES + 50
    assert check_source(_class("Restorer", long), Path("trainer/checkpointer.py")) == []
    assert check_source(_class("Checkpointer", long), Path("trainer/other.py")) == []


def _handler(clause: str, above: str = "") -> str:
    return f"try:\n    pass\n{above}{clause}\n    pass\n"


@pytest.mark.parametrize(
    "clause",
    [
        "except Exception:",
        "except Exception as exc:",
        "except BaseException:",
        "except:",
        "except (OSError, Exception) as exc:",
        "except builtins.BaseException:",
        "except Exception:  # noqa: BLE001",
        "except Exception:  # noqa: BLE001 -",
    ],
)
def test_broad_except_without_a_reason_fails(clause: str) -> None:
    findings = check_source(_handler(clause), Path("storage/x.py"))
    assert findings == [f"storage/x.py:3: {BROAD_WITHOUT_REASON}"]


@pytest.mark.parametrize(
    ("clause", "above"),
    [
        ("except Exception:  # noqa: BLE001 - any client error is retried", ""),
        ("except BaseException:  # cleaned up, then raised again", ""),
        ("except:  # the thread's error goes to its caller", ""),
        ("except BaseException:", "# interrupted too: the temporary file must not stay\n"),
        ("except OSError:", ""),
        ("except (OSError, ValueError) as exc:", ""),
    ],
)
def test_narrow_or_justified_excepts_pass(clause: str, above: str) -> None:
    assert check_source(_handler(clause, above), Path("storage/x.py")) == []


def test_main_fails_on_a_tree_with_findings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ok.py").write_text("x = 1\n")
    assert lint_limits.main([str(tmp_path)]) == 0
    sub = tmp_path / "trainer"
    sub.mkdir()
    (sub / "checkpointer.py").write_text(_class("Checkpointer", MAX_CHECKPOINTER_LINES + 1))
    assert lint_limits.main([str(tmp_path)]) == 1
    assert "trainer/checkpointer.py:1: class Checkpointer has 401 lines" in capsys.readouterr().err
