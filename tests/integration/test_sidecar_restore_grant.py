"""A pod's resume through the restore grant: the init container grants, the sidecar copies after.

Real parts, started as the pod starts them: ``spotguard restore --grant``
(the restore init container) against the S3 test store (SeaweedFS), then the
demo trainer (no credentials, no storage URI: the pod's trainer) beside
``spotguard sidecar``. The trainer streams the granted checkpoint into its
tensors or, with a grant it cannot use, waits for the sidecar's local copy;
either way it resumes bit-exactly. No presigned URL reaches any output.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from reference_runs import ReferenceRuns
from sidecar_helpers import Proc, base_env, reaping, s3_storage, spotguard_argv, train_argv

from spotguard.checkpoint import upload_checkpoint
from spotguard.contract.grant import ANSWER_FILE, GRANT_FILE, read_grant, write_grant

pytestmark = pytest.mark.integration

STEPS, SAVE_EVERY = 40, 10
RESUMED = "ckpt-000000000024"
SECRET = "X-Amz-Signature"


@pytest.fixture(scope="module")
def earlier_attempt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo trainer's checkpoint of step 24, left by an earlier attempt (local; each test uploads it)."""
    root = tmp_path_factory.mktemp("earlier")
    with reaping() as procs:
        proc = Proc(
            train_argv(25, None, save_every=SAVE_EVERY),
            base_env({"SPOTGUARD_CHECKPOINT_DIR": str(root)}),
            root / "train.log",
        )
        procs.append(proc)
        assert proc.wait() == 0, proc.tail()
    return root / RESUMED


def _init_container(s3_store: Any, s3_uri: str, ckdir: Path) -> str:
    """``spotguard restore --grant`` as the pod's restore init container runs it; its output."""
    result = subprocess.run(
        spotguard_argv("restore", "--storage", s3_uri, "--dest", str(ckdir), "--grant"),
        env=base_env(s3_store.env()),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def _pod(s3_store: Any, s3_uri: str, pod: Path, ckdir: Path) -> tuple[Proc, Proc, bytes]:
    """The trainer (as the pod's, without the store) and the sidecar, until both exited 0; the final weights."""
    out = pod / "final.safetensors"
    with reaping() as procs:
        trainer = Proc(
            train_argv(STEPS, out, save_every=SAVE_EVERY),
            base_env({"SPOTGUARD_CHECKPOINT_DIR": str(ckdir)}),
            pod / "t.log",
        )
        procs.append(trainer)
        sidecar = Proc(
            spotguard_argv("sidecar", "--metrics-port", "0", "--termination-log", str(pod / "termination-log")),
            base_env({**s3_store.env(), "SPOTGUARD_CHECKPOINT_DIR": str(ckdir), "SPOTGUARD_STORAGE_URI": s3_uri}),
            pod / "sidecar.log",
        )
        procs.append(sidecar)
        assert trainer.wait() == 0, trainer.tail()
        assert sidecar.wait() == 0, sidecar.tail()
    return trainer, sidecar, out.read_bytes()


def _granted(s3_store: Any, s3_uri: str, earlier_attempt: Path, ckdir: Path) -> str:
    """Step 24 in storage, and the init container's grant of it (not restored); its output."""
    upload_checkpoint(earlier_attempt, s3_storage(s3_store, s3_uri))
    said = _init_container(s3_store, s3_uri, ckdir)
    control = ckdir / ".control"
    assert stat.S_IMODE(os.stat(control / GRANT_FILE).st_mode) == 0o600
    grant = read_grant(control)
    assert grant is not None and [c.name for c in grant.checkpoints] == [RESUMED]
    assert not list(ckdir.glob("ckpt-*"))  # granted, not restored
    return said


def test_a_pod_resumes_through_the_init_containers_grant_and_the_sidecar_copies_after(
    s3_store: Any, s3_uri: str, tmp_path: Path, earlier_attempt: Path, reference_runs: ReferenceRuns
) -> None:
    ckdir = tmp_path / "ckpt"
    said = _granted(s3_store, s3_uri, earlier_attempt, ckdir)
    trainer, sidecar, final = _pod(s3_store, s3_uri, tmp_path, ckdir)
    assert "resumed from step 24" in trainer.text()
    assert final == reference_runs.demo_final(STEPS, SAVE_EVERY)
    # The trainer streamed it; the sidecar restored the local copy after its answer, verified.
    log = sidecar.text()
    assert f"the trainer loaded {RESUMED} through the restore grant" in log
    assert "stage=restore" in log and f"name={RESUMED}" in log
    control = ckdir / ".control"
    assert not (control / GRANT_FILE).exists() and not (control / ANSWER_FILE).exists()
    assert SECRET not in said + trainer.text() + log


def test_a_grant_the_trainer_cannot_use_ends_in_the_sidecars_copy(
    s3_store: Any, s3_uri: str, tmp_path: Path, earlier_attempt: Path, reference_runs: ReferenceRuns
) -> None:
    """Refused by the store (a signature altered), the grant is answered as a declined one: nothing
    loaded, waiting. The sidecar restores the newest checkpoint as the init container would have,
    answers ``restore-done.json``, and the trainer resumes from that copy."""
    ckdir = tmp_path / "ckpt"
    said = _granted(s3_store, s3_uri, earlier_attempt, ckdir)
    control = ckdir / ".control"
    grant = read_grant(control)
    assert grant is not None
    for checkpoint in grant.checkpoints:
        for key, url in checkpoint.objects.items():
            checkpoint.objects[key] = url.replace(f"{SECRET}=", f"{SECRET}=0")  # type: ignore[index]
    write_grant(control, grant)
    trainer, sidecar, final = _pod(s3_store, s3_uri, tmp_path, ckdir)
    assert "resumed from step 24" in trainer.text()
    assert final == reference_runs.demo_final(STEPS, SAVE_EVERY)
    log = sidecar.text()
    assert "the trainer loaded nothing through the restore grant and waits" in log
    assert f"name={RESUMED}" in log
    assert SECRET not in said + trainer.text() + log
