"""``spotguard run``: the uploader's heartbeat says the preemption before the command hears of it.

The supervisor forwards SIGTERM to the command from its signal handler, while its own loop may still be
inside a routine upload. A trainer that saves at once and then asks the heartbeat whether the uploader is
on its preemption's path must be told yes, else it leaves before its checkpoint is verified
(:mod:`spotguard.contract.final`). The command here reads the heartbeat from its own SIGTERM handler."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sidecar_helpers import base_env, spotguard_argv

_COMMAND = r"""
import json, os, signal, sys, time
from pathlib import Path
control, out = Path(os.environ["SPOTGUARD_CONTROL_DIR"]), Path(sys.argv[1])

def on_term(*_):
    out.write_text((control / "uploader-heartbeat.json").read_text())
    sys.exit(0)

signal.signal(signal.SIGTERM, on_term)
out.with_suffix(".ready").write_text("1")
while True:
    time.sleep(0.05)
"""


@pytest.mark.integration
def test_the_heartbeat_says_the_preemption_before_the_command_hears_it(tmp_path: Path) -> None:
    out = tmp_path / "beat.json"
    argv = spotguard_argv(
        "run", "--workdir", str(tmp_path / "work"), "--storage", f"file://{tmp_path / 'store'}", "--grace-seconds",
        "20", "--", sys.executable, "-c", _COMMAND, str(out),
    )  # fmt: skip
    proc = subprocess.Popen(argv, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        ready, heartbeat = out.with_suffix(".ready"), tmp_path / "work"
        deadline = time.time() + 60
        while time.time() < deadline and not (ready.exists() and list(heartbeat.rglob("uploader-heartbeat.json"))):
            time.sleep(0.05)
        assert ready.exists(), "the command never started"
        routine = json.loads(next(heartbeat.rglob("uploader-heartbeat.json")).read_text())
        assert routine["emergency"] is False  # the routine loop beats first
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    logs = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    beat = json.loads(out.read_text())
    assert beat["emergency"] is True and beat["shipping"] is True, (beat, logs[-3000:])
