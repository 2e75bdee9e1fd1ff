"""The process group spotguard initializes for the frameworks is destroyed at a
clean exit, while the interpreter is whole: a gloo group left to the
interpreter's teardown can abort a finished run ("terminate called without an
active exception", SIGABRT), which then looks failed to torchrun and to
``spotguard run``.

Run as a script under torchrun, this file is the worker.
"""

from __future__ import annotations

import atexit
import subprocess
import sys
from pathlib import Path

import pytest
from sidecar_helpers import free_port, worker_env

from testenv.require import require_tool

pytestmark = pytest.mark.integration
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _worker(how: str) -> int:
    import torch
    import torch.distributed as dist

    def report() -> None:  # registered first, so it runs last: after spotguard's own exit handler
        print(f"group initialized at exit: {dist.is_initialized()}", flush=True)

    atexit.register(report)
    from spotguard.integrations import _core

    assert _core.ensure_process_group()  # from torchrun's environment, as a resume helper does
    ones = torch.ones(1)
    dist.all_reduce(ones)  # the group's gloo threads have worked
    assert ones.item() == dist.get_world_size()
    if how == "raise":
        raise RuntimeError("the training failed")
    return 0


def _run(how: str) -> subprocess.CompletedProcess[str]:
    require_tool("torchrun", path=TORCHRUN)
    cmd = [
        str(TORCHRUN),
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        __file__,
        how,
    ]
    return subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=120, check=False)


def test_the_group_spotguard_initialized_is_destroyed_at_a_clean_exit() -> None:
    done = _run("clean")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert out.count("group initialized at exit: False") == 2, out[-6000:]
    assert "terminate called" not in out, out[-6000:]


def test_after_an_uncaught_exception_the_group_is_left_alone() -> None:
    """The other ranks may still be in a collective with a rank that failed: it does not wait for them."""
    done = _run("raise")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-6000:]
    assert "the training failed" in out, out[-6000:]
    assert "group initialized at exit: True" in out, out[-6000:]


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
