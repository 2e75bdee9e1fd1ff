"""spotguard's side-by-side benchmarks: every figure is a ratio against a named
baseline measured in the same run on the same machine.

    make bench                      # everything, writes docs/benchmarks.md + docs/bench/*.png
    .venv/bin/python -m bench.run --only resume --rounds 3      # one section, few rounds
    .venv/bin/python -m bench.run --only resume --profile       # plus a cProfile of one restore

Each ratio is the median of per-round ratios over interleaved rounds (every
round runs spotguard and its baseline once, in alternating order), reported
with its interquartile range and min-max; a goal is met only when the worse
quartile meets it. A run of only some sections writes its report and plots
to a temporary directory (printed), never over docs/.

Environment: BENCH_STATE_MB (default 512) sizes the training state of the
stall/persist/upload/resume benchmarks; BENCH_SIGTERM_GB (default 0.25,1,2)
the SIGTERM -> verified sizes; BENCH_OPERATOR_JOBS (default 200); BENCH_DIST_STATE_MB
(default 256) and BENCH_DIST_SIGTERM_GB (default 0.5) the sharded state of the
distributed stall and SIGTERM benchmarks; BENCH_REQUESTS_POLLS (default 2) the polls per
job of each kind in the storage-requests benchmark; BENCH_STORE_GIBPS (default: this
machine's, measured) the store's per-node throughput the goodput section's 7B scenarios use.
`make bench-large` runs the users' size: the SIGTERM rounds and the fine-tune's plain and
incremental rounds at 8 GiB, then the goodput section on their costs.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import (  # noqa: E402
    dist,
    dist_frozen,
    frameworks,
    gang,
    goodput,
    incremental,
    linear_finetune,
    preempt_upload,
    storage_requests,
)
from bench.common import (  # noqa: E402
    DOCS,
    PLOTS,
    CpuWatch,
    Ctx,
    GiB,
    MiB,
    Section,
    Spread,
    dir_bytes,
    fmt,
    goal,
    interleaved,
    measure,
    median,
    parse_stage_lines,
    per_round,
    state_nbytes,
)
from testenv import cluster  # noqa: E402


class StageClock:
    """Wall time spent inside chosen functions, by stage: bench-side
    instrumentation of code the benchmark calls (a profile by stage)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def patched(self, targets: list[tuple[Any, str, str]]) -> Iterator[StageClock]:
        saved = []
        for obj, attr, stage in targets:
            orig = getattr(obj, attr, None)
            if orig is None:
                continue  # the code changed shape: time what is still there
            saved.append((obj, attr, orig))
            setattr(obj, attr, self._timed(orig, stage))
        try:
            yield self
        finally:
            for obj, attr, orig in reversed(saved):
                setattr(obj, attr, orig)

    def _timed(self, fn: Callable[..., Any], stage: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0

        return timed


def _plot_bars(
    path: Path,
    title: str,
    labels: list[str],
    values: list[float],
    ylabel: str,
    errors: list[tuple[float, float]] | None = None,
) -> str:
    """A bar chart; ``errors`` are (low, high) whiskers around each bar. Returns
    the path relative to the report's directory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    yerr = None
    if errors is not None:
        yerr = [
            [max(0.0, v - lo) for v, (lo, _) in zip(values, errors, strict=True)],
            [max(0.0, hi - v) for v, (_, hi) in zip(values, errors, strict=True)],
        ]
    bars = ax.bar(labels, values, color=["#2b7bba"] + ["#999999"] * (len(values) - 1), yerr=yerr, capsize=4)
    ax.bar_label(bars, fmt="%.3g")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"{path.parent.name}/{path.name}"


def _range(xs: list[float]) -> tuple[float, float]:
    return min(xs), max(xs)


# --- checksum -----------------------------------------------------------------


def bench_checksum(ctx: Ctx) -> Section:
    import hashlib
    import zlib

    import google_crc32c

    data = os.urandom(256 * MiB)
    reps = ctx.rounds_for(3)
    fns: dict[str, Callable[[bytes], Any]] = {
        "CRC32C (google-crc32c)": google_crc32c.value,
        "SHA-256 (hashlib)": lambda v: hashlib.sha256(v).digest(),
        "CRC32 (zlib)": zlib.crc32,
    }

    def timed(fn: Callable[[bytes], Any]) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            fn(data)
            return len(data) / (time.perf_counter() - t0) / GiB

        return run

    res = interleaved(reps, {k: timed(f) for k, f in fns.items()})
    sha = res["SHA-256 (hashlib)"]
    s = Section("Checksum throughput", "checksum", ["algorithm", "GiB/s (median)", "vs SHA-256, per round"])
    for k, v in res.items():
        s.rows.append([k, fmt(median(v)), per_round(v, sha).cell()])
    crc = per_round(res["CRC32C (google-crc32c)"], sha)
    s.notes.append(
        f"256 MiB in memory, {reps} interleaved rounds. CRC32C is the default (`SPOTGUARD_CHECKSUM=crc32c`): "
        f"{crc.text()} SHA-256's speed here, so checksumming never limits a save or a verify; "
        "SHA-256 is offered for stores or policies that want a cryptographic digest."
    )
    s.plot = _plot_bars(
        ctx.plots / "checksum.png",
        "Checksum throughput",
        list(res),
        [median(v) for v in res.values()],
        "GiB/s",
        [_range(v) for v in res.values()],
    )
    return s


# --- trainer stall and persist throughput --------------------------------------


def bench_stall(ctx: Ctx) -> tuple[Section, Section]:
    import torch

    import spotguard

    model, opt = ctx.training_state()
    nbytes = state_nbytes(model, opt)
    disk = ctx.work / "disk"
    disk.mkdir(exist_ok=True)
    reps = ctx.rounds_for(7)

    def train_step() -> None:
        """What a training step does to the state: every parameter and moment changes (untimed)."""
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)
            for st in opt.state.values():
                for v in st.values():
                    if torch.is_tensor(v) and v.is_floating_point():
                        v.mul_(0.999)

    def torch_save(fsync: bool) -> float:
        path = disk / "baseline.pt"
        train_step()
        os.sync()  # no method pays for another's dirty pages being written back
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
        os.sync()
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
    step = 0

    def sg() -> tuple[float, float]:
        nonlocal step
        step += 1
        train_step()
        os.sync()
        ck.save(step, spotguard.torch_state(model, opt))
        stall = ck.last_stall_seconds
        ck.wait()
        return stall, ck.last_persist_seconds

    res = interleaved(
        reps,
        {
            "sg": sg,
            "sync": lambda: torch_save(True),
            "raw": lambda: raw_write(ckpt_bytes),
            "nosync": lambda: torch_save(False),
        },
    )
    ck.close()
    ctx.ckpt_dir = sorted(ckdir.glob("ckpt-*"))[-1]
    stalls = [a for a, _ in res["sg"]]
    persists = [b for _, b in res["sg"]]
    syncs, nosyncs, raws = res["sync"], res["nosync"], res["raw"]
    ctx.costs.update(
        stall_sg=median(stalls), stall_torch_save=median(syncs), persist=median(persists), state_bytes=nbytes
    )
    vs_sync = per_round(syncs, stalls)
    vs_nosync = per_round(nosyncs, stalls)

    s = Section(
        "Trainer stall per checkpoint",
        "stall",
        ["method", "trainer blocked (s, median)", "ratio vs spotguard, per round [IQR]"],
    )
    s.rows += [
        ["spotguard two-phase save (snapshot, persist in background)", fmt(median(stalls), 3), "1.0x"],
        ["torch.save + fsync (durable)", fmt(median(syncs), 3), vs_sync.cell(digits=1)],
        ["torch.save, no fsync (page cache only)", fmt(median(nosyncs), 3), vs_nosync.cell(digits=1)],
    ]
    met = goal(
        s,
        "trainer stall >=10x less than torch.save",
        vs_sync,
        10,
        detail=f"vs torch.save into the page cache: {vs_nosync.text()}",
    )
    if not met:
        s.notes.append(
            "Why the goal is missed here: on a CPU-only machine the snapshot is a memory copy of the "
            "whole state (the optimizer mutates the live tensors in place, so a consistent checkpoint "
            "needs a copy), bounded by memory bandwidth, while torch.save of the same state is bounded "
            "by the disk. The gap grows with slower disks and on GPUs, where the copy is a "
            "device-to-host DMA into pinned buffers."
        )
    s.notes.append(
        f"State: a model and AdamW moments, {nbytes / MiB:.0f} MiB of tensors "
        f"({ckpt_bytes / MiB:.0f} MiB on disk as a checkpoint); {reps} interleaved rounds after one warm-up "
        "save, each round running every method once, each after a step that changes every parameter and "
        "moment (as full training does: no tensor can be skipped as unchanged), dirty pages flushed before each."
    )
    share = Spread.of([100 * r / p for r, p in zip(raws, persists, strict=True)])  # persist MiB/s / raw MiB/s
    s2 = Section("Persist throughput", "stall", ["method", "MiB/s (median)", "share of raw write, per round [IQR]"])
    s2.rows += [
        [
            "spotguard background persist (safetensors + CRC32C + fsync + manifest + rename)",
            fmt(ckpt_bytes / median(persists) / MiB, 0),
            share.cell("%", 0),
        ],
        ["raw sequential os.write + fsync of the same bytes", fmt(ckpt_bytes / median(raws) / MiB, 0), "100%"],
    ]
    if not goal(s2, "persist throughput >=85% of a raw sequential write", share, 85, suffix="%"):
        s2.notes.append(
            f"Missed: the worse quartile is {share.worse():.0f}%. Why: the raw baseline rewrites one 64 MiB "
            "buffer that stays in the CPU caches, while the persist streams the whole snapshot from memory, "
            "copies each 8 MiB chunk once for the CRC32C extension (google-crc32c accepts only immutable "
            "bytes), and fsyncs several files and two directories; on a shared machine the ratio also moves "
            "with background disk load."
        )
    s.plot = _plot_bars(
        ctx.plots / "stall.png",
        "Trainer stall per checkpoint",
        ["spotguard", "torch.save+fsync", "torch.save"],
        [median(stalls), median(syncs), median(nosyncs)],
        "seconds",
        [_range(stalls), _range(syncs), _range(nosyncs)],
    )
    tps = [ckpt_bytes / p / MiB for p in persists]
    raw_tps = [ckpt_bytes / r / MiB for r in raws]
    s2.plot = _plot_bars(
        ctx.plots / "persist.png",
        "Persist throughput",
        ["spotguard", "raw write"],
        [median(tps), median(raw_tps)],
        "MiB/s",
        [_range(tps), _range(raw_tps)],
    )
    return s, s2


# --- upload -------------------------------------------------------------------


def _drop_prefix(ctx: Ctx, prefix: str) -> None:
    """Delete what a round uploaded (untimed), so that the store's disk stays small."""
    with contextlib.suppress(Exception):
        storage = ctx.storage(prefix)
        storage.delete([o.key for o in storage.list_objects("")])


def bench_upload(ctx: Ctx) -> Section:
    from spotguard.checkpoint import upload_checkpoint, verify_checkpoint

    assert ctx.s3 is not None
    s3 = ctx.s3
    src = ctx.checkpoint()
    nbytes = dir_bytes(src)
    client = s3.client()
    s5cmd = Path(sys.executable).parent / "s5cmd"
    reps = ctx.rounds_for(5)

    def sg() -> tuple[float, float]:
        prefix = f"bench-up-{uuid.uuid4().hex[:8]}"
        storage = ctx.storage(prefix)
        with measure() as u:
            upload_checkpoint(src, storage)
        _drop_prefix(ctx, prefix)
        return u.wall, u.cpu

    def boto_default() -> tuple[float, float]:
        prefix = f"bench-boto-{uuid.uuid4().hex[:8]}"
        with measure() as u:
            for f in sorted(src.iterdir()):
                client.upload_file(str(f), s3.bucket, f"{prefix}/{f.name}")
        _drop_prefix(ctx, prefix)
        return u.wall, u.cpu

    def s5() -> tuple[float, float]:
        prefix = f"bench-s5-{uuid.uuid4().hex[:8]}"
        env = {**os.environ, **s3.env()}
        with measure() as u:
            subprocess.run(
                [str(s5cmd), "--endpoint-url", s3.endpoint_url, "cp", f"{src}/*", f"s3://{s3.bucket}/{prefix}/"],
                env=env,
                check=True,
                capture_output=True,
            )
        _drop_prefix(ctx, prefix)
        return u.wall, u.cpu

    names = {
        "sg": "spotguard upload_checkpoint",
        "boto": "boto3 upload_file, defaults",
        "s5": "s5cmd cp (default workers)",
    }
    res = interleaved(reps, {"sg": sg, "boto": boto_default, "s5": s5})
    walls = {k: [w for w, _ in v] for k, v in res.items()}
    cpus = {k: [c for _, c in v] for k, v in res.items()}
    vs_boto = per_round(walls["boto"], walls["sg"])
    vs_s5 = per_round(walls["s5"], walls["sg"])

    storage = ctx.storage(f"bench-verify-{uuid.uuid4().hex[:8]}")
    res_up = upload_checkpoint(src, storage)
    with measure() as v:
        verdict = verify_checkpoint(storage, res_up.name)
    assert verdict.ok
    how = getattr(verdict, "method", "") or "read-back"  # checksums the store keeps, or a download + CRC32C
    s = Section(
        "Upload to S3 (SeaweedFS on this machine)",
        "upload",
        ["method", "MiB/s (median)", "CPU s per GiB", "spotguard's speed vs it, per round [IQR]"],
    )
    for key, label in names.items():
        speed = "1.00x" if key == "sg" else per_round(walls[key], walls["sg"]).cell()
        s.rows.append(
            [label, fmt(nbytes / median(walls[key]) / MiB, 0), fmt(median(cpus[key]) / (nbytes / GiB), 2), speed]
        )
    goal(s, "at least s5cmd's speed", vs_s5, 0.95, detail="within 5%")
    if not goal(s, ">=2x boto3 defaults", vs_boto, 2):
        lowest = min(names, key=lambda k: median(cpus[k]))
        s.notes.append(
            f"The >=2x goal over boto3 defaults is missed ({vs_boto.median:.2f}x). Why: the store runs on the "
            "same machine as the client and caps every client at about the same speed, so no client can be "
            "twice as fast here; what differs is the CPU each spends per GiB (lowest here: "
            f"{names[lowest]}). Against a remote, parallel store the concurrent multipart upload is where the "
            "gap would show."
        )
    s.notes.append(
        f"{nbytes / MiB:.0f} MiB checkpoint ({len(list(src.iterdir()))} files), {reps} interleaved rounds. "
        f"Verifying it afterwards (`verify_checkpoint`, by {how}) took {v.wall:.2f}s. The store runs on the "
        "same cores as the client, so "
        "it, not the client, sets the pace: the ratios say more than the absolute speeds."
    )
    ctx.costs["upload"] = median(walls["sg"])
    ctx.costs["verify"] = v.wall
    speeds = {k: [nbytes / w / MiB for w in walls[k]] for k in names}
    s.plot = _plot_bars(
        ctx.plots / "upload.png",
        "Upload throughput",
        ["spotguard", "boto3 defaults", "s5cmd"],
        [median(x) for x in speeds.values()],
        "MiB/s",
        [_range(x) for x in speeds.values()],
    )
    return s


# --- resume -------------------------------------------------------------------


def _restore_stages(storage: Any) -> list[tuple[Any, str, str]]:
    """Where spotguard's restore spends its time, as (object, attribute, stage):
    the functions ``restore_latest_state`` calls. Stages marked "thread-s" run
    on several threads at once and add up their threads' seconds (more than
    the wall time when they overlap); the others are wall time on the caller's
    thread (the two tensor files stream side by side, so "stream tensors"
    counts both)."""
    from spotguard.checkpoint.restore import stream

    return [
        (storage, "list_dirs", "list"),
        (storage, "list_objects", "list"),
        (storage, "read_bytes", "manifest"),
        (stream, "_check_whole", "state.json + other files"),
        (storage, "open_ranged", "open"),
        (stream._FileRead, "tensors", "stream tensors"),
        (storage, "_get_range", "ranged GETs of headers (thread-s)"),
        (storage, "_get_range_into", "ranged GETs into the tensors (thread-s)"),
        (stream._FileRead, "_take_into", "GET into the tensors + checksum (thread-s)"),
        (stream, "crc32c_combine", "combine CRCs"),
        (stream, "decode_state", "decode state"),
    ]


def _raw(t: Any) -> Any:
    """A tensor's bytes (compared bit for bit: NaNs and signed zeros too)."""
    import torch

    return t.detach().reshape(-1).view(torch.uint8)


def bench_resume(ctx: Ctx) -> Section:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from bench.common import make_training_state
    from spotguard.checkpoint import restore_latest, upload_checkpoint
    from spotguard.checkpoint.local.commit import read_local_manifest
    from spotguard.checkpoint.local.inplace import file_stamps
    from spotguard.checkpoint.restore.grant import make_grant
    from spotguard.checkpoint.restore.load import restore_latest_state
    from spotguard.contract.control import forget_verified_local, write_verified_local
    from spotguard.contract.grant import write_grant
    from spotguard.storage.base import byte_ranges
    from spotguard.trainer import Checkpointer

    assert ctx.s3 is not None
    s3 = ctx.s3
    model, opt = ctx.training_state()
    storage = ctx.storage(f"bench-resume-{uuid.uuid4().hex[:8]}")
    upload_checkpoint(ctx.checkpoint(), storage)
    # The same checkpoint as the default stores it: incremental (content-addressed chunks).
    chunked = ctx.storage(f"bench-resume-chunks-{uuid.uuid4().hex[:8]}")
    upload_checkpoint(ctx.checkpoint(), chunked, incremental=True)
    pt = ctx.work / "naive.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, pt)
    key = f"bench-naive-{uuid.uuid4().hex[:8]}/state.pt"
    client = s3.client()
    client.upload_file(str(pt), s3.bucket, key)
    pt.unlink()
    reps = ctx.rounds_for(7)
    stage_rounds: list[dict[str, float]] = []
    # The resumed trainer's own model and optimizer: built (and stepped) before it restores, as a
    # training script does; other values than the checkpoint's, the same shapes.
    own_model, own_opt = make_training_state(ctx.state_bytes)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_moments = [t.clone() for st in opt.state.values() for t in st.values()]

    def bit_exact() -> bool:
        moments = [t for st in own_opt.state.values() for t in st.values()]
        same = len(moments) == len(saved_moments) and all(
            torch.equal(_raw(a), _raw(b)) for a, b in zip(moments, saved_moments, strict=True)
        )
        return same and all(torch.equal(_raw(v), _raw(saved[k])) for k, v in own_model.state_dict().items())

    def sg() -> float:
        os.sync()  # neither method pays for the other's dirty pages
        clock = StageClock()
        with clock.patched(_restore_stages(storage)):
            t0 = time.perf_counter()
            found = restore_latest_state(storage)
            dt = time.perf_counter() - t0
        assert found is not None and "model" in found[1]
        clock.seconds["total"] = dt
        stage_rounds.append(clock.seconds)
        del found
        return dt

    naive_rounds: list[dict[str, float]] = []

    def naive() -> float:
        dest = ctx.work / f"naive-{uuid.uuid4().hex[:6]}.pt"
        os.sync()
        t0 = time.perf_counter()
        client.download_file(s3.bucket, key, str(dest))
        t1 = time.perf_counter()
        state = torch.load(dest, weights_only=True)
        dt = time.perf_counter() - t0
        naive_rounds.append({"download": t1 - t0, "torch.load": dt - (t1 - t0)})
        assert "model" in state
        del state
        dest.unlink()
        return dt

    trainer_rounds: list[dict[str, float]] = []
    granted_rounds: list[dict[str, float]] = []
    exact: list[bool] = []

    def granted(source: Any = storage) -> float:
        """What a resumed trainer gets under ``spotguard run``: the supervisor's restore grant
        (``make_grant``, as ``spotguard run`` writes it: the newest checkpoints listed, their
        manifests read, their objects signed; no data read), then the trainer's
        ``Checkpointer.restore(model, optimizer)``: the checkpoint streamed by presigned ranged
        GETs straight into its own parameters and optimizer state, CRC32C per range, checked
        against the manifest. No local copy first (the supervisor restores it after the trainer
        answered, in the background: not timed)."""
        dest = ctx.work / f"granted-{uuid.uuid4().hex[:6]}"
        control = dest / ".control"
        ck = Checkpointer(dest, async_save=False, control_dir=control)
        with torch.no_grad():
            next(own_model.parameters()).add_(1.0)
        before = [p.data_ptr() for p in own_model.parameters()]
        os.sync()
        t0 = time.perf_counter()
        grant = make_grant(source)
        assert grant is not None
        write_grant(control, grant)
        t1 = time.perf_counter()
        restored = ck.restore(own_model, own_opt, restore_rng=False)
        dt = time.perf_counter() - t0
        assert restored is not None and restored.in_place_bytes > 0
        granted_rounds.append({"grant": t1 - t0, "streamed into the trainer's tensors": dt - (t1 - t0)})
        exact.append(bit_exact() and before == [p.data_ptr() for p in own_model.parameters()])
        ck.close()
        del restored
        shutil.rmtree(dest)
        return dt

    def trainer(source: Any = storage) -> float:
        """What a resumed trainer got before the grant, and gets from a store that cannot sign:
        the newest verified checkpoint restored into the checkpoint directory (``restore_latest``:
        downloaded and checked in one pass, not fsynced) and recorded as verified with its files'
        stamps, as ``spotguard run`` records it; then the trainer's ``Checkpointer.restore(model,
        optimizer)`` (sizes checked, not checksummed again; the bytes read straight into its own
        parameters and optimizer state)."""
        dest = ctx.work / f"restore-{uuid.uuid4().hex[:6]}"
        control = dest / ".control"
        ck = Checkpointer(dest, async_save=False, control_dir=control)
        # Other values in the trainer's tensors than the checkpoint's: a round that loaded nothing fails.
        with torch.no_grad():
            next(own_model.parameters()).add_(1.0)
        os.sync()
        t0 = time.perf_counter()
        info = restore_latest(source, dest)
        assert info is not None
        path = Path(info.uri)
        write_verified_local(control, path.name, file_stamps(path, read_local_manifest(path)))
        t1 = time.perf_counter()
        restored = ck.restore(own_model, own_opt, restore_rng=False)
        dt = time.perf_counter() - t0
        assert restored is not None and restored.checked_bytes == 0
        trainer_rounds.append({"restore to disk": t1 - t0, "load into the trainer's tensors": dt - (t1 - t0)})
        exact.append(bit_exact())
        ck.close()
        forget_verified_local(control)
        del restored
        shutil.rmtree(dest)
        return dt

    tensor_files = [o for o in storage.list_objects("") if o.key.endswith(".safetensors")]
    # The store's pace: these buffers are allocated and touched once, as the trainer's tensors are.
    touched = [torch.ones(o.size, dtype=torch.uint8).numpy() for o in tensor_files]

    def floor(new: bool) -> float:
        """The store's own pace for these bytes: the tensor files' ranges read by concurrent
        ranged GETs, each checksummed (CRC32C), as the restores read them; nothing listed,
        parsed or placed. Into memory already touched (the trainer's own tensors), or new."""
        import google_crc32c

        os.sync()
        t0 = time.perf_counter()
        objs = [storage.open_ranged(o.key, o) for o in tensor_files]
        bufs = [torch.empty(o.size, dtype=torch.uint8).numpy() for o in objs] if new else touched

        def one(job: tuple[int, int, int]) -> None:
            i, start, end = job
            objs[i].fetch_into(start, [memoryview(bufs[i][start:end])])
            google_crc32c.extend(0, bufs[i][start:end])

        jobs = [(i, s, e) for i, o in enumerate(objs) for s, e in byte_ranges(o.size, o.chunk)]
        with ThreadPoolExecutor(max_workers=2 * max(o.concurrency for o in objs)) as pool:
            list(pool.map(one, jobs))
        return time.perf_counter() - t0

    res = interleaved(
        reps,
        {
            "granted": granted,
            "floor": lambda: floor(False),
            "trainer": trainer,
            "sg": sg,
            "naive": naive,
            "chunks": lambda: granted(chunked),
            "floor-new": lambda: floor(True),
        },
    )
    sg_times, naive_times, trainer_times, chunk_times = res["sg"], res["naive"], res["trainer"], res["chunks"]
    floor_times, new_times, granted_times = res["floor"], res["floor-new"], res["granted"]
    granted_ratio = per_round(granted_times, floor_times, higher_is_better=False)
    ctx.costs["resume"] = median(granted_times)  # the goodput scenarios: what a resumed trainer pays
    s = Section(
        "Resume: download + verify + load",
        "resume",
        ["method", "seconds (median, min-max)", "this / the store's pace, per round [IQR]"],
    )

    def row(label: str, times: list[float]) -> list[str]:
        ratio = per_round(times, floor_times, higher_is_better=False)
        return [label, f"{fmt(median(times))} ({fmt(min(times))}-{fmt(max(times))})", ratio.cell()]

    s.rows += [
        row(
            "the trainer's path under `spotguard run`: the supervisor's restore grant (the newest checkpoints "
            "listed, their manifests read, one presigned GET URL per object; no data read), then "
            "`Checkpointer.restore(model, optimizer)` streams the checkpoint by presigned ranged GETs "
            "straight into the trainer's own parameters and optimizer state, CRC32C per range, checked "
            "against the manifest (the local copy follows in the background, not timed)",
            granted_times,
        ),
        row(
            "the same, the checkpoint stored incrementally (the default: content-addressed chunks, each "
            "checked by size and CRC32C as it lands)",
            chunk_times,
        ),
        row(
            "the local-copy path (a pod by default, `--no-restore-grant`, a store that cannot sign): "
            "restore_latest into the checkpoint "
            "directory (checked in one pass, not fsynced), recorded as verified; then `Checkpointer.restore`: "
            "sizes checked, not checksummed again, the bytes read from the page cache into the trainer's tensors",
            trainer_times,
        ),
        row(
            "restore_latest_state (streamed into new tensors, checksummed on the way; no local copy)",
            sg_times,
        ),
        row("boto3 download_file + torch.load(weights_only=True) (no verification)", naive_times),
        row(
            "the store's pace: the tensor files' bytes by the same concurrent ranged GETs into memory "
            "already touched (as the trainer's tensors are), CRC32C per range; nothing listed, parsed or placed",
            floor_times,
        ),
        row("the store's pace into new memory (each round allocates its buffers)", new_times),
    ]
    goal(
        s,
        "the trainer's path within 1.10x of the store's pace into touched memory, bit-exact",
        granted_ratio,
        1.10,
        detail=f"bit-exact, into the tensors' own memory, in {sum(exact)} of {len(exact)} restores",
    )
    if not all(exact):
        s.goals[-1] = (s.goals[-1][0], False, s.goals[-1][2])

    def med(rounds: list[dict[str, float]], k: str) -> float:
        return median([r.get(k, 0.0) for r in rounds])

    stages = [stage for _, _, stage in _restore_stages(storage)]
    stages = list(dict.fromkeys(stages))
    profile = ", ".join(f"{k} {med(stage_rounds, k):.2f}s" for k in stages)
    trainer_profile = ", ".join(f"{k} {med(trainer_rounds, k):.2f}s" for k in trainer_rounds[0])
    granted_profile = ", ".join(f"{k} {med(granted_rounds, k):.2f}s" for k in granted_rounds[0])
    naive_profile = ", ".join(f"{k} {med(naive_rounds, k):.2f}s" for k in naive_rounds[0])
    s.notes.append(
        f"{reps} interleaved rounds (dirty pages flushed before each), {ctx.state_bytes / GiB:.2f} GiB of model "
        f"and optimizer state; each ratio is per round against the store's pace into touched memory of the same "
        f"round. The trainer's path, per stage (median, files and chunks together): {granted_profile}. The "
        f"local-copy path: {trainer_profile}. The streamed restore: {profile}. The naive path: {naive_profile}."
    )
    s.notes.append(
        "Which is which: a trainer under `spotguard run` resumes by the first row's path. The supervisor holds "
        "the store's credentials and grants the trainer reads of the newest checkpoints (presigned URLs, in a "
        "0600 file of the control directory, removed once read); the trainer streams one into its own "
        "parameters and optimizer moments, memory it already touched, and answers which; the supervisor then "
        "restores that checkpoint into the checkpoint directory in the background (a restart on the same "
        "machine, the next save's links to unchanged files). A TrainingJob's pod resumes the same way with "
        "`checkpoint.restoreGrant: true` (the restore init container grants, the sidecar copies). A pod by "
        "default (its trainer image may hold a spotguard that knows no grant), `spotguard run "
        "--no-restore-grant`, and a store that cannot sign (file://, GCS without a signing key) resume by the "
        "local-copy path: every byte into new pages of the "
        "page cache first, then copied into the trainer's tensors. The store's pace is what any restore of "
        "these bytes from this store costs at least; into new memory it costs more (the last row)."
    )
    if not s.goals[-1][1]:
        grant = med(granted_rounds, "grant")
        stream = med(granted_rounds, "streamed into the trainer's tensors")
        s.notes.append(
            f"Why the goal is missed here: the grant costs {grant:.2f}s (listing, the manifest, signing) and "
            f"the stream {stream:.2f}s (medians of both rows), against the store's pace of "
            f"{median(floor_times):.2f}s; the verdict goes by the worse quartile of the per-round ratios."
        )
    if ctx.profile:
        s.notes.append(
            "cProfile of one more restore (main thread, top 12 by cumulative time; the ranged GETs "
            "run on worker threads):\n\n```\n" + _cprofile(lambda: sg()) + "```"
        )
        stage_rounds.pop()  # the profiled round is not one of the measured ones
    s.plot = _plot_bars(
        ctx.plots / "resume.png",
        "Resume time",
        ["trainer's path (grant)", "local copy", "streamed", "naive", "store's pace", "store, new memory"],
        [
            median(granted_times),
            median(trainer_times),
            median(sg_times),
            median(naive_times),
            median(floor_times),
            median(new_times),
        ],
        "seconds",
        [
            _range(granted_times),
            _range(trainer_times),
            _range(sg_times),
            _range(naive_times),
            _range(floor_times),
            _range(new_times),
        ],
    )
    return s


def _cprofile(fn: Callable[[], Any]) -> str:
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(12)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip()) + "\n"


