"""Shared pieces of the benchmarks: synthetic training state, timing, resource use."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent.parent / "docs"
PLOTS = DOCS / "bench"

MiB = 1024 * 1024
GiB = 1024 * MiB


def make_model(total_bytes: int, width: int = 2048) -> Any:
    """A stack of Linear layers holding about ``total_bytes`` of float32 parameters."""
    import torch

    per_layer = width * width * 4
    layers = max(1, round(total_bytes / per_layer))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def make_training_state(total_bytes: int) -> tuple[Any, Any]:
    """A model and an AdamW optimizer after one step: parameters + 2 moments = ``total_bytes``."""
    import torch

    model = make_model(total_bytes // 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, model[0].in_features)
    model(x).sum().backward()
    opt.step()
    return model, opt


def state_nbytes(model: Any, opt: Any) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for s in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in s.values() if hasattr(v, "numel"))
    return int(n)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@dataclass
class Usage:
    wall: float = 0.0
    cpu: float = 0.0  # user + system, this process and waited-for children


@contextmanager
def measure() -> Iterator[Usage]:
    usage = Usage()
    r0s, r0c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        yield usage
    finally:
        usage.wall = time.perf_counter() - t0
        r1s, r1c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        usage.cpu = (r1s.ru_utime - r0s.ru_utime + r1s.ru_stime - r0s.ru_stime
                     + r1c.ru_utime - r0c.ru_utime + r1c.ru_stime - r0c.ru_stime)  # fmt: skip


def repeat(fn: Callable[[], float], n: int) -> list[float]:
    return [fn() for _ in range(n)]


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class Section:
    """One benchmark's results: a markdown table, notes, a plot, the goal verdicts."""

    title: str
    command: str  # the --only value that reproduces this section
    headers: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plot: str | None = None
    goals: list[tuple[str, bool, str]] = field(default_factory=list)  # (goal, met, detail)

    def markdown(self) -> str:
        out = [f"## {self.title}", "", f"Reproduce: `.venv/bin/python -m bench.run --only {self.command}` "
               "(part of `make bench`)", ""]
        if self.headers:
            out.append("| " + " | ".join(self.headers) + " |")
            out.append("|" + "---|" * len(self.headers))
            out += ["| " + " | ".join(r) + " |" for r in self.rows]
            out.append("")
        for goal, met, detail in self.goals:
            out.append(f"- Goal {goal}: **{'met' if met else 'missed'}** ({detail})")
        if self.goals:
            out.append("")
        out += [n + "\n" for n in self.notes]
        if self.plot:
            out += [f"![{self.title}]({self.plot})", ""]
        return "\n".join(out)


def fmt(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"
