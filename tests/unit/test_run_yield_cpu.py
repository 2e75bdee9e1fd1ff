"""``spotguard run`` lowers the priority of every thread of its command once a preemption's checkpoint
is committed (spotguard.run.supervisor.lower_priority): real processes, their threads read from /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotguard.run.supervisor import lower_priority

# A process with a second thread, and a child of its own in a session of its own (as torchrun starts
# its workers), each printing its pid once its threads are up.
_TREE = """
import os, subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
if sys.argv[1] == "parent":
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "child", ""], start_new_session=True,
                             stdout=subprocess.PIPE, text=True)
    print(child.stdout.readline().strip(), flush=True)
print(os.getpid(), flush=True)
time.sleep(60)
"""


def _nice(pid: int) -> list[int]:
    """The nice value of every thread of ``pid`` (field 19 of its tasks' stat)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        out.append(int(stat.rsplit(")", 1)[1].split()[16]))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads' priorities as Linux keeps them")
def test_every_thread_of_the_processes_named_runs_at_the_given_nice_value() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _TREE, "parent", _TREE], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        parent = int(proc.stdout.readline())
        assert os.getsid(child) != os.getsid(parent)  # out of the parent's group: a group's priority misses it
        deadline = time.monotonic() + 10
        while min(len(_nice(parent)), len(_nice(child))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        before = _nice(parent) + _nice(child)
        assert len(before) >= 4 and max(before) < 19, before
        gone = 2**22 + 1  # no such pid: passed over
        assert lower_priority([parent, child, gone], 19) == len(before)
        assert _nice(parent) + _nice(child) == [19] * len(before)
    finally:
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.wait()
