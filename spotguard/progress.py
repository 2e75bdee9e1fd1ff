"""Progress on stderr for the command lines, drawn by tqdm.

Shown when stderr is a terminal, or when asked for (``--progress``,
:func:`spotguard.cliutil.progress_flag`). On a terminal a bar is redrawn in
place; anywhere else (a pod's log, a pipe, a CI log) the same figures come as
plain lines, one every :data:`LOG_INTERVAL_SECONDS` and one at the end: no
carriage returns or terminal codes in a log.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")

#: How often a log (stderr not a terminal) gets a progress line.
LOG_INTERVAL_SECONDS = 10.0
#: How often a terminal's bar is redrawn.
TERMINAL_INTERVAL_SECONDS = 0.2
#: A log's line: the figures of the bar, without the bar.
LOG_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"
#: The same, for a total not known.
LOG_FORMAT_NO_TOTAL = "{desc}: {n_fmt} [{elapsed}, {rate_fmt}]"


class _Lines:
    """The file a log's bar writes to: each redraw becomes one line, the same line only once."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.last = ""

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line and line != self.last:
            self.stream.write(line + "\n")
            self.last = line

    def flush(self) -> None:
        self.stream.flush()


def open_bar(total: int | None, label: str, stream: TextIO, *, unit: str = "B", leave: bool = True) -> Any:
    """A tqdm bar on ``stream``: redrawn in place on a terminal, as lines
    elsewhere (see the module doc). Bytes (``unit="B"``) are counted in KiB,
    MiB, ... and their rate shown. A ``total`` of 0 or None is not known."""
    total = total or None
    scaled = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    if stream.isatty():
        return tqdm(
            total=total,
            desc=label,
            unit=unit,
            file=stream,
            leave=leave,
            mininterval=TERMINAL_INTERVAL_SECONDS,
            dynamic_ncols=True,
            **scaled,
        )
    return tqdm(
        total=total,
        desc=label,
        unit=unit,
        file=_Lines(stream),
        leave=True,  # a log keeps its lines: leaving nothing would mean a blank line
        mininterval=LOG_INTERVAL_SECONDS,
        bar_format=LOG_FORMAT if total else LOG_FORMAT_NO_TOTAL,
        **scaled,
    )


class ByteProgress:
    """A transfer's progress: called with each count of bytes (a
    :data:`~spotguard.storage.base.ProgressCallback`), ``close()``d at the
    end. Drawn from the first byte on, so a transfer that fails before it
    shows nothing; ``done`` counts the bytes either way."""

    def __init__(self, total: int, label: str, enabled: bool | None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total = total
        self.label = label
        self.done = 0
        self._bar: Any = None

    def __call__(self, n: int) -> None:
        self.done += n
        if not self.enabled or n <= 0:
            return
        if self._bar is None:
            self._bar = open_bar(self.total, self.label, self.stream)
        self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def steps(items: Sequence[T], label: str, enabled: bool | None, stream: TextIO | None = None) -> Iterator[T]:
    """``items`` one by one, the one being worked on shown with a count, on
    a terminal only and gone when done: off a terminal the work's own output
    says enough. ``enabled`` None: on a terminal; False: never."""
    out = stream or sys.stderr
    shown = out.isatty() and enabled is not False
    with tqdm(total=len(items), desc=label, file=out, leave=False, disable=not shown, dynamic_ncols=True) as bar:
        for item in items:
            bar.set_postfix_str(str(item))
            yield item
            bar.update(1)


__all__ = ["LOG_FORMAT", "LOG_INTERVAL_SECONDS", "ByteProgress", "open_bar", "steps"]
