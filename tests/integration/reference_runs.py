"""Uninterrupted reference runs, each computed at most once per test session.

A test that checks that an interrupted and resumed run ends bit for bit where
an uninterrupted one ends needs that uninterrupted run. The session fixture
``reference_runs`` (``tests/integration/conftest.py``) hands out one
:class:`ReferenceRuns`: a run is named by a key (the trainer and every argument
that changes its result: steps, checkpoint interval, ...), made the first time
a test asks for it, in a directory of its own, and remembered for the rest of
the session.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


class Pending(Generic[T]):
    """A reference run under way: :meth:`result` waits for it (once) and keeps what it gave."""

    def __init__(self, finish: Callable[[], T], cancel: Callable[[], None] | None = None) -> None:
        self._finish = finish
        self._cancel = cancel
        self._done = False
        self._value: T | None = None

    @classmethod
    def ready(cls, value: T) -> Pending[T]:
        run = cls(lambda: value)
        run.result()
        return run

    @property
    def done(self) -> bool:
        return self._done

    def result(self) -> T:
        if not self._done:
            self._value = self._finish()
            self._done = True
        return cast(T, self._value)

    def cancel(self) -> None:
        """Stop a run whose result nobody has read yet."""
        if not self._done and self._cancel is not None:
            self._cancel()


class ReferenceRuns:
    """Reference runs by key, each made at most once; see the module's docstring."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._runs: dict[Hashable, Pending[Any]] = {}
        self._dirs: dict[Hashable, Path] = {}

    def start(self, key: Hashable, begin: Callable[[Path], Pending[T]]) -> Pending[T]:
        """The run ``key``; the first ask starts it with ``begin(directory)``, an empty directory of its own.

        ``begin`` may return while the run goes on in the background: its
        :class:`Pending` waits for the result when one is read.
        """
        run = self._runs.get(key)
        if run is None:
            run = begin(self._new_dir(key))
            self._runs[key] = run
        return cast(Pending[T], run)

    def get(self, key: Hashable, compute: Callable[[Path], T]) -> T:
        """What ``compute(directory)`` returned the first time ``key`` was asked for."""
        return self.start(key, lambda d: Pending.ready(compute(d))).result()

    def path(self, key: Hashable) -> Path:
        """The directory the run ``key`` was made in."""
        return self._dirs[key]

    def discard_unfinished(self, *keys: Hashable) -> None:
        """Stop and forget each of the runs ``keys`` whose result was not read: a later ask starts it again."""
        for key in keys:
            run = self._runs.get(key)
            if run is not None and not run.done:
                run.cancel()
                del self._runs[key]

    def close(self) -> None:
        """Stop every run whose result was not read."""
        self.discard_unfinished(*list(self._runs))

    def demo_final(self, steps: int, save_every: int, *extra: str) -> bytes:
        """The final weights of the packaged demo trainer (``spotguard.demo.train``) run without interruption."""
        from sidecar_helpers import uninterrupted_final

        return self.get(
            ("demo", steps, save_every, *extra), lambda d: uninterrupted_final(d, steps, save_every, *extra)
        )

    def _new_dir(self, key: Hashable) -> Path:
        parts = key if isinstance(key, tuple) else (key,)
        name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", "-".join(map(str, parts))).strip("-_") or "run"
        d = self.root / name
        n = 1
        while d.exists():  # a run that failed: its successor starts from nothing
            n += 1
            d = self.root / f"{name}.{n}"
        d.mkdir(parents=True)
        self._dirs[key] = d
        return d