# --- SIGTERM -> verified in S3 --------------------------------------------------


def _sigterm_once(
    ctx: Ctx, nbytes: int, extra_env: dict[str, str]
) -> tuple[float, int, dict[str, float], Path, dict[str, float]]:
    """One ``spotguard run`` preempted by SIGTERM: seconds to a verified
    checkpoint, exit code, seconds per stage from its log (and ``linked``: 1 when the
    trainer's preemption save linked its tensor file from the host buffers' arena), the
    local copy of the checkpoint it shipped (the bytes the raw baseline uploads), and the
    CPU seconds each part used from SIGTERM to the end (:class:`CpuWatch`). ``extra_env``:
    set for ``spotguard run`` and its trainer."""
    from spotguard.checkpoint import latest_verified, list_local_committed, restore_checkpoint

    assert ctx.s3 is not None
    prefix = f"bench-sigterm-{uuid.uuid4().hex[:8]}"
    workdir = ctx.work / prefix
    env = {
        **os.environ,
        **ctx.s3.env(),
        "SPOTGUARD_SAVE_EVERY_STEPS": "100000000",
        "PYTHONPATH": str(ROOT),
        **extra_env,
    }
    spotguard_bin = Path(sys.executable).parent / "spotguard"
    proc = subprocess.Popen(
        [
            str(spotguard_bin),
            "run",
            "--storage",
            f"s3://{ctx.s3.bucket}/{prefix}",
            "--workdir",
            str(workdir),
            "--grace-seconds",
            "600",
            "--no-incremental",  # whole files: this section measures plain checkpoints against a raw upload
            "--",
            sys.executable,
            str(ROOT / "bench" / "sigterm_trainer.py"),
            "--bytes",
            str(nbytes),
            "--routine",  # preempted after a routine checkpoint, as a training run usually is
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    ready = routine = False
    for line in proc.stdout:
        lines.append(line)
        ready = ready or line.strip() == "ready"
        routine = routine or "stage=pointer " in line  # the routine checkpoint is verified in storage
        if ready and routine:
            break
    else:
        raise RuntimeError("trainer never became ready:\n" + "".join(lines[-20:]))
    time.sleep(1.0)
    os.sync()  # the trainer's allocation must not be written back on the clock
    cpu = CpuWatch(root=proc.pid)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=900)
    latency = time.perf_counter() - t0
    used = cpu.stop()
    storage = ctx.storage(prefix)
    info, _ = latest_verified(storage)
    if info is None:
        raise RuntimeError("no verified checkpoint after SIGTERM:\n" + "".join(lines[-10:]) + rest[-3000:])
    stages = parse_stage_lines(rest)
    stages["linked"] = 1.0 if "linked from its host buffers" in rest else 0.0
    local = [p for p in list_local_committed(workdir / "checkpoints") if p.name == info.name]
    copy = local[0] if local else restore_checkpoint(storage, info.name, workdir / "copy").uri
    _drop_prefix(ctx, prefix)
    return latency, proc.returncode, stages, Path(copy), used


def _raw_upload(ctx: Ctx, src: Path) -> tuple[float, dict[str, float]]:
    """The project's own concurrent multipart upload of a checkpoint's data
    files and manifest, and nothing else: no pointer, no verification. Seconds,
    and the CPU seconds of this process and the store meanwhile."""
    prefix = f"bench-raw-{uuid.uuid4().hex[:8]}"
    storage = ctx.storage(prefix)
    files = sorted(p for p in src.iterdir() if p.is_file())
    os.sync()
    cpu = CpuWatch()
    t0 = time.perf_counter()
    storage.upload_files([(p, f"{src.name}/{p.name}") for p in files])
    dt = time.perf_counter() - t0
    used = cpu.stop()
    _drop_prefix(ctx, prefix)
    return dt, used


#: The SIGTERM section's two ways of running: (key, label, environment of ``spotguard run``).
SIGTERM_VARIANTS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("default", "default", {}),
    ("written", "host buffers not moved (`SPOTGUARD_STAGING_ARENA=false`)", {"SPOTGUARD_STAGING_ARENA": "false"}),
)


