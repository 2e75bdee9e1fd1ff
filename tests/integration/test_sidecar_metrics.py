"""The sidecar's metrics endpoint, scraped over HTTP after a known sequence of saves."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from sidecar_helpers import Proc, base_env, free_port, metric, reaping, scrape, spotguard_argv, wait_until

from spotguard.checkpoint import MANIFEST_NAME, read_local_manifest
from spotguard.trainer.checkpointer import Checkpointer

STAGES = ("save", "upload", "verify", "retention", "emergency", "restore", "notice")


def _save(ckdir: Path, step: int, size: int) -> int:
    """Commit one checkpoint of about ``size`` bytes; returns the bytes an upload moves."""
    import torch

    ck = Checkpointer(ckdir, async_save=False, keep_local=10)
    path = ck.save(step, {"weights": torch.full((size // 4,), float(step))})
    ck.close()
    assert path is not None
    return read_local_manifest(path).total_size + len((path / MANIFEST_NAME).read_bytes())


@pytest.mark.integration
def test_metrics_after_known_saves(s3_store, s3_uri: str, tmp_path: Path) -> None:
    ckdir = tmp_path / "ckpt"
    port = free_port()
    env = base_env(
        {
            **s3_store.env(),
            "SPOTGUARD_CHECKPOINT_DIR": str(ckdir),
            "SPOTGUARD_STORAGE_URI": s3_uri,
            "POD_NAMESPACE": "team-a",
            "SPOTGUARD_JOB": "mnist",
        }
    )
    with reaping() as procs:
        sidecar = Proc(
            spotguard_argv(
                "sidecar",
                "--mode",
                "native",
                "--metrics-port",
                str(port),
                "--metrics-addr",
                "127.0.0.1",
                "--grace-seconds",
                "30",
                "--safety-margin",
                "5",
                "--no-incremental",  # whole files: the bytes an upload moves are known exactly
            ),
            env,
            tmp_path / "sidecar.log",
        )
        procs.append(sidecar)
        labels = {"namespace": "team-a", "trainingjob": "mnist"}
        wait_until(lambda: scrape(port), 60, "the metrics endpoint")
        before = scrape(port)
        assert metric(before, "spotguard_checkpoint_last_verified_step", **labels) == -1
        assert metric(before, "spotguard_checkpoint_uploads_total", result="verified", **labels) == 0

        started = time.time()
        expected_bytes = 0
        for step, size in ((10, 4096), (20, 65536), (30, 1 << 20)):
            expected_bytes += _save(ckdir, step, size)
            wait_until(
                lambda s=step: metric(scrape(port), "spotguard_checkpoint_last_verified_step", **labels) == s,
                60,
                f"step {step} verified",
            )
        finished = time.time()
        m = scrape(port)

    assert metric(m, "spotguard_checkpoint_last_verified_step", **labels) == 30
    stamp = metric(m, "spotguard_checkpoint_last_verified_timestamp_seconds", **labels)
    assert stamp is not None and started <= stamp <= finished
    assert metric(m, "spotguard_checkpoint_uploads_total", result="verified", **labels) == 3
    assert metric(m, "spotguard_checkpoint_uploads_total", result="failed", **labels) == 0
    assert metric(m, "spotguard_checkpoint_uploaded_bytes_total", **labels) == expected_bytes
    assert metric(m, "spotguard_checkpoint_upload_duration_seconds_count", **labels) == 3
    assert metric(m, "spotguard_checkpoint_verify_duration_seconds_count", **labels) == 3
    # Save times come from each manifest's timing.
    assert metric(m, "spotguard_checkpoint_save_duration_seconds_count", reason="interval", **labels) == 3
    upload_sum = metric(m, "spotguard_checkpoint_upload_duration_seconds_sum", **labels)
    assert upload_sum is not None and upload_sum > 0
    for stage in STAGES:
        assert metric(m, "spotguard_checkpoint_failures_total", stage=stage, **labels) == 0
    assert metric(m, "spotguard_checkpoint_grace_seconds", **labels) == 30
    start = metric(m, "spotguard_sidecar_start_timestamp_seconds", **labels)
    assert start is not None and 0 < start <= started
    # No SPOTGUARD_SAVE_EVERY_SECONDS: the interval is observed from the routine checkpoints.
    interval = metric(m, "spotguard_checkpoint_interval_seconds", **labels)
    assert interval is not None and 0 < interval <= finished - started
    assert metric(m, "spotguard_checkpoint_deadline_at_risk", **labels) == 0
    expected = metric(m, "spotguard_checkpoint_expected_emergency_seconds", **labels)
    assert expected is not None and 0 < expected < 25
    # No notice and no signal yet: the counter has no series.
    assert metric(m, "spotguard_preemption_notices_total", **labels) is None


@pytest.mark.integration
def test_deadline_at_risk_is_exported_and_triggers_proactive_checkpoints(s3_store, s3_uri: str, tmp_path: Path) -> None:
    ckdir = tmp_path / "ckpt"
    port = free_port()
    env = base_env(
        {
            **s3_store.env(),
            "SPOTGUARD_CHECKPOINT_DIR": str(ckdir),
            "SPOTGUARD_STORAGE_URI": s3_uri,
            "SPOTGUARD_SAVE_EVERY_SECONDS": "600",
        }
    )
    # A grace period no emergency checkpoint can fit (the fixed overhead alone is 2 s).
    argv = spotguard_argv(
        "sidecar",
        "--mode",
        "native",
        "--metrics-port",
        str(port),
        "--metrics-addr",
        "127.0.0.1",
        "--grace-seconds",
        "1",
        "--safety-margin",
        "0.5",
        "--proactive-interval",
        "1",
    )
    with reaping() as procs:
        sidecar = Proc(argv, env, tmp_path / "sidecar.log")
        procs.append(sidecar)
        wait_until(lambda: scrape(port), 60, "the metrics endpoint")
        first = scrape(port)
        assert metric(first, "spotguard_checkpoint_deadline_at_risk") == 0  # nothing measured yet
        assert metric(first, "spotguard_checkpoint_interval_seconds") == 600  # as configured
        _save(ckdir, 5, 4096)
        wait_until(lambda: metric(scrape(port), "spotguard_checkpoint_deadline_at_risk") == 1, 60, "at risk")
        request = ckdir / ".control" / "checkpoint-request.json"
        doc = wait_until(lambda: request.is_file() and json.loads(request.read_text()), 30, "a proactive request")
        assert doc["reason"] == "proactive" and doc["preempt"] is False
        sidecar.signal(signal.SIGTERM)
        sidecar.wait()
    assert "deadline: expected emergency checkpoint" in sidecar.text() and "AT RISK" in sidecar.text()
