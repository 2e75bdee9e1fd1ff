"""The collector's settings against the real S3 store: a grace that is no finite number of
seconds is refused before anything is deleted, an upload intent is judged by the lease stored
with it, and an uploader whose chunk sweep has a grace shorter than the lease refuses to start."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import subprocess_env
from sidecar_helpers import base_env, s3_storage, spotguard_argv

from spotguard.checkpoint.format.manifest import checkpoint_name
from spotguard.checkpoint.store.gc import collect_garbage, find_orphans, sweep_chunks
from spotguard.checkpoint.store.intents import read_intents, upload_intent
from spotguard.checkpoint.store.retention import RetentionPolicy

pytestmark = pytest.mark.integration


def fresh_orphan(storage: Any) -> str:
    """A checkpoint prefix an upload is writing right now (data, no manifest yet)."""
    key = f"{checkpoint_name(70)}/model.safetensors"
    storage.write_bytes(key, b"being uploaded")
    return key


@pytest.mark.parametrize("grace", [float("nan"), float("inf"), -1.0])
def test_a_grace_that_is_no_finite_number_of_seconds_is_refused_before_anything_is_deleted(
    s3_store: Any, s3_uri: str, grace: float
) -> None:
    storage = s3_storage(s3_store, s3_uri)
    key = fresh_orphan(storage)
    with pytest.raises(ValueError, match="finite number of seconds"):
        collect_garbage(storage, RetentionPolicy(keep_last=1), orphan_grace=grace)
    with pytest.raises(ValueError, match="finite number of seconds"):
        find_orphans(storage, grace=grace)
    with pytest.raises(ValueError, match="finite number of seconds"):
        sweep_chunks(storage, grace=grace)
    assert storage.stat(key) is not None, "a fresh prefix was deleted"


@pytest.mark.parametrize("grace", ["nan", "inf", "-1"])
def test_the_gc_command_refuses_a_grace_that_is_no_finite_number(s3_store: Any, s3_uri: str, grace: str) -> None:
    storage = s3_storage(s3_store, s3_uri)
    key = fresh_orphan(storage)
    proc = subprocess.run(
        [sys.executable, "-m", "spotguard.cli", "ckpt", "gc", s3_uri, "--keep-last", "1", f"--orphan-grace={grace}"],
        env=subprocess_env(s3_store),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spotguard: error: "), proc.stderr
    assert "finite number of seconds" in lines[0], proc.stderr
    assert storage.stat(key) is not None, "a fresh prefix was deleted"


def test_an_intent_is_judged_by_the_lease_stored_with_it(
    s3_store: Any, s3_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An uploader with a 10-minute lease stalls for two minutes; a collector whose own lease is
    the default minute still takes its intent as live and keeps the chunk it names."""
    storage = s3_storage(s3_store, s3_uri)
    data = b"a chunk the stalled upload will name"
    digest = hashlib.sha256(data).hexdigest()
    chunk = f"chunks/{digest[:2]}/{digest}"
    storage.write_bytes(chunk, data)
    monkeypatch.delenv("SPOTGUARD_GC_LEASE_SECONDS", raising=False)
    with upload_intent(storage, checkpoint_name(20), [digest], lease=600.0) as key:
        assert json.loads(storage.read_bytes(key))["lease"] == 600.0
        later = time.time() + 120  # the heartbeat is two minutes old: past the collector's lease, not the upload's
        intents = read_intents(storage, later)
        assert [i.key for i in intents.live] == [key] and intents.live[0].lease == 600.0, intents
        sweep = sweep_chunks(storage, grace=0, now=later)
        assert sweep.deleted == [] and storage.stat(chunk) is not None
        assert storage.stat(key) is not None, "the live intent was deleted as dead"
        # Past its own lease it is dead, and the chunk nothing else names goes.
        gone = sweep_chunks(storage, grace=0, now=time.time() + 700)
        assert gone.deleted == [chunk] and key in gone.tombstones_deleted


@pytest.mark.parametrize("command", ["sidecar", "run"])
def test_an_uploader_refuses_a_lease_longer_than_its_sweeps_grace(tmp_path: Path, command: str) -> None:
    """The uploader's housekeeping sweeps chunks with a grace of an hour: a lease of two hours
    is refused at start, naming the variable, with nothing run."""
    marker = tmp_path / "trainer-ran"
    if command == "sidecar":
        args = ["sidecar", "--storage", (tmp_path / "store").as_uri(), "--checkpoint-dir", str(tmp_path / "ck")]
    else:
        args = ["run", "--workdir", str(tmp_path / "w"), "--", "touch", str(marker)]
    proc = subprocess.run(
        spotguard_argv(*args),
        env=base_env({"SPOTGUARD_GC_LEASE_SECONDS": "7200"}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "ERROR" in ln or ln.startswith("spotguard: error")]
    assert len(errors) == 1 and "SPOTGUARD_GC_LEASE_SECONDS=7200" in errors[0], proc.stderr
    assert "at most 3600" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and not marker.exists()
