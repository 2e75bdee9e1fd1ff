"""A sharded save's steps on the trainer's side alone, this code against another, by the number of frozen items.

    .venv/bin/python -m bench.dist_steps                         # 5 rounds, 64 and 512 frozen layers
    BENCH_DIST_STEPS_BEFORE=DIR .venv/bin/python -m bench.dist_steps 5   # and the code in DIR, same rounds

What ``bench.dist_frozen`` cannot resolve on a busy machine (two ranks and the
supervisor share its cores), measured in one process of its own: an FSDP2
model of N frozen ``Linear(512, 512)`` layers and a trained head, on one gloo
rank, AdamW after one step. Each save takes the steps a sharded save takes
before its writer thread: ``torch_state`` (torch's ``get_state_dict``), the
split of tensors from the rest, the stage of DCP's tensors (the unchanged
ones told by write tracking, the rest copied by torch's stager), and the
snapshot of the rest. Nothing changes between saves but the head's bytes;
after 3 saves, the median of 12. Codes run alternately, each in a fresh
process; printed: per code and size, the median of each step and their sum,
and the sum's ratio to the first code's in the same round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.dist import _free_port

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("torch_state", "split", "stage", "snapshot")

_WORKER = r"""
import json, os, sys, time, statistics
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
import spotguard
from spotguard.trainer import distributed as D
from spotguard.trainer.dcpwriter import DcpSaves
from spotguard.checkpoint.local.codec import snapshot_state
from spotguard.trainer import statedicts

statedicts.enter()  # as a distributed Checkpointer does: torch_state takes torch's get_state_dict

n, width = int(sys.argv[1]), 512
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(n)], torch.nn.Linear(width, 8))
for p in model[:-1].parameters():
    p.requires_grad_(False)
for layer in model:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
x = torch.randn(2, width)
options = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                         use_non_blocking_copy=False)
stager = DefaultStager(options)._state_dict_stager
saves, pool = DcpSaves(), {}
times = []
for i in range(15):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    state = spotguard.torch_state(model, opt)
    t1 = time.perf_counter()
    tensors, skeleton = D.split_tensors({k: state[k] for k in D.DCP_KEYS if k in state})
    rest = {k: (skeleton[k] if k in D.DCP_KEYS else v) for k, v in state.items()}
    t2 = time.perf_counter()
    saves.stage(tensors, lambda t: stager.stage(t, non_blocking=False), keep=True)
    t3 = time.perf_counter()
    snapshot_state(rest, pinned=pool)
    t4 = time.perf_counter()
    if i >= 3:
        times.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
assert len(saves.unchanged) >= n, len(saves.unchanged)  # the frozen base told unchanged at every save
print(json.dumps([statistics.median(t[k] for t in times) for k in range(4)]))
dist.destroy_process_group()
"""


def run_once(code: Path, layers: int) -> list[float]:
    """The medians of each step (seconds) for ``layers`` frozen layers, spotguard imported from ``code``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env.update(PYTHONPATH=str(code), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", _WORKER, str(layers), str(_free_port())],
        cwd=code,  # ``-c`` puts the working directory first on the path
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return [float(v) for v in json.loads(out.stdout.strip().splitlines()[-1])]


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    sizes = [int(s) for s in os.environ.get("BENCH_DIST_STEPS_LAYERS", "64,512").split(",")]
    before = os.environ.get("BENCH_DIST_STEPS_BEFORE")
    codes = {"before": Path(before).resolve(), "this code": ROOT} if before else {"this code": ROOT}
    runs: dict[tuple[str, int], list[list[float]]] = {(c, n): [] for c in codes for n in sizes}
    for r in range(rounds):
        for code in codes if r % 2 == 0 else list(reversed(codes)):
            for n in sizes:
                runs[(code, n)].append(run_once(codes[code], n))
    first = next(iter(codes))
    print(f"| code | frozen layers | {' / '.join(STEPS)} (ms, medians) | sum (ms) | vs {first}, per round [IQR] |")
    print("|---|---|---|---|---|")
    for n in sizes:
        for code in codes:
            rows = runs[(code, n)]
            steps = " / ".join(f"{1000 * statistics.median(r[k] for r in rows):.1f}" for k in range(len(STEPS)))
            sums = [sum(r) for r in rows]
            ratios = sorted(s / sum(b) for s, b in zip(sums, runs[(first, n)], strict=True))
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            print(
                f"| {code} | {n} | {steps} | {1000 * statistics.median(sums):.1f} | "
                f"{statistics.median(ratios):.2f}x [{q[0]:.2f}-{q[2]:.2f}] |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
