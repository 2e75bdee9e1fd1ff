"""The Hugging Face Trainer under ``spotguard run``: real processes, the real S3 store.

``examples/train_hf.py`` (a tiny GPT-2 from a config, dropout on, the
Trainer's shuffling sampler, ``SpotguardCallback`` and
``spotguard_resume_path``) is SIGTERMed at random steps and resumed; its
final digest (weights, optimizer and scheduler state, every rank's RNG) must
equal an uninterrupted run's byte for byte. A code-running pickle planted in
the newest stored checkpoint is refused at restore and the resume walks back.
With ``save_total_limit=1`` and no uploader at all, the Trainer deletes its
own folders but every committed checkpoint stays intact.

The uninterrupted references (one rank and two) start together with the
first test and run beside the interrupted runs (they are independent), so
both cores are busy.
"""

from __future__ import annotations

import os
import random
import re
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import replace_stored_file
from reference_runs import Pending, ReferenceRuns
from sidecar_helpers import PY, Proc, base_env, reaping, s3_storage, spotguard_argv
from sidecar_helpers import STOPPED_RE as STOPPED_RE_ANY

from spotguard.checkpoint import latest_verified, list_checkpoint_names, list_local_committed
from spotguard.checkpoint.local.commit import verify_local_checkpoint
from spotguard.checkpoint.store.stored import read_manifest
from testenv import trials

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_hf.py"

STEPS = 48  # two epochs on one rank (24 steps each), four on two ranks
SAVE_EVERY = 10  # the Trainer's own save_steps
STEP_DELAY = "0.1"
PREEMPTIONS = 3

RESUMED_RE = re.compile(r"^resumed from step (\d+)", re.M)
DIGEST_RE = re.compile(r"final digest ([0-9a-f]{64})")
# Another process's log line may come glued to this one (a shared pipe): its timestamp's
# digits are not the step's.
STOPPED_RE = re.compile(r"^preempted after step (\d+?)(?=\d{4}-\d\d-\d\d |\D|$)", re.M)
# Each rank's line; two ranks writing at once may share a line of the combined output.
RANK_STOPPED_RE = re.compile(r"preempted after step (\d+) \(rank (\d+) of \d+\)")

pytestmark = pytest.mark.integration


def train_args(output_dir: Path, delay: str = STEP_DELAY, *extra: str) -> list[str]:
    return [
        "--steps",
        str(STEPS),
        "--save-every",
        str(SAVE_EVERY),
        "--step-delay",
        delay,
        "--output-dir",
        str(output_dir),
        *extra,
    ]


def torchrun(nproc: int, *args: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(EXAMPLE), *args]


def run_argv(workdir: Path, storage: str, command: list[str]) -> list[str]:
    return spotguard_argv(
        "run",
        "--workdir",
        str(workdir),
        "--storage",
        storage,
        "--max-restarts",
        "1",
        "--backoff",
        "0.1",
        "--",
        *command,
    )


def env_for(extra: dict[str, str] | None = None) -> dict[str, str]:
    return base_env({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(extra or {})})


def digest_of(proc: Proc) -> str:
    m = DIGEST_RE.search(proc.wait_for_line(lambda ln: bool(DIGEST_RE.search(ln)), timeout=300))
    assert m is not None
    return m.group(1)


def start_of(proc: Proc) -> int | None:
    """The step the trainer resumed from, None for a fresh start."""
    line = proc.wait_for_line(lambda ln: ln.startswith(("resumed from step", "starting from scratch")), 300)
    m = RESUMED_RE.match(line)
    return int(m.group(1)) if m else None


def stopped_step(proc: Proc) -> int:
    found = {int(s) for s in STOPPED_RE_ANY.findall(proc.text())}
    assert len(found) == 1, f"every rank stops after one and the same step: {found}\n{proc.tail()}"
    return found.pop()


#: The uninterrupted runs' keys in the session's ``reference_runs``.
REFERENCE_KEYS = {"one": ("hf", 1, STEPS, SAVE_EVERY, "save-total-limit=1"), "two": ("hf", 2, STEPS, SAVE_EVERY)}


