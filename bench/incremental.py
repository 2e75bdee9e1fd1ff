"""Incremental (content-addressed) checkpoints: what a checkpoint uploads and
how long SIGTERM -> verified takes, incremental vs plain, through ``spotguard run``.

Three parts, each a section of the report:

- Fine-tune-shaped state (bench.incremental_worker ``finetune``): a frozen
  base of 0.25 / 1 / 4 GiB (BENCH_INCREMENTAL_FROZEN_GB; sizes in
  BENCH_INCREMENTAL_ALONE_GB run once more, incremental alone) and the same small
  adapter trained with AdamW. The trainer checkpoints twice (the first
  stores everything), and once the second is verified in storage gets
  SIGTERM: the preemption checkpoint is a training run's usual one, after
  others, in both modes.
  Measured: bytes the SIGTERM checkpoint uploads (the supervisor's
  ``stage=upload ... bytes=`` line) as a share of the checkpoint's size (its
  stored manifest), and SIGTERM -> verified (SIGTERM to the supervisor until
  its ``stage=verify`` line for that checkpoint).
- Full training (``full``): every tensor changes at every step, so an
  incremental upload stores every byte too and pays for chunking (hashing,
  one request per chunk). Both modes checkpoint once, then SIGTERM.
  Rounds: BENCH_INCREMENTAL_FULL_ROUNDS when set (its goal's 10% margin is
  narrow against this machine's noise, so a run may give it more rounds
  than the others), else --rounds, else 5.
- Hash throughput: SHA-256 (what names a chunk), BLAKE2b, CRC32C, and
  SHA-256 + CRC32C (what an incremental upload computes per chunk).

Every run is its own ``spotguard run`` process against one SeaweedFS store of
this benchmark's own; modes alternate which goes first from round to round.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import (
    GiB,
    MiB,
    Section,
    Spread,
    fmt,
    goal,
    interleaved,
    make_room,
    median,
    per_round,
    seaweedfs_store,
    stage_line,
)
from bench.incremental_worker import ROUTINE

if TYPE_CHECKING:
    from bench.common import Ctx
    from testenv.cluster import S3Store

ROOT = Path(__file__).resolve().parent.parent
ADAPTER_BYTES = 6 * MiB  # adapter parameters (2 MiB) + AdamW's two moments
FULL_STATE_BYTES = 256 * MiB  # full training: parameters + moments, every tensor changes
CHUNK = 16 * MiB  # the largest chunk (spotguard.checkpoint.format.chunks.MAX_CHUNK)
MODES = {"plain": "plain (whole files, --no-incremental)", "incremental": "incremental (the default)"}


@dataclass
class Run:
    """One ``spotguard run`` preempted by SIGTERM."""

    to_verified: float  # SIGTERM -> the supervisor's stage=verify line of the SIGTERM checkpoint
    to_exit: float  # SIGTERM -> the supervisor exited
    size: int  # data bytes of the SIGTERM checkpoint (its stored manifest)
    uploaded: int  # bytes its upload stored (stage=upload bytes=)
    stages: dict[str, float]  # seconds per stage of the emergency path
    fields: dict[str, str] = field(default_factory=dict)  # the upload line's fields, verify's trusted_chunks
    exit_code: int = 0
    files: list[int] = field(default_factory=list)  # sizes of the checkpoint's data files

    @property
    def chunks(self) -> int:
        return int(self.fields.get("new_chunks", 0)) + int(self.fields.get("reused_chunks", 0))

    def requests(self) -> tuple[int, int]:
        """Requests of its upload (data and manifest; a plain file of 32 MiB or more goes as 32 MiB
        multipart parts plus create and complete) and of its verification (one per file or chunk)."""
        if self.chunks:
            return self.chunks + 1, self.chunks
        up = sum(-(-n // (32 * MiB)) + 2 if n >= 32 * MiB else 1 for n in self.files)
        return up + 1, len(self.files)


class _Lines:
    """The supervisor's merged output, read in a thread, each line with its arrival time."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._cond:
                self.lines.append((time.perf_counter(), line))
                self._cond.notify_all()
        with self._cond:
            self.lines.append((time.perf_counter(), ""))  # end of output
            self._cond.notify_all()

    def wait_for(self, pred: Callable[[str], bool], after: float, timeout: float) -> float:
        """Arrival time of the first line after ``after`` matching ``pred``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for t, line in self.lines:
                    if t >= after and pred(line):
                        return t
                if self.lines and self.lines[-1][1] == "":
                    raise RuntimeError("the supervisor exited:\n" + self.tail())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError("timed out waiting for the supervisor:\n" + self.tail())
                self._cond.wait(min(left, 1.0))

    def since(self, after: float) -> list[str]:
        with self._cond:
            return [line for t, line in self.lines if t >= after]

    def tail(self, n: int = 30) -> str:
        with self._cond:
            return "".join(line for _, line in self.lines[-n:])

    def join(self) -> None:
        self._thread.join(timeout=30)


def _is_stage(stage: str) -> Callable[[str], bool]:
    return lambda line: f"stage={stage} " in line


def _run_once(s3: S3Store, work: Path, mode: str, shape: str, frozen: int, trainable: int) -> Run:
    from spotguard.checkpoint import latest_verified, read_manifest
    from spotguard.storage import open_storage

    prefix = f"bench-incr-{uuid.uuid4().hex[:8]}"
    workdir = work / prefix
    # The trainer's checkpoints on the disk and the store's copy, with room to spare.
    make_room(s3, work, 3 * (frozen + trainable) + 2 * GiB)
    env = {
        **os.environ,
        **s3.env(),
        "SPOTGUARD_SAVE_EVERY_STEPS": "100000000",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("SPOTGUARD_INCREMENTAL", None)  # the option below decides
    cmd = [
        str(Path(sys.executable).parent / "spotguard"),
        "run",
        "--storage",
        f"s3://{s3.bucket}/{prefix}",
        "--workdir",
        str(workdir),
        "--grace-seconds",
        "900",
    ]
    cmd.append("--incremental" if mode == "incremental" else "--no-incremental")
    cmd += [
        "--",
        sys.executable,
        "-m",
        "bench.incremental_worker",
        shape,
        "--frozen-bytes",
        str(frozen),
        "--trainable-bytes",
        str(trainable),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = _Lines(proc)
    try:
        t_ready = out.wait_for(lambda line: line.strip() == "ready", 0.0, 600)
        # The routine checkpoints stored and verified: the SIGTERM one comes after them.
        last_routine = f"name=ckpt-{ROUTINE:012d}"
        out.wait_for(lambda line: _is_stage("pointer")(line) and last_routine in line, t_ready, 900)
        time.sleep(0.5)  # a few more training steps
        os.sync()  # nothing written before the signal is flushed on the clock
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        t_verified = out.wait_for(_is_stage("verify"), t0, 900)
        proc.wait(timeout=900)
        t_exit = time.perf_counter()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.join()
    stages: dict[str, float] = {}
    fields: dict[str, str] = {}
    uploaded = -1
    for line in out.since(t0):
        st = stage_line(line)
        if st is None:
            continue
        stages[st.stage] = stages.get(st.stage, 0.0) + st.seconds
        if st.stage == "upload":
            fields = {**fields, **st.fields}
            uploaded = int(fields.get("bytes", -1))
        elif st.stage == "verify" and "trusted_chunks" in st.fields:  # chunks the verification took as checked
            fields = {**fields, "trusted_chunks": st.fields["trusted_chunks"]}
    storage = open_storage(
        f"s3://{s3.bucket}/{prefix}",
        endpoint_url=s3.endpoint_url,
        region=s3.region,
        access_key=s3.access_key,
        secret_key=s3.secret_key,
    )
    info, _ = latest_verified(storage)
    if info is None or uploaded < 0:
        raise RuntimeError(f"{mode} {shape}: no verified SIGTERM checkpoint:\n" + "".join(out.since(t0))[-4000:])
    manifest = read_manifest(storage, info.name)
    if manifest.chunked != (mode == "incremental") or info.step <= 1:
        raise RuntimeError(f"{mode} {shape}: unexpected newest verified {info.name} (chunked={manifest.chunked})")
    with contextlib.suppress(Exception):  # what the run stored, so that the store's disk stays small
        storage.delete([o.key for o in storage.list_objects("")])
    shutil.rmtree(workdir, ignore_errors=True)
    return Run(
        t_verified - t0,
        t_exit - t0,
        manifest.total_size,
        uploaded,
        stages,
        fields,
        proc.returncode,
        [f.size for f in manifest.files],
    )


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def bench_incremental(ctx: Ctx) -> tuple[Section, Section, Section]:
    load0 = os.getloadavg()[0]
    hashes, speeds = _bench_hashes(ctx)  # first: before the store and the trainers share the cores
    with seaweedfs_store(ctx.work, "incremental-bench") as s3:
        finetune = _bench_finetune(ctx, s3, speeds)
        full = _bench_full(ctx, s3, speeds)
    load1 = os.getloadavg()[0]
    hashes.notes.append(
        f"Load average of the machine (1 min) when this benchmark started: {load0:.1f}, when it ended: "
        f"{load1:.1f}, of {os.cpu_count()} cores: other work on the machine shares them."
    )
    return finetune, full, hashes


# --- fine-tune-shaped state ------------------------------------------------------


def _bench_finetune(ctx: Ctx, s3: S3Store, hash_speed: dict[str, float]) -> Section:
    sizes = [float(x) for x in os.environ.get("BENCH_INCREMENTAL_FROZEN_GB", "0.25,1,4").split(",")]
    reps = ctx.rounds_for(2)
    runs: dict[tuple[float, str], list[Run]] = {(gb, m): [] for gb in sizes for m in MODES}
    for r in range(reps):
        for gb in sizes:
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                run = _run_once(s3, ctx.work, mode, "finetune", int(gb * GiB), ADAPTER_BYTES)
                runs[(gb, mode)].append(run)
                print(
                    f"   finetune {gb:g} GiB {mode} round {r + 1}: SIGTERM -> verified {run.to_verified:.2f}s, "
                    f"uploaded {run.uploaded / MiB:.1f} of {run.size / MiB:.1f} MiB, stages {run.stages}",
                    flush=True,
                )
    s = Section(
        "Incremental checkpoints: fine-tune-shaped state",
        "incremental",
        [
            "frozen base",
            "mode",
            "checkpoint (MiB)",
            "uploaded by the SIGTERM checkpoint (MiB)",
            "share of the checkpoint, per round [IQR]",
            "SIGTERM -> verified (s, median, min-max)",
            "incremental / plain, per round [IQR]",
            "save / upload / verify (s)",
        ],
    )
    for gb in sizes:
        plain, incr = runs[(gb, "plain")], runs[(gb, "incremental")]
        vs = per_round([x.to_verified for x in incr], [x.to_verified for x in plain], higher_is_better=False)
        for mode in MODES:
            rs = runs[(gb, mode)]
            share = Spread.of([100 * x.uploaded / x.size for x in rs], higher_is_better=False)
            lat = [x.to_verified for x in rs]
            st = " / ".join(fmt(median([x.stages.get(k, 0.0) for x in rs])) for k in ("save", "upload", "verify"))
            s.rows.append(
                [
                    f"{gb:g} GiB",
                    MODES[mode],
                    fmt(median([x.size for x in rs]) / MiB, 0),
                    fmt(median([x.uploaded for x in rs]) / MiB, 1),
                    share.cell("%", 1),
                    f"{fmt(median(lat))} ({fmt(min(lat))}-{fmt(max(lat))})",
                    "1.00x" if mode == "plain" else vs.cell(),
                    st,
                ]
            )
    # Sizes measured incremental alone, once (BENCH_INCREMENTAL_ALONE_GB): larger than a plain run of the
    # same size leaves room for in this machine's memory beside the store.
    alone = [float(x) for x in os.environ.get("BENCH_INCREMENTAL_ALONE_GB", "").split(",") if x.strip()]
    lo_median = median([x.to_verified for x in runs[(min(sizes), "incremental")]])
    for gb in alone:
        x = _run_once(s3, ctx.work, "incremental", "finetune", int(gb * GiB), ADAPTER_BYTES)
        print(f"   finetune {gb:g} GiB incremental alone: SIGTERM -> verified {x.to_verified:.2f}s", flush=True)
        st = " / ".join(fmt(x.stages.get(k, 0.0)) for k in ("save", "upload", "verify"))
        s.rows.append(
            [
                f"{gb:g} GiB",
                f"{MODES['incremental']}, one run",
                fmt(x.size / MiB, 0),
                fmt(x.uploaded / MiB, 1),
                f"{100 * x.uploaded / x.size:.1f}%",
                fmt(x.to_verified),
                "plain not run",
                st,
            ]
        )
        s.notes.append(
            f"{gb:g} GiB frozen, incremental alone (one run, after the rounds above; a plain run of this size "
            f"does not fit this machine's memory beside the store): SIGTERM -> verified {x.to_verified:.2f} s, "
            f"{x.to_verified / lo_median:.2f}x the {min(sizes):g} GiB median; it uploaded "
            f"{x.uploaded / MiB:.1f} MiB ({100 * x.uploaded / x.size:.2f}% of {x.size / GiB:.1f} GiB)."
        )
    for gb in sizes:
        incr = runs[(gb, "incremental")]
        share = Spread.of([100 * x.uploaded / x.size for x in incr], higher_is_better=False)
        chunks = incr[0].fields
        goal(
            s,
            f"incremental: a checkpoint after the first uploads < 5% of the full checkpoint ({gb:g} GiB frozen)",
            share,
            5,
            suffix="%",
            detail=f"{chunks.get('new_chunks', '?')} new chunks, {chunks.get('reused_chunks', '?')} reused",
        )
    lo_gb, hi_gb = min(sizes), max(sizes)
    growth = {
        m: per_round(
            [x.to_verified for x in runs[(hi_gb, m)]], [x.to_verified for x in runs[(lo_gb, m)]], higher_is_better=False
        )
        for m in MODES
    }
    met = goal(
        s,
        f"incremental: SIGTERM -> verified does not grow with the frozen part ({hi_gb:g} GiB vs "
        f"{lo_gb:g} GiB frozen, <= 1.25x)",
        growth["incremental"],
        1.25,
        detail=f"plain: {growth['plain'].text()}",
    )

    # How each stage grows with the frozen part: slope over the sizes of the per-size medians.
    def slope(mode: str, key: str) -> float:
        ys = [
            median([(x.to_verified if key == "total" else x.stages.get(key, 0.0)) for x in runs[(gb, mode)]])
            for gb in sizes
        ]
        return _slope(sizes, ys)

    keys = ["total", "save", "upload", "verify"]
    per_gib = {m: {k: slope(m, k) for k in keys} for m in MODES}
    # For the goodput scenarios: SIGTERM -> verified = fixed + per GiB of frozen base, incremental.
    ctx.costs["incr_per_frozen_gb"] = per_gib["incremental"]["total"]
    ctx.costs["incr_fixed"] = max(
        0.0, median([x.to_verified for x in runs[(lo_gb, "incremental")]]) - per_gib["incremental"]["total"] * lo_gb
    )
    s.notes.append(
        f"`spotguard run` supervising a trainer (bench/incremental_worker.py) whose state is a frozen base "
        f"(float32 tensors of 64 MiB, `requires_grad=False`, distinct random values) and an adapter of "
        f"{ADAPTER_BYTES // 3 / MiB:.0f} MiB trained with AdamW ({ADAPTER_BYTES / MiB:.0f} MiB with its two "
        f"moments), the same at every size. Each run checkpoints twice (the first stores everything; in the "
        f"second the frozen base moves to its kept file), waits until the second is verified in storage, then "
        f"gets SIGTERM: the SIGTERM checkpoint is a training run's usual one, after others, in both modes. "
        f"SIGTERM -> verified: "
        f"from SIGTERM to the supervisor until its `stage=verify` line for the SIGTERM checkpoint (the process "
        f"exits {median([x.to_exit - x.to_verified for rs in runs.values() for x in rs]):.2f} s later, median). "
        f"{reps} rounds, sizes in turn, the modes alternating which goes first; dirty "
        f"pages flushed before each SIGTERM. Stages: `save` (the trainer's checkpoint: snapshot, local write, "
        f"CRC32C, fsync; a tensor none of whose pages was written since the last checkpoint is not read, any "
        f"other compared with its host copy of the last checkpoint, an unchanged kept file linked, not "
        f"written), `upload` (incremental: SHA-256 + CRC32C of every changed chunk, a comparison with "
        f"the previous checkpoint's copy for the others, none for a linked file; PUT of each new chunk; the "
        f"SIGTERM's upload asks nothing of the chunks its uploader verified last), `verify` (one store-checksum "
        f"request per file, or per chunk not taken as checked)."
    )
    s.notes.append(
        "How SIGTERM -> verified grows with the frozen part, seconds per GiB of frozen base (least-squares slope "
        f"of the medians over {', '.join(f'{g:g}' for g in sizes)} GiB):\n\n"
        "| mode | SIGTERM -> verified | save | upload | verify |\n|---|---|---|---|---|\n"
        + "\n".join(f"| {MODES[m]} | " + " | ".join(f"{per_gib[m][k]:.2f}" for k in keys) + " |" for m in MODES)
        + f"\n\nFrom {lo_gb:g} to {hi_gb:g} GiB frozen, SIGTERM -> verified grows "
        f"{growth['incremental'].median:.1f}x incremental and {growth['plain'].median:.1f}x plain."
    )
    if not met:
        inc = per_gib["incremental"]
        big = runs[(hi_gb, "incremental")][0]
        s.notes.append(
            f"Why the growth goal is missed: what an incremental SIGTERM checkpoint *uploads* does not grow (the "
            f"same {median([x.uploaded for x in runs[(hi_gb, 'incremental')]]) / MiB:.1f} MiB at every size), "
            f"and neither does what it asks of the store: the upload reads and hashes none of the linked frozen "
            f"file and asks nothing of the {big.fields.get('reused_chunks', '?')} chunks it reuses at {hi_gb:g} "
            f"GiB (they are the checkpoint its uploader verified last), and verification asks only of the new "
            f"ones ({big.fields.get('trusted_chunks', '?')} taken as checked): {inc['upload']:.2f} and "
            f"{inc['verify']:.2f} s/GiB. What still grows is the trainer's save ({inc['save']:.2f} s/GiB; plain: "
            f"{per_gib['plain']['save']:.2f} s/GiB). Its snapshot reads no tensor whose pages were not written "
            "since the last checkpoint (the kernel's write tracking, see docs/checkpoint-format.md); where the "
            "kernel has none (SPOTGUARD_TRACK_WRITES=0, a kernel before 6.7, a sandbox without userfaultfd) it "
            "compares every tensor with its host copy at memory speed. Plain's upload moves every byte "
            f"({per_gib['plain']['upload']:.2f} s/GiB)."
        )
    return s


# --- full training --------------------------------------------------------------


def _bench_full(ctx: Ctx, s3: S3Store, hash_speed: dict[str, float]) -> Section:
    # Cheap runs; the goal's margin (10%) is narrow against this machine's noise.
    reps = int(os.environ.get("BENCH_INCREMENTAL_FULL_ROUNDS", "0")) or ctx.rounds_for(5)

    def one(mode: str) -> Callable[[], Run]:
        def run() -> Run:
            res = _run_once(s3, ctx.work, mode, "full", 0, FULL_STATE_BYTES)
            print(
                f"   full {mode}: SIGTERM -> verified {res.to_verified:.2f}s, "
                f"upload {res.stages.get('upload', 0):.2f}s, uploaded {res.uploaded / MiB:.1f} of "
                f"{res.size / MiB:.1f} MiB, stages {res.stages}",
                flush=True,
            )
            return res

        return run

    res: dict[str, list[Run]] = interleaved(reps, {m: one(m) for m in MODES})
    plain, incr = res["plain"], res["incremental"]
    total = per_round([x.to_verified for x in incr], [x.to_verified for x in plain], higher_is_better=False)
    ship = per_round(
        [x.stages.get("upload", 0.0) + x.stages.get("verify", 0.0) for x in incr],
        [x.stages.get("upload", 0.0) + x.stages.get("verify", 0.0) for x in plain],
        higher_is_better=False,
    )
    s = Section(
        "Incremental checkpoints: full training (chunking overhead)",
        "incremental",
        ["measure", "plain (s, median)", "incremental (s, median)", "incremental / plain, per round [IQR]"],
    )
    s.rows += [
        [
            "SIGTERM -> verified",
            fmt(median([x.to_verified for x in plain])),
            fmt(median([x.to_verified for x in incr])),
            total.cell(),
        ],
        [
            "after the commit: upload + verify",
            fmt(median([x.stages.get("upload", 0.0) + x.stages.get("verify", 0.0) for x in plain])),
            fmt(median([x.stages.get("upload", 0.0) + x.stages.get("verify", 0.0) for x in incr])),
            ship.cell(),
        ],
    ]
    met = goal(s, "full training: chunking overhead on SIGTERM -> verified < 10% (<= 1.10x plain)", total, 1.10)
    size = median([x.size for x in incr])
    chunks = incr[0].fields
    (inc_up, inc_ver), (plain_up, plain_ver) = incr[0].requests(), plain[0].requests()
    s.notes.append(
        f"A model of Linear layers trained with AdamW, {FULL_STATE_BYTES / MiB:.0f} MiB of parameters and "
        f"moments, every tensor changed at every step: the SIGTERM checkpoint ({size / MiB:.0f} MiB) shares "
        f"nothing with the first, so incremental uploads every byte too "
        f"({median([x.uploaded for x in incr]) / MiB:.1f} MiB, {chunks.get('new_chunks', '?')} new chunks, "
        f"{chunks.get('reused_chunks', '?')} reused; plain {median([x.uploaded for x in plain]) / MiB:.1f} MiB). "
        f"Both modes checkpoint once, then get SIGTERM; {reps} interleaved rounds."
    )
    to_verified = median([x.to_verified for x in plain])
    sha_crc = hash_speed.get("sha256+crc32c-2", 0.0)
    hash_s = size / (sha_crc * 1e9) if sha_crc else 0.0
    verify_more = median([x.stages.get("verify", 0.0) for x in incr]) - median(
        [x.stages.get("verify", 0.0) for x in plain]
    )
    s.notes.append(
        "Both modes send the preemption's save while the trainer writes it (`stage=follow`, see "
        "docs/checkpoint-format.md): plain as multipart parts of whole files, incremental as chunks hashed and "
        "stored as soon as the file holds them, so each mode's `upload` after the commit is only what is left "
        "(plain: the files not opened before the commit; incremental: the manifest, naming the chunks found). "
        f"What chunking adds: hashing the checkpoint (SHA-256 + CRC32C at {sha_crc:.2f} GB/s with two threads "
        f"in the hash section below: {hash_s:.2f} s of CPU for {size / MiB:.0f} MiB, "
        f"{100 * hash_s / to_verified:.0f}% of plain's SIGTERM -> verified), done while the trainer writes and "
        f"other chunks are in flight; and requests: the upload sends {inc_up} (a PUT per new chunk, a HEAD per "
        f"known one, the manifest) where plain sends {plain_up} (files of 32 MiB or more as 32 MiB multipart "
        f"parts), and verification asks for {inc_ver} chunks' checksums where plain asks for {plain_ver} "
        f"files' ({verify_more:+.2f} s, median). The save is the same work in both modes."
    )
    if not met:
        s.notes.append(
            f"Why the goal is missed: the store on this machine shares the two cores with the trainer and the "
            f"client, so the hashing ({100 * hash_s / to_verified:.0f}% of plain's time, in CPU) can only partly "
            f"overlap the writes and transfers, and verification adds {verify_more:.2f} s; the per-round spread "
            f"is {total.lo:.2f}-{total.hi:.2f}x. Where a core is free the hashing hides behind the transfer; what "
            "remains is one checksum request per chunk at verification."
        )
    return s


# --- hash throughput --------------------------------------------------------------


def _bench_hashes(ctx: Ctx) -> tuple[Section, dict[str, float]]:
    """The section, and the median GB/s by ``<algorithm>-<threads>``."""
    from concurrent.futures import ThreadPoolExecutor

    import google_crc32c

    from spotguard.checkpoint.format.chunks import hash_chunk

    data = os.urandom(256 * MiB)
    pieces = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]  # bytes: google-crc32c takes no views
    reps = ctx.rounds_for(3)
    fns: dict[str, Callable[[bytes], Any]] = {
        "SHA-256 (hashlib)": lambda v: hashlib.sha256(v).digest(),
        "BLAKE2b (hashlib)": lambda v: hashlib.blake2b(v).digest(),
        "CRC32C (google-crc32c)": google_crc32c.value,
        "SHA-256 + CRC32C (a chunk's name and checksum, `hash_chunk`)": hash_chunk,
    }
    keys = {
        "SHA-256 (hashlib)": "sha256",
        "BLAKE2b (hashlib)": "blake2b",
        "CRC32C (google-crc32c)": "crc32c",
        "SHA-256 + CRC32C (a chunk's name and checksum, `hash_chunk`)": "sha256+crc32c",
    }
    pool = ThreadPoolExecutor(max_workers=2)

    def timed(fn: Callable[[bytes], Any], threads: int) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            if threads == 1:
                fn(data)
            else:
                list(pool.map(fn, pieces))
            return len(data) / (time.perf_counter() - t0) / 1e9

        return run

    methods = {f"{k}|{t}": timed(f, t) for k, f in fns.items() for t in (1, 2)}
    try:
        res = interleaved(reps, methods)
    finally:
        pool.shutdown()
    s = Section(
        "Content hash throughput",
        "incremental",
        [
            "algorithm",
            "1 thread, 256 MiB (GB/s)",
            "2 threads, 16 MiB chunks (GB/s)",
            "2 threads / 1 thread, per round [IQR]",
            "vs SHA-256 (1 thread), per round [IQR]",
        ],
    )
    sha = res["SHA-256 (hashlib)|1"]
    speeds: dict[str, float] = {}
    for k in fns:
        one, two = res[f"{k}|1"], res[f"{k}|2"]
        speeds[keys[k] + "-1"] = median(one)
        speeds[keys[k] + "-2"] = median(two)
        s.rows.append([k, fmt(median(one)), fmt(median(two)), per_round(two, one).cell(), per_round(one, sha).cell()])
    s.notes.append(
        f"256 MiB of random bytes in memory, {reps} interleaved rounds; GB/s = 10^9 bytes per second. One thread "
        "hashes the whole buffer; two threads hash its 16 MiB chunks (the largest chunk an incremental upload "
        "stores) from a pool of two, as an upload's workers do (before the store starts). A chunk is named by "
        "its SHA-256: collision resistant (2^128 work), so two different chunks never share a name; in the "
        "standard library, and accelerated by the CPU's SHA extensions where present (this CPU has them: "
        "`sha_ni`), which is why BLAKE2b, the other strong hash there, is slower here. CRC32C is recorded beside "
        "it because the store checks and keeps it, which verifies a chunk without reading it back. hashlib "
        "releases the GIL while hashing, so a second thread helps as far as a second core is free: "
        f"{per_round(res['SHA-256 (hashlib)|2'], sha).text()} for SHA-256 on this shared machine."
    )
    return s, speeds
