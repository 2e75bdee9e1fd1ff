"""Where the suite's CPU goes: each test phase's CPU seconds, the most costly listed at the end.

The suite is bound by its two cores, not by waiting: its lanes keep the CPUs
busy for nearly all of their wall time, so what a test costs the run is the
CPU it spends, and pytest's ``--durations`` (wall time, which grows with
whatever else runs beside it) cannot tell which tests to make cheaper. This
plugin measures each phase (setup, call, teardown) as the CPU time of the
pytest process and of the child processes it waited for during the phase
(``getrusage``: ``RUSAGE_SELF`` + ``RUSAGE_CHILDREN``), so a test's trainers,
torchrun groups and CLI runs count, and services a session fixture started
count where they are reaped. It rides on each report (``user_properties``),
so pytest-xdist's workers hand it to the session that prints.

``SPOTGUARD_TEST_CPU_TOP`` (default 40; 0 prints nothing) sets how many phases
are listed, after pytest's own summary: "most CPU N test phases".
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from typing import Any

import pytest

TOP_ENV = "SPOTGUARD_TEST_CPU_TOP"
PROPERTY = "cpu_s"
_STARTS = pytest.StashKey[dict[str, float]]()


def cpu_seconds() -> float:
    """User and system CPU of this process and of every child process it has waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _measure(item: pytest.Item, when: str) -> Iterator[None]:
    start = cpu_seconds()
    try:
        yield
    finally:
        item.stash.setdefault(_STARTS, {})[when] = cpu_seconds() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    yield from _measure(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    yield from _measure(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    yield from _measure(item, "teardown")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    spent = item.stash.get(_STARTS, {}).get(call.when)
    if spent is not None:
        outcome.get_result().user_properties.append((PROPERTY, round(spent, 3)))


#: (CPU seconds, phase, test id) of every phase reported to this session.
_phases: list[tuple[float, str, str]] = []


def pytest_configure(config: pytest.Config) -> None:
    _phases.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Every phase's figure, in the session that prints (xdist's workers send theirs here)."""
    for key, value in report.user_properties:
        if key == PROPERTY:
            _phases.append((float(value), report.when or "", report.nodeid))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    top = int(os.environ.get(TOP_ENV, "40") or 0)
    if top <= 0 or getattr(config, "workerinput", None) is not None:
        return
    phases = sorted(_phases, reverse=True)
    if not phases:
        return
    total = sum(s for s, _, _ in phases)
    terminalreporter.write_sep("=", f"most CPU {min(top, len(phases))} test phases")
    for seconds, when, nodeid in phases[:top]:
        terminalreporter.write_line(f"{seconds:7.2f}s {when:<8} {nodeid}")
    terminalreporter.write_line(
        f"CPU of all {len(phases)} phases: {total:.0f} s (this session's process and the processes it waited for)"
    )
