"""Garbage collection of shared chunks (mark and sweep) against a real S3 store, and crash trials.

The sweep must never delete a chunk a checkpoint needs: chunks two
checkpoints share stay when one of them goes; a deleted checkpoint's own
chunks go only once its tombstone is older than the grace period; a chunk
uploaded moments ago (its manifest not written yet) stays; a chunk written
again after the listing stays; a manifest of a newer format, or one that
could not be read, stops the sweep before it deletes anything.

Crash trials: kills at stratified instants (trial i of n at (i + U)/n of two
measured cycles) of an uploader that also applies retention and sweeps
chunks, and of an uploader beside a separate collector (30 in ``make soak``,
9 in ``make test``; ``testenv.trials`` prints the seed, ``SPOTGUARD_TEST_SEED``
repeats a run), each kill's stage printed, on S3 and on gs:// (fake-gcs-server)
alike; then
kills aimed at each stage of a collection, where the fault proxy
(``testenv/faultproxy.py``) holds one request: between the tombstone and the
manifest's deletion, before the sweep, during it, and before the tombstone's
deletion. After every kill each stored checkpoint has every chunk it
references and verifies, and the newest verified one restores byte-exact.
This file is also the worker those trials run (``python THIS
cycle|upload|gc|collect ...``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ckpt_helpers import s3_options, subprocess_env

from spotguard.checkpoint import (
    RetentionPolicy,
    collect_garbage,
    delete_checkpoint,
    latest_verified,
    list_checkpoint_names,
    load_checkpoint_state,
    prune_local,
    read_latest_pointer,
    read_manifest,
    restore_checkpoint,
    snapshot_state,
    upload_checkpoint,
    verify_checkpoint,
    verify_local_checkpoint,
    write_checkpoint,
)
from spotguard.checkpoint.format.chunks import hash_chunk
from spotguard.checkpoint.format.manifest import (
    CHUNKS_DIR,
    MANIFEST_NAME,
    checkpoint_name,
    parse_chunk_key,
    parse_manifest,
)
from spotguard.checkpoint.store.chunked import TOMBSTONES_DIR, KnownChunks, upload_chunks
from spotguard.checkpoint.store.gc import sweep_chunks
from spotguard.checkpoint.store.intents import check_orphan_grace, read_intents
from spotguard.storage import NotFoundError, Storage, StorageError, open_storage
from testenv import trials

pytestmark = pytest.mark.integration

#: float32 elements of one frozen tensor: 1.25 MiB, a chunk of its own
#: (regions of at least chunks.MIN_CHUNK are never grouped with others).
FROZEN_NUMEL = 320 * 1024
CYCLE_TRIALS = trials.count(full=20, quick=6)
CONCURRENT_TRIALS = trials.count(full=10, quick=3)
#: The upload lease of the crash trials (uploaders and collectors agree on it),
#: and the separate collector's grace: the shortest a collection may use.
#: Safety does not rest on it (uploads announce themselves by intents); it
#: bounds how long a killed uploader's intent keeps what it stored.
TRIAL_LEASE = 5.0
CONCURRENT_GRACE = TRIAL_LEASE


def gc_state(step: int) -> dict[str, Any]:
    """A fine-tune-shaped state for ``step``: two frozen tensors (the same at
    every step), one that changes every fourth step, a small trainable part."""
    frozen = np.random.default_rng(0)
    block = np.random.default_rng(1_000_000 + step // 4)
    trained = np.random.default_rng(step)
    return {
        "model": {
            "base.a": frozen.standard_normal(FROZEN_NUMEL, dtype=np.float32),
            "base.b": frozen.standard_normal(FROZEN_NUMEL, dtype=np.float32),
            "block": block.standard_normal(FROZEN_NUMEL, dtype=np.float32),
            "adapter": trained.standard_normal(4096, dtype=np.float32),
        },
        "optimizer": {"adapter.m": trained.standard_normal(4096, dtype=np.float32)},
        "step": step,
    }


def commit(directory: Path, step: int) -> Path:
    """gc_state(step) as a committed local checkpoint."""
    return write_checkpoint(directory, step, snapshot_state(gc_state(step)))


@functools.cache
def expected_state(step: int) -> dict[str, Any]:
    """gc_state(step), made once (only read)."""
    return gc_state(step)


@functools.cache
def fresh_digests(step: int) -> dict[str, bytes]:
    """SHA-256 of every data file a fresh save of ``step`` writes (saves are deterministic)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = commit(Path(scratch), step)
        manifest = parse_manifest((path / MANIFEST_NAME).read_bytes())
        return {e.path: hashlib.sha256((path / e.path).read_bytes()).digest() for e in manifest.files}


