"""A preemption's save whose memory staging is full, in a mount namespace of its own
(run by test_emergency_staging.py).

Mounts a 1 MiB tmpfs at ``argv[1]`` (seen by this process alone; it goes
with the namespace), writes checkpoints into ``argv[2]`` with it as their
staging, and prints what it found as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np

from spotguard.checkpoint import snapshot_state, verify_local_checkpoint, write_checkpoint
from spotguard.checkpoint.local.staged import choose_staging
from spotguard.trainer.persist import write_in_staging


def main(mount: Path, ckdir: Path) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "spotguard-staging-test", str(mount)], check=True)
    out: dict[str, object] = {}
    big = snapshot_state({"model": {"w": np.ones(512 * 1024, dtype=np.float32)}})  # 2 MiB
    chosen = choose_staging(mount, big)
    out["chosen"] = None if chosen is None else str(chosen)
    path = write_in_staging(partial(write_checkpoint, ckdir, 2, big, durable=False), mount)
    out["written"] = str(path)
    out["is_link"] = path.is_symlink()
    out["verifies"] = verify_local_checkpoint(path).ok
    out["memory_after"] = sorted(os.listdir(mount))
    small = snapshot_state({"model": {"w": np.ones(1024, dtype=np.float32)}})
    staged = write_in_staging(partial(write_checkpoint, ckdir, 3, small, durable=False), mount)
    out["small_is_link"] = staged.is_symlink()
    print(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
