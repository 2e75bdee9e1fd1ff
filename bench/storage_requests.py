"""Operator storage requests per job-hour: what the storage probe's polls cost a store that bills per request.

The probe of ``spotguard operator`` (``CheckpointProbe``, the operator's own
code, one shared S3 client, requests counted in
``spotguard_operator_storage_requests_total``) polls 200 jobs whose
checkpoints are in a real SeaweedFS store: most single-process, some
distributed (8 parts, whose part manifests a full read fetches one by one).
Two ways, side by side:

- baseline: a full read at every poll (``--checkpoint-full-read-seconds 0``,
  what the operator did before: the listing, the manifest, the checkpoint's
  listing, and each part manifest of a distributed checkpoint);
- watch: the ``latest`` pointer read conditionally (``If-None-Match``) at
  every poll, a full read only when it changed and every 30 minutes.

Requests are counted over a few polls per job in each way (a fake clock
moves the watch's polls 30 s apart, then past its full-read interval) and
turned into a job-hour of polls every 30 s; one whole simulated hour of a
sample of the jobs checks that arithmetic.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import Section, fmt, seaweedfs_store
from spotguard.checkpoint.store.latest import FULL_READ_SECONDS

NS = "bench"
POLL_SECONDS = 30.0
HOUR = 3600.0
PARTS = 8


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _plain(directory: Path, step: int) -> Path:
    """A small committed single-process checkpoint (3 data files)."""
    import numpy as np

    from spotguard.checkpoint import snapshot_state, write_checkpoint

    rng = np.random.default_rng(step)
    state = {
        "model": {"w": rng.standard_normal(4096).astype(np.float32)},
        "optimizer": {"m": rng.standard_normal(2048)},
        "step": step,
    }
    return write_checkpoint(directory, step, snapshot_state(state))


def _parts(directory: Path, step: int) -> list[Path]:
    """The local part directories of a distributed checkpoint: PARTS nodes, one rank each."""
    from spotguard.checkpoint import MANIFEST_NAME, FileEntry, Sharding, checkpoint_name
    from spotguard.checkpoint.format.manifest import new_manifest
    from spotguard.storage.checksum import checksum_bytes

    out = []
    for index in range(PARTS):
        ckpt = directory / f"part{index}" / checkpoint_name(step)
        files = {
            f"dcp/__{index}_0.distcp": os.urandom(4096),
            f"ranks/{index:05d}/state.json": json.dumps({"rank": index, "step": step}).encode(),
        }
        entries = []
        for rel, data in sorted(files.items()):
            (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
            (ckpt / rel).write_bytes(data)
            entries.append(FileEntry(rel, len(data), checksum_bytes(data, "crc32c")))
        manifest = new_manifest(step, entries, "crc32c", sharding=Sharding(PARTS, PARTS, index, (index,), "bench"))
        (ckpt / MANIFEST_NAME).write_bytes(manifest.to_json())
        out.append(ckpt)
    return out


def _populate(
    store: Any, root: str, plain: list[str], sharded: list[str], work: Path, pool: ThreadPoolExecutor
) -> None:
    """One verified checkpoint per job (step 200), as the sidecar leaves it: uploaded once per kind by
    ``upload_checkpoint`` (data, manifest, pointer), then copied in the store to every job (pointer last)."""
    from spotguard.checkpoint import upload_checkpoint
    from spotguard.storage import open_storage

    options = {
        "endpoint_url": store.endpoint_url,
        "access_key": store.access_key,
        "secret_key": store.secret_key,
        "region": store.region,
    }
    bucket, prefix = root[len("s3://") :].split("/", 1)
    template = open_storage(f"{root}/templates/plain", **options)
    client = template.client  # type: ignore[attr-defined]
    upload_checkpoint(_plain(work / "plain", 200), template)
    sharded_template = open_storage(f"{root}/templates/sharded", client=client)
    for part in _parts(work / "parts", 200):
        upload_checkpoint(part, sharded_template)

    def objects(kind: str) -> list[str]:
        base = f"{prefix}/templates/{kind}/"
        keys = [o.key for o in open_storage(f"{root}/templates/{kind}", client=client).list_objects("")]
        # The pointer goes last, as after an upload; nothing else of the upload (its intent) is left.
        return [base + k for k in sorted(keys, key=lambda k: k == "latest") if not k.startswith("gc/")]

    def copy(job: str, keys: list[str], kind: str) -> None:
        for key in keys:
            dest = key.replace(f"{prefix}/templates/{kind}/", f"{prefix}/{NS}/{job}/", 1)
            client.copy_object(Bucket=bucket, Key=dest, CopySource={"Bucket": bucket, "Key": key})

    plain_keys, sharded_keys = objects("plain"), objects("sharded")
    futures = [pool.submit(copy, j, plain_keys, "plain") for j in plain]
    futures += [pool.submit(copy, j, sharded_keys, "sharded") for j in sharded]
    for f in futures:
        f.result()


def _probe(store: Any, root: str, jobs: list[str], clock: Clock, full_read_seconds: float) -> Any:
    """The operator's storage probe over ``jobs`` (read from a filled reconcile cache: no control plane)."""
    from spotguard.operator import kubeapi as rc
    from spotguard.operator.metrics import OperatorMetrics
    from spotguard.operator.podbuilder import OperatorConfig
    from spotguard.operator.probe import CheckpointProbe

    ctx = rc.Context(core=None, custom=None, config=OperatorConfig(image="spotguard:bench"), metrics=OperatorMetrics())
    trainer = {"name": "trainer", "image": "trainer:1", "command": ["python", "-m", "train"]}
    for job in jobs:
        ctx.jobs[(NS, job)] = {
            "apiVersion": "spotguard.dev/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": job},
            "spec": {
                "template": {"spec": {"containers": [trainer]}},
                "checkpoint": {"storage": root, "endpoint": store.endpoint_url, "region": store.region},
            },
            "status": {"phase": "Running"},
        }
    return CheckpointProbe(
        ctx, workers=1, full_read_seconds=full_read_seconds, allowed_endpoints=("127.0.0.1",), clock=clock
    )