def assert_restores_exactly(storage: Storage, name: str, scratch: Path) -> None:
    """``name`` restores from its chunks to the very bytes a fresh save of its
    step writes, and loads as that step's state."""
    restored = Path(restore_checkpoint(storage, name, scratch / "restored").uri)
    assert verify_local_checkpoint(restored).ok
    step = int(name.split("-")[1])
    want = fresh_digests(step)
    assert {e.path for e in read_manifest(storage, name).files} == set(want)
    for path, digest in want.items():
        assert hashlib.sha256((restored / path).read_bytes()).digest() == digest, f"{name}/{path} differs"
    state = load_checkpoint_state(restored)
    want_state = expected_state(step)
    assert state["step"] == step
    for part in ("model", "optimizer"):
        assert set(state[part]) == set(want_state[part])
        for key, arr in want_state[part].items():
            assert np.array_equal(state[part][key], arr), (name, part, key)


def stored_chunks(storage: Storage) -> dict[str, int]:
    """Digest -> size of every chunk in storage."""
    out = {}
    for info in storage.list_objects(f"{CHUNKS_DIR}/"):
        digest = parse_chunk_key(info.key)
        if digest is not None:
            out[digest] = info.size
    return out


def chunks_of(storage: Storage, name: str) -> set[str]:
    return set(read_manifest(storage, name).chunk_refs())


def tombstones(storage: Storage) -> list[str]:
    return [o.key for o in storage.list_objects(f"{TOMBSTONES_DIR}/")]


def wait_for_next_second() -> None:
    """The store keeps modified times in whole seconds: what is written after
    this returns is dated later than what was written before."""
    time.sleep(1.05 - time.time() % 1.0)


@pytest.fixture
def s3(s3_store: Any, s3_uri: str) -> Storage:
    return open_storage(s3_uri, **s3_options(s3_store))


def test_retention_keeps_shared_chunks_and_frees_unique_ones_after_the_grace(s3: Storage, tmp_path: Path) -> None:
    first = upload_checkpoint(commit(tmp_path / "local", 1), s3, incremental=True)
    second = upload_checkpoint(commit(tmp_path / "local", 2), s3, incremental=True)
    assert second.reused_chunks >= 3 and second.new_chunks >= 1, second  # base.a, base.b, block are shared
    one, two = chunks_of(s3, first.name), chunks_of(s3, second.name)
    shared, unique = one & two, one - two
    assert shared and unique
    # Retention deletes ckpt-1; its tombstone keeps its chunks through the grace period.
    report = collect_garbage(s3, RetentionPolicy(keep_last=1), orphan_grace=3600)
    assert report.deleted == [first.name]
    assert report.chunks_deleted == [] and report.chunk_bytes_freed == 0
    assert len(tombstones(s3)) == 1
    assert set(stored_chunks(s3)) == one | two
    # Once the grace is over, the unique chunks go and the shared ones stay.
    dry = sweep_chunks(s3, grace=0, dry_run=True)
    assert set(stored_chunks(s3)) == one | two
    sizes = stored_chunks(s3)
    sweep = sweep_chunks(s3, grace=0)
    assert sorted(sweep.deleted) == sorted(dry.deleted) == sorted(f"{CHUNKS_DIR}/{d[:2]}/{d}" for d in unique)
    assert sweep.freed_bytes == dry.freed_bytes == sum(sizes[d] for d in unique)
    assert sweep.kept == len(two) and sweep.tombstones_deleted == dry.tombstones_deleted
    assert len(sweep.tombstones_deleted) == 1 and tombstones(s3) == []
    assert set(stored_chunks(s3)) == two
    assert verify_checkpoint(s3, second.name).ok
    assert_restores_exactly(s3, second.name, tmp_path / "scratch")
    # Nothing left to collect.
    again = sweep_chunks(s3, grace=0)
    assert again.deleted == [] and again.kept == len(two)


def test_a_tombstone_younger_than_the_grace_keeps_the_chunks(s3: Storage, tmp_path: Path) -> None:
    first = upload_checkpoint(commit(tmp_path / "local", 4), s3, incremental=True)
    second = upload_checkpoint(commit(tmp_path / "local", 8), s3, incremental=True)  # a new block too
    unique = chunks_of(s3, first.name) - chunks_of(s3, second.name)
    assert len(unique) >= 2
    wait_for_next_second()
    delete_checkpoint(s3, first.name)
    [tomb] = list(s3.list_objects(f"{TOMBSTONES_DIR}/"))
    assert tomb.key.startswith(f"{TOMBSTONES_DIR}/{first.name}.")
    newest_chunk = max(o.modified for o in s3.list_objects(f"{CHUNKS_DIR}/"))
    gap = tomb.modified - newest_chunk
    assert gap >= 1.0
    # Every chunk is older than the grace, the tombstone is not: it alone keeps ckpt-1's chunks.
    grace, now = gap * 2 / 3, tomb.modified + gap / 3
    kept = sweep_chunks(s3, grace=grace, now=now)
    assert kept.deleted == [] and kept.tombstones_deleted == []
    assert unique <= set(stored_chunks(s3))
    # The same sweep once the tombstone is as old as the grace (a hair past it: (t + g) - t may round below g).
    gone = sweep_chunks(s3, grace=grace, now=tomb.modified + grace + 1e-3)
    assert {parse_chunk_key(k) for k in gone.deleted} == unique
    assert gone.tombstones_deleted == [tomb.key]
    assert_restores_exactly(s3, second.name, tmp_path / "scratch")