def bench_sigterm(ctx: Ctx) -> Section:
    sizes = [float(x) for x in os.environ.get("BENCH_SIGTERM_GB", "0.25,1,2").split(",")]
    reps = ctx.rounds_for(3)
    keys = [(gb, v) for gb in sizes for v, _, _ in SIGTERM_VARIANTS]
    # (size, variant) -> rounds of (SIGTERM -> verified, exit code, stages, raw upload of the same bytes)
    results: dict[tuple[float, str], list[tuple[float, int, dict[str, float], float]]] = {k: [] for k in keys}
    # (size, variant) -> rounds of (CPU seconds per part of the SIGTERM run, of the raw upload)
    cpu: dict[tuple[float, str], list[tuple[dict[str, float], dict[str, float]]]] = {k: [] for k in keys}
    # The raw upload goes after the SIGTERM runs in even rounds and before them in odd ones (uploading the
    # previous round's checkpoint of the same size: the same files, the same sizes), so that neither
    # always meets the store first (a store grows its volumes on the first writes after a deletion);
    # the two SIGTERM runs of a size swap their order every round too.
    kept: dict[float, Path] = {}
    for r in range(reps):
        for gb in sizes:
            first = r % 2 == 1 and gb in kept
            raw, raw_cpu = _raw_upload(ctx, kept[gb]) if first else (0.0, {})
            runs = {}
            for v, _, extra_env in SIGTERM_VARIANTS[:: 1 if r % 2 == 0 else -1]:
                runs[v] = _sigterm_once(ctx, int(gb * GiB), extra_env)
                copy = runs[v][3]
                keep = ctx.work / f"sigterm-copy-{gb:g}" / copy.name
                shutil.rmtree(keep.parent, ignore_errors=True)
                keep.parent.mkdir(parents=True)
                shutil.move(copy, keep)
                shutil.rmtree(copy.parents[1], ignore_errors=True)
                kept[gb] = keep
            if not first:
                raw, raw_cpu = _raw_upload(ctx, kept[gb])
            for v, (latency, rc, stages, _, sig_cpu) in runs.items():
                results[(gb, v)].append((latency, rc, stages, raw))
                cpu[(gb, v)].append((sig_cpu, raw_cpu))
            print(
                f"   {gb:g} GiB round {r + 1}: SIGTERM -> verified "
                + ", ".join(f"{v} {runs[v][0]:.2f}s" for v in runs)
                + f", raw upload {raw:.2f}s ({'before' if first else 'after'})",
                flush=True,
            )
    for keep in kept.values():
        shutil.rmtree(keep.parent, ignore_errors=True)
    # Linear fit latency = a + b * size over the medians of the default, to estimate the largest state that
    # fits 25 s (the goodput scenarios take the default's costs: nothing set aside).
    xs = sizes
    ys = [median([x[0] for x in results[(gb, "default")]]) for gb in sizes]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else ys[0] / xs[0]
    a = my - b * mx
    fits = (25 - a) / b if b > 0 else float("inf")
    ctx.costs["emergency_per_gb"] = b
    ctx.costs["emergency_fixed"] = a
    # How much one preemption's emergency time varies (its largest size): the goodput scenarios draw from it.
    spread = Spread.of([x[0] for x in results[(max(sizes), "default")]], higher_is_better=False)
    ctx.costs["emergency_sigma"] = goodput.sigma_from_quartile(spread.median, spread.q3)
    s = Section(
        "SIGTERM to checkpoint verified in S3",
        "sigterm",
        [
            "state",
            "staging",
            "SIGTERM -> verified (s)",
            "raw upload of the same bytes (s)",
            "SIGTERM -> verified / raw upload, per round [IQR]",
            "exit code",
        ],
    )
    all_stages: list[str] = []
    for gb in sizes:
        for v, label, _ in SIGTERM_VARIANTS:
            rounds = results[(gb, v)]
            lat, raws = [x[0] for x in rounds], [x[3] for x in rounds]
            ratio = per_round(lat, raws, higher_is_better=False)
            codes = sorted({str(x[1]) for x in rounds})
            s.rows.append([f"{gb:g} GiB", label, fmt(median(lat)), fmt(median(raws)), ratio.cell(), ",".join(codes)])
            if gb >= 1:
                goal(
                    s,
                    f"SIGTERM -> verified within 1.25x a raw upload of the same bytes ({gb:g} GiB, {label})",
                    ratio,
                    1.25,
                )
            for x in rounds:
                all_stages += [k for k in x[2] if k not in all_stages]
    s.notes.append(
        f"`spotguard run` supervising a trainer with the given state, SIGTERM to the supervisor once the "
        f"trainer's routine checkpoint (step 1) is verified in storage, as a training run is usually "
        f"preempted after one (its host buffers are then allocated; a trainer's very first save also pays "
        f"for fresh memory): the trainer saves at its next step boundary, the supervisor uploads, verifies "
        f"and exits. Each size runs twice per round: by default, where after the routine checkpoint "
        f"the trainer moved its host buffers into `/dev/shm`, laid out as the checkpoint's file, and the "
        f"preemption's save links that file instead of writing it (docs/checkpoint-format.md, \"Host buffers "
        f"laid out as the checkpoint's files\"; `linked` in the stage table: the share of runs whose save did), "
        f"and with `SPOTGUARD_STAGING_ARENA=false`, where the save writes its file from the host buffers into "
        f"new pages of `/dev/shm`, as before. In the "
        f"same round the checkpoint files of that size are uploaded again with the project's own concurrent "
        f"multipart upload (`Storage.upload_files`) and nothing else: no pointer, no verification (after the "
        f"SIGTERM runs in even rounds, before them in odd ones, then with the previous round's files). "
        f"{reps} rounds, sizes interleaved; dirty pages flushed before each timed step. A linear fit of the "
        f"default gives {a:.1f} s + {b:.1f} s/GiB, so the largest state that fits a 25 s budget on this machine "
        f"is about **{max(fits, 0):.2f} GiB**; on a real cloud node the store is remote and parallel, so the "
        "per-GiB cost is the network's, not this machine's."
    )
    # Where the emergency path's time goes, from the `stage=... seconds=...` lines the supervisor logs.
    s.notes.append(
        "Where the time goes, median seconds per stage from the supervisor's stage log lines "
        "(`stage=<name> seconds=<s>`; `ship` is upload + verify, `emergency` the whole path). The trainer "
        "writes the preemption's checkpoint to memory (`/dev/shm`, see docs/checkpoint-format.md, \"A "
        "preemption's save staged in memory\") and the supervisor sends it while it is written: `save` and "
        "`follow` both count from the request, and `upload` is then the resumed upload after the commit "
        "(the small files and the manifest). SIGTERM -> verified ends when `spotguard run` exits, which frees "
        "the staged copy's memory after it exits:\n"
    )
    s.notes.append(
        "| state | staging | SIGTERM -> verified | "
        + " | ".join(all_stages)
        + " |\n|"
        + "---|" * (len(all_stages) + 3)
        + "\n"
        + "\n".join(
            f"| {gb:g} GiB | {label} | {median([x[0] for x in results[(gb, v)]]):.2f} | "
            + " | ".join(f"{median([x[2].get(k, 0.0) for x in results[(gb, v)]]):.2f}" for k in all_stages)
            + " |"
            for gb in sizes
            for v, label, _ in SIGTERM_VARIANTS
        )
    )
    s.notes.append(_sigterm_cpu_note(sizes, results, cpu))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for v, label, _ in SIGTERM_VARIANTS:
        med = [median([x[0] for x in results[(gb, v)]]) for gb in sizes]
        lo = [med[i] - min(x[0] for x in results[(gb, v)]) for i, gb in enumerate(sizes)]
        hi = [max(x[0] for x in results[(gb, v)]) - med[i] for i, gb in enumerate(sizes)]
        ax.errorbar(xs, med, yerr=[lo, hi], fmt="o-", capsize=4, label=f"SIGTERM -> verified, {label.split(' (')[0]}")
    ax.plot(
        xs,
        [median([x[3] for x in results[(gb, "default")]]) for gb in sizes],
        "s--",
        color="#999999",
        label="raw upload of the same bytes",
    )
    ax.axhline(25, color="red", ls="--", label="25 s budget")
    ax.set_xlabel("state size (GiB)")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    ctx.plots.mkdir(parents=True, exist_ok=True)
    fig.savefig(ctx.plots / "sigterm.png", dpi=110)
    plt.close(fig)
    s.plot = f"{ctx.plots.name}/sigterm.png"
    return s


