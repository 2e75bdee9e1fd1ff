"""Writes or uploads checkpoints in a loop until it is killed (crash-safety trials).

Modes:
- ``write DIR START``: a Checkpointer saving step_tensors(step) every step
  (background writes, every third one synchronous), pruning to 3 locally;
- ``upload URI DIR START``: commit locally, upload, and every other step
  apply retention (keep-last 3) in storage.

Prints one line per event (``ready``, ``begin N``, ``committed N``,
``uploaded N``, ``gc``) so the test can tell where it was killed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckpt_helpers import commit_local, step_tensors  # noqa: E402

NUMEL = 200_000


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def write_loop(directory: Path, start: int) -> None:
    from spotguard.trainer import Checkpointer

    ck = Checkpointer(directory, keep_local=3)
    say("ready")
    step = start
    while True:
        say(f"begin {step}")
        path = ck.save(step, step_tensors(step, NUMEL), metrics={"loss": 1.0 / (step + 1)}, blocking=step % 3 == 0)
        if path is not None:
            say(f"committed {step}")
        step += 1


def upload_loop(uri: str, directory: Path, start: int) -> None:
    from spotguard.checkpoint import RetentionPolicy, apply_retention, prune_local, upload_checkpoint
    from spotguard.storage import open_storage

    storage = open_storage(uri)
    policy = RetentionPolicy(keep_last=3)
    say("ready")
    step = start
    while True:
        say(f"begin {step}")
        path = commit_local(directory, step, NUMEL)
        say(f"committed {step}")
        upload_checkpoint(path, storage)
        say(f"uploaded {step}")
        if step % 2 == 0:
            apply_retention(storage, policy)
            say("gc")
        prune_local(directory, 1)
        step += 1


def main() -> int:
    mode = sys.argv[1]
    if mode == "write":
        write_loop(Path(sys.argv[2]), int(sys.argv[3]))
    elif mode == "upload":
        upload_loop(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
