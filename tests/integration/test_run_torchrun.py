"""``spotguard run -- torchrun ...``: distributed training kept alive end to end.

Real processes throughout: ``spotguard run`` supervises torchrun, whose
workers run ``examples/train_ddp.py`` (DDP, gloo on CPU) or
``dist_train.py`` (the same loop with FSDP2-sharded state); checkpoints go
to the real SeaweedFS store. Each test compares the final digest (model,
optimizer and every rank's RNG) with an uninterrupted run of the same
command.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from reference_runs import ReferenceRuns
from sidecar_helpers import PY, STOPPED_RE, Proc, base_env, free_port, reaping, s3_storage, spotguard_argv

from spotguard.checkpoint import latest_verified, list_checkpoint_names, verify_checkpoint
from spotguard.checkpoint.store.stored import read_latest_pointer, read_manifest
from spotguard.contract.env import RUN_ID
from testenv import trials

RUN_ID_ENV = RUN_ID.name

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
SHARDED = Path(__file__).with_name("dist_train.py")

STEPS = 60
SAVE_EVERY = 10
STEP_DELAY = "0.03"
PREEMPTIONS = trials.count(full=3, quick=1)  # SIGTERMs a run survives before it finishes
CRASH_TRIALS = trials.count(full=30, quick=4)

# The workers' output shares one pipe: a line of rank 0 may come glued to
# another process's (torch's C++ warnings), so lines are searched, not matched.
RESUMED_RE = re.compile(r"resumed from step (\d+) exact=(True|False) resharded_from=(\d+|None)")
DIGEST_RE = re.compile(r"final digest ([0-9a-f]{64})")
# Another process's log line may come glued to this one (a shared pipe): its timestamp's
# digits are not the step's.
EMERGENCY_RE = re.compile(r"stage=emergency seconds=([0-9.]+) result=verified")

pytestmark = pytest.mark.integration


def torchrun(nproc: int, script: Path, *args: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script), *args]


def train_args(steps: int = STEPS, save_every: int = SAVE_EVERY, delay: str = STEP_DELAY) -> list[str]:
    return ["--steps", str(steps), "--save-every", str(save_every), "--step-delay", delay, "--log-every", "1"]


def run_argv(workdir: Path, storage: str, command: list[str], max_restarts: int = 3) -> list[str]:
    return spotguard_argv(
        "run",
        "--workdir",
        str(workdir),
        "--storage",
        storage,
        "--max-restarts",
        str(max_restarts),
        "--backoff",
        "0.1",
        "--",
        *command,
    )


def env_for(extra: dict[str, str] | None = None) -> dict[str, str]:
    # One thread per rank (and no warning about it from torchrun).
    return base_env({"OMP_NUM_THREADS": "1", **(extra or {})})


def digest_of(proc: Proc) -> str:
    m = DIGEST_RE.search(proc.wait_for_line(lambda ln: bool(DIGEST_RE.search(ln))))
    assert m is not None
    return m.group(1)


def start_line(proc: Proc, nth: int = 1) -> tuple[int, int | None, bool | None, str | None]:
    """The ``nth`` start line of the trainer: (its index in the output, step,
    exact, resharded_from); step and the rest are None for a fresh start."""
    seen = 0
    index = -1

    def match(line: str) -> bool:
        nonlocal seen, index
        index += 1
        if is_fresh_start(line) or RESUMED_RE.search(line):
            seen += 1
            return seen == nth
        return False

    line = proc.wait_for_line(match)
    m = RESUMED_RE.search(line)
    if m is None:
        return index, None, None, None
    return index, int(m.group(1)), m.group(2) == "True", m.group(3)


def resumed(proc: Proc, nth: int = 1) -> tuple[int | None, bool | None, str | None]:
    """The ``nth`` start line of the trainer: (step, exact, resharded_from), or Nones for a fresh start."""
    return start_line(proc, nth)[1:]


def wait_for_step_after(proc: Proc, index: int, step: int) -> None:
    """Wait for a ``step N`` line with N >= ``step`` after output line ``index``."""
    seen = -1

    def match(line: str) -> bool:
        nonlocal seen
        seen += 1
        return seen > index and line.startswith("step ") and int(line.split()[1]) >= step

    proc.wait_for_line(match)


def is_fresh_start(line: str) -> bool:
    # The trainer's line, not the supervisor's "... yet: starting from scratch".
    return "starting from scratch" in line and "spotguard INFO" not in line


def stopped_step(proc: Proc) -> int:
    m = STOPPED_RE.search(proc.wait_for_line(lambda ln: bool(STOPPED_RE.search(ln))))
    assert m is not None
    return int(m.group(1))


def emergency_seconds(proc: Proc) -> float:
    m = EMERGENCY_RE.search(proc.wait_for_line(lambda ln: bool(EMERGENCY_RE.search(ln))))
    assert m is not None
    return float(m.group(1))


def worker_pids(run_id: str) -> dict[int, int]:
    """Global rank -> pid of the torchrun workers of one ``spotguard run``."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        if env.get(RUN_ID_ENV.encode()) == run_id.encode() and b"LOCAL_RANK" in env and b"RANK" in env:
            found[int(env[b"RANK"])] = int(entry)
    return found


