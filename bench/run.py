"""spotguard's side-by-side benchmarks: every figure is a ratio against a named
baseline measured in the same run on the same machine.

    make bench                      # everything, writes docs/benchmarks.md + docs/bench/*.png
    .venv/bin/python -m bench.run --only checksum,stall

Environment: BENCH_STATE_MB (default 512) sizes the training state of the
stall/persist/upload/resume benchmarks; BENCH_SIGTERM_GB (default 0.25,1,4)
the SIGTERM -> verified sizes; BENCH_OPERATOR_JOBS (default 200).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import goodput  # noqa: E402
from bench.common import (  # noqa: E402
    DOCS,
    PLOTS,
    GiB,
    MiB,
    Section,
    dir_bytes,
    fmt,
    make_training_state,
    measure,
    median,
    state_nbytes,
)
from testenv import cluster  # noqa: E402


class Ctx:
    """What the benchmarks share: scratch space, the S3 store, measured costs."""

    def __init__(self, work: Path, s3: cluster.S3Store | None, state_mb: int) -> None:
        self.work = work
        self.s3 = s3
        self.state_bytes = state_mb * MiB
        self.costs: dict[str, float] = {}
        self._model: Any = None
        self.ckpt_dir: Path | None = None
        if s3 is not None:  # spotguard reads the standard AWS environment
            os.environ.update(s3.env())

    def training_state(self) -> tuple[Any, Any]:
        if self._model is None:
            self._model = make_training_state(self.state_bytes)
        return self._model

    def storage(self, prefix: str) -> Any:
        from spotguard.storage import open_storage

        assert self.s3 is not None
        return open_storage(f"s3://{self.s3.bucket}/{prefix}")


def _plot_bars(path: Path, title: str, labels: list[str], values: list[float], ylabel: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    bars = ax.bar(labels, values, color=["#2b7bba"] + ["#999999"] * (len(values) - 1))
    ax.bar_label(bars, fmt="%.3g")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path.relative_to(DOCS))


# --- checksum -----------------------------------------------------------------


def bench_checksum(ctx: Ctx) -> Section:
    import hashlib
    import zlib

    import google_crc32c

    data = os.urandom(256 * MiB)
    results: dict[str, float] = {}

    def run(name: str, fn: Any) -> None:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn(data)
            times.append(time.perf_counter() - t0)
        results[name] = len(data) / median(times) / GiB

    run("CRC32C (google-crc32c)", lambda v: google_crc32c.value(v))
    run("SHA-256 (hashlib)", lambda v: hashlib.sha256(v).digest())
    run("CRC32 (zlib)", lambda v: zlib.crc32(v))
    crc, sha = results["CRC32C (google-crc32c)"], results["SHA-256 (hashlib)"]
    s = Section("Checksum throughput", "checksum",
                ["algorithm", "GiB/s", "vs SHA-256"])  # fmt: skip
    for k, v in results.items():
        s.rows.append([k, fmt(v), fmt(v / sha) + "x"])
    s.notes.append(
        f"256 MiB in memory, median of 3. CRC32C is the default (`SPOTGUARD_CHECKSUM=crc32c`): "
        f"{crc / sha:.1f}x SHA-256 here, so checksumming never limits a save or a verify; "
        "SHA-256 is offered for stores or policies that want a cryptographic digest."
    )
    s.plot = _plot_bars(PLOTS / "checksum.png", "Checksum throughput", list(results), list(results.values()), "GiB/s")
    return s


# --- trainer stall and persist throughput --------------------------------------


def bench_stall(ctx: Ctx) -> Section:
    import torch

    import spotguard

    model, opt = ctx.training_state()
    nbytes = state_nbytes(model, opt)
    disk = ctx.work / "disk"
    disk.mkdir(exist_ok=True)
    reps = 5

    def torch_save(fsync: bool) -> float:
        path = disk / "baseline.pt"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        path.unlink()
        return dt

    # Raw sequential write of the same number of bytes, fsynced: the disk's ceiling.
    buf = memoryview(bytearray(os.urandom(64 * MiB)))

    def raw_write(nbytes: int) -> float:
        path = disk / "raw.bin"
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(left, len(buf))])
        os.fsync(fd)
        os.close(fd)
        dt = time.perf_counter() - t0
        path.unlink()
        return dt

    ckdir = ctx.work / "checkpoints"
    ck = spotguard.Checkpointer(ckdir, async_save=True, keep_local=1)
    ck.save(0, spotguard.torch_state(model, opt))  # warm-up: allocates the reusable host buffers
    ck.wait()
    ckpt_bytes = dir_bytes(sorted(ckdir.glob("ckpt-*"))[-1])
    # Interleave the methods so that background load on a shared machine hits them alike.
    stalls, persists, raws, syncs, nosyncs = [], [], [], [], []
    # os.sync() before each timed step: no method pays for another's dirty pages being written back.
    for step in range(1, reps + 1):
        os.sync()
        syncs.append(torch_save(True))
        os.sync()
        ck.save(step, spotguard.torch_state(model, opt))
        stalls.append(ck.last_stall_seconds)
        ck.wait()
        persists.append(ck.last_persist_seconds)
        os.sync()
        raws.append(raw_write(ckpt_bytes))
        os.sync()
        nosyncs.append(torch_save(False))
    ck.close()
    ctx.ckpt_dir = sorted(ckdir.glob("ckpt-*"))[-1]
    stall, persist, raw = median(stalls), median(persists), median(raws)
    base_sync, base_nosync = median(syncs), median(nosyncs)
    sg_tp, raw_tp = ckpt_bytes / persist / MiB, ckpt_bytes / raw / MiB
    ctx.costs.update(stall_sg=stall, stall_torch_save=base_sync, persist=persist, state_bytes=nbytes)

    s = Section("Trainer stall per checkpoint", "stall",
                ["method", "trainer blocked (s)", "ratio vs spotguard"])  # fmt: skip
    s.rows += [
        ["spotguard two-phase save (snapshot, persist in background)", fmt(stall, 3), "1.0x"],
        ["torch.save + fsync (durable)", fmt(base_sync, 3), fmt(base_sync / stall, 1) + "x"],
        ["torch.save, no fsync (page cache only)", fmt(base_nosync, 3), fmt(base_nosync / stall, 1) + "x"],
    ]
    ratio = base_sync / stall
    s.goals.append(("trainer stall >=10x less than torch.save", ratio >= 10,
                    f"{ratio:.1f}x less than durable torch.save, {base_nosync / stall:.1f}x less than "
                    "torch.save into the page cache"))  # fmt: skip
    if ratio < 10:
        s.notes.append(
            "Why the goal is missed here: on a CPU-only machine the snapshot is a memory copy of the "
            "whole state (the optimizer mutates the live tensors in place, so a consistent checkpoint "
            "needs a copy), bounded by memory bandwidth, while torch.save of the same state is bounded "
            "by the disk. The gap grows with slower disks and on GPUs, where the copy is a "
            "device-to-host DMA into pinned buffers."
        )
    s.notes.append(
        f"State: a model and AdamW moments, {nbytes / MiB:.0f} MiB of tensors "
        f"({ckpt_bytes / MiB:.0f} MiB on disk as a checkpoint); median of {reps} rounds after one warm-up save, "
        "each round running every method once."
    )
    s2 = Section("Persist throughput", "stall",
                 ["method", "MiB/s", "share of raw write"])  # fmt: skip
    s2.rows += [
        ["spotguard background persist (safetensors + CRC32C + fsync + manifest + rename)", fmt(sg_tp, 0),
         f"{sg_tp / raw_tp:.0%}"],
        ["raw sequential os.write + fsync of the same bytes", fmt(raw_tp, 0), "100%"],
    ]  # fmt: skip
    s2.goals.append(("persist throughput >=85% of a raw sequential write", sg_tp / raw_tp >= 0.85,
                     f"{sg_tp / raw_tp:.0%}"))  # fmt: skip
    if sg_tp / raw_tp < 0.85:
        s2.notes.append(
            f"Missed by {85 - 100 * sg_tp / raw_tp:.0f} points. Why: the raw baseline rewrites one 64 MiB buffer "
            "that stays in the CPU caches, while the persist streams the whole snapshot from memory, copies each "
            "8 MiB chunk once for the CRC32C extension (google-crc32c accepts only immutable bytes), and fsyncs "
            "several files and two directories. On this shared 2-core machine the ratio also moves with "
            "background load from run to run (40% to 130% was seen while other work ran); a checksum that reads "
            "the buffer in place, in a second thread, is the next step."
        )
    s.plot = _plot_bars(PLOTS / "stall.png", "Trainer stall per checkpoint",
                        ["spotguard", "torch.save+fsync", "torch.save"], [stall, base_sync, base_nosync], "seconds")
    s2.plot = _plot_bars(PLOTS / "persist.png", "Persist throughput", ["spotguard", "raw write"],
                         [sg_tp, raw_tp], "MiB/s")  # fmt: skip
    return s, s2  # type: ignore[return-value]


# --- upload -------------------------------------------------------------------


def bench_upload(ctx: Ctx) -> Section:
    from spotguard.checkpoint import upload_checkpoint, verify_checkpoint

    assert ctx.s3 is not None and ctx.ckpt_dir is not None, "run the stall benchmark first"
    src = ctx.ckpt_dir
    nbytes = dir_bytes(src)
    client = ctx.s3.client()
    s5cmd = Path(sys.executable).parent / "s5cmd"
    rows: dict[str, tuple[float, float]] = {}
    reps = 2

    def sg() -> tuple[float, float]:
        storage = ctx.storage(f"bench-up-{uuid.uuid4().hex[:8]}")
        with measure() as u:
            upload_checkpoint(src, storage)
        return u.wall, u.cpu

    def boto_default() -> tuple[float, float]:
        prefix = f"bench-boto-{uuid.uuid4().hex[:8]}"
        with measure() as u:
            for f in sorted(src.iterdir()):
                client.upload_file(str(f), ctx.s3.bucket, f"{prefix}/{f.name}")  # type: ignore[union-attr]
        return u.wall, u.cpu

    def s5() -> tuple[float, float]:
        prefix = f"bench-s5-{uuid.uuid4().hex[:8]}"
        env = {**os.environ, **ctx.s3.env()}  # type: ignore[union-attr]
        with measure() as u:
            subprocess.run([str(s5cmd), "--endpoint-url", ctx.s3.endpoint_url, "cp", f"{src}/*",  # type: ignore[union-attr]
                            f"s3://{ctx.s3.bucket}/{prefix}/"], env=env, check=True, capture_output=True)  # type: ignore[union-attr]
        return u.wall, u.cpu

    for name, fn in (("spotguard upload_checkpoint", sg), ("boto3 upload_file, defaults", boto_default),
                     ("s5cmd cp (default workers)", s5)):  # fmt: skip
        runs = [fn() for _ in range(reps)]
        rows[name] = (median([r[0] for r in runs]), median([r[1] for r in runs]))

    storage = ctx.storage(f"bench-verify-{uuid.uuid4().hex[:8]}")
    res = upload_checkpoint(src, storage)
    with measure() as v:
        ok = verify_checkpoint(storage, res.name).ok
    assert ok
    sg_wall = rows["spotguard upload_checkpoint"][0]
    s = Section("Upload to S3 (SeaweedFS on this machine)", "stall,upload",
                ["method", "MiB/s", "CPU s per GiB", "speed vs spotguard"])  # fmt: skip
    for name, (wall, cpu) in rows.items():
        s.rows.append([name, fmt(nbytes / wall / MiB, 0), fmt(cpu / (nbytes / GiB), 2), fmt(sg_wall / wall, 2) + "x"])
    boto, s5w = rows["boto3 upload_file, defaults"][0], rows["s5cmd cp (default workers)"][0]
    s.goals.append(("at least s5cmd", sg_wall <= s5w * 1.05, f"spotguard {s5w / sg_wall:.2f}x s5cmd's speed"))
    s.goals.append((">=2x boto3 defaults", boto / sg_wall >= 2, f"{boto / sg_wall:.2f}x"))
    if boto / sg_wall < 2:
        s.notes.append(
            f"The >=2x goal over boto3 defaults is missed ({boto / sg_wall:.2f}x). Why: the store runs on the "
            "same 2 cores as the client and caps every client at about the same speed (the three methods land "
            "within a few tens of MiB/s of each other), so no client can be twice as fast here; what differs is "
            f"the CPU each spends per GiB (lowest here: {min(rows, key=lambda k: rows[k][1])}). Against a remote, "
            "parallel store the "
            "concurrent multipart upload is where the gap would show."
        )
    s.notes.append(
        f"{nbytes / MiB:.0f} MiB checkpoint ({len(list(src.iterdir()))} files), median of {reps}. "
        f"Verifying it afterwards (download + CRC32C of every file) took {v.wall:.2f}s "
        f"({nbytes / v.wall / MiB:.0f} MiB/s). The store runs on the same 2 cores as the client, so "
        "it, not the client, sets the pace: the ratios say more than the absolute speeds."
    )
    ctx.costs["upload"] = sg_wall
    ctx.costs["verify"] = v.wall
    s.plot = _plot_bars(PLOTS / "upload.png", "Upload throughput", ["spotguard", "boto3 defaults", "s5cmd"],
                        [nbytes / w / MiB for w, _ in rows.values()], "MiB/s")  # fmt: skip
    return s


# --- resume -------------------------------------------------------------------


def bench_resume(ctx: Ctx) -> Section:
    import torch

    from spotguard.checkpoint import load_checkpoint_state, restore_latest, upload_checkpoint

    assert ctx.s3 is not None and ctx.ckpt_dir is not None, "run the stall benchmark first"
    model, opt = ctx.training_state()
    storage = ctx.storage(f"bench-resume-{uuid.uuid4().hex[:8]}")
    upload_checkpoint(ctx.ckpt_dir, storage)
    pt = ctx.work / "naive.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, pt)
    key = f"bench-naive-{uuid.uuid4().hex[:8]}/state.pt"
    client = ctx.s3.client()
    client.upload_file(str(pt), ctx.s3.bucket, key)
    pt.unlink()
    reps = 3

    def sg() -> float:
        dest = ctx.work / f"restore-{uuid.uuid4().hex[:6]}"
        t0 = time.perf_counter()
        info = restore_latest(storage, dest)
        assert info is not None
        state = load_checkpoint_state(next(dest.glob("ckpt-*")))
        dt = time.perf_counter() - t0
        assert "model" in state
        shutil.rmtree(dest)
        return dt

    def naive() -> float:
        dest = ctx.work / f"naive-{uuid.uuid4().hex[:6]}.pt"
        t0 = time.perf_counter()
        client.download_file(ctx.s3.bucket, key, str(dest))
        state = torch.load(dest, weights_only=True)
        dt = time.perf_counter() - t0
        assert "model" in state
        dest.unlink()
        return dt

    sg_times, naive_times = [], []
    for _ in range(reps):  # interleaved, so background load hits both alike
        sg_times.append(sg())
        naive_times.append(naive())
    t_sg, t_naive = median(sg_times), median(naive_times)
    ctx.costs["resume"] = t_sg
    s = Section("Resume: download + verify + load", "stall,resume",
                ["method", "seconds", "ratio vs spotguard"])  # fmt: skip
    s.rows += [
        ["spotguard restore_latest (verified, checksummed) + load", fmt(t_sg), "1.0x"],
        ["boto3 download_file + torch.load(weights_only=True) (no verification)", fmt(t_naive),
         fmt(t_naive / t_sg, 2) + "x"],
    ]  # fmt: skip
    s.goals.append((">=2x faster than naive download + torch.load", t_naive / t_sg >= 2, f"{t_naive / t_sg:.2f}x"))
    if t_naive / t_sg < 2:
        s.notes.append(
            "Why the goal is missed here: boto3's download_file already downloads one large object in "
            "concurrent ranged parts, and the store (sharing the client's 2 cores) is the bottleneck for "
            "both; spotguard additionally checksums every byte and picks the newest verified checkpoint "
            "by listing, which the naive path does not do."
        )
    s.plot = _plot_bars(PLOTS / "resume.png", "Resume time", ["spotguard", "naive"], [t_sg, t_naive], "seconds")
    return s


# --- SIGTERM -> verified in S3 --------------------------------------------------


def _sigterm_once(ctx: Ctx, nbytes: int) -> tuple[float, int]:
    from spotguard.checkpoint import latest_verified

    assert ctx.s3 is not None
    prefix = f"bench-sigterm-{uuid.uuid4().hex[:8]}"
    workdir = ctx.work / prefix
    env = {**os.environ, **ctx.s3.env(), "SPOTGUARD_SAVE_EVERY_STEPS": "100000000", "PYTHONPATH": str(ROOT)}
    spotguard_bin = Path(sys.executable).parent / "spotguard"
    proc = subprocess.Popen(
        [str(spotguard_bin), "run", "--storage", f"s3://{ctx.s3.bucket}/{prefix}", "--workdir", str(workdir),
         "--grace-seconds", "600", "--", sys.executable, str(ROOT / "bench" / "sigterm_trainer.py"),
         "--bytes", str(nbytes)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == "ready":
            break
    else:
        raise RuntimeError("trainer never became ready:\n" + "".join(lines[-20:]))
    time.sleep(1.0)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=900)
    latency = time.perf_counter() - t0
    info, _ = latest_verified(ctx.storage(prefix))
    if info is None:
        raise RuntimeError("no verified checkpoint after SIGTERM:\n" + "".join(lines[-10:]) + rest[-3000:])
    shutil.rmtree(workdir, ignore_errors=True)
    return latency, proc.returncode


def bench_sigterm(ctx: Ctx) -> Section:
    sizes = [float(x) for x in os.environ.get("BENCH_SIGTERM_GB", "0.25,1,4").split(",")]
    results = []
    for gb in sizes:
        latency, rc = _sigterm_once(ctx, int(gb * GiB))
        results.append((gb, latency, rc))
    # Linear fit latency = a + b * size, to estimate the largest state that fits 25 s here.
    xs, ys = [r[0] for r in results], [r[1] for r in results]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else ys[0] / xs[0]
    a = my - b * mx
    fits = (25 - a) / b if b > 0 else float("inf")
    ctx.costs["emergency_per_gb"] = b
    ctx.costs["emergency_fixed"] = a
    s = Section("SIGTERM to checkpoint verified in S3", "sigterm",
                ["state", "SIGTERM -> verified (s)", "effective MiB/s", "exit code"])  # fmt: skip
    for gb, latency, rc in results:
        s.rows.append([f"{gb:g} GiB", fmt(latency), fmt(gb * 1024 / latency, 0), str(rc)])
    s.notes.append(
        f"`spotguard run` supervising a trainer with the given state, SIGTERM to the supervisor: the "
        f"trainer saves at its next step boundary, the supervisor uploads, verifies (downloads and "
        f"checksums every byte) and exits. A linear fit gives {a:.1f} s + {b:.1f} s/GiB, so the largest "
        f"state that fits a 25 s budget on this machine is about **{max(fits, 0):.2f} GiB**; on a real "
        "cloud node the store is remote and parallel, so the per-GiB cost is the network's, not this "
        "machine's 2 cores'."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(xs, ys, "o-", label="measured")
    ax.axhline(25, color="red", ls="--", label="25 s budget")
    ax.set_xlabel("state size (GiB)")
    ax.set_ylabel("SIGTERM -> verified (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOTS / "sigterm.png", dpi=110)
    plt.close(fig)
    s.plot = "bench/sigterm.png"
    return s


# --- goodput ------------------------------------------------------------------


def bench_goodput(ctx: Ctx) -> Section:
    gb = ctx.costs.get("state_bytes", 1.5 * GiB) / GiB
    per_gb = ctx.costs.get("emergency_per_gb", 10.0)
    upload_per_gb = ctx.costs.get("upload", 8.0 * gb) / max(gb, 1e-9)
    costs = goodput.Costs(
        stall_spotguard=ctx.costs.get("stall_sg", 0.1),
        stall_periodic=ctx.costs.get("stall_torch_save", 1.0) + upload_per_gb * gb,
        emergency=ctx.costs.get("emergency_fixed", 2.0) + per_gb * gb,
        restart=30.0 + ctx.costs.get("resume", 5.0),
    )
    source = ("come from this run" if "stall_sg" in ctx.costs
              else "are defaults (run it with the other benchmarks to use measured ones)")
    trace = goodput.Trace(mtbf_hours=1.0, notice_seconds=30.0, job_hours=24.0)
    res = goodput.compare(costs, trace, trials=400, seed=7)
    s = Section("Goodput over a preemption trace (simulation)", "goodput",
                ["strategy", "checkpoint interval", "goodput", "wall hours for 24 h of compute"])  # fmt: skip
    for r in res:
        if r.finished < 1:
            wall = f"over {goodput.CAP_HOURS:.0f} (the cap) in {1 - r.finished:.0%} of runs"
            s.rows.append([r.name, r.interval, "~0%", wall])
        else:
            s.rows.append([r.name, r.interval, f"{r.goodput:.1%}", fmt(r.wall_hours, 1)])
    s.notes.append(
        f"Poisson preemptions, one per hour on average, each with a {trace.notice_seconds:.0f} s notice; "
        f"400 simulated 24 h jobs per strategy, fixed seed. Costs {source}: spotguard stall "
        f"{costs.stall_spotguard:.2f} s, periodic-only blocking checkpoint (torch.save + upload) "
        f"{costs.stall_periodic:.1f} s, emergency save + upload + verify {costs.emergency:.1f} s, "
        f"restart (pod start assumed 30 s + measured resume) {costs.restart:.1f} s, for the "
        f"{gb:.2f} GiB state of the stall benchmark. Intervals are Young/Daly: sqrt(2 x cost x MTBF)."
    )
    s.plot = _plot_bars(PLOTS / "goodput.png", "Goodput", [r.name.split(" ")[0] for r in res],
                        [r.goodput * 100 for r in res], "% useful compute")  # fmt: skip
    return s


BENCHES: dict[str, Any] = {
    "checksum": bench_checksum,
    "stall": bench_stall,
    "upload": bench_upload,
    "resume": bench_resume,
    "sigterm": bench_sigterm,
    "operator": None,  # filled in below when the operator benchmark module is present
    "goodput": bench_goodput,
}
try:
    from bench import operator_bench

    BENCHES["operator"] = operator_bench.bench_operator
except ImportError:  # pragma: no cover
    del BENCHES["operator"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--only", default=",".join(BENCHES), help="comma-separated benchmarks")
    parser.add_argument("--output", type=Path, default=DOCS / "benchmarks.md")
    args = parser.parse_args(argv)
    chosen = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = set(chosen) - set(BENCHES)
    if unknown:
        parser.error(f"unknown benchmarks {sorted(unknown)}; choose from {list(BENCHES)}")
    state_mb = int(os.environ.get("BENCH_STATE_MB", "512"))
    PLOTS.mkdir(parents=True, exist_ok=True)
    started = time.time()
    sections: list[Section] = []
    with tempfile.TemporaryDirectory(prefix="spotguard-bench-", dir=os.environ.get("BENCH_TMP")) as tmp:
        work = Path(tmp)
        needs_s3 = bool({"upload", "resume", "sigterm"} & set(chosen))
        needs_kube = "operator" in chosen
        with cluster.running(work / "services", kube=needs_kube, s3=needs_s3) as env:
            ctx = Ctx(work, env.s3, state_mb)
            ctx.kube = env.kube  # type: ignore[attr-defined]
            for name in BENCHES:
                if name not in chosen:
                    continue
                if name in ("upload", "resume") and ctx.ckpt_dir is None:
                    bench_stall(ctx)  # they upload the checkpoint the stall benchmark writes
                print(f"== {name}", flush=True)
                t0 = time.perf_counter()
                out = BENCHES[name](ctx)
                print(f"   {time.perf_counter() - t0:.1f}s", flush=True)
                sections += list(out) if isinstance(out, tuple) else [out]
    elapsed = time.time() - started
    header = [
        "# Benchmarks",
        "",
        "Every figure is measured side by side with its baseline in the same run, on the same machine; "
        "absolute numbers depend on the machine, the ratios are the point. Regenerate with `make bench` "
        "(this file and the plots in `docs/bench/` are overwritten). On this shared 2-core machine, with the "
        "S3 store on the same cores, ratios move between runs of the same code (seen: resume 1.2x to 2.6x, "
        "trainer stall 9x to 13x); each verdict below is from this one run.",
        "",
        f"Machine: {os.cpu_count()} cores, {_mem_gib():.0f} GiB memory, {platform.platform()}, "
        f"Python {platform.python_version()}, torch {_torch_version()}; the S3 store (SeaweedFS) and the "
        f"control plane run on the same machine. Run took {elapsed / 60:.1f} min.",
        "",
    ]
    summary = ["| goal | result |", "|---|---|"]
    for s in sections:
        for goal, met, detail in s.goals:
            summary.append(f"| {s.title}: {goal} | {'met' if met else 'missed'}: {detail} |")
    text = "\n".join(header + ["## Goals", ""] + summary + [""] + [s.markdown() for s in sections])
    if set(chosen) == set(BENCHES) or not args.output.exists():
        args.output.write_text(text)
    else:
        args.output.with_suffix(".partial.md").write_text(text)
    print(text)
    (PLOTS / "costs.json").write_text(json.dumps(ctx.costs, indent=2))
    return 0


def _mem_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    sys.exit(main())
