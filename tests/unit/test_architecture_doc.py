"""docs/architecture.md says why the hand-written leader election stays, and
the tests it names as showing its fencing exist (a renamed test would leave
the page pointing at nothing)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: `tests/x.py`, `tests/x.py::test_name`, or `::test_name` (in the file named last).
_TEST_REF = re.compile(r"`(?:(tests/[\w/]+\.py)(?:::(\w+))?|::(\w+))`")


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def named_tests(text: str) -> list[tuple[str, str | None]]:
    refs: list[tuple[str, str | None]] = []
    last = ""
    for m in _TEST_REF.finditer(text):
        path, name, continued = m.groups()
        if path:
            last = path
            refs.append((path, name))
        else:
            assert last, f"`::{continued}` names no file before it"
            refs.append((last, continued))
    return refs


def test_the_leader_election_section_says_why_it_stays_and_its_tests_exist() -> None:
    text = section(ARCHITECTURE.read_text(), "Kept on purpose: the leader election")
    assert "operator/leader.py" in text and "fencing" in text.lower()
    for library in ("kopf's peering", "kubernetes.leaderelection"):
        assert library in text, f"the section does not say why {library} does not do"
    refs = named_tests(text)
    assert {path for path, _ in refs} >= {"tests/unit/test_leader_unit.py", "tests/integration/test_leader.py"}
    for path, name in refs:
        source = (ROOT / path).read_text()
        if name is not None:
            assert re.search(rf"^def {name}\(", source, re.M), f"{path} has no test {name}"


def test_every_test_the_page_names_exists() -> None:
    for path, name in named_tests(ARCHITECTURE.read_text()):
        assert (ROOT / path).is_file(), f"docs/architecture.md names {path}, which does not exist"
        if name is not None:
            assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{path} has no test {name}"