def run_id_of(workdir: Path) -> str:
    import json

    return str(json.loads((workdir / "child.json").read_text(encoding="utf-8"))["run_id"])


def check_store(storage: Any, world_size: int) -> int | None:
    """Storage invariants at any instant; returns the newest verified step.

    A prefix with a global manifest verifies (every file of every part) and
    covers every rank; a prefix without one never verifies; the pointer
    names a verified checkpoint.
    """
    newest: int | None = None
    for name in list_checkpoint_names(storage):
        # Listed before the verification: an uploader may write the global
        # manifest in between (nothing deletes from storage in these tests).
        keys = {o.key[len(name) + 1 :] for o in storage.list_objects(f"{name}/")}
        verdict = verify_checkpoint(storage, name)
        if not verdict.ok:
            assert "manifest.json" not in keys, f"{name} has a global manifest but does not verify: {verdict.reason}"
            continue
        manifest = read_manifest(storage, name)
        assert manifest.sharding is not None and manifest.sharding.part is None, name
        assert manifest.sharding.ranks == tuple(range(manifest.sharding.world_size)), name
        assert manifest.sharding.world_size == world_size, name
        listed = {f.path for f in manifest.files}
        assert {f"parts/{i:05d}.json" for i in range(manifest.sharding.parts)} <= listed, name
        newest = manifest.step if newest is None else max(newest, manifest.step)
    pointer = read_latest_pointer(storage)
    if pointer is not None:
        assert verify_checkpoint(storage, f"ckpt-{pointer:012d}").ok, f"latest -> {pointer} does not verify"
    return newest


class References:
    """Digests of uninterrupted runs (plain torchrun, no supervisor), each computed once per session."""

    def __init__(self, runs: ReferenceRuns) -> None:
        self.runs = runs

    def get(
        self, script: Path, nproc: int, steps: int = STEPS, save_every: int = SAVE_EVERY, extra: tuple[str, ...] = ()
    ) -> str:
        def run(d: Path) -> str:
            with reaping() as procs:
                proc = Proc(
                    torchrun(nproc, script, *train_args(steps, save_every, "0"), *extra),
                    env_for({"SPOTGUARD_CHECKPOINT_DIR": str(d / "ckpt")}),
                    d / "train.log",
                )
                procs.append(proc)
                assert proc.wait(300) == 0, proc.tail()
                return digest_of(proc)

        return self.runs.get(("torchrun", script.stem, nproc, steps, save_every, *extra), run)


@pytest.fixture(scope="module")
def references(reference_runs: ReferenceRuns) -> References:
    return References(reference_runs)


@contextlib.contextmanager
def measured(name: str) -> Iterator[list[float]]:
    """Collects SIGTERM -> globally verified seconds and prints them (``-s``) at the end."""
    seconds: list[float] = []
    yield seconds
    if seconds:
        print(f"\n{name}: SIGTERM -> globally verified seconds: " + " ".join(f"{s:.2f}" for s in seconds), flush=True)


