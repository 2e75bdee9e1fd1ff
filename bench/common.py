"""Shared pieces of the benchmarks: synthetic training state, timing, resource use."""

from __future__ import annotations

import os
import re
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from testenv import cluster

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
        usage.cpu = (
            r1s.ru_utime
            - r0s.ru_utime
            + r1s.ru_stime
            - r0s.ru_stime
            + r1c.ru_utime
            - r0c.ru_utime
            + r1c.ru_stime
            - r0c.ru_stime
        )


_TICKS = os.sysconf("SC_CLK_TCK")


def _processes(cmdlines: dict[int, str]) -> dict[int, tuple[int, str, float]]:
    """Every process: pid -> (parent pid, command line, CPU seconds so far, user + system). A
    command line is read once per process (``cmdlines`` keeps them)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if pid not in cmdlines:
                cmdlines[pid] = (
                    Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode("ascii", "replace")
                )
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        found[pid] = (int(fields[1]), cmdlines[pid], (int(fields[11]) + int(fields[12])) / _TICKS)
    return found


def runs(cmdline: str, command: str) -> bool:
    """Pure: whether ``cmdline`` runs ``command`` ("program subcommand ..."): its program's name
    is the first word, and the other words follow among its arguments (``weed -logdir=x server``
    runs ``weed server``)."""
    words, want = cmdline.split(), command.split()
    return bool(words and want) and os.path.basename(words[0]) == want[0] and all(w in words[1:] for w in want[1:])


class CpuWatch:
    """CPU seconds (user + system) that each part of a run used while watched, read from ``/proc``.

    Parts: ``client`` (this process), ``supervisor`` (``root``, when given), ``trainer`` (every
    descendant of ``root``), ``store`` (processes that :func:`runs` ``store``: the program and its
    subcommand, wherever options stand between them). Sampled every ``interval`` s, so a process that
    exits while watched loses at most its last interval.
    """

    def __init__(self, root: int | None = None, store: str = "weed server", interval: float = 0.1) -> None:
        self._root, self._store, self._interval = root, store, interval
        self._cmdlines: dict[int, str] = {}
        self._before = _processes(self._cmdlines)
        self._last: dict[int, tuple[int, str, float]] = dict(self._before)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self._last.update(_processes(self._cmdlines))

    def _part(self, pid: int, parents: dict[int, int]) -> str | None:
        if pid == os.getpid():
            return "client"
        if runs(self._last[pid][1], self._store):
            return "store"
        if self._root is None:
            return None
        if pid == self._root:
            return "supervisor"
        seen = set()
        while pid in parents and pid not in seen:
            seen.add(pid)
            pid = parents[pid]
            if pid == self._root:
                return "trainer"
        return None

    def stop(self) -> dict[str, float]:
        """CPU seconds per part since the watch began (and ``all``: their sum)."""
        self._stop.set()
        self._thread.join()
        self._last.update(_processes(self._cmdlines))
        parents = {pid: v[0] for pid, v in self._last.items()}
        used: dict[str, float] = {}
        for pid, (_, _, cpu) in self._last.items():
            part = self._part(pid, parents)
            if part is not None:
                before = self._before.get(pid)
                used[part] = used.get(part, 0.0) + cpu - (before[2] if before else 0.0)
        used["all"] = sum(used.values())
        return used


def profiled(call: Callable[[], Any], path: str) -> Any:
    """``call()`` under cProfile, the threads it starts too (DCP's writer): statistics written to ``path``
    and ``path.threadN``. For the benchmarks' workers' ``*_PROFILE`` settings."""
    import cProfile

    threads: list[cProfile.Profile] = []

    def profile_thread(*_: Any) -> None:
        sys.setprofile(None)
        threads.append(cProfile.Profile())
        threads[-1].enable()

    profiler = cProfile.Profile()
    threading.setprofile(profile_thread)
    profiler.enable()
    try:
        return call()
    finally:
        profiler.disable()
        threading.setprofile(None)
        for i, t in enumerate(threads):
            t.disable()
            t.dump_stats(f"{path}.thread{i}")
        profiler.dump_stats(path)


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
        out = [
            f"## {self.title}",
            "",
            f"Reproduce: `.venv/bin/python -m bench.run --only {self.command}` (part of `make bench`)",
            "",
        ]
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


def quantile(xs: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), ``q`` in [0, 1]."""
    return percentile(xs, q)


@dataclass(frozen=True)
class Spread:
    """Per-round values of one measure (a ratio, a share) over interleaved rounds.

    Reported as the median with its interquartile range and its min-max. A
    goal is judged on the *worse* quartile (:meth:`worse`): the lower one when
    higher is better. Quartiles rather than extremes, so that one round hit
    by a burst of background load on a shared machine does not decide the
    verdict, while a goal met only in the better half of the rounds is missed.
    """

    values: tuple[float, ...]
    higher_is_better: bool = True

    @classmethod
    def of(cls, values: list[float], *, higher_is_better: bool = True) -> Spread:
        if not values:
            raise ValueError("a spread needs at least one round")
        return cls(tuple(values), higher_is_better)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def median(self) -> float:
        return float(statistics.median(self.values))

    @property
    def q1(self) -> float:
        return quantile(list(self.values), 0.25)

    @property
    def q3(self) -> float:
        return quantile(list(self.values), 0.75)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)

    def worse(self) -> float:
        """The quartile that the verdict on a goal uses."""
        return self.q1 if self.higher_is_better else self.q3

    def meets(self, threshold: float) -> bool:
        """Whether the worse quartile meets ``threshold`` (>= when higher is better)."""
        return self.worse() >= threshold if self.higher_is_better else self.worse() <= threshold

    def text(self, suffix: str = "x", digits: int = 2) -> str:
        """``2.21x (IQR 2.05-2.40x, min-max 1.90-2.60x, 7 rounds)``."""

        def f(x: float) -> str:
            return f"{x:.{digits}f}"

        if self.n == 1:
            return f"{f(self.median)}{suffix} (1 round: no spread)"
        return (
            f"{f(self.median)}{suffix} (IQR {f(self.q1)}-{f(self.q3)}{suffix}, "
            f"min-max {f(self.lo)}-{f(self.hi)}{suffix}, {self.n} rounds)"
        )

    def cell(self, suffix: str = "x", digits: int = 2) -> str:
        """Short form for a table cell: ``2.21x [2.05-2.40]``."""
        if self.n == 1:
            return f"{self.median:.{digits}f}{suffix}"
        return f"{self.median:.{digits}f}{suffix} [{self.q1:.{digits}f}-{self.q3:.{digits}f}]"


