"""Classic and native sidecar when the trainer simply finishes (file:// storage)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from sidecar_helpers import Proc, base_env, reaping, spotguard_argv, train_argv, wait_until

from spotguard.checkpoint import latest_verified
from spotguard.storage import open_storage

STEPS = 30


def _pair(tmp_path: Path, mode: str) -> tuple[Proc, Proc, str]:
    uri = (tmp_path / "store").as_uri()
    env = base_env({"SPOTGUARD_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "SPOTGUARD_STORAGE_URI": uri})
    sidecar = Proc(
        spotguard_argv(
            "sidecar", "--mode", mode, "--metrics-port", "0", "--termination-log", str(tmp_path / "termination-log")
        ),
        env,
        tmp_path / "sidecar.log",
    )
    trainer = Proc(train_argv(STEPS, None, 0.0, save_every=10), env, tmp_path / "trainer.log")
    return trainer, sidecar, uri


def test_classic_sidecar_exits_after_the_trainer_with_everything_verified(tmp_path: Path) -> None:
    with reaping() as procs:
        trainer, sidecar, uri = _pair(tmp_path, "classic")
        procs += [trainer, sidecar]
        assert trainer.wait() == 0, trainer.tail()
        # No signal: it leaves on its own, so a pod with a classic sidecar completes.
        assert sidecar.wait() == 0, sidecar.tail()
    info, _ = latest_verified(open_storage(uri))
    assert info is not None and info.step == STEPS - 1
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report["preempted"] is False and report["reason"] == "finished" and report["step"] == STEPS - 1


def test_native_sidecar_runs_until_stopped_and_reports_a_finished_trainer(tmp_path: Path) -> None:
    with reaping() as procs:
        trainer, sidecar, uri = _pair(tmp_path, "native")
        procs += [trainer, sidecar]
        assert trainer.wait() == 0, trainer.tail()
        storage = open_storage(uri)
        wait_until(
            lambda: (latest_verified(storage)[0] or None) and latest_verified(storage)[0].step == STEPS - 1,
            60,
            "the final checkpoint verified",
        )
        time.sleep(1.0)  # give a wrongly self-exiting sidecar the chance to show it
        assert sidecar.popen.poll() is None, "a native sidecar waits for kubelet to stop it"
        sidecar.signal(signal.SIGTERM)  # what kubelet does once the trainer has exited
        assert sidecar.wait() == 0, sidecar.tail()
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report["preempted"] is False and report["reason"] == "finished" and report["step"] == STEPS - 1
