"""``spotguard run``: preemption, kill -9 of the supervisor and its child, crash restarts.

Real processes throughout; storage is SeaweedFS (integration) or file://.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from reference_runs import ReferenceRuns
from sidecar_helpers import (
    PY,
    Proc,
    base_env,
    reaping,
    s3_storage,
    spotguard_argv,
    train_argv,
    wait_until,
)

from spotguard.checkpoint import latest_verified, list_local_committed
from spotguard.contract.env import RUN_ID
from spotguard.run.supervisor import memory_staging_dir, processes_with_env

RUN_ID_ENV = RUN_ID.name

STEPS = 120
SAVE_EVERY = 10


@pytest.fixture(scope="module")
def reference(reference_runs: ReferenceRuns) -> bytes:
    """Final state of an uninterrupted run."""
    return reference_runs.demo_final(STEPS, SAVE_EVERY)


def run_argv(workdir: Path, storage: str, *train: str, max_restarts: int = 3) -> list[str]:
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
        *train,
    )


def resumed_step(proc: Proc) -> int | None:
    line = proc.wait_for_line(lambda ln: ln.startswith(("resumed from step", "starting from scratch")))
    return int(line.rsplit(" ", 1)[1]) if line.startswith("resumed") else None


@pytest.mark.integration
def test_sigterm_checkpoints_and_next_start_resumes(s3_store, s3_uri: str, tmp_path: Path, reference: bytes) -> None:
    out = tmp_path / "final.safetensors"
    env = base_env(s3_store.env())
    argv = run_argv(tmp_path / "work", s3_uri, *train_argv(STEPS, out, 0.02, SAVE_EVERY))
    with reaping() as procs:
        first = Proc(argv, env, tmp_path / "run1.log")
        procs.append(first)
        first.wait_for_step(45)
        first.signal(signal.SIGTERM)
        assert first.wait() == 128 + signal.SIGTERM, first.tail()
        stopped = first.wait_for_stopped_step()
        info, _ = latest_verified(s3_storage(s3_store, s3_uri))
        assert info is not None and info.step == stopped, (info, stopped)
        # The trainer's close() returned (it prints after it) only once its checkpoint was verified:
        # its exit did not take the upload's CPU.
        lines = first.text().splitlines()
        verified = [i for i, ln in enumerate(lines) if "stage=verify " in ln and f"name=ckpt-{stopped:012d}" in ln]
        left = [i for i, ln in enumerate(lines) if ln == f"preempted after step {stopped}"]
        assert verified and left and verified[0] < left[0], first.tail()
        memory = memory_staging_dir(tmp_path / "work")
        if memory is not None:
            # The preemption's checkpoint was written in memory, shipped from there, and removed
            # once verified (the store holds it); nothing is left in the machine's memory.
            assert "staged in memory: 1 verified and removed, 0 copied to disk" in first.text(), first.tail()
            wait_until(lambda: not memory.exists(), 30, "the memory staging to be freed")  # after the exit
            assert f"ckpt-{stopped:012d}" not in [p.name for p in list_local_committed(tmp_path / "work/checkpoints")]

        second = Proc(argv, env, tmp_path / "run2.log")
        procs.append(second)
        assert resumed_step(second) == stopped
        assert second.wait() == 0, second.tail()
    assert out.read_bytes() == reference


@pytest.mark.integration
def test_survives_three_sigterms_on_google_cloud_storage_bitwise(
    gcs_store, gs_uri: str, tmp_path: Path, reference: bytes
) -> None:
    """``--storage gs://``: each SIGTERM leaves a verified checkpoint there, and the end is bit-exact."""
    from spotguard.storage import open_storage

    out = tmp_path / "final.safetensors"
    env = base_env(gcs_store.env())
    argv = run_argv(tmp_path / "work", gs_uri, *train_argv(STEPS, out, 0.02, SAVE_EVERY))
    storage = open_storage(gs_uri, **gcs_store.options())
    with reaping() as procs:
        resumed_at = None
        for i, step in enumerate((25, 55, 85)):
            run = Proc(argv, env, tmp_path / f"run{i}.log")
            procs.append(run)
            assert resumed_step(run) == resumed_at
            run.wait_for_step(step)
            run.signal(signal.SIGTERM)
            assert run.wait() == 128 + signal.SIGTERM, run.tail()
            resumed_at = run.wait_for_stopped_step()
            info, _ = latest_verified(storage)
            assert info is not None and info.step == resumed_at, (info, resumed_at)
        last = Proc(argv, env, tmp_path / "run-last.log")
        procs.append(last)
        assert resumed_step(last) == resumed_at
        assert last.wait() == 0, last.tail()
    assert out.read_bytes() == reference