def goal(section: Section, text: str, spread: Spread, threshold: float, *, suffix: str = "x", detail: str = "") -> bool:
    """Record a goal judged on the worse quartile of ``spread``; returns whether it is met."""
    met = spread.meets(threshold)
    worse = "lower" if spread.higher_is_better else "upper"
    verdict = f"{spread.text(suffix)}; {worse} quartile {spread.worse():.2f}{suffix}"
    section.goals.append((text, met, verdict + (f"; {detail}" if detail else "")))
    return met


class StageLine(NamedTuple):
    """One of spotguard's ``stage=<name> seconds=<s> key=value ...`` log lines."""

    stage: str
    seconds: float
    fields: dict[str, str]  # the key=value pairs after the seconds (``name``: the checkpoint's)


_STAGE_LINE = re.compile(r"stage=(\w+) seconds=([0-9.]+)(.*)")
_FIELD = re.compile(r"(\w+)=(\S+)")


def stage_line(line: str) -> StageLine | None:
    """The stage line in ``line``, or None."""
    m = _STAGE_LINE.search(line)
    if m is None:
        return None
    return StageLine(m.group(1), float(m.group(2)), dict(_FIELD.findall(m.group(3))))


def parse_stage_lines(text: str) -> dict[str, float]:
    """Seconds per stage from spotguard's ``stage=<name> seconds=<s>`` log lines
    (summed when a stage appears more than once)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        st = stage_line(line)
        if st is not None:
            out[st.stage] = out.get(st.stage, 0.0) + st.seconds
    return out


def interleaved(rounds: int, methods: dict[str, Callable[[], Any]]) -> dict[str, list[Any]]:
    """Run every method once per round, rotating which goes first, so that
    background load and cache state hit them alike; results per method."""
    names = list(methods)
    out: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(methods[name]())
    return out


def per_round(num: list[float], den: list[float], *, higher_is_better: bool = True) -> Spread:
    """The spread of ``num[i] / den[i]`` over rounds."""
    return Spread.of([a / b for a, b in zip(num, den, strict=True)], higher_is_better=higher_is_better)


def make_room(s3: Any, path: Path, need: int) -> None:
    """Make sure ``need`` bytes of disk are free under ``path`` before a large run.

    The store on this machine keeps deleted objects' bytes until it compacts
    its volumes; when the disk is short, ask it to compact now
    (:meth:`~testenv.cluster.S3Store.reclaim`). Raises when there is still
    not enough room, rather than letting a run fail halfway on a full disk."""
    import shutil

    if shutil.disk_usage(path).free >= need:
        return
    s3.reclaim()
    free = shutil.disk_usage(path).free
    if free < need:
        raise RuntimeError(
            f"{need / GiB:.1f} GiB of free disk needed under {path} for this run, {free / GiB:.1f} GiB free "
            "after the store compacted its deleted objects: free some disk space or run smaller sizes"
        )


@contextmanager
def seaweedfs_store(work: Path, name: str) -> Iterator[Any]:
    """A SeaweedFS store of a benchmark's own (bucket ``name``), stopped at the end."""
    from testenv import cluster

    for attempt in range(3):
        sup = cluster.Supervisor(work / f"{name}-store-{attempt}")
        sup.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            store = cluster.start_seaweedfs(sup, bucket=name)
        except RuntimeError:
            # The ports are picked free before weed binds them; another process may take one meanwhile.
            sup.stop()
            if attempt == 2:
                raise
            continue
        try:
            yield store
        finally:
            sup.stop()
        return


