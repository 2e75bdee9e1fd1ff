"""Bit-exact resume: 200 steps uninterrupted vs. preempted and resumed 3 times at
random steps, each segment a fresh process (nothing survives in memory)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import HELPERS, subprocess_env
from reference_runs import ReferenceRuns
from safetensors.torch import load_file

from spotguard.checkpoint import LocalWriter, read_local_manifest
from testenv import trials

pytestmark = pytest.mark.integration

SCRIPT = HELPERS / "exact_train.py"
STEPS = 200


def run(out: Path, env: dict[str, str], *extra: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", str(STEPS), "--out", str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


#: Preemptions per run: 3 in ``make soak``.
INTERRUPTIONS = trials.count(full=3, quick=2)


def interruption_steps() -> tuple[int, list[int]]:
    return trials.seed(), sorted(trials.rng("exact-resume").sample(range(1, STEPS - 1), INTERRUPTIONS))


def compare(reference: Path, resumed: Path) -> None:
    want, got = load_file(str(reference)), load_file(str(resumed))
    assert set(want) == set(got)
    assert any(k.startswith("optimizer.") for k in want) and any(k.startswith("model.") for k in want)
    for key in want:
        assert want[key].dtype == got[key].dtype, key
        assert torch.equal(want[key], got[key]), f"{key} differs after resume"
    want_draws: dict[str, Any] = json.loads(Path(str(reference) + ".json").read_text())
    got_draws: dict[str, Any] = json.loads(Path(str(resumed) + ".json").read_text())
    assert got_draws == want_draws


def uninterrupted(tmp: Path) -> Path:
    out = tmp / "final.safetensors"
    env = subprocess_env(SPOTGUARD_CHECKPOINT_DIR=str(tmp / "ck"))
    stdout = run(out, env)
    assert "start 0" in stdout and "finished" in stdout
    return out


@pytest.fixture(scope="module")
def reference(reference_runs: ReferenceRuns) -> Path:
    return reference_runs.get(("exact_train", STEPS), uninterrupted)


@pytest.mark.trials
def test_resume_from_local_checkpoints_is_bit_exact(reference: Path, tmp_path: Path) -> None:
    seed, stops = interruption_steps()
    print(f"seed {seed}: preempting after steps {stops}")
    env = subprocess_env(SPOTGUARD_CHECKPOINT_DIR=str(tmp_path / "ck"))
    out = tmp_path / "final.safetensors"
    expected_start = 0
    for stop in stops:
        stdout = run(out, env, "--preempt-at", str(stop))
        assert f"start {expected_start}" in stdout and f"preempted after step {stop}" in stdout, stdout
        expected_start = stop + 1
    stdout = run(out, env)
    assert f"start {expected_start}" in stdout and "finished" in stdout
    compare(reference, out)


@pytest.mark.trials
def test_resume_through_s3_on_fresh_machines_is_bit_exact(
    reference: Path, tmp_path: Path, s3_store: Any, s3_uri: str
) -> None:
    """Each segment starts with an empty local directory (a new node) and
    restores from S3, where the previous segment uploaded its checkpoints."""
    seed, stops = interruption_steps()
    print(f"seed {seed}: preempting after steps {stops}")
    out = tmp_path / "final.safetensors"
    expected_start = 0
    for segment, stop in enumerate([*stops, None]):
        env = subprocess_env(
            s3_store, SPOTGUARD_CHECKPOINT_DIR=str(tmp_path / f"node{segment}"), SPOTGUARD_STORAGE_URI=s3_uri
        )
        extra = ["--upload"] + (["--preempt-at", str(stop)] if stop is not None else [])
        stdout = run(out, env, *extra)
        assert f"start {expected_start}" in stdout, stdout
        if stop is not None:
            assert f"preempted after step {stop}" in stdout
            expected_start = stop + 1
    assert "finished" in stdout
    compare(reference, out)


def test_a_different_run_is_detected(reference: Path, tmp_path: Path) -> None:
    """The comparison can fail: a run that loses its RNG state differs."""
    env = subprocess_env(SPOTGUARD_CHECKPOINT_DIR=str(tmp_path / "ck"))
    out = tmp_path / "final.safetensors"
    run(out, env, "--preempt-at", "100")
    # Drop the RNG states from the checkpoint: resume is then no longer exact.
    ckpt_dir = next((tmp_path / "ck").glob("ckpt-*"))
    state_json = ckpt_dir / "state.json"
    doc = json.loads(state_json.read_text())
    doc["state"].pop("rng")
    manifest = read_local_manifest(ckpt_dir)
    writer = LocalWriter(tmp_path / "ck2", manifest.step)
    for f in manifest.files:
        data = json.dumps(doc).encode() if f.path == "state.json" else (ckpt_dir / f.path).read_bytes()
        writer.add_bytes(f.path, data)
    writer.commit()
    run(out, subprocess_env(SPOTGUARD_CHECKPOINT_DIR=str(tmp_path / "ck2")))
    with pytest.raises(AssertionError):
        compare(reference, out)