def _sigterm_cpu_note(
    sizes: list[float],
    results: dict[tuple[float, str], list[tuple[float, int, dict[str, float], float]]],
    cpu: dict[tuple[float, str], list[tuple[dict[str, float], dict[str, float]]]],
) -> str:
    """Where the SIGTERM runs' and the raw uploads' CPU went, and how the
    SIGTERM path's extra CPU compares with its extra time."""
    parts = ["trainer", "supervisor", "client", "store", "all"]
    rows = []
    for gb in sizes:
        runs = [(f"SIGTERM -> verified, {label}", (gb, v), 0, 0) for v, label, _ in SIGTERM_VARIANTS]
        for name, key, which, col in [*runs, ("raw upload", (gb, "default"), 1, 3)]:
            walls = [x[col] for x in results[key]]
            used = [c[which] for c in cpu[key]]
            cells = [fmt(median([u.get(k, 0.0) for u in used])) for k in parts]
            busy = median([u.get("all", 0.0) / w for u, w in zip(used, walls, strict=True) if w > 0])
            rows.append(f"| {gb:g} GiB | {name} | " + " | ".join(cells) + f" | {busy:.2f} |")
    ratios = []
    for gb in sizes:
        for v, label, _ in SIGTERM_VARIANTS:
            c = cpu[(gb, v)]
            cpu_ratio = per_round([x[0].get("all", 0.0) for x in c], [x[1].get("all", 0.0) for x in c])
            ratios.append(f"{gb:g} GiB {label.split(' (')[0]} {cpu_ratio.cell()}")
    return (
        "CPU seconds (user + system) from SIGTERM to the end, and during the raw upload, median per part "
        "(read from `/proc` every 0.1 s by `bench.common.CpuWatch`: `trainer` is every process the "
        "supervisor started, `client` the benchmark's own process, which makes the raw upload; `all / wall` "
        "is how many of this machine's cores were busy with them on average). The SIGTERM run's CPU over the "
        "raw upload's, per round: " + "; ".join(ratios) + ". Where both keep the two cores busy, the ratio of "
        "times follows the ratio of CPU: the trainer's save and what the supervisor does beyond the upload "
        "(following the file, verifying, the pointer) are time taken from the upload and the store on the "
        "same cores, which on a node whose store is remote they would not be.\n\n"
        "| state | run | "
        + " | ".join(parts)
        + " | all / wall |\n|"
        + "---|" * (len(parts) + 3)
        + "\n"
        + "\n".join(rows)
    )


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
        ship=ctx.costs.get("emergency_fixed", 2.0) + per_gb * gb,  # a routine checkpoint's way to verified
    )
    source = (
        "come from this run"
        if "stall_sg" in ctx.costs
        else "are defaults (run it with the other benchmarks to use measured ones)"
    )
    trace = goodput.Trace(mtbf_hours=1.0, notice_seconds=30.0, job_hours=24.0)
    res = goodput.compare(costs, trace, trials=400, seed=7)
    s = Section(
        "Goodput over a preemption trace (simulation)",
        "goodput",
        ["strategy", "checkpoint interval", "goodput", "wall hours for 24 h of compute"],
    )
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
    s.plot = _plot_bars(
        ctx.plots / "goodput.png",
        "Goodput",
        [r.name.split(" ")[0] for r in res],
        [r.goodput * 100 for r in res],
        "% useful compute",
    )
    _seven_b_scenarios(ctx, s, resume_per_gb=ctx.costs.get("resume", 5.0) / max(gb, 1e-9))
    return s