def test_chunks_of_an_upload_without_its_manifest_stay_through_the_grace(s3: Storage, tmp_path: Path) -> None:
    first = upload_checkpoint(commit(tmp_path / "local", 1), s3, incremental=True)
    # An upload interrupted after its chunks, before its manifest.
    path = commit(tmp_path / "local", 9)
    pending = upload_chunks(path, s3, parse_manifest((path / MANIFEST_NAME).read_bytes()), KnownChunks.from_storage(s3))
    assert pending.new_chunks >= 2 and pending.reused_chunks >= 2
    new = set(pending.manifest.chunk_refs()) - chunks_of(s3, first.name)
    assert new and new <= set(stored_chunks(s3))
    kept = sweep_chunks(s3)  # the default grace: an hour
    assert kept.deleted == [] and kept.kept == len(stored_chunks(s3))
    # The same with an explicit clock: 10 s old, a grace of 60 s.
    assert sweep_chunks(s3, grace=60, now=time.time() + 10).deleted == []
    # The upload never finished: after the grace its chunks go, the first checkpoint's stay.
    gone = sweep_chunks(s3, grace=60, now=time.time() + 61)
    assert {parse_chunk_key(k) for k in gone.deleted} == new
    assert set(stored_chunks(s3)) == chunks_of(s3, first.name)
    assert_restores_exactly(s3, first.name, tmp_path / "scratch")


@pytest.mark.parametrize("kind", ["incremental", "plain"])
def test_a_collection_without_grace_during_a_long_upload_deletes_nothing_the_upload_names(
    s3: Storage, tmp_path: Path, kind: str
) -> None:
    """An upload holds still after its first stored object (as a slow upload of a large base would,
    far past any grace) while a collection with no grace at all runs to its end: the upload's intent
    keeps what it stored and what it will reuse, and its prefix; once its manifest is written the
    checkpoint verifies. Safety no longer rests on uploads being shorter than the grace."""
    upload_checkpoint(commit(tmp_path / "local", 1), s3, incremental=True)
    path = commit(tmp_path / "local", 9)  # a new block and adapter beside the frozen base
    stored, go = threading.Event(), threading.Event()

    def progress(_nbytes: int) -> None:
        stored.set()
        assert go.wait(60)

    errors: list[BaseException] = []

    def upload() -> None:
        try:
            upload_checkpoint(path, s3, incremental=kind == "incremental", progress=progress, update_pointer=False)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    uploader = threading.Thread(target=upload)
    uploader.start()
    try:
        assert stored.wait(60), "the upload stored nothing"
        wait_for_next_second()  # what it stored is now older than any grace this collection uses
        before = set(stored_chunks(s3))
        report = collect_garbage(s3, RetentionPolicy(keep_last=1), orphan_grace=0)
        assert report.orphans == [] and report.chunks_deleted == [], report
        assert set(stored_chunks(s3)) == before
    finally:
        go.set()
        uploader.join(60)
    assert not errors, errors
    assert verify_checkpoint(s3, checkpoint_name(9)).ok
    assert not list(s3.list_objects("gc/uploads/")), "the upload left its intent behind"
    assert_restores_exactly(s3, checkpoint_name(9), tmp_path / "scratch")


