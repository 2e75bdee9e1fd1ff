"""Progress on stderr (spotguard.progress): a bar redrawn in place on a
terminal, plain lines in a log, nothing unless asked for off a terminal."""

from __future__ import annotations

import io

import pytest

from spotguard.progress import ByteProgress, steps


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def transfer(bar: ByteProgress, sizes: list[int]) -> None:
    bar(0)  # transfers ask before each part (storage.base.before_part)
    for n in sizes:
        bar(n)
    bar.close()


def test_a_log_gets_plain_lines_without_carriage_returns() -> None:
    log = io.StringIO()
    transfer(ByteProgress(3 * 2**20, "restoring ckpt-000000000020", True, log), [2**20] * 3)
    out = log.getvalue()
    assert "\r" not in out and "\x1b" not in out
    lines = out.splitlines()
    assert lines[-1].startswith("restoring ckpt-000000000020: 100% 3.00M/3.00M"), out
    assert len(lines) == len(set(lines)) <= 3  # a start, the end, nothing repeated


def test_a_log_without_a_known_total_gets_counts() -> None:
    log = io.StringIO()
    transfer(ByteProgress(0, "fetching", True, log), [1024, 2048])
    assert log.getvalue().splitlines()[-1].startswith("fetching: 3.00k ["), log.getvalue()


def test_a_terminal_gets_a_bar_redrawn_in_place() -> None:
    term = Terminal()
    transfer(ByteProgress(2048, "restoring", None, term), [1024, 1024])
    out = term.getvalue()
    assert out.startswith("\r") and out.endswith("\n") and "100%|" in out


@pytest.mark.parametrize("enabled", [None, False])
def test_nothing_off_a_terminal_unless_asked(enabled: bool | None) -> None:
    log = io.StringIO()
    bar = ByteProgress(10, "restoring", enabled, log)
    transfer(bar, [4, 6])
    assert log.getvalue() == "" and bar.done == 10
    assert ByteProgress(10, "x", False, Terminal()).enabled is False


def test_nothing_drawn_before_the_first_byte() -> None:
    term = Terminal()
    bar = ByteProgress(10, "restoring", True, term)
    bar(0)
    bar.close()
    assert term.getvalue() == "" and bar.done == 0


def test_steps_show_the_count_on_a_terminal_and_clear_it() -> None:
    term = Terminal()
    names = ["ckpt-000000000010", "ckpt-000000000020", "ckpt-000000000030"]
    seen = []
    for name in steps(names, "verifying", True, term):
        seen.append((name, term.getvalue()))
    assert [name for name, _ in seen] == names
    assert "verifying:  33%" in seen[1][1] and "1/3" in seen[1][1] and names[1] in seen[1][1]
    assert term.getvalue().endswith("\r")  # the line is blanked when done: the table follows


@pytest.mark.parametrize("enabled", [None, True, False])
def test_steps_show_nothing_off_a_terminal(enabled: bool | None) -> None:
    log = io.StringIO()
    assert list(steps(["a", "b"], "verifying", enabled, log)) == ["a", "b"]
    assert log.getvalue() == ""
    term = Terminal()
    assert list(steps(["a"], "verifying", False, term)) == ["a"] and term.getvalue() == ""
