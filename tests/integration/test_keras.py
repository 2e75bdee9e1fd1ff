"""Keras 3 (torch backend) under ``spotguard run``: a preempted fit resumes bit for bit.

Real processes throughout: ``spotguard run`` supervises
``examples/train_keras.py`` (a small MLP with dropout, numpy arrays shuffled
by ``fit``, validation data, on CPU); checkpoints are written by
``SpotguardCallback`` through the Checkpointer and uploaded to the real S3
store. Every stop comes from a real SIGTERM to ``spotguard run``, placed at
a chosen point (the example waits there until the preemption reaches it):
at the end of an epoch after its validation, in the middle of an epoch, and
after the last batch of an epoch before its validation. The fit that
finishes ends with the weights and optimizer state of an uninterrupted fit,
byte for byte (digests compared).
"""

from __future__ import annotations

import importlib.util
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from reference_runs import ReferenceRuns
from sidecar_helpers import PY, Proc, base_env, reaping, s3_storage, spotguard_argv

from spotguard.checkpoint import latest_verified
from spotguard.checkpoint.store.stored import read_manifest
from testenv import trials
from testenv.require import require

# Not imported here (seconds of import in the test process): the example imports it.
require(importlib.util.find_spec("keras") is not None, "Python package keras is not installed")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_keras.py"

SAMPLES = 64
BATCH = 8
EPOCHS = 4
SAVE_EVERY = 5
PER_EPOCH = SAMPLES // BATCH

DIGEST_RE = re.compile(r"final digest ([0-9a-f]{64})")
RESUMED_RE = re.compile(r"resumed from step (\d+)")

pytestmark = pytest.mark.integration


def command(*extra: str) -> list[str]:
    return [
        PY,
        str(EXAMPLE),
        "--samples",
        str(SAMPLES),
        "--batch-size",
        str(BATCH),
        "--epochs",
        str(EPOCHS),
        "--save-every",
        str(SAVE_EVERY),
        *extra,
    ]


def env_for(extra: dict[str, str] | None = None) -> dict[str, str]:
    return base_env({"OMP_NUM_THREADS": "1", "KERAS_BACKEND": "torch", **(extra or {})})


def digest_of(proc: Proc) -> str:
    m = DIGEST_RE.search(proc.wait_for_line(lambda ln: bool(DIGEST_RE.search(ln)), timeout=180))
    assert m is not None
    return m.group(1)


class References:
    """Digests of uninterrupted fits (no supervisor), each computed once per session."""

    def __init__(self, runs: ReferenceRuns) -> None:
        self.runs = runs

    def get(self, data: str) -> str:
        def run(d: Path) -> str:
            with reaping() as procs:
                env = env_for({"SPOTGUARD_CHECKPOINT_DIR": str(d / "ckpt")})
                proc = Proc(command("--data", data), env, d / "train.log")
                procs.append(proc)
                assert proc.wait(180) == 0, proc.tail()
                return digest_of(proc)

        return self.runs.get(("keras", data, SAMPLES, BATCH, EPOCHS, SAVE_EVERY), run)


@pytest.fixture(scope="module")
def references(reference_runs: ReferenceRuns) -> References:
    return References(reference_runs)


