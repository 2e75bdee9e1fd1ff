"""``python -m bench.gpu_check``: the GPU check script, run on CPU (``--allow-cpu --quick``).

The script's checks run real torchrun groups (gloo here, nccl on GPUs) and
``spotguard run`` with ``file://`` storage; this test only proves the script
itself works end to end where there is no GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testenv.require import require_module, require_tool

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ("env", "ddp", "fsdp-stall", "fsdp-exact", "pinned", "arena", "finetune")

# Torchrun groups keep both cores busy.
pytestmark = pytest.mark.integration


def gpu_check(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(600)
def test_gpu_check_passes_on_cpu_and_prints_every_check() -> None:
    require_module("torch")
    require_tool("torchrun", path=Path(sys.executable).with_name("torchrun"))
    proc = gpu_check("--allow-cpu", "--quick", timeout=540)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    lines = out.splitlines()
    for name in CHECKS:
        assert any(ln.startswith(f"PASS {name} ") for ln in lines), (name, out[-4000:])
    for figure in (
        "ddp: final digest equals the uninterrupted run's: yes",
        "ddp: supervisor exit status after SIGTERM: 143",
        "SIGTERM -> verified line",
        "fsdp-stall: spotguard / dcp.async_save",
        "fsdp-exact: parameters and optimizer moments bitwise equal after restore: yes",
        "pinned: host copy of",
        "arena made and complete: yes",
        "preemption's save (median of",
        "finetune: preempted after step",
        "finetune: new node: fetched",
        "adapter and optimizer equal the preempted: yes; every base tensor equals the seed's: yes",
        "finetune: after 3 more steps",
    ):
        assert figure in out, (figure, out[-4000:])
    summary = json.loads(lines[-1])
    assert summary["ok"] is True and summary["failed"] == []
    assert sorted(summary["checks"]) == sorted(CHECKS)
    assert all(c["ok"] for c in summary["checks"].values())
    assert summary["checks"]["ddp"]["bit_exact"] is True
    finetune = summary["checks"]["finetune"]
    assert finetune["bit_exact"] is True
    # The emergency checkpoint sent what changed (the adapter), not the frozen base.
    assert 0 < finetune["emergency_uploaded_bytes"] < summary["frozen_bytes"] / 4


def test_gpu_check_without_cuda_or_with_bad_options_exits_2() -> None:
    torch = require_module("torch")
    bad = gpu_check("--allow-cpu", "--only", "nosuch", timeout=120)
    assert bad.returncode == 2 and "unknown check" in bad.stderr, bad.stderr
    if torch.cuda.is_available():
        return
    proc = gpu_check(timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "CUDA is not available" in proc.stderr and "--allow-cpu" in proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["ok"] is False
