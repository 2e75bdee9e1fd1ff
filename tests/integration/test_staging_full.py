"""A save on a full checkpoint volume: the partial checkpoint goes, the older one stays, the failure is named.

The volume is a real 1 MiB tmpfs, mounted in a mount namespace of the child
process alone (``unshare -m``): nothing outside sees it, and it goes when
the child ends.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from testenv.require import require_module, require_root, require_tool

CHILD = Path(__file__).with_name("staging_full_child.py")
ROOT = Path(__file__).resolve().parents[2]


def test_a_save_on_a_full_volume_keeps_the_older_checkpoint(tmp_path: Path) -> None:
    unshare = require_tool("unshare", "install util-linux (unshare makes the test's private mount namespace)")
    require_root("mounting a tmpfs")
    require_module("numpy")  # the child's tensors (the [torch] extra)
    mount = tmp_path / "staging"
    mount.mkdir()
    done = subprocess.run(
        [unshare, "-m", "--propagation", "private", sys.executable, str(CHILD), str(mount)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["first"].endswith("ckpt-000000000001")
    # The checkpoint that did not fit: not written, named, and the partial one removed.
    assert out["full"] == "None"
    assert out["is_staging_full"] is True, out["error_type"]
    assert "step 2" in out["error"] and "spec.checkpoint.staging" in out["error"]
    assert out["entries_after_full"] == [".control", "ckpt-000000000001"]
    # What the sidecar passes on in its report.
    assert out["report"]["step"] == 2 and "is full" in out["report"]["error"]
    assert "No space left" in done.stderr or "is full" in done.stderr
    # In the background too.
    assert out["async_waited"] is True and out["async_error_type"] == "StagingFullError"
    # The next checkpoint that fits is written, and the report is withdrawn.
    assert out["again"].endswith("ckpt-000000000004")
    assert out["entries_at_end"] == [".control", "ckpt-000000000001", "ckpt-000000000004"]
    assert out["report_at_end"] is False
    # Nothing of the mount is left outside the child's namespace.
    assert os.listdir(mount) == []
    assert not any(" spotguard-staging-test " in f" {line} " for line in Path("/proc/mounts").read_text().splitlines())
    shutil.rmtree(mount)