@pytest.mark.trials
@pytest.mark.parametrize(
    ("script", "nproc", "machine_dies"),
    trials.variants(
        full=[
            pytest.param(EXAMPLE, 2, True, id="ddp-2"),
            pytest.param(EXAMPLE, 4, False, id="ddp-4"),
            pytest.param(SHARDED, 2, False, id="fsdp2-2"),
        ],
        # Four ranks resume in make test too: test_four_ranks_resume_a_two_rank_checkpoint_flagged_inexact.
        quick=[pytest.param(EXAMPLE, 2, True, id="ddp-2"), pytest.param(SHARDED, 2, False, id="fsdp2-2")],
    ),
)
def test_preempted_torchrun_resumes_bit_identical(
    s3_store: Any, s3_uri: str, tmp_path: Path, references: References, script: Path, nproc: int, machine_dies: bool
) -> None:
    """SIGTERM at random steps, PREEMPTIONS times (1, 3 in ``make soak``); with ``machine_dies`` then also a
    SIGKILL of the supervisor and torchrun at once (their workers, in sessions
    of their own, live on until the next start kills them by run id)."""
    reference = references.get(script, nproc)
    seed = trials.seed()
    rng = trials.rng(f"torchrun-preempt-{script.stem}-{nproc}")
    storage = s3_storage(s3_store, s3_uri)
    workdir = tmp_path / "work"
    argv = run_argv(workdir, s3_uri, torchrun(nproc, script, *train_args()))
    env = env_for(s3_store.env())
    stopped: int | None = None
    with reaping() as procs, measured(f"{script.stem} x{nproc}") as seconds:
        for i in range(PREEMPTIONS):
            proc = Proc(argv, env, tmp_path / f"run{i}.log")
            procs.append(proc)
            step, exact, _ = resumed(proc)
            assert step == stopped, f"seed {seed}: resumed from {step}, stopped at {stopped}"
            assert exact in (None, True)
            proc.wait_for_step((step if step is not None else -1) + rng.randint(2, 12))
            proc.signal(signal.SIGTERM)
            assert proc.wait(120) == 128 + signal.SIGTERM, proc.tail()
            stopped = stopped_step(proc)
            seconds.append(emergency_seconds(proc))
            info, _ = latest_verified(storage)
            assert info is not None and info.step == stopped, (seed, info, stopped)
            assert check_store(storage, nproc) == stopped
        assert stopped is not None
        if machine_dies:
            proc = Proc(argv, env, tmp_path / "killed.log")
            procs.append(proc)
            assert resumed(proc)[0] == stopped
            proc.wait_for_step(stopped + rng.randint(2, 8))
            run_id = run_id_of(workdir)
            started = re.search(r"started attempt \d+: pid (\d+)", proc.text())
            workers = worker_pids(run_id)
            assert started is not None and sorted(workers) == list(range(nproc)), workers
            # Orphaned workers would train on and finish on their own: stopped,
            # they are certainly still there when the next start comes.
            for pid in workers.values():
                os.kill(pid, signal.SIGSTOP)
            os.kill(proc.popen.pid, signal.SIGKILL)
            os.kill(int(started.group(1)), signal.SIGKILL)
            proc.wait()
            stopped = check_store(storage, nproc)
            assert stopped is not None
        final = Proc(argv, env, tmp_path / "final.log")
        procs.append(final)
        step, exact, _ = resumed(final)
        # The newest verified checkpoint, or a newer complete local one.
        assert step is not None and step >= stopped and exact, (seed, step, stopped)
        if machine_dies:
            assert f"killed {nproc} process(es) left by an earlier spotguard run" in final.text(), final.tail()
            assert not worker_pids(run_id), "the dead run's workers live on"
        assert final.wait(180) == 0, final.tail()
        assert digest_of(final) == reference, f"seed {seed}"


#: The FSDP2 fine-tune's frozen base: each rank stores half of it.
FROZEN_MIB = 16
#: SIGTERMs the fine-tune survives (the sharded-incremental acceptance: three).
FINE_TUNE_PREEMPTIONS = 3