@pytest.mark.integration
def test_survives_kill_9_of_itself_and_its_child(s3_store, s3_uri: str, tmp_path: Path, reference: bytes) -> None:
    out = tmp_path / "final.safetensors"
    workdir = tmp_path / "work"
    env = base_env(s3_store.env())
    argv = run_argv(workdir, s3_uri, *train_argv(STEPS, out, 0.03, SAVE_EVERY))
    storage = s3_storage(s3_store, s3_uri)
    with reaping() as procs:
        first = Proc(argv, env, tmp_path / "run1.log")
        procs.append(first)
        # Some checkpoints are verified in storage, training goes on.
        wait_until(
            lambda: (latest_verified(storage)[0] or None) and latest_verified(storage)[0].step >= 30,
            120,
            "a verified checkpoint at step >= 30",
        )
        first.wait_for_step(first.last_step + 3 if first.last_step else 35)
        run_id = json.loads((workdir / "child.json").read_text())["run_id"]
        child = json.loads((workdir / "checkpoints" / ".control" / "trainer.pid").read_text())["pid"]
        # The machine "dies": supervisor and trainer are killed at once, nothing can clean up.
        os.kill(first.popen.pid, signal.SIGKILL)
        os.kill(child, signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
        wait_until(lambda: not processes_with_env(RUN_ID_ENV, run_id), 30, "no process of the killed run left")
        verified_before, _ = latest_verified(storage)
        assert verified_before is not None

        second = Proc(argv, env, tmp_path / "run2.log")
        procs.append(second)
        resumed = resumed_step(second)
        # The newest verified checkpoint (the restart first ships any complete
        # local checkpoint the dead supervisor had not uploaded yet).
        assert resumed is not None and resumed >= verified_before.step
        assert second.wait() == 0, second.tail()
    assert out.read_bytes() == reference


@pytest.mark.integration
def test_kill_9_of_the_supervisor_takes_the_child_with_it(s3_store, s3_uri: str, tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    argv = run_argv(workdir, s3_uri, *train_argv(10_000, None, 0.05, SAVE_EVERY))
    with reaping() as procs:
        first = Proc(argv, base_env(s3_store.env()), tmp_path / "run.log")
        procs.append(first)
        first.wait_for_step(3)
        run_id = json.loads((workdir / "child.json").read_text())["run_id"]
        assert processes_with_env(RUN_ID_ENV, run_id)
        os.kill(first.popen.pid, signal.SIGKILL)
        first.wait()
        wait_until(lambda: not processes_with_env(RUN_ID_ENV, run_id), 30, "the child to die with its supervisor")


def test_restarts_a_crashed_command_and_it_resumes(tmp_path: Path, reference: bytes) -> None:
    out = tmp_path / "final.safetensors"
    marker = tmp_path / "crashed-once"
    half = " ".join(train_argv(STEPS // 2, None, 0.0, SAVE_EVERY))
    full = " ".join(train_argv(STEPS, out, 0.0, SAVE_EVERY))
    # First attempt trains half the steps, then "crashes" (exit 3); the restart resumes.
    script = f"if [ -e {marker} ]; then exec {full}; else touch {marker}; {half}; exit 3; fi"
    storage = (tmp_path / "store").as_uri()
    with reaping() as procs:
        proc = Proc(
            run_argv(tmp_path / "work", storage, "sh", "-c", script, max_restarts=2), base_env(), tmp_path / "run.log"
        )
        procs.append(proc)
        assert proc.wait() == 0, proc.tail()
    text = proc.text()
    assert "command failed (exit status 3); restart 1/2" in text
    assert f"resumed from step {STEPS // 2 - 1}" in text
    assert out.read_bytes() == reference


def test_gives_up_when_the_restart_budget_is_spent(tmp_path: Path) -> None:
    storage = (tmp_path / "store").as_uri()
    result = subprocess.run(
        run_argv(tmp_path / "work", storage, PY, "-c", "import sys; sys.exit(7)", max_restarts=2),
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 7, result.stderr
    assert result.stderr.count("started attempt") == 3
    assert "restart budget of 2 spent" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run"], "no command"),
        (["run", "--storage", "gs://bucket/x", "--", "true"], "gs://bucket/x"),
        (["run", "--", "/nonexistent/trainer"], "cannot start '/nonexistent/trainer'"),
        (["run", "--no-memory-staging", "--reserve-staging", "--", "true"], "drop --no-memory-staging"),
    ],
)
def test_user_errors_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    argv = spotguard_argv(args[0], "--workdir", str(tmp_path / "w"), *args[1:])
    result = subprocess.run(argv, env=base_env(), capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    errors = [ln for ln in result.stderr.splitlines() if "ERROR" in ln or ln.startswith("spotguard: error")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_a_second_supervisor_on_the_same_workdir_is_refused(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    storage = (tmp_path / "store").as_uri()
    with reaping() as procs:
        first = Proc(
            run_argv(workdir, storage, *train_argv(10_000, None, 0.05, SAVE_EVERY)), base_env(), tmp_path / "first.log"
        )
        procs.append(first)
        first.wait_for_step(1)
        result = subprocess.run(
            run_argv(workdir, storage, "true"), env=base_env(), capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 2
        assert "another spotguard run is using" in result.stderr
        first.signal(signal.SIGINT)
        assert first.wait() == 128 + signal.SIGINT, first.tail()


@pytest.mark.integration
def test_applies_the_sidecars_retention_policy(s3_store, s3_uri: str, tmp_path: Path) -> None:
    from spotguard.checkpoint import RetentionCandidate, RetentionPolicy, list_checkpoint_names, plan_retention

    storage = s3_storage(s3_store, s3_uri)
    env = base_env(
        {**s3_store.env(), "SPOTGUARD_KEEP_LAST": "1", "SPOTGUARD_KEEP_BEST": "2", "SPOTGUARD_BEST_METRIC": "loss"}
    )
    with reaping() as procs:
        proc = Proc(
            run_argv(tmp_path / "work", s3_uri, *train_argv(STEPS, None, 0.0, SAVE_EVERY)), env, tmp_path / "run.log"
        )
        procs.append(proc)
        assert proc.wait() == 0, proc.tail()
    # Checkpoints after steps 10, 20, ..., 110 carry their step's loss; the
    # final one (119) none. What the policy keeps, from the losses printed.
    # (The trainer's line and its newline are two writes: a log line may come between.)
    losses = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step (\d+) loss (-?\d+\.\d{6})", proc.text())}
    # The trainer runs without a pause: the uploader ships the newest committed checkpoint and
    # skips those a newer one superseded meanwhile. The policy is applied to what was stored
    # (a checkpoint it dropped at one pass would not be kept at a later one either).
    stored = sorted({int(m.group(1)) for m in re.finditer(r"uploaded \S+/ckpt-(\d{12}) ", proc.text())})
    assert stored[-1] == STEPS - 1 and len(stored) > 3, stored  # something for the policy to delete
    candidates = [
        RetentionCandidate(f"ckpt-{s:012d}", s, {"loss": losses[s]} if s != STEPS - 1 else {}) for s in stored
    ]
    plan = plan_retention(
        candidates, RetentionPolicy(keep_last=1, keep_best=2, metric="loss"), f"ckpt-{STEPS - 1:012d}"
    )
    assert len(plan.keep) == 3
    assert list_checkpoint_names(storage) == sorted(plan.keep)
    # Locally, only the newest is left (the older ones are safe in storage or superseded).
    assert [p.name for p in (tmp_path / "work" / "checkpoints").glob("ckpt-*")] == [f"ckpt-{STEPS - 1:012d}"]