#: A 7B model: bf16 weights (14 GiB); full training with AdamW in mixed precision keeps fp32 master
#: weights and two moments besides (16 bytes a parameter: 112 GB), here over 4 nodes.
SEVEN_B_FROZEN_GIB = 14.0
SEVEN_B_ADAPTER_GIB = 0.1  # LoRA adapter + its AdamW moments
SEVEN_B_FULL_GB, SEVEN_B_NODES = 112.0, 4


def _seven_b_scenarios(ctx: Ctx, s: Section, resume_per_gb: float) -> None:
    """A 7B LoRA fine-tune and a 7B full training, at a 30 s and a 120 s notice, with this run's costs per GiB."""
    measured = "emergency_per_gb" in ctx.costs and "incr_per_frozen_gb" in ctx.costs
    per_gb = ctx.costs.get("emergency_per_gb", 10.0)  # plain: every byte saved, uploaded, verified
    fixed = ctx.costs.get("emergency_fixed", 2.0)
    per_frozen = ctx.costs.get("incr_per_frozen_gb", 4.15)  # incremental: per GiB of unchanged base
    incr_fixed = ctx.costs.get("incr_fixed", fixed)
    sigma = ctx.costs.get("emergency_sigma", 0.1)
    # The store's throughput per node is an input: BENCH_STORE_GIBPS (GiB/s, e.g. a cloud store's), else this
    # machine's, measured as the plain emergency path's seconds per GiB (save, upload and verify of each byte).
    measured_gibps = 1.0 / per_gb if per_gb > 0 else float("inf")
    given = os.environ.get("BENCH_STORE_GIBPS", "").strip()
    store_gibps = float(given) if given else measured_gibps
    per_gb = 1.0 / store_gibps
    per_node = SEVEN_B_FULL_GB * 1e9 / GiB / SEVEN_B_NODES  # each node saves and uploads its share at once
    lora = incr_fixed + per_frozen * SEVEN_B_FROZEN_GIB + per_gb * SEVEN_B_ADAPTER_GIB
    full = fixed + per_gb * per_node
    # A blocking periodic checkpoint costs the whole state's save + upload in both.
    # (name, emergency and routine way to verified, blocking save + upload, state a node restores)
    workloads = [
        (
            f"7B LoRA fine-tune ({SEVEN_B_FROZEN_GIB:g} GiB frozen base, incremental)",
            lora,
            fixed + per_gb * (SEVEN_B_FROZEN_GIB + SEVEN_B_ADAPTER_GIB),
            SEVEN_B_FROZEN_GIB + SEVEN_B_ADAPTER_GIB,
        ),
        (
            f"7B full training ({SEVEN_B_FULL_GB:g} GB over {SEVEN_B_NODES} nodes, {per_node:.0f} GiB each)",
            full,
            full,
            per_node,
        ),
    ]
    rows = []
    verdicts: list[str] = []
    for name, emergency, blocking, state_gib in workloads:
        costs = goodput.Costs(
            stall_spotguard=ctx.costs.get("stall_sg", 0.1),
            stall_periodic=blocking,
            emergency=emergency,
            restart=30.0 + resume_per_gb * state_gib,
            emergency_sigma=sigma,
            ship=emergency,
        )
        for notice in (30.0, 120.0):
            r = goodput.run_scenario(goodput.Scenario(name, costs, notice))
            verdicts.append(
                f"{name.split(' (')[0]} at a {notice:.0f} s notice "
                + ("fits" if r.in_time >= 0.95 else f"does not fit ({r.in_time:.0%} verified in time)")
            )
            rows.append(
                [
                    name,
                    f"{notice:.0f} s",
                    fmt(emergency, 1),
                    f"{r.in_time:.0%}",
                    f"{r.spotguard.goodput:.1%}",
                    f"{r.periodic.goodput:.1%}",
                ]
            )
    table = (
        "| workload | notice | emergency save + upload + verify (s, median) | preemptions verified in time "
        "| goodput, spotguard | goodput, periodic only |\n|---|---|---|---|---|---|\n"
        + "\n".join("| " + " | ".join(r) + " |" for r in rows)
    )
    src = (
        "this run's costs"
        if measured
        else "default costs (run with the sigterm and incremental sections to use measured ones)"
    )
    if given:
        src += f", the store's throughput given as {store_gibps:.3g} GiB/s per node (BENCH_STORE_GIBPS)"
    need = _throughput_needed(
        [
            (
                f"7B full training ({per_node:.0f} GiB per node)",
                f"{per_node:.0f} GiB, every byte",
                per_node,
                fixed,
            ),
            (
                f"7B LoRA fine-tune ({SEVEN_B_FROZEN_GIB:g} GiB frozen)",
                f"{SEVEN_B_ADAPTER_GIB:g} GiB adapter (the frozen base compared, not moved: "
                f"{per_frozen * SEVEN_B_FROZEN_GIB:.2f} s)",
                SEVEN_B_ADAPTER_GIB,
                incr_fixed + per_frozen * SEVEN_B_FROZEN_GIB,
            ),
        ],
        measured_gibps,
    )
    s.notes.append(
        f"The users' scale, with {src} scaled per GiB: plain {per_gb:.2f} s/GiB + {fixed:.1f} s, incremental "
        f"{per_frozen:.2f} s per GiB of unchanged base + {incr_fixed:.1f} s; each preemption's emergency time "
        f"drawn lognormal around the median (sigma {sigma:.2f}, from the spread of the measured rounds); a "
        f"restart is 30 s plus the resume, {resume_per_gb:.2f} s/GiB of a node's state; a routine checkpoint "
        f"counts once verified, as long after its snapshot as an emergency one takes. "
        f"One preemption an hour, 24 h jobs, 400 simulated jobs each.\n\n{table}\n\n{need}\n\n"
        f"On these costs: {'; '.join(verdicts)} (fits: at least 95% of preemptions verified in time). "
        f"The fine-tune's emergency checkpoint is the adapter and a comparison of the frozen base with its "
        f"host copy ({per_frozen:.2f} s per frozen GiB here), so the notice is not its limit. The full "
        f"training's is each node's {per_node:.0f} GiB share at {per_gb:.2f} s/GiB ({full:.0f} s), about the "
        "time this machine's store takes those bytes: it fits where the store takes a node's share within "
        "the notice, which is a matter of the store's speed per node, not of spotguard; where it does not, "
        "the routine checkpoints it resumes from are what bounds the loss (the goodput column).\n\n"
        "These costs are those of this machine, whose S3 store shares two cores with the trainer: a cloud "
        "store takes a node's upload several times faster, so the seconds here are an upper bound. What does "
        "not change with the store is the shape: the full training's emergency path moves every byte of each "
        "node's share, so its time is the node's share over the store's speed; the LoRA fine-tune's path sends "
        "and checks only the adapter, but its save still compares the unchanged base with its host copy at "
        "memory speed (on a GPU, on the device), so it grows a little with the frozen size, not with the store."
    )


