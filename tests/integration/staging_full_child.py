"""Saves on a full checkpoint volume, in a mount namespace of its own (run by test_staging_full.py).

Mounts a 1 MiB tmpfs at ``argv[1]`` (seen by this process alone; it goes with
the namespace when the process ends), saves a checkpoint that fits, one that
does not, and one that fits again, and prints what it found as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from spotguard.contract.control import STAGING_FULL_FILE, read_staging_full
from spotguard.trainer import Checkpointer
from spotguard.trainer.persist import StagingFullError


def main(mount: Path) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "spotguard-staging-test", str(mount)], check=True)
    directory = mount / "checkpoints"
    control = directory / ".control"
    ck = Checkpointer(directory, control_dir=control, async_save=False, keep_local=5)
    out: dict[str, object] = {}
    small = {"model": {"w": np.zeros(16 * 1024, dtype=np.float32)}}  # 64 KiB
    big = {"model": {"w": np.ones(512 * 1024, dtype=np.float32)}}  # 2 MiB: more than the volume
    out["first"] = str(ck.save(1, small, blocking=True))
    out["full"] = str(ck.save(2, big, blocking=True))
    error = ck.last_error
    out["error_type"] = type(error).__name__
    out["is_staging_full"] = isinstance(error, StagingFullError)
    out["error"] = str(error)
    out["entries_after_full"] = sorted(os.listdir(directory))
    full = read_staging_full(control)
    out["report"] = full.to_json() if full is not None else None  # its wire form in the report
    out["async"] = str(ck.save(3, big, blocking=False))
    out["async_waited"] = ck.wait(30)
    out["async_error_type"] = type(ck.last_error).__name__
    out["again"] = str(ck.save(4, small, blocking=True))
    out["entries_at_end"] = sorted(os.listdir(directory))
    out["report_at_end"] = (control / STAGING_FULL_FILE).exists()
    ck.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