def start_reference(command: Callable[[Path], list[str]], extra: dict[str, str]) -> Callable[[Path], Pending[str]]:
    """Start ``command(directory)`` in its run directory; its result: the final digest."""

    def begin(d: Path) -> Pending[str]:
        env = env_for({"SPOTGUARD_CHECKPOINT_DIR": str(d / "ckpt"), **extra})
        proc = Proc(command(d), env, d / "train.log", cwd=d)

        def finish() -> str:
            assert proc.wait(300) == 0, proc.tail()
            return digest_of(proc)

        return Pending(finish, proc.kill)

    return begin


class References:
    """The uninterrupted runs (no supervisor), one rank and two, started
    together in the background when the module's first test asks (each once
    per session) and read when needed.

    The one-rank run doubles as the ``save_total_limit`` test: a storage URI
    but no uploader at all (no sidecar, no ``spotguard run``), and the
    Trainer keeps one folder of its own.
    """

    def __init__(self, runs: ReferenceRuns, s3_store: Any) -> None:
        self.runs = runs
        uri = f"s3://{s3_store.bucket}/t-{uuid.uuid4().hex[:10]}"
        self.pending = {
            "one": runs.start(
                REFERENCE_KEYS["one"],
                start_reference(
                    lambda d: [PY, str(EXAMPLE), *train_args(d / "out", "0", "--save-total-limit", "1")],
                    {**s3_store.env(), "SPOTGUARD_STORAGE_URI": uri},
                ),
            ),
            "two": runs.start(
                REFERENCE_KEYS["two"], start_reference(lambda d: torchrun(2, *train_args(d / "out", "0")), {})
            ),
        }
        self.one = runs.path(REFERENCE_KEYS["one"])
        self.two = runs.path(REFERENCE_KEYS["two"])

    def digest(self, key: str) -> str:
        return self.pending[key].result()

    def kill(self) -> None:
        """Stop the runs no test read (a later ask starts them again)."""
        self.runs.discard_unfinished(*REFERENCE_KEYS.values())


@pytest.fixture(scope="module")
def references(reference_runs: ReferenceRuns, s3_store: Any) -> Iterator[References]:
    refs = References(reference_runs, s3_store)
    try:
        yield refs
    finally:
        refs.kill()


def preempt_at_random_step(proc: Proc, rng: random.Random, start: int | None) -> int:
    """SIGTERM a few steps after the start; returns the step every rank stopped after."""
    proc.wait_for_step((start or 0) + rng.randint(2, 8), timeout=300)
    proc.signal(signal.SIGTERM)
    assert proc.wait(120) == 128 + signal.SIGTERM, proc.tail()
    return stopped_step(proc)


def plant_code_pickle(storage: Any, name: str, path: str, marker: Path) -> None:
    """Replace ``name/path`` in storage with a torch.save archive whose pickle
    runs ``touch marker`` when loaded, and fix the manifest to match (an
    attacker with write access to the bucket)."""
    import io

    import torch

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    buf = io.BytesIO()
    torch.save({"state": Evil(), "param_groups": []}, buf)
    replace_stored_file(storage, name, path, buf.getvalue())