def test_fsdp2_fine_tune_stored_incrementally_resumes_bit_identical(
    s3_store: Any, s3_uri: str, tmp_path: Path, references: References
) -> None:
    """FSDP2 on two ranks, a frozen base and trained layers, ``--incremental``: every
    checkpoint after the first stores under 5% of the state in new chunks (the frozen
    base's DCP items are the same chunks each time), and after three SIGTERMs the run
    ends with the digest of an uninterrupted one."""
    extra = ("--frozen-mib", str(FROZEN_MIB))
    reference = references.get(SHARDED, 2, extra=extra)
    seed = trials.seed()
    rng = trials.rng("torchrun-fine-tune")
    storage = s3_storage(s3_store, s3_uri)
    argv = run_argv(tmp_path / "work", s3_uri, torchrun(2, SHARDED, *train_args(), *extra))
    argv.insert(argv.index("--"), "--incremental")
    env = env_for(s3_store.env())
    stopped: int | None = None
    with reaping() as procs:
        for i in range(FINE_TUNE_PREEMPTIONS):
            proc = Proc(argv, env, tmp_path / f"run{i}.log")
            procs.append(proc)
            assert resumed(proc)[0] == stopped, f"seed {seed}"
            proc.wait_for_step((stopped if stopped is not None else -1) + rng.randint(3, 12))
            proc.signal(signal.SIGTERM)
            assert proc.wait(120) == 128 + signal.SIGTERM, proc.tail()
            stopped = stopped_step(proc)
            assert check_store(storage, 2) == stopped, f"seed {seed}"
        final = Proc(argv, env, tmp_path / "final.log")
        procs.append(final)
        step, exact, _ = resumed(final)
        assert step is not None and step >= stopped and exact, (seed, step, stopped)
        assert final.wait(180) == 0, final.tail()
        assert digest_of(final) == reference, f"seed {seed}"
    # What each committed checkpoint added to the store, against the whole state it names.
    seen: set[str] = set()
    added = []
    for name in list_checkpoint_names(storage):
        verdict = verify_checkpoint(storage, name)
        if not verdict.ok:
            continue
        manifest = verdict.manifest
        assert manifest is not None and manifest.chunked and manifest.is_global, name
        refs = manifest.chunk_refs()
        added.append((name, sum(r.size for d, r in refs.items() if d not in seen), manifest.total_size))
        seen |= refs.keys()
    assert len(added) >= 1 + FINE_TUNE_PREEMPTIONS, added
    assert added[0][1] >= FROZEN_MIB << 20, added
    later = [new / total for _, new, total in added[1:]]
    assert max(later) < 0.05, (seed, added)
    print(f"\nfsdp2 fine-tune: bytes stored per checkpoint after the first: {max(later):.2%} of the state at most")


def test_four_ranks_resume_a_two_rank_checkpoint_flagged_inexact(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    storage = s3_storage(s3_store, s3_uri)
    env = env_for(s3_store.env())
    with reaping() as procs:
        first = Proc(
            run_argv(tmp_path / "work", s3_uri, torchrun(2, EXAMPLE, *train_args(30))), env, tmp_path / "two.log"
        )
        procs.append(first)
        first.wait_for_step(trials.rng("torchrun-reshard").randint(5, 15))
        first.signal(signal.SIGTERM)
        assert first.wait(120) == 128 + signal.SIGTERM, first.tail()
        stopped = stopped_step(first)
        second = Proc(
            run_argv(tmp_path / "work", s3_uri, torchrun(4, EXAMPLE, *train_args(30))), env, tmp_path / "four.log"
        )
        procs.append(second)
        assert resumed(second) == (stopped, False, "2")
        assert second.wait(180) == 0, second.tail()
        assert "finished 30 steps" in second.text()
    info, _ = latest_verified(storage)
    assert info is not None and info.step == 29
    manifest = read_manifest(storage, info.name)
    assert manifest.sharding is not None and manifest.sharding.world_size == 4


@pytest.mark.trials
@pytest.mark.timeout(300 + 60 * CRASH_TRIALS)  # about 10 s per trial on 2 idle cores; more on a loaded machine
def test_crash_trials_a_rank_killed_mid_save_or_upload_restarts_the_group(
    s3_store: Any, s3_uri: str, tmp_path: Path, references: References
) -> None:
    """Save every step; in each trial one worker is SIGKILLed inside a step.

    The step's period is measured in each trial (from one step line to the
    next), and trial i of n kills at (i + U)/n of it after a step line, so the
    kills spread over the whole step. Saving and uploading take most of each
    step, so the kill lands in a collective save or while its upload runs. Each kill ends the group;
    ``spotguard run`` kills what is left of it and restarts it from the
    newest verified (or a newer complete local) checkpoint. After each
    trial: nothing of the killed group runs, storage holds no verified
    checkpoint with a missing or bad part, and the next start resumes from
    a loadable checkpoint at least as new as the newest verified one. The
    run ends exactly where an uninterrupted run ends.
    """
    steps = 40 + 4 * CRASH_TRIALS  # each trial moves the run a few steps on
    reference = references.get(EXAMPLE, 2, steps)
    seed = trials.seed()
    rng = trials.rng("torchrun-crash")
    instants = trials.stratified(CRASH_TRIALS, rng)
    periods: list[float] = []
    storage = s3_storage(s3_store, s3_uri)
    workdir = tmp_path / "work"
    command = torchrun(2, EXAMPLE, *train_args(steps, 1, "0.01"))
    argv = run_argv(workdir, s3_uri, command, max_restarts=CRASH_TRIALS + 5)
    argv[argv.index("--backoff") + 1 : argv.index("--backoff") + 2] = ["0.1", "--backoff-max", "0.5"]
    with reaping() as procs:
        proc = Proc(argv, env_for(s3_store.env()), tmp_path / "run.log")
        procs.append(proc)
        done = 0
        verified: int | None = None
        while done < CRASH_TRIALS:
            index, step, exact, _ = start_line(proc, done + 1)
            if verified is not None:
                assert step is not None and step >= verified and exact, (seed, done, step, verified)
            assert step is None or step < steps - 10, f"seed {seed}: the run got too far for {CRASH_TRIALS} trials"
            # A step line is printed right before its save: the period from one
            # to the next is a save and its upload; the kill lands at the trial's
            # stratified fraction of it.
            first = (step if step is not None else 0) + 1  # step 0 is never saved
            wait_for_step_after(proc, index, first)
            began = time.monotonic()
            wait_for_step_after(proc, index, first + 1)
            periods.append(time.monotonic() - began)
            time.sleep(instants[done] * periods[-1])
            run_id = run_id_of(workdir)
            pids = worker_pids(run_id)
            assert sorted(pids) == [0, 1], pids
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[rng.choice([0, 1])], signal.SIGKILL)
            done += 1
            proc.wait_for_line(lambda ln, n=done: "command failed" in ln and f"restart {n}/" in ln)
            assert not set(pids.values()) & set(worker_pids(run_id).values()), "the killed group lives on"
            verified = check_store(storage, 2)
        assert proc.wait(300) == 0, proc.tail()
        assert digest_of(proc) == reference, f"seed {seed}"
    assert check_store(storage, 2) == steps - 1
    print(
        f"\ntorchrun crash trials: seed {seed}, {CRASH_TRIALS} kills at "
        + " ".join(f"{f:.2f}x{p:.2f}s" for f, p in zip(instants, periods, strict=True))
    )