def _throughput_needed(workloads: list[tuple[str, str, float, float]], measured_gibps: float) -> str:
    """A table: for each workload ``(name, what a node moves, GiB moved, seconds that do not depend on
    the bytes moved)``, the per-node throughput a 30 s and a 2 min notice need, beside this machine's."""

    def cell(v: float | None) -> str:
        return "none fits (fixed costs take the notice)" if v is None else f"{v:.3f} GiB/s ({v * GiB / 1e6:.0f} MB/s)"

    rows = [
        f"| {name} | {moved} | {fixed:.1f} | "
        f"{cell(goodput.needed_throughput(gib, 30.0, fixed))} | {cell(goodput.needed_throughput(gib, 120.0, fixed))} | "
        f"{cell(measured_gibps)} |"
        for name, moved, gib, fixed in workloads
    ]
    return (
        "The per-node throughput of the emergency path (save, upload and verify of the bytes a node moves at "
        "SIGTERM) that a notice needs, against what this machine measured (its plain emergency path's seconds "
        "per GiB); the fixed seconds are what does not grow with the bytes moved (set `BENCH_STORE_GIBPS` to "
        "run the scenarios above at another store's throughput):\n\n"
        "| workload | a node moves at SIGTERM | fixed seconds | needed for a 30 s notice | needed for a 2 min notice "
        "| this machine measured |\n|---|---|---|---|---|---|\n" + "\n".join(rows)
    )


