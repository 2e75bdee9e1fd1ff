"""``spotguard.deterministic()``: torch's deterministic mode, without importing the compiler.

Run in a fresh interpreter: whether ``torch._inductor`` was imported is the point.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testenv.require import require_module

PROBE = """
import json, os, sys
import torch, spotguard
spotguard.deterministic()
before = "torch._inductor.config" in sys.modules
import torch._inductor.config as inductor
print(json.dumps({"enabled": torch.are_deterministic_algorithms_enabled(),
                  "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
                  "inductor_imported": before, "inductor": inductor.deterministic,
                  "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}))
"""


@pytest.mark.integration
def test_deterministic_sets_torch_and_the_compiler_without_importing_it() -> None:
    require_module("torch")
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # The same end state as torch.use_deterministic_algorithms(True), which would have imported the compiler.
    assert got == {
        "enabled": True,
        "warn_only": False,
        "inductor_imported": False,
        "inductor": True,
        "cublas": ":4096:8",
    }, got
