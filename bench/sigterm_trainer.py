"""A trainer with a state of a chosen size, for the SIGTERM -> verified benchmark.

Runs under ``spotguard run``: steps forever (a cheap in-place update and a short
sleep), checkpoints only when asked (a preemption), prints ``ready`` once its
state is allocated and it is stepping.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--routine", action="store_true", help="a routine checkpoint at step 1, before ready")
    args = p.parse_args()
    # The preemption's save says when it links its file from the host buffers (the benchmark counts it).
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("spotguard.checkpoint.local.commit").setLevel(logging.INFO)

    import torch

    import spotguard

    chunk = 64 * 1024 * 1024 // 4
    n = max(1, args.bytes // 4)
    params = {f"p{i}": torch.full((min(chunk, n - i * chunk),), float(i)) for i in range((n + chunk - 1) // chunk)}
    ckpt = spotguard.Checkpointer.from_env()
    step = 0
    if args.routine:
        step = 1
        ckpt.save(step, {"model": params})
        ckpt.wait()
    print("ready", flush=True)
    while True:
        step += 1
        for t in params.values():
            t[:1024].add_(1.0)
        if ckpt.should_save(step):
            ckpt.save(step, {"model": params})
        if ckpt.preempted:
            print(f"preempted after step {step}", flush=True)
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