BENCHES: dict[str, Any] = {
    "checksum": bench_checksum,
    "stall": bench_stall,
    "upload": bench_upload,
    "resume": bench_resume,
    "sigterm": bench_sigterm,
    "operator": None,  # filled in below when the operator benchmark module is present
    "storage-requests": storage_requests.bench_storage_requests,
    "flags": dist.bench_flags,
    "dist-stall": dist.bench_dist_stall,
    "dist-sigterm": dist.bench_dist_sigterm,
    "dist-finetune": dist.bench_dist_fine_tune,
    "gang": gang.bench_gang,
    "frameworks": frameworks.bench_frameworks,
    "incremental": incremental.bench_incremental,
    "preempt-upload": preempt_upload.bench_preempt_upload,
    "finetune-sigterm": linear_finetune.bench_finetune_sigterm,
    "dist-frozen": dist_frozen.bench_dist_frozen,
    "goodput": bench_goodput,  # last: it uses the costs the sections before it measured
}
try:
    from bench import operator_bench

    BENCHES["operator"] = operator_bench.bench_operator
except ImportError:  # pragma: no cover
    del BENCHES["operator"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(BENCHES), help="comma-separated benchmarks")
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds per section (default: each section's own, 3 to 7)"
    )
    parser.add_argument("--profile", action="store_true", help="add a cProfile of one restore to the resume section")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="report file (default: docs/benchmarks.md for a full run, a temporary "
        "directory for a partial one); plots go to bench/ next to it",
    )
    parser.add_argument(
        "--costs",
        type=Path,
        default=None,
        help="start from the costs.json of an earlier run (what goodput uses), each replaced by a section run now",
    )
    args = parser.parse_args(argv)
    chosen = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = set(chosen) - set(BENCHES)
    if unknown:
        parser.error(f"unknown benchmarks {sorted(unknown)}; choose from {list(BENCHES)}")
    full = set(chosen) == set(BENCHES) and args.rounds is None
    output: Path = args.output or (
        DOCS / "benchmarks.md" if full else Path(tempfile.gettempdir()) / "spotguard-bench" / "benchmarks.partial.md"
    )
    plots = PLOTS if output.parent.resolve() == DOCS.resolve() else output.parent / "bench"
    plots.mkdir(parents=True, exist_ok=True)
    state_mb = int(os.environ.get("BENCH_STATE_MB", "512"))
    started = time.time()
    sections: list[Section] = []
    with tempfile.TemporaryDirectory(prefix="spotguard-bench-", dir=os.environ.get("BENCH_TMP")) as tmp:
        work = Path(tmp)
        # The operator benchmark starts its own store.
        needs_s3 = bool({"upload", "resume", "sigterm", "dist-sigterm", "dist-finetune"} & set(chosen))
        needs_kube = bool({"operator", "gang"} & set(chosen))
        with cluster.running(work / "services", kube=needs_kube, s3=needs_s3) as env:
            ctx = Ctx(work, env.s3, state_mb, rounds=args.rounds, plots=plots, profile=args.profile)
            ctx.kube = env.kube
            if args.costs is not None:
                ctx.costs.update(json.loads(args.costs.read_text()))
            for name in BENCHES:
                if name not in chosen:
                    continue
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
        "(this file and the plots in `docs/bench/` are overwritten).",
        "",
        "Each ratio is the **median of per-round ratios** over interleaved rounds (every round runs spotguard "
        "and its baseline once, alternating which goes first), shown with its interquartile range [IQR] and "
        "min-max. A goal is **met only when the worse quartile meets it** (the lower quartile where higher is "
        "better): a verdict that one lucky or unlucky round cannot flip. The machine is shared and the S3 "
        "store runs on the same cores, so single timings move between runs; the spreads show by how much.",
        "",
        f"Machine: {os.cpu_count()} cores, {_mem_gib():.0f} GiB memory, {platform.platform()}, "
        f"Python {platform.python_version()}, torch {_torch_version()}; the S3 store (SeaweedFS) and the "
        f"control plane run on the same machine. Run took {elapsed / 60:.1f} min"
        + (f", {args.rounds} rounds per section (`--rounds`)." if args.rounds else "."),
        "",
    ]
    summary = ["| goal | result |", "|---|---|"]
    for s in sections:
        for text_, met, detail in s.goals:
            summary.append(f"| {s.title}: {text_} | {'met' if met else 'missed'}: {detail} |")
    text = "\n".join(header + ["## Goals", ""] + summary + [""] + [s.markdown() for s in sections])
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    print(text)
    (plots / "costs.json").write_text(json.dumps(ctx.costs, indent=2))
    print(f"\nwrote {output} and plots in {plots}", flush=True)
    return 0


def _mem_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    sys.exit(main())