def test_preempted_trainer_resumes_bit_identical_and_walks_back_past_a_planted_pickle(
    s3_store: Any, s3_uri: str, tmp_path: Path, references: References
) -> None:
    """Three SIGTERMs at random steps, each run resuming where the last stopped
    (``save_total_limit=1``: the Trainer rotates its folders meanwhile). Then
    the newest stored checkpoint gets a code-running ``optimizer.pt``; a fresh
    machine (empty work and output directories) refuses it, naming the file,
    resumes from the previous verified checkpoint and ends byte-identical to
    an uninterrupted run."""
    seed = trials.seed()
    rng = trials.rng("hf-one-rank")
    storage = s3_storage(s3_store, s3_uri)
    env = env_for(s3_store.env())
    marker = tmp_path / "code-ran"
    with reaping() as procs:
        argv = run_argv(
            tmp_path / "work",
            s3_uri,
            [PY, str(EXAMPLE), *train_args(tmp_path / "out", STEP_DELAY, "--save-total-limit", "1")],
        )
        stopped: int | None = None
        for i in range(PREEMPTIONS):
            proc = Proc(argv, env, tmp_path / f"run{i}.log")
            procs.append(proc)
            start = start_of(proc)
            assert start == stopped, f"seed {seed}: resumed from {start}, stopped at {stopped}"
            stopped = preempt_at_random_step(proc, rng, start)
            info, _ = latest_verified(storage)
            assert info is not None and info.step == stopped, (seed, info, stopped)
            # save_total_limit=1: the Trainer keeps one folder of its own (it never touches spotguard's).
            assert [p.name for p in (tmp_path / "out").glob("checkpoint-*")] == [f"checkpoint-{stopped}"]
        assert stopped is not None and stopped < STEPS

        names = list_checkpoint_names(storage)
        newest, previous = names[-1], names[-2]
        assert newest == f"ckpt-{stopped:012d}"
        assert "training_args.bin" not in {f.path for f in read_manifest(storage, newest).files}
        plant_code_pickle(storage, newest, "optimizer.pt", marker)

        final = Proc(
            run_argv(tmp_path / "machine2", s3_uri, [PY, str(EXAMPLE), *train_args(tmp_path / "out2", "0")]),
            env,
            tmp_path / "final.log",
        )
        procs.append(final)
        assert start_of(final) == int(previous.rsplit("-", 1)[1]), (seed, previous, final.tail())
        assert final.wait(300) == 0, final.tail()
        refusals = [ln for ln in final.lines if newest in ln and "optimizer.pt" in ln]
        assert refusals, f"no refusal of {newest} naming optimizer.pt:\n{final.tail(80)}"
        print("refused:", refusals[0])
        assert digest_of(final) == references.digest("one"), f"seed {seed}"
    assert not marker.exists(), "the planted pickle ran"


def test_two_ranks_agree_on_the_stop_step_and_resume_bit_identical(
    s3_store: Any, s3_uri: str, tmp_path: Path, references: References
) -> None:
    """torchrun with 2 ranks (gloo on CPU) under ``spotguard run``: one SIGTERM
    stops both ranks after the same step, one checkpoint holds both ranks' RNG
    files, and the resumed run ends with the digest of an uninterrupted 2-rank run."""
    seed = trials.seed()
    rng = trials.rng("hf-two-ranks")
    storage = s3_storage(s3_store, s3_uri)
    env = env_for(s3_store.env())
    with reaping() as procs:
        argv = run_argv(tmp_path / "work", s3_uri, torchrun(2, *train_args(tmp_path / "out")))
        first = Proc(argv, env, tmp_path / "run0.log")
        procs.append(first)
        assert start_of(first) is None
        stopped = preempt_at_random_step(first, rng, None)
        said = RANK_STOPPED_RE.findall(first.text())  # each rank says where it stopped: the same step
        assert sorted(r for _, r in said) == ["0", "1"] and len({s for s, _ in said}) == 1, first.tail()
        info, _ = latest_verified(storage)
        assert info is not None and info.step == stopped, (seed, info, stopped)
        files = {f.path for f in read_manifest(storage, info.name).files}
        assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "model.safetensors"} <= files, files

        second = Proc(argv, env, tmp_path / "run1.log")
        procs.append(second)
        assert start_of(second) == stopped
        assert second.wait(300) == 0, second.tail()
        assert digest_of(second) == references.digest("two"), f"seed {seed}"


def test_save_total_limit_never_deletes_a_committed_checkpoint(references: References) -> None:
    """``save_total_limit=1`` and an uploader that never comes (the one-rank
    reference: a storage URI, no sidecar, no ``spotguard run``): the Trainer
    deletes each older folder of its own, yet every checkpoint spotguard
    committed stays, complete and matching its checksums, for the uploader."""
    references.digest("one")
    out, ckpt_dir = references.one / "out", references.one / "ckpt"
    assert [p.name for p in out.glob("checkpoint-*")] == [f"checkpoint-{STEPS}"]
    committed = list_local_committed(ckpt_dir)
    expected = [*range(SAVE_EVERY, STEPS, SAVE_EVERY), STEPS]
    assert [p.name for p in committed] == [f"ckpt-{s:012d}" for s in expected]
    for path in committed:
        verdict = verify_local_checkpoint(path)
        assert verdict.ok, (path, verdict.reason)
        assert verdict.manifest is not None
        assert {"model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt", "trainer_state.json"} <= {
            f.path for f in verdict.manifest.files
        }
