"""The sidecar's emergency path: save -> upload -> verify -> pointer -> report, and nothing else.

The store (real SeaweedFS) sits behind a proxy of the test's own that logs
every request and can answer 500 for a while. The trainer and sidecar are
real processes, as in a pod.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from sidecar_helpers import (
    Proc,
    base_env,
    reaping,
    s3_storage,
    spotguard_argv,
    store_proxy,
    train_argv,
    wait_until,
)

from spotguard.checkpoint import latest_verified, list_checkpoint_names, verify_local_checkpoint
from spotguard.checkpoint.local.commit import STAGED_PREFIX
from spotguard.sidecar.mainloop import EXIT_EMERGENCY_FAILED

pytestmark = pytest.mark.integration


def _pod(tmp_path: Path, env: dict[str, str], grace: int = 25) -> tuple[Proc, Proc]:
    # No routine checkpoints: only the emergency one is new.
    trainer = Proc(train_argv(100_000, None, 0.02, 1_000_000), env, tmp_path / "trainer.log")
    sidecar = Proc(
        spotguard_argv(
            "sidecar",
            "--metrics-port",
            "0",
            "--grace-seconds",
            str(grace),
            "--termination-log",
            str(tmp_path / "termination-log"),
        ),
        env,
        tmp_path / "sidecar.log",
    )
    return trainer, sidecar


def _preempt(trainer: Proc, sidecar: Proc, sidecar_exit: int = 0) -> int:
    """SIGTERM to both containers at once, as kubelet does; the step the trainer stopped after."""
    trainer.signal(signal.SIGTERM)
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait() == sidecar_exit, sidecar.tail()
    assert trainer.wait() == 0, trainer.tail()
    return trainer.wait_for_stopped_step()


def test_emergency_upload_rides_out_a_store_answering_500(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    storage = s3_storage(s3_store, s3_uri)
    with store_proxy(s3_store) as proxy, reaping() as procs:
        env = base_env(
            {
                **proxy.env(s3_store.env()),
                "SPOTGUARD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
                "SPOTGUARD_STORAGE_URI": s3_uri,
            }
        )
        trainer, sidecar = _pod(tmp_path, env, grace=40)
        procs += [trainer, sidecar]
        trainer.wait_for_step(5)
        wait_until(lambda: "sidecar watching" in sidecar.text(), 60, "the sidecar to start")
        # The store fails every request for 25 seconds of the 40-second grace
        # period (deadline: 35 s): longer than one upload's own retries last.
        proxy.fail_for(25.0)
        t_term = time.time()
        stopped = _preempt(trainer, sidecar)
    assert any(status == 500 for _, _, _, status in proxy.since(t_term)), "the fault was never hit"
    text = sidecar.text()
    # Which layer rides the 500s out depends on the machine's pace: the emergency's own retries
    # (stage=retry), or one upload whose S3 client's retries last until the fault ends.
    assert "result=verified" in text, text
    info, _ = latest_verified(storage)
    assert info is not None and info.step >= stopped
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report == {"preempted": True, "reason": "sigterm", "step": info.step, "trainerStep": stopped}


def test_a_sidecar_told_to_fails_its_pod_after_a_preemption(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    """The webhook's pods (SPOTGUARD_PREEMPTED_EXIT_CODE=143): a Job sees the preempted pod fail and runs it
    again, although the trainer returned 0; the checkpoint is verified and the report the same as ever."""
    storage = s3_storage(s3_store, s3_uri)
    with reaping() as procs:
        env = base_env(
            {
                **s3_store.env(),
                "SPOTGUARD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
                "SPOTGUARD_STORAGE_URI": s3_uri,
                "SPOTGUARD_PREEMPTED_EXIT_CODE": "143",
            }
        )
        trainer, sidecar = _pod(tmp_path, env)
        procs += [trainer, sidecar]
        trainer.wait_for_step(5)
        wait_until(lambda: "sidecar watching" in sidecar.text(), 60, "the sidecar to start")
        stopped = _preempt(trainer, sidecar, sidecar_exit=143)
    info, _ = latest_verified(storage)
    assert info is not None and info.step >= stopped
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report == {"preempted": True, "reason": "sigterm", "step": info.step, "trainerStep": stopped}


def _data_gets(requests: list[tuple[float, str, str, int]], name: str) -> dict[str, int]:
    """GETs per data file of checkpoint ``name`` (the manifest and the pointer are metadata)."""
    counts: dict[str, int] = {}
    for _, method, path, _ in requests:
        key = unquote(urlsplit(path).path)
        if method == "GET" and f"/{name}/" in key and not key.endswith("/manifest.json"):
            counts[key] = counts.get(key, 0) + 1
    return counts


def test_no_retention_and_no_rereading_between_sigterm_and_the_report(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    storage = s3_storage(s3_store, s3_uri)
    # An earlier attempt left three checkpoints in storage (no retention then).
    first = tmp_path / "first"
    result = subprocess.run(
        spotguard_argv("run", "--workdir", str(first), "--storage", s3_uri, "--", *train_argv(25, None, 0.0, 10)),
        env=base_env(s3_store.env()),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    before = list_checkpoint_names(storage)
    assert before == [f"ckpt-{s:012d}" for s in (10, 20, 24)]

    pod = tmp_path / "pod"
    ckdir = pod / "ckpt"
    with store_proxy(s3_store) as proxy, reaping() as procs:
        # The init container stages the newest verified checkpoint.
        restore = subprocess.run(
            spotguard_argv("restore", "--storage", s3_uri, "--dest", str(ckdir)),
            env=base_env(s3_store.env()),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert restore.returncode == 0, restore.stderr
        # This pod's policy would keep only the newest checkpoint.
        env = base_env(
            {
                **proxy.env(s3_store.env()),
                "SPOTGUARD_CHECKPOINT_DIR": str(ckdir),
                "SPOTGUARD_STORAGE_URI": s3_uri,
                "SPOTGUARD_KEEP_LAST": "1",
            }
        )
        t_start = time.time()
        trainer, sidecar = _pod(pod, env)
        procs += [trainer, sidecar]
        trainer.wait_for_line(lambda ln: ln == "resumed from step 24")
        trainer.wait_for_step(30)
        wait_until(lambda: "sidecar watching" in sidecar.text(), 60, "the sidecar to start")
        t_term = time.time()
        stopped = _preempt(trainer, sidecar)
    emergency = f"ckpt-{stopped:012d}"
    report = json.loads((pod / "termination-log").read_text())
    assert report["preempted"] is True and report["step"] == stopped
    # Nothing deleted on the way out: retention waits for a routine round.
    assert list_checkpoint_names(storage) == [*before, emergency]
    requests = proxy.since(t_start)
    # (Only the uploads' own intents go: gc/uploads/, see spotguard.checkpoint.store.intents.)
    deletes = [r for r in requests if r[1] == "DELETE" or (r[1] == "POST" and "delete" in r[2])]
    assert not [
        r
        for r in deletes
        if any("gc/uploads/" not in k for k in r[2].split(" keys=", 1)[-1].split(",")) or " keys=" not in r[2]
    ], requests
    # The restored checkpoint is not read back (the restore verified it) ...
    assert _data_gets(requests, "ckpt-000000000024") == {}
    # ... and the emergency checkpoint's data is read at most once, by its own verification.
    gets = _data_gets(proxy.since(t_term), emergency)
    assert all(n == 1 for n in gets.values()), gets
    text = sidecar.text()
    after_term = text[text.index("preemption source=") :]
    assert "stage=retention" not in after_term
    stages = [ln.split("stage=", 1)[1].split()[0] for ln in after_term.splitlines() if "stage=" in ln]
    # In this order, with nothing else in between (``follow``: the save's chunks hashed while written).
    assert stages == ["request", "save", "follow", "upload", "verify", "pointer", "ship", "emergency", "report"], stages


@pytest.mark.parametrize("store_up", [True, False])
def test_a_checkpoint_staged_in_memory_is_settled_before_the_sidecar_exits(
    s3_store: Any, s3_uri: str, tmp_path: Path, store_up: bool
) -> None:
    """``checkpoint.memoryStaging``: the trainer writes its preemption's checkpoint to the
    memory volume, the sidecar ships it from there; before the pod (and the memory) goes,
    a verified one leaves memory, and one the store never got is copied to the staging volume."""
    storage = s3_storage(s3_store, s3_uri)
    memory, ckdir = tmp_path / "memory", tmp_path / "ckpt"
    with store_proxy(s3_store) as proxy, reaping() as procs:
        env = base_env(
            {
                **proxy.env(s3_store.env()),
                "SPOTGUARD_CHECKPOINT_DIR": str(ckdir),
                "SPOTGUARD_STORAGE_URI": s3_uri,
                "SPOTGUARD_EMERGENCY_STAGING": str(memory),
            }
        )
        trainer, sidecar = _pod(tmp_path, env, grace=25 if store_up else 8)
        procs += [trainer, sidecar]
        trainer.wait_for_step(5)
        wait_until(lambda: "sidecar watching" in sidecar.text(), 60, "the sidecar to start")
        if not store_up:
            proxy.fail_for(120.0)  # from SIGTERM on, the store answers nothing but 500
        trainer.signal(signal.SIGTERM)
        sidecar.signal(signal.SIGTERM)
        rc = sidecar.wait()
        assert trainer.wait() == 0, trainer.tail()
        stopped = trainer.wait_for_stopped_step()
    name = f"ckpt-{stopped:012d}"
    text = sidecar.text()
    assert not [e for e in memory.iterdir() if e.name.startswith(STAGED_PREFIX)], list(memory.iterdir())
    if store_up:
        assert rc == 0, text
        assert "staged in memory: 1 verified and removed, 0 copied to disk" in text, text
        info, _ = latest_verified(storage)
        assert info is not None and info.name == name
        assert not (ckdir / name).exists()
    else:
        assert rc == EXIT_EMERGENCY_FAILED, text  # the emergency checkpoint is not verified
        assert "staged in memory: 0 verified and removed, 1 copied to disk" in text, text
        copied = ckdir / name
        assert copied.is_dir() and not copied.is_symlink()
        assert verify_local_checkpoint(copied).ok
