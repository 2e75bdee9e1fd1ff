"""``spotguard run`` during a storage outage: nothing committed is lost.

The store (real SeaweedFS) sits behind a proxy the test can switch off. A
run commits checkpoints while storage is unreachable and is preempted;
the next start resumes from its newest local checkpoint (storage only
knows an older one) and ships it once storage answers again.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from reference_runs import ReferenceRuns
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

from spotguard.checkpoint import latest_verified, list_local_committed

STEPS = 160
SAVE_EVERY = 10


@pytest.fixture(scope="module")
def reference(reference_runs: ReferenceRuns) -> bytes:
    """Final state of an uninterrupted run."""
    return reference_runs.demo_final(STEPS, SAVE_EVERY)


def local_steps(ckdir: Path) -> list[int]:
    return [int(p.name.rsplit("-", 1)[1]) for p in list_local_committed(ckdir)]


@pytest.mark.integration
def test_storage_outage_keeps_and_resumes_the_newest_local_checkpoint(
    s3_store: Any, s3_uri: str, tmp_path: Path, reference: bytes
) -> None:
    out = tmp_path / "final.safetensors"
    workdir = tmp_path / "work"
    ckdir = workdir / "checkpoints"
    storage = s3_storage(s3_store, s3_uri)  # the test's own view, not through the proxy
    with store_proxy(s3_store) as proxy, reaping() as procs:
        env = base_env(proxy.env(s3_store.env()))
        argv = spotguard_argv(
            "run",
            "--workdir",
            str(workdir),
            "--storage",
            s3_uri,
            "--grace-seconds",
            "10",
            "--backoff",
            "0.1",
            "--",
            *train_argv(STEPS, out, 0.05, SAVE_EVERY),
        )
        first = Proc(argv, env, tmp_path / "run1.log")
        procs.append(first)
        # The run itself has verified a checkpoint (and moved the pointer).
        first.wait_for_line(lambda ln: "stage=pointer" in ln)
        verified = latest_verified(storage)[0]
        assert verified is not None

        # Storage goes away; training goes on and commits locally.
        proxy.down()
        wait_until(
            lambda: local_steps(ckdir) and local_steps(ckdir)[-1] >= verified.step + 2 * SAVE_EVERY,
            120,
            "two checkpoints committed during the outage",
        )
        first.signal(signal.SIGTERM)
        # The emergency checkpoint cannot be verified: that is what the status says.
        assert first.wait() == 3, first.tail()
        stopped = first.wait_for_stopped_step()
        newest_local = local_steps(ckdir)[-1]
        assert newest_local >= verified.step + 2 * SAVE_EVERY and newest_local <= stopped
        in_storage, _ = latest_verified(storage)
        assert in_storage is not None and in_storage.step < newest_local

        # Restart while storage is still down: resume from the newest local checkpoint.
        second = Proc(argv, env, tmp_path / "run2.log")
        procs.append(second)
        second.wait_for_line(lambda ln: ln == f"resumed from step {newest_local}")
        assert f"resuming from local ckpt-{newest_local:012d}" in second.text()

        # Storage is back: the checkpoint is shipped, training finishes.
        proxy.up()
        wait_until(
            lambda: (latest_verified(storage)[0] or verified).step >= newest_local,
            120,
            f"ckpt {newest_local} verified in storage",
        )
        assert second.wait(300) == 0, second.tail()
    assert out.read_bytes() == reference