def test_a_manifest_of_a_newer_format_stops_the_sweep(s3: Storage, tmp_path: Path) -> None:
    first = upload_checkpoint(commit(tmp_path / "local", 1), s3, incremental=True)
    second = upload_checkpoint(commit(tmp_path / "local", 2), s3, incremental=True)
    # A newer spotguard wrote ckpt-3 (whose chunks this one cannot see) and deleted ckpt-2.
    doc = json.loads(s3.read_bytes(f"{second.name}/{MANIFEST_NAME}"))
    doc.update(format_version=99, step=3)
    s3.write_bytes(f"ckpt-{3:012d}/{MANIFEST_NAME}", json.dumps(doc).encode())
    delete_checkpoint(s3, second.name)
    before = stored_chunks(s3)
    assert set(before) > chunks_of(s3, first.name)

    sweep = sweep_chunks(s3, grace=0)
    assert sweep.aborted is not None and "format_version 99" in sweep.aborted, sweep
    assert sweep.deleted == [] and sweep.tombstones_deleted == []
    report = collect_garbage(s3, RetentionPolicy(keep_last=1), orphan_grace=0, stale_upload_age=0)
    assert report.chunk_sweep_aborted is not None and report.chunks_deleted == []
    assert report.orphans == []  # the newer manifest is not mistaken for debris
    assert s3.stat(f"ckpt-{3:012d}/{MANIFEST_NAME}") is not None
    assert stored_chunks(s3) == before

    # A tombstone of the newer format stops it too.
    s3.delete([f"ckpt-{3:012d}/{MANIFEST_NAME}"])
    s3.write_bytes(f"{TOMBSTONES_DIR}/ckpt-{3:012d}.{int(time.time() * 1000)}.json", json.dumps(doc).encode())
    assert sweep_chunks(s3, grace=3600, now=time.time() + 3599).aborted is not None
    assert stored_chunks(s3) == before
    # Without it, ckpt-2's chunks are garbage.
    s3.delete(tombstones(s3))
    assert sweep_chunks(s3, grace=0).deleted
    assert set(stored_chunks(s3)) == chunks_of(s3, first.name)


def test_an_unreadable_manifest_marks_nothing(s3: Storage, tmp_path: Path) -> None:
    first = upload_checkpoint(commit(tmp_path / "local", 1), s3, incremental=True)
    second = upload_checkpoint(commit(tmp_path / "local", 2), s3, incremental=True)
    # ckpt-2's manifest damaged: it can never verify, so its own chunks are garbage.
    s3.write_bytes(f"{second.name}/{MANIFEST_NAME}", b'{"format_version": 3, "step": ')
    assert not verify_checkpoint(s3, second.name).ok
    before = set(stored_chunks(s3))
    sweep = sweep_chunks(s3, grace=0)
    assert sweep.aborted is None
    assert {parse_chunk_key(k) for k in sweep.deleted} == before - chunks_of(s3, first.name)
    assert set(stored_chunks(s3)) == chunks_of(s3, first.name)
    assert_restores_exactly(s3, first.name, tmp_path / "scratch")


