"""Run the test suite as concurrent lanes: separate pytest sessions side by side.

Most of the suite waits (grace periods, watches, step delays), but its heaviest
tests (torchrun groups, process-node fleets, the end-to-end jobs) keep both
cores busy: two of them at once only slow each other down and turn timeouts
into flakes. So the tests marked ``heavy`` (``tests/conftest.py`` names their
modules) run one after the other in one lane, while the rest run beside them
in another. Each lane is a pytest session of its own, with its own control
plane, store and process nodes (the test worlds share a host safely), and the
same seed and trial scale (exported before the lanes start). The tests of real
nodes (``realnodes``: kubelets, containerd, the images they pull) run in a
third lane, so that no control plane has process nodes and real nodes at
once: to the scheduler both are GPU nodes, and each kind's pods would land on
the other.

    python -m testenv.lanes [PYTEST ARGS...]

The light lane is itself spread over ``SPOTGUARD_LIGHT_WORKERS`` pytest-xdist
workers (default 2; 0 runs it in one process), a module to a worker
(``--dist loadfile``, so a module's fixtures stay in one process): its tests
mostly wait, so more of them fit beside the heavy lane on two cores.

Each lane's output goes to ``$SPOTGUARD_LANES_DIR/<lane>.log`` (default
``.lanes/``) and is printed whole when the lane ends; then a summary line per
lane with its exit status and wall time. The exit status is the first
failing lane's; a lane that collected no test (pytest's exit 5) fails the run
only when no lane ran any.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from testenv import trials

#: name -> pytest's marker expression for the lane.
LANES = {"heavy": "heavy and not realnodes", "light": "not heavy and not realnodes", "real": "realnodes"}
WORKERS_ENV = "SPOTGUARD_LIGHT_WORKERS"
#: Modules whose tests keep both cores busy (torchrun groups, process-node fleets, end-to-end
#: jobs): ``tests/conftest.py`` marks their tests ``heavy``. The split was measured: with
#: Lightning and the GPU check among the heavy, the heavy lane took 34 min and the light one 23;
#: once ``make test`` ran one preemption of each process-node end-to-end job, the light lane ended
#: last (1759 s against 1597), and Lightning's two-rank fits came back here. Once the process-node
#: DDP gang moved to ``make soak`` (its kinds run on real nodes), the light lane ended last again
#: (1878 s against 1726 before), and the GPU check's torchrun groups came back here; the light lane
#: still ended last, alone for its last 4 minutes (1720 s against 1494), and the Hugging Face
#: Trainer's torchrun groups followed.
HEAVY_MODULES = (
    "tests/e2e/test_operator_e2e.py",
    "tests/integration/test_fleet.py",
    "tests/integration/test_run_torchrun.py",
    "tests/integration/test_lightning.py",
    "tests/integration/test_gpu_check.py",
    "tests/integration/test_hf.py",
)
#: Modules whose tests run real nodes (kubelet + containerd) or build the images they pull: marked
#: ``realnodes``, a lane and a control plane of their own. Process nodes and real nodes in one control
#: plane would take one another's pods (both are GPU nodes to the scheduler). They share one set of
#: real nodes (``testenv.pytest_realnodes``), in this order: first the module whose first test compares
#: the machine before and after a set of its own while no other set runs, then the end-to-end module
#: (it adds the nodes it needs and pulls the torch image onto them), then the modules that find the
#: image on those nodes.
REAL_NODE_MODULES = (
    "tests/integration/test_realnodes.py",
    "tests/e2e/test_realnode_e2e.py",
    "tests/e2e/test_realnode_webhook.py",
    "tests/integration/test_realnode_dns.py",
    "tests/integration/test_realnode_services.py",
    "tests/integration/test_images_built.py",
)


#: The lanes that name their modules.
MODULES = {"heavy": HEAVY_MODULES, "real": REAL_NODE_MODULES}
#: What a lane runs before its tests. The real lane builds the images its nodes pull (or finds them in the
#: cache, by content), beside the other lanes' tests rather than before every lane: after a change to what
#: goes into them the build takes minutes (141 s after a change to the project's code, on this machine's
#: kind). A build that fails fails the lane under CI; elsewhere the tests that need the images say so.
PREPARE = {"real": ("testenv.images", "build")}


def lane_args(name: str, argv: Sequence[str] = ()) -> list[str]:
    """Extra pytest arguments of a lane: the light lane's xdist workers; the heavy and real lanes' modules.

    The heavy and real lanes name their modules unless the command line names tests itself, so that
    they do not collect (and import the frameworks of) the whole suite only to deselect it.
    """
    workers = int(os.environ.get(WORKERS_ENV, "2") or 0)
    if name == "light" and workers > 0:
        return ["-n", str(workers), "--dist", "loadfile"]
    named = any(Path(a.split("::", 1)[0]).exists() for a in argv if not a.startswith("-"))
    if name in MODULES and not named:
        return list(MODULES[name])
    return []


def lane_command(name: str, expr: str, argv: Sequence[str] = ()) -> list[str]:
    """The command of a lane: its pytest session, after what :data:`PREPARE` names for it."""
    pytest = [sys.executable, "-m", "pytest", "-m", expr, *lane_args(name, argv), *argv]
    prepare = PREPARE.get(name)
    if not prepare:
        return pytest
    first = shlex.join([sys.executable, "-m", *prepare])
    return ["bash", "-c", f'{first} || [ -z "${{CI:-}}" ] || exit 1; exec {shlex.join(pytest)}']


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def reap(p: subprocess.Popen[bytes]) -> float | None:
    """None while ``p`` runs; once it ended, its exit status set on it and the CPU time (user and
    system, in seconds) it and every descendant it waited for used: where a lane's time went, which its
    wall time on shared cores does not tell. 0.0 when it was reaped already (by ``Popen.poll``)."""
    if p.returncode is not None:
        return 0.0
    pid, status, usage = os.wait4(p.pid, os.WNOHANG)
    if pid == 0:
        return None
    p.returncode = os.waitstatus_to_exitcode(status)
    return float(usage.ru_utime + usage.ru_stime)


def main(argv: list[str]) -> int:
    trials.seed()  # exported: both lanes replay the same way
    trials.scale()
    out = Path(os.environ.get("SPOTGUARD_LANES_DIR", ".lanes"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    cpu0 = cpu_times()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: out / f"{name}.log" for name in LANES}
    for name, expr in LANES.items():
        with logs[name].open("wb") as log:
            procs[name] = subprocess.Popen(
                lane_command(name, expr, argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    described = [
        " ".join([f"{n} (-m {LANES[n]!r}", *lane_args(n, argv)])
        + (f", after python -m {' '.join(PREPARE[n])}" if n in PREPARE else "")
        + f", {logs[n]})"
        for n in LANES
    ]
    print(
        f"lanes: {', '.join(described)}; {trials.SEED_ENV}={trials.seed()} {trials.SCALE_ENV}={trials.scale()}",
        flush=True,
    )

    def forward(signum: int, _frame: object) -> None:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    ended: dict[str, tuple[int, float, float]] = {}
    while len(ended) < len(procs):
        for name, p in procs.items():
            if name not in ended and (cpu := reap(p)) is not None:
                ended[name] = (p.returncode, time.monotonic() - started, cpu)
                sys.stdout.write(f"\n==> lane {name} ended (exit {p.returncode}) after {ended[name][1]:.0f} s\n")
                sys.stdout.write(logs[name].read_text(errors="replace"))
                sys.stdout.flush()
        time.sleep(1)
    print()
    for name, (rc, seconds, cpu) in ended.items():
        what = "no tests collected" if rc == 5 else ("passed" if rc == 0 else "FAILED")
        print(f"==> lane {name}: {what} (exit {rc}), {seconds:.0f} s, {cpu:.0f} s of CPU")
    busy, total = (b - a for a, b in zip(cpu0, cpu_times(), strict=True))
    print(
        f"==> lanes: {time.monotonic() - started:.0f} s of wall time; the CPUs were busy "
        f"{100 * busy / max(total, 1):.0f}% of it (every process on the machine)",
        flush=True,
    )
    codes = [ended[name][0] for name in LANES]
    if all(rc == 5 for rc in codes):
        return 1  # nothing ran at all
    # A lane whose selection holds no test (exit 5) is fine when another lane ran tests.
    return next((rc for rc in codes if rc not in (0, 5)), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