class Ctx:
    """What the benchmarks share: scratch space, the S3 store, measured costs."""

    def __init__(
        self,
        work: Path,
        s3: cluster.S3Store | None,
        state_mb: int,
        *,
        rounds: int | None = None,
        plots: Path = PLOTS,
        profile: bool = False,
    ) -> None:
        self.work = work
        self.s3 = s3
        self.state_bytes = state_mb * MiB
        self.costs: dict[str, float] = {}
        self._model: Any = None
        self.ckpt_dir: Path | None = None
        self.rounds = rounds  # --rounds: overrides every section's default
        self.plots = plots
        self.profile = profile
        self.kube: Any = None
        if s3 is not None:  # spotguard reads the standard AWS environment
            os.environ.update(s3.env())

    def rounds_for(self, default: int) -> int:
        return max(1, self.rounds) if self.rounds is not None else default

    def training_state(self) -> tuple[Any, Any]:
        if self._model is None:
            self._model = make_training_state(self.state_bytes)
        model, opt = self._model
        return model, opt

    def storage(self, prefix: str) -> Any:
        from spotguard.storage import open_storage

        assert self.s3 is not None
        return open_storage(f"s3://{self.s3.bucket}/{prefix}")

    def checkpoint(self) -> Path:
        """A committed checkpoint of the training state (the stall benchmark's,
        or one written now when that benchmark did not run)."""
        if self.ckpt_dir is None:
            import spotguard

            model, opt = self.training_state()
            ckdir = self.work / "checkpoints-one"
            ck = spotguard.Checkpointer(ckdir, async_save=False, keep_local=1)
            ck.save(0, spotguard.torch_state(model, opt))
            ck.close()
            self.ckpt_dir = sorted(ckdir.glob("ckpt-*"))[-1]
        return self.ckpt_dir


def run_section_alone(bench: Callable[[Ctx], Section]) -> int:
    """A section run alone (``python -m bench.<module> [rounds]``), in a scratch directory of its own
    (under ``BENCH_TMP``); prints its markdown."""
    import tempfile

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else None
    with tempfile.TemporaryDirectory(prefix="spotguard-bench-", dir=os.environ.get("BENCH_TMP")) as tmp:
        print(bench(Ctx(Path(tmp), None, 0, rounds=rounds)).markdown())
    return 0


def run_under_spotguard(workdir: Path, code: Path, trainer: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment of ``spotguard run`` (spotguard imported from ``code``, every setting
    at its default: no ``SPOTGUARD_*`` variable, a grace period the bench never reaches) over ``trainer``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env.update(PYTHONPATH=str(code), OMP_NUM_THREADS="1")
    spotguard = str(Path(sys.executable).parent / "spotguard")
    return [spotguard, "run", "--workdir", str(workdir), "--grace-seconds", "300", "--", *trainer], env


def size_and_latency_cells(gb: float, lo: float, lat: list[float], base: list[float]) -> list[str]:
    """A bench row's first latency cells: the size, the median (min-max) of ``lat`` and, beside the
    smallest size ``lo`` (whose latencies are ``base``), the per-round ratio."""
    vs = per_round(lat, base, higher_is_better=False)
    return [
        f"{gb * 1024:g} MiB" if gb < 1 else f"{gb:g} GiB",
        f"{fmt(median(lat), 3)} ({fmt(min(lat), 3)}-{fmt(max(lat), 3)})",
        "1.00x" if gb == lo else vs.cell(),
    ]