def _requests(probe: Any) -> float:
    return float(probe.ctx.metrics.registry.get_sample_value("spotguard_operator_storage_requests_total") or 0.0)


def _kinds(probe: Any) -> Counter[str]:
    """Counts the requests of the probe's S3 client by kind, from now on."""
    kinds: Counter[str] = Counter()
    lock = threading.Lock()

    def count(request: Any, **_: Any) -> None:
        path, _sep, query = request.url.partition("?")
        what = "LIST" if "list-type=2" in query else f"{request.method} {path.rsplit('/', 1)[-1]}"
        if what.endswith(".json") and not what.endswith("/manifest.json") and what != "GET manifest.json":
            what = "GET part manifest"
        with lock:
            kinds[what] += 1

    for client in probe._connections.values():  # noqa: SLF001 - the shared client the probe built
        client.meta.events.register("before-send.s3", count)
    return kinds


def _poll_all(pool: ThreadPoolExecutor, probe: Any, jobs: list[str]) -> None:
    for outcome in pool.map(lambda j: probe.probe_once(NS, j), jobs):
        if outcome not in ("changed", "unchanged"):
            raise RuntimeError(f"probe: {outcome}: {probe.errors}")


def _round(pool: ThreadPoolExecutor, probe: Any, jobs: list[str]) -> float:
    """Requests per job of one poll of every job."""
    before = _requests(probe)
    _poll_all(pool, probe, jobs)
    return (_requests(probe) - before) / len(jobs)


