"""SIGTERM during a routine upload: does the emergency checkpoint wait for it?

The sidecar's shipper (its own code, against a SeaweedFS store of this
benchmark's own) in two situations, side by side in each round:

- idle: SIGTERM comes while nothing is being uploaded; the emergency
  checkpoint is uploaded, verified and pointed to at once;
- busy: SIGTERM comes a quarter into the routine upload of a checkpoint of
  the same size (BENCH_PREEMPT_UPLOAD_MB, default 1024); the routine round
  is stopped (the shipper's ``should_stop``, the sidecar's signal latch)
  and the emergency checkpoint goes out.

Measured: SIGTERM -> the emergency checkpoint verified (the emergency
checkpoint is committed before the signal in both situations: the save is
not what is compared). Goal: busy / idle <= 1.25x at the worse
quartile. The stopped upload starts no new part, and the parts it had on
the wire end within a MiB (each part's body asks whether to stop as it is
sent).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import MiB, Section, fmt, goal, interleaved, median, per_round, seaweedfs_store

if TYPE_CHECKING:
    from bench.common import Ctx
    from testenv.cluster import S3Store


def _commit(directory: Path, step: int, state: dict[str, Any]) -> Path:
    from spotguard.checkpoint.local.codec import snapshot_state
    from spotguard.checkpoint.local.commit import write_checkpoint

    return write_checkpoint(directory, step, snapshot_state({**state, "step": step}), durable=False)


def _shipper(s3: S3Store, work: Path) -> Any:
    from spotguard.sidecar.deadline import ThroughputTracker
    from spotguard.sidecar.metrics import SidecarMetrics
    from spotguard.sidecar.shipper import CheckpointShipper
    from spotguard.storage import open_storage

    storage = open_storage(
        f"s3://{s3.bucket}/{uuid.uuid4().hex[:10]}",
        endpoint_url=s3.endpoint_url,
        access_key=s3.access_key,
        secret_key=s3.secret_key,
        region=s3.region,
    )
    return CheckpointShipper(work, storage, SidecarMetrics(), ThroughputTracker(30.0, 5.0), keep_local=10)


def _emergency(shipper: Any, step: int) -> float:
    """SIGTERM -> verified of the checkpoint at ``step`` (committed already)."""
    t0 = time.monotonic()
    shipped = shipper.ship(newest_only=True, housekeeping=False)
    elapsed = time.monotonic() - t0
    assert [s.step for s in shipped] == [step], (shipped, shipper.failed)
    return elapsed


def bench_preempt_upload(ctx: Ctx) -> Section:
    import torch

    size_mb = int(os.environ.get("BENCH_PREEMPT_UPLOAD_MB", "1024"))
    reps = ctx.rounds_for(5)
    gen = torch.Generator().manual_seed(0)
    state = {
        "model": {
            f"w{i}": torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8, generator=gen)
            for i in range(max(1, size_mb // 64))
        }
    }
    routine_seconds: list[float] = []
    stopped_after: list[float] = []

    with seaweedfs_store(ctx.work, "preempt-upload-bench") as s3:

        def situation(busy: bool) -> Callable[[], float]:
            def run() -> float:
                work = ctx.work / f"preempt-{uuid.uuid4().hex[:8]}"
                shipper = _shipper(s3, work)
                try:
                    if not busy:
                        _commit(work, 20, state)
                        return _emergency(shipper, 20)
                    # The routine upload's own duration on this store now (a checkpoint of the same size).
                    _commit(work, 5, state)
                    t0 = time.monotonic()
                    shipper.ship(housekeeping=False)
                    routine_seconds.append(time.monotonic() - t0)
                    _commit(work, 10, state)
                    # The trainer's emergency checkpoint, committed before the signal (writing it takes
                    # longer than a quarter of the routine upload here); the routine round takes 10 first.
                    _commit(work, 20, state)
                    sigterm = threading.Event()
                    returned: list[float] = []

                    def routine_round() -> None:
                        shipper.ship(housekeeping=False, should_stop=sigterm.is_set)
                        returned.append(time.monotonic())

                    thread = threading.Thread(target=routine_round)
                    thread.start()
                    time.sleep(routine_seconds[-1] / 4)
                    t_signal = time.monotonic()
                    sigterm.set()
                    elapsed = _emergency(shipper, 20)
                    thread.join()
                    stopped_after.append(returned[0] - t_signal)
                    assert "ckpt-000000000010" not in shipper.shipped, "the routine upload was not stopped"
                    return elapsed
                finally:
                    shutil.rmtree(work, ignore_errors=True)

            return run

        res = interleaved(reps, {"idle": situation(False), "busy": situation(True)})
    idle, busy = res["idle"], res["busy"]
    ratio = per_round(busy, idle, higher_is_better=False)
    s = Section(
        "SIGTERM during a routine upload",
        "preempt-upload",
        ["measure", "idle (s, median)", "busy (s, median)", "busy / idle, per round [IQR]"],
    )
    s.rows.append(["SIGTERM -> verified", fmt(median(idle)), fmt(median(busy)), ratio.cell()])
    goal(s, f"SIGTERM during a {size_mb} MiB routine upload -> verified <= 1.25x SIGTERM when idle", ratio, 1.25)
    s.notes.append(
        f"Checkpoints of {size_mb} MiB (random bytes, one safetensors file, plain format) shipped by the sidecar's "
        f"shipper to a SeaweedFS store on this machine; {reps} interleaved rounds. The routine upload of the same "
        f"size took {fmt(median(routine_seconds))} s (median); SIGTERM came a quarter into it, and the routine "
        f"round returned {fmt(median(stopped_after) * 1000, 0)} ms after SIGTERM (median; worst "
        f"{fmt(max(stopped_after) * 1000, 0)} ms), with no manifest written for the stopped checkpoint. "
        "Waiting for the routine upload instead would add three quarters of its duration."
    )
    return s