def test_two_nodes_race_to_commit_the_global_manifest(
    s3_store: Any, s3_uri: str, tmp_path: Path, references: References
) -> None:
    """Two supervisors ("nodes", one rank each) share one storage root; SIGTERM reaches one.

    Both ranks save the same step; each supervisor uploads its part; one
    global manifest write wins, the pointer moves once; both resume and end
    exactly where a single-node 2-rank run ends.
    """
    reference = references.get(EXAMPLE, 2)
    storage = s3_storage(s3_store, s3_uri)
    env = env_for(s3_store.env())

    def node_argv(node: int, port: int) -> list[str]:
        command = [
            PY,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(EXAMPLE),
            *train_args(),
        ]
        return run_argv(tmp_path / f"node{node}", s3_uri, command)

    with reaping() as procs:
        port = free_port()
        nodes = [Proc(node_argv(i, port), env, tmp_path / f"node{i}-1.log") for i in (0, 1)]
        procs.extend(nodes)
        nodes[0].wait_for_step(trials.rng("torchrun-two-nodes").randint(12, 25))
        nodes[0].signal(signal.SIGTERM)
        assert nodes[0].wait(120) == 128 + signal.SIGTERM, nodes[0].tail()
        assert nodes[1].wait(120) == 128 + signal.SIGTERM, nodes[1].tail()
        stopped = stopped_step(nodes[0])
        info, _ = latest_verified(storage)
        assert info is not None and info.step == stopped
        manifest = read_manifest(storage, info.name)
        assert manifest.sharding is not None and manifest.sharding.parts == 2
        assert check_store(storage, 2) == stopped
        # One global manifest write won (the other uploader found it there);
        # each supervisor verified the step and asked to move the pointer; it moved once.
        writes = [ln for n in nodes for ln in n.lines if f"{info.name}: all" in ln and "global manifest written" in ln]
        assert len(writes) == 1, writes
        moves = [ln for n in nodes for ln in n.lines if "stage=pointer" in ln and f"name={info.name}" in ln]
        assert sum("moved=True" in ln for ln in moves) == 1, moves

        port = free_port()
        again = [Proc(node_argv(i, port), env, tmp_path / f"node{i}-2.log") for i in (0, 1)]
        procs.extend(again)
        assert resumed(again[0])[:2] == (stopped, True)
        for proc in again:
            assert proc.wait(180) == 0, proc.tail()
        assert digest_of(again[0]) == reference