class Job:
    """One job's ``spotguard run`` invocations against one store prefix."""

    def __init__(self, tmp_path: Path, s3_store: Any, s3_uri: str, data: str, procs: list[Proc]) -> None:
        self.tmp_path = tmp_path
        self.data = data
        self.procs = procs
        self.env = env_for(s3_store.env())
        self.storage = s3_storage(s3_store, s3_uri)
        self.uri = s3_uri
        self.runs = 0
        self.stopped: int | None = None

    def start(self, *extra: str) -> Proc:
        self.runs += 1
        argv = spotguard_argv(
            "run",
            "--workdir",
            str(self.tmp_path / "work"),
            "--storage",
            self.uri,
            "--max-restarts",
            "0",
            "--",
            *command("--data", self.data, *extra),
        )
        proc = Proc(argv, self.env, self.tmp_path / f"run{self.runs}.log")
        self.procs.append(proc)
        line = proc.wait_for_line(
            lambda ln: "starting from scratch" in ln and "spotguard INFO" not in ln or bool(RESUMED_RE.search(ln))
        )
        m = RESUMED_RE.search(line)
        assert (int(m.group(1)) if m else None) == self.stopped, proc.tail()
        return proc

    def preempt_at(self, where: str, *pause: str) -> int:
        """A run that waits at ``where`` (``step N``, ``epoch E``) until the
        SIGTERM to ``spotguard run`` reaches it; the fit checkpoints, the
        checkpoint is verified in storage, the fit stops."""
        proc = self.start(*pause)
        proc.wait_for_line(lambda ln: ln == f"waiting for a preemption after {where}")
        proc.signal(signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM, proc.tail()
        text = proc.text()
        assert "Traceback" not in text and "not exact" not in text, proc.tail()
        stopped = proc.wait_for_stopped_step()
        info, _ = latest_verified(self.storage)
        assert info is not None and info.step == stopped, (info, stopped)
        self.stopped = stopped
        return stopped

    def finish(self) -> str:
        proc = self.start()
        assert proc.wait(180) == 0, proc.tail()
        assert "not exact" not in proc.text(), proc.tail()
        return digest_of(proc)


def test_preempted_at_an_epoch_end_mid_epoch_and_after_an_epochs_last_batch_ends_bit_identical(
    s3_store: Any, s3_uri: str, tmp_path: Path, references: References
) -> None:
    """Three SIGTERMs: at the end of epoch 1 (after validation: the
    checkpoint records val_loss and resumes with epoch 2), in the middle of
    epoch 2 (the resume skips the done batches), after the last batch of
    epoch 3 (before validation: the resume reads the whole epoch again,
    validates, goes on); then the fit finishes."""
    expected = references.get("arrays")
    seed = trials.seed()
    rng = trials.rng("keras")
    with reaping() as procs:
        job = Job(tmp_path, s3_store, s3_uri, "arrays", procs)

        at_epoch_end = job.preempt_at("epoch 1", "--pause-for-preemption-after-epoch", "1")
        assert at_epoch_end == PER_EPOCH
        manifest = read_manifest(job.storage, f"ckpt-{at_epoch_end:012d}")
        # A part's tensors that did not change since the last committed
        # checkpoint sit in <part>.kept.safetensors (the non-trainable ones).
        parts = {f.path.removesuffix(".safetensors").removesuffix(".kept") for f in manifest.files}
        assert parts == {"state.json", "model", "optimizer", "rng"}, sorted(f.path for f in manifest.files)
        assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(manifest.metrics or {}), manifest.metrics

        mid = PER_EPOCH + rng.randint(1, PER_EPOCH - 2)
        assert job.preempt_at(f"step {mid}", "--pause-for-preemption-at", str(mid)) == mid
        manifest = read_manifest(job.storage, f"ckpt-{mid:012d}")
        assert "metrics.safetensors" in {f.path for f in manifest.files}
        metrics = manifest.metrics or {}
        assert "running_loss" in metrics and "loss" not in metrics and "val_loss" not in metrics, metrics

        last_batch = 3 * PER_EPOCH
        assert job.preempt_at(f"step {last_batch}", "--pause-for-preemption-at", str(last_batch)) == last_batch

        assert job.finish() == expected, f"seed {seed}"


def test_torch_dataloader_with_its_own_generator_preempted_mid_epoch_ends_bit_identical(
    s3_store: Any, s3_uri: str, tmp_path: Path, references: References
) -> None:
    """A torch DataLoader shuffling with a generator of its own (handed to
    the callback with ``generators=``), stopped in the middle of epoch 2:
    the generator goes back to its state at the epoch's start for the
    replay of the done batches, then to its state at the checkpoint."""
    expected = references.get("dataloader")
    seed = trials.seed()
    mid = PER_EPOCH + trials.rng("keras-dataloader").randint(1, PER_EPOCH - 1)
    with reaping() as procs:
        job = Job(tmp_path, s3_store, s3_uri, "dataloader", procs)
        assert job.preempt_at(f"step {mid}", "--pause-for-preemption-at", str(mid)) == mid
        assert job.finish() == expected, f"seed {seed}"
