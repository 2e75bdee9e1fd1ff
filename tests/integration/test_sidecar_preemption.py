"""SIGTERM at random moments to a pod-like pair: trainer process + sidecar process.

As kubelet does on a preemption, both containers get SIGTERM at once (in a
random order). Each time, the sidecar must get the trainer's emergency
checkpoint verified in SeaweedFS before it exits 0, and a new "pod"
resuming from storage must end bitwise identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from reference_runs import ReferenceRuns
from sidecar_helpers import Proc, base_env, reaping, s3_storage, spotguard_argv, train_argv

from spotguard.checkpoint import latest_verified
from testenv import trials

STEPS = 80
SAVE_EVERY = 25
STEP_DELAY = 0.01
TRIALS = trials.count(full=20, quick=5)


@pytest.mark.trials
@pytest.mark.integration
def test_sigterm_trials_end_bitwise_identical(
    s3_store, s3_uri: str, tmp_path: Path, reference_runs: ReferenceRuns
) -> None:
    rng = trials.rng("sidecar-sigterm")
    # SIGTERM at stratified steps: trial i of n lands in the i-th n-th of the run.
    targets = [1 + int(f * (STEPS - 9)) for f in trials.stratified(TRIALS, rng)]
    print(f"\nsidecar SIGTERM trials: seed {trials.seed()}, {TRIALS} trials at steps {targets}")
    s3_env = s3_store.env()
    ref_bytes = reference_runs.demo_final(STEPS, SAVE_EVERY)

    outcomes: list[tuple[int, int, int, int]] = []
    pending_resumes: list[tuple[int, Proc, Path]] = []

    def check_resume(trial: int, proc: Proc, out: Path) -> None:
        assert proc.wait() == 0, proc.tail()
        assert out.read_bytes() == ref_bytes, f"trial {trial}: resumed run is not bitwise identical"

    with reaping() as procs:
        for trial in range(TRIALS):
            pod = tmp_path / f"trial-{trial:02d}"
            pod.mkdir()
            uri = f"{s3_uri}/trial-{trial:02d}"
            env = base_env(
                {
                    **s3_env,
                    "SPOTGUARD_CHECKPOINT_DIR": str(pod / "ckpt"),
                    "SPOTGUARD_STORAGE_URI": uri,
                    "SPOTGUARD_JOB": f"trial-{trial}",
                }
            )
            trainer = Proc(
                train_argv(STEPS, pod / "never.safetensors", STEP_DELAY, SAVE_EVERY), env, pod / "trainer.log"
            )
            sidecar = Proc(
                spotguard_argv(
                    "sidecar",
                    "--metrics-port",
                    "0",
                    "--grace-seconds",
                    "30",
                    "--termination-log",
                    str(pod / "termination-log"),
                ),
                env,
                pod / "sidecar.log",
            )
            procs += [trainer, sidecar]
            target = targets[trial]
            trainer.wait_for_step(target)
            time.sleep(rng.uniform(0, 2 * STEP_DELAY))  # anywhere inside a step, not only at its start
            # Both containers get SIGTERM "at once", in either order.
            pair = [trainer, sidecar]
            rng.shuffle(pair)
            for p in pair:
                p.signal(signal.SIGTERM)
            sidecar_rc = sidecar.wait()
            trainer_rc = trainer.wait()
            assert trainer_rc == 0, trainer.tail()
            assert sidecar_rc == 0, sidecar.tail()
            stopped_step = trainer.wait_for_stopped_step()
            info, skipped = latest_verified(s3_storage(s3_store, uri))
            assert info is not None, f"trial {trial}: nothing verified; sidecar log:\n{sidecar.tail()}"
            assert info.step >= stopped_step, f"trial {trial}: verified {info.step} < stopped {stopped_step}"
            assert "stage=emergency" in sidecar.text() and "result=verified" in sidecar.text()
            # What the operator reads from the container's termination message.
            report = json.loads((pod / "termination-log").read_text())
            assert report == {"preempted": True, "reason": "sigterm", "step": info.step, "trainerStep": stopped_step}
            outcomes.append((trial, target, stopped_step, info.step))

            # A new pod: empty local directory, restore from storage, train to the end.
            while pending_resumes:
                check_resume(*pending_resumes.pop())
            new_pod = pod / "next-pod"
            resume = Proc(
                train_argv(STEPS, new_pod / "final.safetensors", 0.0, SAVE_EVERY),
                {**env, "SPOTGUARD_CHECKPOINT_DIR": str(new_pod / "ckpt")},
                pod / "resume.log",
            )
            procs.append(resume)
            pending_resumes.append((trial, resume, new_pod / "final.safetensors"))
            resumed = resume.wait_for_line(lambda ln: ln.startswith(("resumed from step", "starting from")))
            assert resumed == f"resumed from step {info.step}", resumed
        while pending_resumes:
            check_resume(*pending_resumes.pop())

    print(f"\n{'trial':>5} {'sigterm at':>10} {'stopped':>8} {'verified':>8} {'lost':>5}")
    for trial, target, stopped_step, verified in outcomes:
        print(f"{trial:>5} {target:>10} {stopped_step:>8} {verified:>8} {stopped_step - verified:>5}")
    assert len(outcomes) == TRIALS
