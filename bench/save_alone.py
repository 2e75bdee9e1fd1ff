"""The trainer's save of a fine-tune-shaped state alone, by frozen size: does it grow with the frozen base?

    .venv/bin/python -m bench.save_alone                     # 0.25 and 4 GiB frozen, 5 saves each
    .venv/bin/python -m bench.save_alone --frozen-gb 0.25,8 --saves 9

The state of the incremental benchmark (bench/incremental_worker.py: a frozen
base of 64 MiB float32 tensors and a 2 MiB adapter trained with AdamW), saved
by a Checkpointer into a local directory after two routine saves, one
training step before each save, as the preemption's save is taken in that
benchmark; nothing uploaded, nothing pruned. Prints the median, minimum and
maximum of the timed saves per size, and the ratio of the medians. No store:
what it isolates is the trainer's part of SIGTERM -> verified.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

GiB = 1 << 30
ROUTINE = 2


def saves_of(frozen_gb: float, saves: int) -> list[float]:
    """Seconds of each save after the routine ones, for a base of ``frozen_gb``."""
    from bench.incremental_worker import finetune_model
    from spotguard.trainer import Checkpointer

    model, opt, step = finetune_model(int(frozen_gb * GiB), 6 << 20)
    work = Path(tempfile.mkdtemp(prefix="save-alone-"))
    try:
        ck = Checkpointer(work, async_save=False, keep_local=ROUTINE + saves + 1)
        timed = []
        for n in range(1, ROUTINE + saves + 1):
            step()
            t0 = time.perf_counter()
            ck.save(n, {"model": model.state_dict(), "optim": opt.state_dict()}, blocking=True)
            if n > ROUTINE:
                timed.append(time.perf_counter() - t0)
        ck.close()
        return timed
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frozen-gb", default="0.25,4", help="comma-separated frozen base sizes (GiB)")
    p.add_argument("--saves", type=int, default=5, help="timed saves per size")
    args = p.parse_args()
    sizes = [float(x) for x in args.frozen_gb.split(",")]
    medians = []
    for gb in sizes:
        timed = saves_of(gb, args.saves)
        medians.append(statistics.median(timed))
        print(f"{gb:g} GiB frozen: save {medians[-1]:.3f} s (min {min(timed):.3f}, max {max(timed):.3f})", flush=True)
    print(f"largest / smallest, medians: {medians[-1] / medians[0]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