def bench_storage_requests(ctx: Any) -> Section:
    n_jobs = int(os.environ.get("BENCH_OPERATOR_JOBS", "200"))
    polls = int(os.environ.get("BENCH_REQUESTS_POLLS", "2"))
    n_sharded = max(1, n_jobs // 5)
    plain = [f"job-{i:03d}" for i in range(n_jobs - n_sharded)]
    sharded = [f"dist-{i:03d}" for i in range(n_sharded)]
    per_hour = HOUR / POLL_SECONDS  # polls per job-hour
    fulls = HOUR / FULL_READ_SECONDS  # full reads per job-hour when nothing changes
    rows: dict[str, dict[str, float]] = {}
    kinds: dict[str, Counter[str]] = {}
    hour_check: dict[str, float] = {}
    with seaweedfs_store(ctx.work, "requests-bench") as store, ThreadPoolExecutor(16) as pool:
        root = f"s3://{store.bucket}/jobs"
        t0 = time.perf_counter()
        _populate(store, root, plain, sharded, ctx.work / "requests-local", pool)
        populate_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        # A job without a credentials Secret takes the store's credentials from the environment.
        with _environment({"AWS_ACCESS_KEY_ID": store.access_key, "AWS_SECRET_ACCESS_KEY": store.secret_key}):
            for label, jobs in (("single-process", plain), (f"distributed, {PARTS} parts", sharded)):
                clock = Clock()
                # Baseline: a full read at every poll (the operator before: --checkpoint-full-read-seconds 0).
                base = _probe(store, root, jobs, clock, 0)
                try:
                    first = _round(pool, base, jobs)  # builds the probe's client; costs what every poll costs
                    counted = _kinds(base)
                    base_poll = sum([first] + [_round(pool, base, jobs) for _ in range(polls - 1)]) / polls
                    kinds[f"baseline, {label}"] = counted
                finally:
                    base.shutdown()
                # The watch (the default, 1800 s): polls 30 s apart, then one past the full-read interval.
                watch = _probe(store, root, jobs, clock, FULL_READ_SECONDS)
                try:
                    start = _round(pool, watch, jobs)  # the operator starts: one full read per job
                    counted = _kinds(watch)
                    unchanged = []
                    for _ in range(polls):
                        clock.now += POLL_SECONDS
                        unchanged.append(_round(pool, watch, jobs))
                    clock.now += FULL_READ_SECONDS
                    periodic = _round(pool, watch, jobs)
                    kinds[f"watch, {label}"] = counted
                finally:
                    watch.shutdown()
                unchanged_poll = sum(unchanged) / polls
                rows[label] = {
                    "jobs": len(jobs),
                    "base_poll": base_poll,
                    "base_hour": base_poll * per_hour,
                    "unchanged_poll": unchanged_poll,
                    "start": start,
                    "periodic": periodic,
                    "watch_hour": (per_hour - fulls) * unchanged_poll + fulls * periodic,
                }
            # The arithmetic checked: a few jobs polled through one whole simulated hour.
            sample = plain[:4] + sharded[:1]
            clock = Clock()
            watch = _probe(store, root, sample, clock, FULL_READ_SECONDS)
            try:
                _poll_all(pool, watch, sample)
                before = _requests(watch)
                for _ in range(int(per_hour)):
                    clock.now += POLL_SECONDS
                    _poll_all(pool, watch, sample)
                hour_check["measured"] = (_requests(watch) - before) / len(sample)
            finally:
                watch.shutdown()
        poll_seconds = time.perf_counter() - t0
    total = sum(r["jobs"] for r in rows.values())

    def mix(key: str) -> float:
        return sum(r[key] * r["jobs"] for r in rows.values()) / total

    everything = {k: mix(k) for k in ("base_poll", "base_hour", "unchanged_poll", "start", "periodic", "watch_hour")}
    rows[f"all {total} jobs"] = everything | {"jobs": total}
    hour_check["computed"] = sum(
        (rows["single-process"] if j in plain else rows[f"distributed, {PARTS} parts"])["watch_hour"] for j in sample
    ) / len(sample)
    s = Section(
        f"Operator storage requests per job-hour ({total} jobs, a poll every {POLL_SECONDS:.0f} s)",
        "storage-requests",
        [
            "jobs",
            "baseline (full read every poll): per poll",
            "baseline: per job-hour",
            "watch: per unchanged poll",
            "watch: per full read",
            "watch: per job-hour",
            "baseline / watch",
        ],
    )
    for label, r in rows.items():
        s.rows.append(
            [
                f"{label} ({r['jobs']:.0f})",
                fmt(r["base_poll"]),
                fmt(r["base_hour"], 0),
                fmt(r["unchanged_poll"]),
                fmt(r["periodic"], 1),
                fmt(r["watch_hour"], 1),
                f"{r['base_hour'] / r['watch_hour']:.1f}x",
            ]
        )
    changes = 6.0  # a new checkpoint every 10 minutes: each a full read; no periodic one is then due
    busy = changes * everything["periodic"] + (per_hour - changes) * everything["unchanged_poll"]
    s.rows.append(
        [
            f"all, a new checkpoint every 10 min ({changes:.0f} full reads an hour)",
            fmt(everything["base_poll"]),
            fmt(everything["base_hour"], 0),
            fmt(everything["unchanged_poll"]),
            fmt(everything["periodic"], 1),
            fmt(busy, 1),
            f"{everything['base_hour'] / busy:.1f}x",
        ]
    )
    worst = max(r["unchanged_poll"] for r in rows.values())
    s.goals.append(
        (
            "one storage request per poll when nothing changed",
            worst <= 1.0,
            f"{worst:.2f} requests per unchanged poll, every kind of job; "
            f"{everything['base_hour'] / everything['watch_hour']:.1f}x fewer per job-hour",
        )
    )

    def show(c: Counter[str]) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))

    s.notes.append(
        f"Requests counted by the operator's own `spotguard_operator_storage_requests_total` (a boto3 "
        f"`before-send` hook on the probe's shared S3 client: every HTTP request, retries included), the probe "
        f"of `spotguard operator` (`CheckpointProbe.probe_once`) polling {total} jobs in a SeaweedFS store: "
        f"{len(plain)} single-process jobs and {len(sharded)} distributed ones ({PARTS} parts), each with one "
        f"verified checkpoint and its `latest` pointer ({populate_seconds:.0f} s to set up). Baseline: "
        f"`--checkpoint-full-read-seconds 0`, what every poll cost before (the job's listing, the manifest, the "
        f"checkpoint's listing, and for a distributed checkpoint its parts' listing and each part manifest: sizes "
        f"and manifests, no checksums); {polls} polls per job, and every poll costs the same. Watch (the default, "
        f"`--checkpoint-full-read-seconds {FULL_READ_SECONDS:.0f}`): {polls} polls per job 30 s apart, each a "
        f"conditional GET of the pointer (`If-None-Match`, answered 304 Not Modified), then one past the "
        f"interval (a fake clock), a full read with the pointer before it. Per job-hour: {per_hour:.0f} polls, "
        f"{per_hour - fulls:.0f} unchanged and {fulls:.0f} full reads; a new checkpoint moves the pointer and "
        f"costs one full read at the next poll (last row, computed). Checked over one whole simulated hour "
        f"({per_hour:.0f} polls of {len(sample)} of the jobs): {hour_check['measured']:.1f} requests per job-hour "
        f"measured, {hour_check['computed']:.1f} computed. The operator's start costs one full read per job "
        f"({everything['start']:.1f} requests on average), not in the hourly figures."
    )
    s.notes.append(
        "Requests by kind, from each probe's second poll of every job on: "
        + "; ".join(f"{label}: {show(c)}" for label, c in kinds.items())
        + "."
    )
    s.notes.append(
        f"Polling took {poll_seconds:.0f} s of wall time (16 threads calling the probe; the store and "
        "other work share this machine's cores)."
    )
    return s
