"""Which pid is the trainer: ``sidecar.trainerproc.is_trainer_process`` against real processes and threads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from spotguard.sidecar.trainerproc import is_trainer_process


def _initial_path() -> str:
    """PATH as /proc/self/environ holds it (the environment this process started with)."""
    for item in Path("/proc/self/environ").read_bytes().split(b"\0"):
        if item.startswith(b"PATH="):
            return item.split(b"=", 1)[1].decode()
    raise AssertionError("no PATH in this process's environment")


def test_a_thread_of_this_process_is_never_the_trainer() -> None:
    """In a pod without a shared process namespace, trainer.pid's number can be one of the
    sidecar's own thread ids; /proc answers for it with the sidecar's environment, which
    carries the same markers. Taken for the trainer, that thread's end would end the sidecar."""
    markers = {"PATH": _initial_path()}
    ready, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def work() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        done.wait(10)

    thread = threading.Thread(target=work)
    thread.start()
    try:
        assert ready.wait(10)
        assert tid[0] != os.getpid() and Path(f"/proc/{tid[0]}/environ").exists()
        assert not is_trainer_process(tid[0], markers)
        assert not is_trainer_process(os.getpid(), markers)
        # Another process with the same environment is one (what the markers are for).
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"], stdout=subprocess.PIPE
        )
        try:
            # Once it runs: until the kernel has set up the new program's memory, which it does after
            # the point where Popen returns, /proc/<pid>/environ reads empty.
            assert child.stdout is not None and child.stdout.readline() == b"up\n"
            assert is_trainer_process(child.pid, markers)
            assert not is_trainer_process(child.pid, {"PATH": "/elsewhere"})
        finally:
            child.kill()
            child.wait()
            if child.stdout is not None:
                child.stdout.close()
    finally:
        done.set()
        thread.join()