def test_a_storage_error_while_marking_deletes_nothing(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    from testenv.faultproxy import FaultProxy, status

    direct = open_storage(s3_uri, **s3_options(s3_store))
    upload_checkpoint(commit(tmp_path / "local", 1), direct, incremental=True)
    second = upload_checkpoint(commit(tmp_path / "local", 2), direct, incremental=True)
    before = stored_chunks(direct)
    with FaultProxy(s3_store.endpoint_url) as proxy:
        options = {**s3_options(s3_store), "endpoint_url": proxy.url, "max_attempts": 1}
        flaky = open_storage(s3_uri, **options)
        proxy.add(status(500, "InternalError"), method="GET", path=rf"/{second.name}/manifest\.json$")
        with pytest.raises(StorageError):
            sweep_chunks(flaky, grace=0)
        assert proxy.faults(), "the fault never hit: the test tested nothing"
    assert stored_chunks(direct) == before
    assert verify_checkpoint(direct, second.name).ok


def test_a_chunk_written_again_after_the_listing_stays(s3: Storage, tmp_path: Path) -> None:
    upload_checkpoint(commit(tmp_path / "local", 1), s3, incremental=True)
    garbage = [os.urandom(1000), os.urandom(1000)]
    refs = [hash_chunk(data) for data in garbage]
    for ref, data in zip(refs, garbage, strict=True):
        s3.write_checked(ref.key, data)
    wait_for_next_second()
    calls = 0

    def meanwhile() -> bool:
        # Asked before each deletion: an upload stores the first chunk again,
        # another collector deletes the second.
        nonlocal calls
        calls += 1
        if calls == 1:
            s3.write_checked(refs[0].key, garbage[0])
            s3.delete([refs[1].key])
        return False

    # Both are 100 s old by this clock; the listing had them; the second stat sees the change.
    sweep = sweep_chunks(s3, grace=50, now=time.time() + 100, should_stop=meanwhile, workers=1)
    assert calls >= 2
    assert sweep.deleted == [] and sweep.freed_bytes == 0
    assert s3.stat(refs[0].key) is not None


def test_should_stop_stops_the_sweep(s3: Storage, tmp_path: Path) -> None:
    first = upload_checkpoint(commit(tmp_path / "local", 1), s3, incremental=True)
    second = upload_checkpoint(commit(tmp_path / "local", 2), s3, incremental=True)
    delete_checkpoint(s3, first.name)
    before = stored_chunks(s3)
    sweep = sweep_chunks(s3, grace=0, should_stop=lambda: True)
    assert sweep.deleted == [] and sweep.tombstones_deleted == [] and sweep.kept == len(before)
    assert stored_chunks(s3) == before and len(tombstones(s3)) == 1
    assert set(stored_chunks(s3)) > chunks_of(s3, second.name)


# -- crash trials --------------------------------------------------------------------------------


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _worker(argv: list[str]) -> int:
    """``cycle URI DIR START``: collect garbage (keep-last 2, no grace: nothing
    else writes), then commit and upload incrementally, in a loop. ``upload
    URI DIR START``: commit and upload, in a loop. ``gc URI GRACE``: collect
    garbage (keep-last 2), in a loop. ``collect URI``: collect garbage once
    (keep-last 2, no grace). Says ``ready`` once connected, starts on
    a line on stdin, then says one line per event, until killed."""
    mode, uri = argv[0], argv[1]

    class Stages(logging.Handler):
        """Says when a collection deletes a checkpoint, and each chunk it deletes."""

        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("gc: deleting"):
                say("retention " + message.split()[2].rsplit("/", 1)[-1])
            elif message.startswith("chunk sweep: deleting"):
                say("sweep " + message.rsplit("/", 1)[-1][:12])

    gc_log = logging.getLogger("spotguard.checkpoint.store.gc")
    gc_log.setLevel(logging.DEBUG)
    gc_log.addHandler(Stages())
    storage = open_storage(uri)
    storage.stat("latest")  # connected: the first kill lands in real work too
    policy = RetentionPolicy(keep_last=2)
    say("ready")
    if not sys.stdin.readline():
        return 0  # the test is gone

    def collect(grace: float) -> None:
        began = time.monotonic()
        report = collect_garbage(storage, policy, orphan_grace=grace)
        say(
            f"gc {len(report.deleted)} checkpoints {len(report.chunks_deleted)} chunks "
            f"in {time.monotonic() - began:.2f}s"
        )

    if mode == "gc":
        while True:
            collect(float(argv[2]))
    if mode == "collect":
        collect(0.0)
        return 0
    directory, step = Path(argv[2]), int(argv[3])
    while True:
        if mode == "cycle":
            collect(0.0)
        say(f"begin {step}")
        path = commit(directory, step)
        result = upload_checkpoint(path, storage, incremental=True)
        say(f"uploaded {step} {result.new_chunks} new {result.reused_chunks} reused")
        prune_local(directory, 1)
        step += 1
        if mode == "upload":
            time.sleep(0.2)  # a trainer checkpoints between steps; the collector runs all along


class Worker:
    """A worker subprocess whose output lines are collected as they come."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self._stderr = open(log, "w")  # noqa: SIM115 - closed in kill()
        self.mode, self.log = args[0], log
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *args],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line came (time.monotonic)
        self._done = False
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.strip())
                self.times.append(time.monotonic())
                self._cond.notify_all()
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def go(self) -> None:
        """Let it start working (it is ready: imported, storage opened)."""
        self.wait_for("ready")
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def wait_for(self, prefix: str, after: int = 0, timeout: float = 60) -> int:
        """Wait until it has said a line starting with ``prefix`` (from line
        ``after`` on); returns that line's index."""

        def said() -> int | None:
            return next((i for i in range(after, len(self.lines)) if self.lines[i].startswith(prefix)), None)

        with self._cond:
            self._cond.wait_for(lambda: said() is not None or self._done, timeout)
            index = said()
        assert index is not None, f"worker never said {prefix!r}: {self.log.read_text()[-3000:]}"
        return index

    def kill(self) -> str:
        """SIGKILL it; returns its last event."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(30)
        self._stderr.close()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        assert self.proc.returncode == -signal.SIGKILL, f"worker ended on its own: {self.log.read_text()[-3000:]}"
        return self.lines[-1] if self.lines else ""


@dataclass
class Outcome:
    """One crash trial, as the table shows it."""

    trial: int
    mode: str
    delay: float
    stages: list[str]
    newest: int | None
    checkpoints: int
    chunks: int


@dataclass
class Ledger:
    """What the checks saw so far in one storage root: the newest verified
    step, every chunk listed, and how many of those a later check no longer found."""

    newest: int | None = None
    seen_chunks: set[str] = field(default_factory=set)
    collected: int = 0


def check_store(storage: Storage, scratch: Path, ledger: Ledger) -> tuple[int | None, int, int]:
    """After a kill: every checkpoint with a manifest references only chunks
    stored with their sizes and verifies; the newest verified one never goes
    back, restores byte-exact, and the pointer is never ahead of it."""
    chunks = stored_chunks(storage)
    ledger.collected += len(ledger.seen_chunks - set(chunks))
    ledger.seen_chunks = set(chunks)
    complete = []
    for name in list_checkpoint_names(storage):
        try:
            manifest = read_manifest(storage, name)
        except NotFoundError:
            continue
        missing = [d[:12] for d, ref in manifest.chunk_refs().items() if chunks.get(d) != ref.size]
        assert not missing, f"{name} has a manifest but its chunks {missing} are gone"
        result = verify_checkpoint(storage, name)
        assert result.ok, f"{name} has a manifest but does not verify: {result.problems}"
        complete.append(name)
    info, skipped = latest_verified(storage)
    assert not skipped, skipped
    if info is None:
        assert not complete and ledger.newest is None, "every checkpoint was lost"
        return None, 0, len(chunks)
    assert info.name == complete[-1]
    assert ledger.newest is None or info.step >= ledger.newest, "the newest verified checkpoint went back"
    ledger.newest = info.step
    pointer = read_latest_pointer(storage)
    assert pointer is None or pointer <= info.step
    assert_restores_exactly(storage, info.name, scratch)
    return info.step, len(complete), len(chunks)


#: Where a worker was when it was killed, by its mode and the first word of its last line.
STAGES = {
    ("cycle", "ready"): "gc:plan",
    ("cycle", "uploaded"): "gc:plan",
    ("cycle", "gc"): "upload",
    ("cycle", "begin"): "upload",
    ("upload", "ready"): "upload",
    ("upload", "begin"): "upload",
    ("upload", "uploaded"): "idle",
    ("gc", "ready"): "gc:plan",
    ("gc", "gc"): "gc:plan",
}


def stage(mode: str, last: str) -> str:
    """Where a worker of ``mode`` whose last line was ``last`` was: uploading, idle,
    planning a collection (verifying, reading manifests, marking), deleting
    checkpoints (retention), or deleting chunks (sweep)."""
    word = last.split()[0] if last else "ready"
    return {"retention": "gc:retention", "sweep": "gc:sweep"}.get(word) or STAGES[(mode, word)]


def print_table(seed: int, outcomes: list[Outcome]) -> None:
    print(f"\nchunk-gc crash trials, seed {seed}")
    print(
        f"{'trial':>5}  {'mode':<10} {'kill after':>10}  {'killed while':<24} {'newest':>7} {'ckpts':>5} {'chunks':>6}"
    )
    for o in outcomes:
        newest = "-" if o.newest is None else str(o.newest)
        print(
            f"{o.trial:>5}  {o.mode:<10} {o.delay:>9.3f}s  {' + '.join(o.stages):<24} {newest:>7} "
            f"{o.checkpoints:>5} {o.chunks:>6}"
        )
    kinds: dict[str, int] = {}
    for o in outcomes:
        for where in o.stages:
            kinds[where] = kinds.get(where, 0) + 1
    print(
        f"{len(outcomes)} trials, all safe; workers killed while: "
        + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
    )


def wait_for_chunks_collected(worker: Worker, timeout: float = 120) -> None:
    """Wait until one of ``worker``'s collections has ended having deleted chunks."""
    deadline, after = time.monotonic() + timeout, 0
    while True:
        index = worker.wait_for("gc ", after=after, timeout=max(1.0, deadline - time.monotonic()))
        if int(worker.lines[index].split()[3]) > 0:
            return
        assert time.monotonic() < deadline, f"no collection deleted a chunk in {timeout:.0f}s"
        after = index + 1


def wait_until_no_live_upload(storage: Storage, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while read_intents(storage).live:
        assert time.monotonic() < deadline, f"uploads still live after {timeout:.0f}s: {read_intents(storage)}"
        time.sleep(0.5)


@pytest.fixture(params=["s3", "gs"])
def trial_store(request: pytest.FixtureRequest) -> tuple[str, Any, dict[str, Any]]:
    """The crash trials' store: (root URI, the store's fixture, ``open_storage`` options),
    S3 (SeaweedFS) or gs:// (fake-gcs-server): the same promises hold on both."""
    if request.param == "s3":
        store = request.getfixturevalue("s3_store")
        return request.getfixturevalue("s3_uri"), store, s3_options(store)
    store = request.getfixturevalue("gcs_store")
    return request.getfixturevalue("gs_uri"), store, store.options()


@pytest.mark.trials
def test_crash_trials(
    trial_store: tuple[str, Any, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, store, options = trial_store
    seed = trials.seed()
    rng = trials.rng("chunk-gc")
    print(f"\nchunk-gc crash-trial seed {seed} on {root.split(':', 1)[0]}")
    env = subprocess_env(store, SPOTGUARD_GC_LEASE_SECONDS=str(TRIAL_LEASE))
    monkeypatch.setenv("SPOTGUARD_GC_LEASE_SECONDS", str(TRIAL_LEASE))  # the checks' collections below
    check_orphan_grace(CONCURRENT_GRACE)
    outcomes: list[Outcome] = []
    ledgers: dict[str, Ledger] = {}
    stores: dict[str, tuple[str, Storage]] = {}
    for mode in ("cycle", "concurrent"):
        uri = f"{root}/{mode}"
        stores[mode] = (uri, open_storage(uri, **options))
        ledgers[mode] = Ledger()
    # Interleaved, so that each root's garbage ages past the collector's grace meanwhile.
    n, c = CYCLE_TRIALS + CONCURRENT_TRIALS, CONCURRENT_TRIALS
    plan = ["concurrent" if (i + 1) * c // n > i * c // n else "cycle" for i in range(n)]
    # Kill instants by trial number: per mode, stratified over its trials after the first
    # (which measures the cycle).
    instants: dict[int, float] = {}
    for m in ("cycle", "concurrent"):
        numbers = [i + 1 for i, pm in enumerate(plan) if pm == m][1:]
        instants.update(zip(numbers, trials.stratified(len(numbers), rng), strict=True))

    def spawn(trial: int) -> list[Worker]:
        mode, uri, local, start = plan[trial - 1], stores[plan[trial - 1]][0], str(tmp_path / f"l{trial}"), trial * 1000
        if mode == "cycle":
            return [Worker(["cycle", uri, local, str(start)], env, tmp_path / f"{trial}.log")]
        return [
            Worker(["upload", uri, local, str(start)], env, tmp_path / f"{trial}-upload.log"),
            Worker(["gc", uri, str(CONCURRENT_GRACE)], env, tmp_path / f"{trial}-gc.log"),
        ]

    cycles: dict[str, float] = {}
    passes: dict[str, list[float]] = {"cycle": [], "concurrent": []}
    swept = {"cycle": 0, "concurrent": 0}  # chunks the collections said they deleted
    began_trials = time.monotonic()
    upcoming = spawn(1)
    for trial in range(1, len(plan) + 1):
        mode, workers = plan[trial - 1], upcoming
        try:
            for w in workers:
                w.go()
            began = time.monotonic()
            if mode not in cycles:
                # The first trial of a mode measures one cycle on a store that
                # holds a checkpoint (from the first upload to the second; a
                # collection runs between them, or beside them); the others are
                # killed at stratified instants within about two such cycles.
                up = workers[0]
                first = up.wait_for("uploaded")
                second = up.wait_for("uploaded", after=first + 1)
                cycles[mode] = up.times[second] - up.times[first]
                if mode == "concurrent":
                    gc = workers[1]
                    index = gc.wait_for("gc", after=len(gc.lines))
                    cycles[mode] = max(cycles[mode], gc.times[index] - up.times[second])
                # It goes on until a collection has deleted chunks: the trials that follow
                # then kill on a store where chunks are collected, whatever instants they draw.
                wait_for_chunks_collected(workers[-1])
                delay = time.monotonic() - began
            else:
                if mode == "concurrent":
                    # One whole collection first: a collection that never ends
                    # would neither be timed nor keep the store from growing.
                    workers[1].wait_for("gc ")
                # Stratified over two cycles: the mode's k-th trial of n kills in the k-th n-th.
                time.sleep(2 * cycles[mode] * instants[trial])
                delay = time.monotonic() - began
        finally:
            stages = [stage(w.mode, w.kill()) for w in workers]
        # A collection takes longer as the store fills: the kills must still land anywhere in one.
        passes[mode] += [
            float(line.rsplit(" ", 1)[1][:-1]) for w in workers for line in w.lines if line.startswith("gc ")
        ]
        cycles[mode] = max(cycles[mode], statistics.median(passes[mode] or [0.0]))
        swept[mode] += sum(int(line.split()[3]) for w in workers for line in w.lines if line.startswith("gc "))
        # The next trial's workers start (import, open storage) while this one is checked.
        upcoming = spawn(trial + 1) if trial < len(plan) else []
        try:
            with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
                newest, checkpoints, chunks = check_store(stores[mode][1], Path(scratch), ledgers[mode])
        except BaseException:
            for w in upcoming:
                w.kill()
            raise
        outcomes.append(Outcome(trial, mode, delay, stages, newest, checkpoints, chunks))
    print_table(seed, outcomes)
    print(
        f"in {time.monotonic() - began_trials:.1f}s; "
        + "; ".join(
            f"{m}: cycle {c:.2f}s, {swept[m]} chunks deleted by completed collections, {ledgers[m].collected} "
            "seen gone between trials"
            for m, c in cycles.items()
        )
    )
    assert len(outcomes) == CYCLE_TRIALS + CONCURRENT_TRIALS

    # Every root ends with a verified checkpoint, and the trials did collect chunks.
    for mode, (_, storage) in stores.items():
        ledger = ledgers[mode]
        assert ledger.newest is not None, f"{mode}: no checkpoint ever verified: the trials tested nothing"
        assert swept[mode], f"{mode}: no chunk was ever collected during the trials"
        # With nothing running (the killed uploaders' intents dead), one collection leaves
        # exactly the chunks the kept checkpoints use.
        wait_until_no_live_upload(storage, TRIAL_LEASE + 10)
        report = collect_garbage(storage, RetentionPolicy(keep_last=1), orphan_grace=0)
        assert report.chunk_sweep_aborted is None
        names = list_checkpoint_names(storage)
        assert names == [f"ckpt-{ledger.newest:012d}"]
        assert set(stored_chunks(storage)) == chunks_of(storage, names[0])
        assert tombstones(storage) == []
        with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
            assert_restores_exactly(storage, names[0], Path(scratch))


@dataclass(frozen=True)
class AimedStage:
    """A kill of a collection that deletes the oldest of three checkpoints,
    where the fault proxy holds the request ``method`` ``path`` (a regex over
    the target) after letting ``skip`` pass (None: after the manifest's and
    every chunk's delete, that is, the tombstone's delete); the test kills it
    there."""

    name: str
    method: str
    path: str
    skip: int | None = 0


AIMED = [
    AimedStage("tombstone written, manifest not deleted", "POST", r"\?delete"),
    AimedStage("manifest deleted, sweep not started", "GET", r"list-type=2&prefix=[^&]*chunks"),
    AimedStage("sweeping", "POST", r"\?delete", 1),
    AimedStage("chunks deleted, tombstone not yet", "POST", r"\?delete", None),
]


def test_kills_aimed_at_each_collection_stage(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    from testenv.faultproxy import FaultProxy

    storage = open_storage(s3_uri, **s3_options(s3_store))
    local = tmp_path / "local"
    for step in (1, 2):
        upload_checkpoint(commit(local, step), storage, incremental=True)
    rows = []
    with FaultProxy(s3_store.endpoint_url) as proxy:
        env = subprocess_env(s3_store, AWS_ENDPOINT_URL_S3=proxy.url, AWS_ENDPOINT_URL=proxy.url)

        def spawn(number: int) -> Worker:
            return Worker(["collect", s3_uri], env, tmp_path / f"collect-{number}.log")

        upcoming = spawn(3)
        try:
            for number, aimed in enumerate(AIMED, start=3):
                worker = upcoming
                upload_checkpoint(commit(local, number), storage, incremental=True)
                names = list_checkpoint_names(storage)
                assert len(names) == 3, names
                oldest = names[0]
                unique = chunks_of(storage, oldest) - chunks_of(storage, names[1]) - chunks_of(storage, names[2])
                assert len(unique) >= 3, unique
                skip = 1 + len(unique) if aimed.skip is None else aimed.skip
                held = proxy.hold(method=aimed.method, path=aimed.path, skip=skip)
                try:
                    worker.go()
                    assert held.wait(60), f"{aimed.name}: the collection never got there: {worker.log.read_text()}"
                finally:
                    worker.kill()
                    held.release(forward=False)
                # The next stage's collector starts (imports, connects) while this one is checked.
                upcoming = spawn(number + 1)
                manifest_there = storage.stat(f"{oldest}/{MANIFEST_NAME}") is not None
                gone = unique - set(stored_chunks(storage))
                stones = tombstones(storage)
                where = {
                    "tombstone written, manifest not deleted": manifest_there and len(stones) == 1 and not gone,
                    "manifest deleted, sweep not started": not manifest_there and len(stones) == 1 and not gone,
                    # The held delete is one of several sent at once: the others may be done.
                    "sweeping": not manifest_there and len(stones) == 1 and len(gone) < len(unique),
                    "chunks deleted, tombstone not yet": not manifest_there and len(stones) == 1 and gone == unique,
                }
                assert where[aimed.name], (aimed.name, manifest_there, len(gone), len(unique), stones)
                with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
                    newest, checkpoints, chunks = check_store(storage, Path(scratch), Ledger())
                assert newest == number
                rows.append(
                    f"{aimed.name:<40} {len(gone)}/{len(unique)} of its own chunks gone, "
                    f"{checkpoints} checkpoints, {chunks} chunks: all verify"
                )
                # A collection run to its end leaves exactly what the kept checkpoints use.
                proxy.clear()
                collect_garbage(storage, RetentionPolicy(keep_last=2), orphan_grace=0)
                kept = list_checkpoint_names(storage)
                assert kept == names[1:] and tombstones(storage) == []
                assert set(stored_chunks(storage)) == chunks_of(storage, kept[0]) | chunks_of(storage, kept[1])
        finally:
            upcoming.kill()
    print("\n" + "\n".join(rows))


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] in ("cycle", "upload", "gc", "collect"):
    sys.exit(_worker(sys.argv[1:]))
