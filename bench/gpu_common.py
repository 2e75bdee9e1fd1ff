"""What the GPU check's parts share: a check's record, the run's context, child processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


class UsageError(Exception):
    """Bad options or an unusable environment: exit 2."""


class CheckFailed(Exception):
    """A check found something wrong: exit 1."""


@dataclass
class Check:
    name: str
    ok: bool = False
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    def say(self, text: str) -> None:
        print(f"{self.name}: {text}", flush=True)

    def fig(self, key: str, value: Any) -> Any:
        self.figures[key] = value
        return value


@dataclass
class Ctx:
    cuda: bool
    ranks: int
    size_mib: int
    quick: bool
    root: Path
    launcher: list[str]
    frozen_bytes: int = 0  # the finetune check's frozen base

    @property
    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"

    @property
    def rounds(self) -> int:
        return 3 if self.quick else 5

    @property
    def timeout(self) -> float:
        return 300.0

    def torchrun(self, nproc: int | None = None) -> list[str]:
        return [*self.launcher, "--standalone", "--nproc-per-node", str(nproc or self.ranks)]


# -- child processes -----------------------------------------------------------------


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without spotguard settings, this checkout importable, one thread per rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


class Child:
    """A subprocess in a session of its own; its output is read line by line, with arrival times."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.argv = argv
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._log = log
        self.popen = subprocess.Popen(
            argv,
            env=env,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with self._log.open("a", encoding="utf-8") as logf:
            for raw in self.popen.stdout:
                line = raw.rstrip("\n")
                logf.write(line + "\n")
                with self._cond:
                    self.lines.append((time.monotonic(), line))
                    self._cond.notify_all()

    def wait_for(self, pred: Callable[[str], bool], timeout: float) -> tuple[float, str]:
        """The first line matching ``pred`` and when it arrived."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for when, line in self.lines[seen:]:
                    if pred(line):
                        return when, line
                seen = len(self.lines)
                if not self._reader.is_alive():
                    raise CheckFailed(f"no expected line before the command ended; see {self._log}")
                if time.monotonic() >= deadline:
                    raise CheckFailed(f"no expected line within {timeout:.0f}s; see {self._log}")
                self._cond.wait(0.2)

    def find(self, regex: re.Pattern[str]) -> tuple[float, re.Match[str]] | None:
        with self._cond:
            for when, line in self.lines:
                m = regex.search(line)
                if m:
                    return when, m
        return None

    def wait(self, timeout: float) -> int:
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise CheckFailed(f"still running after {timeout:.0f}s (killed); see {self._log}") from None
        self._reader.join(10)
        return rc

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def tail(self, n: int = 15) -> str:
        with self._cond:
            return "\n".join(line for _, line in self.lines[-n:])


def run_child(argv: list[str], env: dict[str, str], log: Path, timeout: float) -> Child:
    """Run to the end; a non-zero exit fails the check with the output's tail."""
    child = Child(argv, env, log)
    try:
        rc = child.wait(timeout)
    finally:
        child.kill()
    if rc != 0:
        raise CheckFailed(f"{' '.join(argv[:6])} ... exited {rc}:\n{child.tail()}")
    return child


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))
