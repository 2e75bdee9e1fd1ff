"""Incremental checkpoints against the real S3 store: only new chunks travel,
every chunk is verified, a damaged shared chunk fails every checkpoint that
uses it and resume walks back past them, bit-exact through ``spotguard run``."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from reference_runs import ReferenceRuns
from sidecar_helpers import PY, Proc, base_env, reaping, s3_storage, spotguard_argv

from spotguard.checkpoint import (
    KnownChunks,
    latest_verified,
    read_manifest,
    restore_checkpoint,
    restore_latest,
    upload_checkpoint,
    verify_checkpoint,
)
from spotguard.checkpoint.format.manifest import CHUNKS_DIR, MANIFEST_NAME, checkpoint_name
from spotguard.checkpoint.local.codec import snapshot_state
from spotguard.checkpoint.local.commit import load_checkpoint_state, verify_local_checkpoint, write_checkpoint
from spotguard.checkpoint.store.chunked import TRUST_SECONDS
from spotguard.checkpoint.store.retention import RetentionPolicy
from spotguard.checkpoint.store.stored import list_checkpoint_names
from spotguard.sidecar.deadline import ThroughputTracker
from spotguard.sidecar.metrics import SidecarMetrics
from spotguard.sidecar.shipper import CheckpointShipper

MiB = 1 << 20


def fine_tune_state(step: int, adapter_version: int) -> dict[str, Any]:
    """A frozen base of 24 MiB (the same at every step) and a small adapter
    whose values depend on ``adapter_version``."""
    base = torch.Generator().manual_seed(1)
    frozen = {f"base.{i}.weight": torch.randn(1024, 1024, generator=base) for i in range(6)}
    adapter_gen = torch.Generator().manual_seed(100 + adapter_version)
    adapter = {f"base.{i}.lora_a": torch.randn(8, 1024, generator=adapter_gen) for i in range(6)}
    return {"model": {**frozen, **adapter}, "step": step}


def commit(directory: Path, step: int, adapter_version: int) -> Path:
    return write_checkpoint(directory, step, snapshot_state(fine_tune_state(step, adapter_version)))


def chunk_objects(storage: Any) -> dict[str, int]:
    return {o.key: o.size for o in storage.list_objects(f"{CHUNKS_DIR}/")}


@pytest.mark.integration
def test_only_new_chunks_are_uploaded_and_verified_by_store_checksum(s3_store, s3_uri: str, tmp_path: Path) -> None:
    storage = s3_storage(s3_store, s3_uri)
    local = tmp_path / "ckpt"
    first = upload_checkpoint(commit(local, 10, 0), storage, incremental=True)
    total = read_manifest(storage, checkpoint_name(10)).total_size
    assert first.new_bytes == total and first.reused_bytes == 0
    stored_after_first = chunk_objects(storage)
    assert sum(stored_after_first.values()) == total
    assert len(stored_after_first) == first.new_chunks

    known = KnownChunks.of(read_manifest(storage, checkpoint_name(10)))
    second = upload_checkpoint(commit(local, 20, 1), storage, incremental=known)
    assert second.new_bytes < 0.05 * total, (second.new_bytes, total)
    assert second.new_bytes + second.reused_bytes == total
    stored_after_second = chunk_objects(storage)
    stored_after_second_digests = {key.rsplit("/", 1)[1] for key in stored_after_second}
    # Exactly the new chunks were added; nothing was uploaded twice.
    assert len(stored_after_second) - len(stored_after_first) == second.new_chunks
    assert sum(stored_after_second.values()) - sum(stored_after_first.values()) == second.new_bytes
    # The checkpoint prefix holds only the manifest.
    assert [o.key for o in storage.list_objects(f"{checkpoint_name(20)}/")] == [
        f"{checkpoint_name(20)}/{MANIFEST_NAME}"
    ]

    result = verify_checkpoint(storage, checkpoint_name(20))
    assert result.ok, result.problems
    assert result.manifest is not None and result.manifest.format_version == 3
    assert result.method == "store-checksum" and result.read_back == 0 and result.checked_bytes == 0
    deep = verify_checkpoint(storage, checkpoint_name(20), deep=True)
    assert deep.ok and deep.method == "read-back" and deep.checked_bytes == total

    # Restore assembles the files byte for byte; --plain makes a self-contained copy.
    info = restore_checkpoint(storage, checkpoint_name(20), tmp_path / "restored")
    for entry in read_manifest(storage, checkpoint_name(20)).files:
        assert (Path(info.uri) / entry.path).read_bytes() == (local / checkpoint_name(20) / entry.path).read_bytes()
    plain = restore_checkpoint(storage, checkpoint_name(20), tmp_path / "plain", plain=True)
    doc = json.loads((Path(plain.uri) / MANIFEST_NAME).read_bytes())
    assert doc["format_version"] == 1 and all("chunks" not in f for f in doc["files"])
    assert doc["files"] == json.loads((local / checkpoint_name(20) / MANIFEST_NAME).read_bytes())["files"]
    assert verify_local_checkpoint(Path(plain.uri)).ok
    state = load_checkpoint_state(Path(plain.uri))
    assert torch.equal(state["model"]["base.3.lora_a"], fine_tune_state(20, 1)["model"]["base.3.lora_a"])

    # The CLI: ls shows what each checkpoint added; restore --plain exports a self-contained copy.
    env = base_env(s3_store.env())
    listing = subprocess.run(
        spotguard_argv("ckpt", "ls", "--json", s3_uri), env=env, capture_output=True, text=True, check=True, timeout=120
    )
    rows = {r["step"]: r for r in json.loads(listing.stdout)["checkpoints"]}
    assert rows[10]["format_version"] == rows[20]["format_version"] == 3
    assert rows[10]["new_bytes"] == total and rows[20]["new_bytes"] == second.new_bytes
    assert all(r["verified"] for r in rows.values())
    export = tmp_path / "export"
    subprocess.run(
        spotguard_argv("ckpt", "restore", "--plain", f"{s3_uri}/{checkpoint_name(20)}", str(export)),
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    exported = export / checkpoint_name(20)
    assert (exported / MANIFEST_NAME).read_bytes() == (Path(plain.uri) / MANIFEST_NAME).read_bytes()
    assert (exported / "model.safetensors").read_bytes() == (
        local / checkpoint_name(20) / "model.safetensors"
    ).read_bytes()

    # gc: retention deletes 10, the sweep (no grace) removes exactly the chunks only 10 used.
    only_10 = set(read_manifest(storage, checkpoint_name(10)).chunk_refs()) - set(result.manifest.chunk_refs())
    assert only_10
    # (Nothing else writes: the shortest lease and grace.)
    gc = subprocess.run(
        spotguard_argv("ckpt", "gc", "--keep-last", "1", "--orphan-grace", "0.001", s3_uri),
        env={**env, "SPOTGUARD_GC_LEASE_SECONDS": "0.001"},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert f"deleted {checkpoint_name(10)}  (retention)" in gc.stdout, gc.stdout
    assert f"deleted {len(only_10)} unused chunk(s)" in gc.stdout, gc.stdout
    remaining = {key.rsplit("/", 1)[1] for key in chunk_objects(storage)}
    assert remaining == set(result.manifest.chunk_refs()) == set(stored_after_second_digests) - only_10
    assert verify_checkpoint(storage, checkpoint_name(20), deep=True).ok


@pytest.mark.integration
def test_a_known_chunk_missing_from_storage_is_uploaded_again(s3_store, s3_uri: str, tmp_path: Path) -> None:
    """The uploader's knowledge is checked before the manifest names a chunk:
    one removed from storage meanwhile is sent again, so the manifest never
    names a chunk that is not stored."""
    storage = s3_storage(s3_store, s3_uri)
    upload_checkpoint(commit(tmp_path, 10, 0), storage, incremental=True)
    known = KnownChunks.of(read_manifest(storage, checkpoint_name(10)))
    gone = max(known.chunks, key=lambda d: known.chunks[d])
    storage.delete([f"{CHUNKS_DIR}/{gone[:2]}/{gone}"])
    result = upload_checkpoint(commit(tmp_path, 20, 1), storage, incremental=known)
    assert result.new_bytes >= known.chunks[gone]
    assert verify_checkpoint(storage, checkpoint_name(20)).ok


@pytest.mark.integration
def test_chunks_the_uploader_verified_are_reused_and_taken_as_checked_without_a_request_each(
    s3_store, s3_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Knowledge from a checkpoint the uploader verified itself: the next upload
    asks nothing of its chunks, and that checkpoint's verification asks only of
    the chunks that are new. Stale trust (older than TRUST_SECONDS), knowledge
    read from storage, and a deep verification ask of every chunk again."""
    storage = s3_storage(s3_store, s3_uri)
    asked: list[str] = []
    for method in ("stat", "stored_checksum"):
        real = getattr(storage, method)

        def counted(key: str, _real: Any = real) -> Any:
            if key.startswith(f"{CHUNKS_DIR}/"):
                asked.append(key)
            return _real(key)

        monkeypatch.setattr(storage, method, counted)

    # Stored only (update_pointer=False): the verifications counted are this test's.
    upload_checkpoint(commit(tmp_path, 10, 0), storage, incremental=True, update_pointer=False)
    first = verify_checkpoint(storage, checkpoint_name(10))
    assert first.ok and first.trusted == 0 and first.manifest is not None
    assert len(asked) == first.store_checked == len(first.manifest.chunk_refs())
    known = KnownChunks.verified(first.manifest, first.trusted, None)
    assert known.trusted()

    asked.clear()
    second = upload_checkpoint(commit(tmp_path, 20, 1), storage, incremental=known, update_pointer=False)
    assert asked == [], asked  # no HEAD per reused chunk
    assert second.reused_chunks > 0 and set(second.trusted_chunks) <= set(known.chunks)
    assert len(second.trusted_chunks) == second.reused_chunks
    verdict = verify_checkpoint(storage, checkpoint_name(20), trusted=second.trusted_chunks)
    assert verdict.ok and verdict.trusted == second.reused_chunks
    assert verdict.manifest is not None
    new = set(verdict.manifest.chunk_refs()) - set(second.trusted_chunks)
    assert {key.rsplit("/", 1)[1] for key in asked} == new and verdict.store_checked == len(new)
    # The trust of a checkpoint verified by trusting another runs from the older check.
    chained = KnownChunks.verified(verdict.manifest, verdict.trusted, known)
    assert chained.checked_at == known.checked_at
    assert not replace(chained, checked_at=time.monotonic() - TRUST_SECONDS - 1).trusted()

    deep = verify_checkpoint(storage, checkpoint_name(20), trusted=second.trusted_chunks, deep=True)
    assert deep.ok and deep.trusted == 0

    for untrusted in (
        replace(known, checked_at=time.monotonic() - TRUST_SECONDS - 1),
        KnownChunks.of(first.manifest),
        known.with_chunks({}),
    ):
        asked.clear()
        third = upload_checkpoint(
            commit(tmp_path / "again", 20, 1), storage, incremental=untrusted, update_pointer=False
        )
        assert third.trusted_chunks == {} and len(asked) == third.reused_chunks > 0


@pytest.mark.integration
def test_a_damaged_shared_chunk_fails_every_checkpoint_using_it(s3_store, s3_uri: str, tmp_path: Path) -> None:
    """Checkpoints 20 and 30 share an adapter chunk that 10 does not have;
    damaging it in storage fails both, naming the chunk and its file, and
    resume walks back to 10, which shares only the frozen base with them."""
    storage = s3_storage(s3_store, s3_uri)
    for step, version in ((10, 0), (20, 1), (30, 1)):
        upload_checkpoint(commit(tmp_path, step, version), storage, incremental=True)
    m10, m20, m30 = (read_manifest(storage, checkpoint_name(s)) for s in (10, 20, 30))
    shared = set(m20.chunk_refs()) & set(m30.chunk_refs()) - set(m10.chunk_refs())
    assert shared and set(m10.chunk_refs()) & set(m30.chunk_refs())
    digest = sorted(shared)[0]
    ref = m30.chunk_refs()[digest]
    key = ref.key
    good = storage.read_bytes(key)
    storage.write_bytes(key, bytes([good[0] ^ 0xFF]) + good[1:])  # same size, other bytes

    for step in (20, 30):
        result = verify_checkpoint(storage, checkpoint_name(step))
        assert not result.ok
        assert any(p.startswith(f"{key}: ") and "(chunk of model.safetensors)" in p for p in result.problems), result
    assert verify_checkpoint(storage, checkpoint_name(10)).ok
    info, skipped = latest_verified(storage)
    assert info is not None and info.step == 10
    assert [s.step for s in skipped] == [30, 20] and all(key in s.reason for s in skipped)

    restored = restore_latest(storage, tmp_path / "fresh")
    assert restored is not None and restored.step == 10
    state = load_checkpoint_state(Path(restored.uri))
    want = fine_tune_state(10, 0)["model"]
    assert all(torch.equal(state["model"][k], v) for k, v in want.items())


def run_argv(workdir: Path, storage: str, out: Path, steps: int) -> list[str]:
    train = [
        PY,
        "-m",
        "spotguard.demo.train",
        "--steps",
        str(steps),
        "--save-every",
        "10",
        "--log-every",
        "1",
        "--frozen-mib",
        "24",
        "--step-delay",
        "0.1",
        "--output",
        str(out),
    ]
    return spotguard_argv(
        "run", "--workdir", str(workdir), "--storage", storage, "--max-restarts", "3", "--backoff", "0.1", "--", *train
    )


@pytest.mark.integration
def test_spotguard_run_resumes_bitwise_after_walking_back_past_a_damaged_shared_chunk(
    s3_store, s3_uri: str, tmp_path: Path, reference_runs: ReferenceRuns
) -> None:
    """``spotguard run`` with incremental checkpoints on a model with a 24 MiB
    frozen base: SIGTERM mid-run, every checkpoint after the first uploads a
    small fraction of its size; then a chunk the newest checkpoints share is
    damaged in storage and a fresh machine resumes from an older one. The
    result equals an uninterrupted run's byte for byte."""
    steps = 80
    reference = reference_runs.demo_final(steps, 10, "--frozen-mib", "24")
    env = base_env(s3_store.env() | {"SPOTGUARD_INCREMENTAL": "1"})
    with reaping() as procs:
        out = tmp_path / "final.safetensors"
        first = Proc(run_argv(tmp_path / "work1", s3_uri, out, steps), env, tmp_path / "run1.log")
        procs.append(first)
        first.wait_for_step(45)
        first.signal(signal.SIGTERM)
        assert first.wait() == 128 + signal.SIGTERM, first.tail()
        stopped = first.wait_for_stopped_step()

    storage = s3_storage(s3_store, s3_uri)
    info, _ = latest_verified(storage)
    assert info is not None and info.step == stopped, (info, stopped)
    uploads = [line for line in (tmp_path / "run1.log").read_text().splitlines() if "stage=upload " in line]
    sent = [int(line.split(" bytes=")[1].split()[0]) for line in uploads]
    size = info.size
    assert len(sent) >= 3 and sent[0] >= size, uploads
    assert all(b < 0.05 * size for b in sent[1:]), (sent, size)
    # The frozen base: in the first checkpoint with the rest; unchanged in the second, so in its own kept
    # file (hashed once: new offsets); from the third on that file is linked, and its chunks are not hashed.
    unchanged = [int(line.split(" unchanged_chunks=")[1].split()[0]) for line in uploads]
    assert unchanged[0] == 0 and all(n > 0 for n in unchanged[2:]), uploads
    # Routine verifications check every chunk; the SIGTERM's takes the chunks its upload reused
    # from the checkpoint verified before it as checked (no request each).
    verifies = [line for line in (tmp_path / "run1.log").read_text().splitlines() if "stage=verify " in line]
    trusted = [int(line.split(" trusted_chunks=")[1].split()[0]) for line in verifies]
    assert len(trusted) == len(uploads) and trusted[-1] > 0 and not any(trusted[:-1]), verifies

    # Damage a chunk the newest checkpoint shares with the one before it but
    # not with the oldest: both newest fail, resume walks back further.
    names = sorted(n for n in (o.key.split("/")[0] for o in storage.list_objects("ckpt-")))
    manifests = [read_manifest(storage, n) for n in dict.fromkeys(names)]
    newest, before, oldest = manifests[-1], manifests[-2], manifests[0]
    shared = sorted(set(newest.chunk_refs()) & set(before.chunk_refs()) - set(oldest.chunk_refs()))
    if not shared:  # every trained tensor changed: damage one only the newest has
        shared = sorted(set(newest.chunk_refs()) - set(before.chunk_refs()))
    key = newest.chunk_refs()[shared[0]].key
    data = storage.read_bytes(key)
    storage.write_bytes(key, data[:-1] + bytes([data[-1] ^ 1]))
    info2, skipped = latest_verified(storage)
    assert info2 is not None and info2.step < stopped and skipped and all(key in s.reason for s in skipped)

    with reaping() as procs:
        second = Proc(run_argv(tmp_path / "work2", s3_uri, out, steps), env, tmp_path / "run2.log")
        procs.append(second)
        line = second.wait_for_line(lambda ln: ln.startswith(("resumed from step", "starting from scratch")))
        assert line == f"resumed from step {info2.step}", line
        assert second.wait() == 0, second.tail()
    assert out.read_bytes() == reference
    final, _ = latest_verified(storage)
    assert final is not None and final.step == steps - 1


def sample(metrics: SidecarMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name, dict(metrics.labels))
    return value or 0.0


@pytest.mark.integration
def test_shipper_reuses_chunks_across_a_restart_and_counts_only_new_bytes(
    s3_store, s3_uri: str, tmp_path: Path
) -> None:
    """The sidecar's shipper: the second checkpoint sends only its new chunks
    (the reused ones are counted apart), and a restarted shipper learns the
    stored chunks from the ``latest`` pointer's manifest, so its first upload
    is small too; the deadline estimate counts the bytes sent."""
    storage = s3_storage(s3_store, s3_uri)
    local = tmp_path / "ckpt"

    def shipper(
        retention: RetentionPolicy | None = None,
    ) -> tuple[CheckpointShipper, SidecarMetrics, ThroughputTracker]:
        metrics, tracker = SidecarMetrics(), ThroughputTracker(30.0, 5.0)
        return CheckpointShipper(local, storage, metrics, tracker, retention, incremental=True), metrics, tracker

    first, metrics, _ = shipper()
    commit(local, 10, 0)
    commit(local, 20, 1)
    assert [s.name for s in first.ship()] == [checkpoint_name(10), checkpoint_name(20)]
    total = read_manifest(storage, checkpoint_name(20)).total_size
    # 10 sent whole, 20 only its adapter (and the small files): the frozen base is reused.
    assert total < sample(metrics, "spotguard_checkpoint_uploaded_bytes_total") < 1.05 * total
    assert sample(metrics, "spotguard_checkpoint_reused_bytes_total") >= 0.95 * total
    commit(local, 30, 2)
    first.ship()
    assert sample(metrics, "spotguard_checkpoint_uploaded_bytes_total") < 1.10 * total
    assert sample(metrics, "spotguard_checkpoint_reused_bytes_total") >= 1.9 * total

    again, metrics2, tracker2 = shipper(RetentionPolicy(keep_last=1))
    again.adopt_existing()
    commit(local, 40, 3)
    assert [s.name for s in again.ship()] == [checkpoint_name(40)]
    assert sample(metrics2, "spotguard_checkpoint_uploaded_bytes_total") < 0.05 * total
    assert sample(metrics2, "spotguard_checkpoint_reused_bytes_total") >= 0.95 * total
    assert tracker2._upload_bytes is not None and tracker2._upload_bytes < 0.05 * total
    # Retention deleted the older checkpoints, leaving tombstones; the chunk
    # sweep kept every chunk (all younger than the grace), and 40 verifies.
    assert list_checkpoint_names(storage) == [checkpoint_name(40)]
    tombstones = sorted(o.key.split("/")[-1].split(".")[0] for o in storage.list_objects("gc/tombstones/"))
    assert tombstones == [checkpoint_name(s) for s in (10, 20, 30)]
    assert verify_checkpoint(storage, checkpoint_name(40)).ok


def ship_until(shipper: CheckpointShipper, step: int, timeout: float = 30) -> None:
    """Shipping rounds (as the sidecar's loop runs them) until ``step`` is verified."""
    deadline = time.monotonic() + timeout
    while shipper.last_shipped is None or shipper.last_shipped.step < step:
        assert time.monotonic() < deadline, f"step {step} never verified: {shipper.failed}"
        shipper.ship(housekeeping=False)
        time.sleep(0.2)


@pytest.mark.integration
def test_a_damaged_stored_chunk_is_sent_again_from_local_bytes_and_heals_every_checkpoint(
    s3_store, s3_uri: str, tmp_path: Path
) -> None:
    """A chunk of the frozen base flipped in the store (same size): the verification that names it
    evicts it from what the uploader trusts, a newer checkpoint is still tried and sends it again
    from local bytes, and the same content key heals the older checkpoints that use it. An uploader
    restarted onto the damage (its knowledge read from the pointer's manifest) heals it too."""
    storage = s3_storage(s3_store, s3_uri)
    local = tmp_path / "ckpt"

    def shipper() -> CheckpointShipper:
        return CheckpointShipper(
            local, storage, SidecarMetrics(), ThroughputTracker(30.0, 5.0), keep_local=10, incremental=True
        )

    def damage(step: int) -> str:
        refs = read_manifest(storage, checkpoint_name(step)).chunk_refs()
        key = refs[max(refs, key=lambda d: refs[d].size)].key  # a chunk of the frozen base
        good = storage.read_bytes(key)
        storage.write_bytes(key, bytes([good[0] ^ 0xFF]) + good[1:])
        return key

    first = shipper()
    commit(local, 10, 0)
    ship_until(first, 10)
    key = damage(10)
    assert not verify_checkpoint(storage, checkpoint_name(10)).ok
    commit(local, 20, 1)
    commit(local, 30, 2)
    ship_until(first, 30)
    assert any(key in problem for problem in first.failed.get(checkpoint_name(20), "").split("; ")), first.failed
    for step in (10, 20, 30):  # 20 was stored with the damaged chunk; re-sent, it verifies
        assert verify_checkpoint(storage, checkpoint_name(step)).ok, step

    key = damage(30)
    restarted = shipper()
    restarted.adopt_existing()
    commit(local, 40, 3)
    ship_until(restarted, 40)
    for step in (10, 20, 30, 40):
        assert verify_checkpoint(storage, checkpoint_name(step)).ok, step
    restored = restore_checkpoint(storage, checkpoint_name(40), tmp_path / "restored")
    assert verify_local_checkpoint(Path(restored.uri)).ok


@pytest.mark.integration
def test_an_uploading_trainer_stores_incrementally(s3_store, s3_uri: str, tmp_path: Path) -> None:
    """``Checkpointer(upload=True, incremental=True)``: the in-process upload stores chunks too
    (the frozen base once), each checkpoint is verified, and a fresh trainer restores the newest
    byte for byte."""
    from ckpt_helpers import s3_options

    from spotguard import Checkpointer

    ck = Checkpointer(
        tmp_path / "ck",
        storage_uri=s3_uri,
        storage_options=s3_options(s3_store),
        upload=True,
        incremental=True,
        keep_local=1,
        async_save=False,
    )
    for step in (10, 20, 30):
        ck.save(step, fine_tune_state(step, step))
    ck.close()
    assert ck.last_error is None, ck.last_error

    storage = s3_storage(s3_store, s3_uri)
    manifests = [read_manifest(storage, checkpoint_name(step)) for step in (10, 20, 30)]
    assert all(m.format_version == 3 for m in manifests)
    assert all(verify_checkpoint(storage, m.name).ok for m in manifests)
    total = manifests[0].total_size
    # Stored: the first checkpoint whole, then only what changed (the adapter, the small files).
    assert sum(chunk_objects(storage).values()) < 1.1 * total, (sum(chunk_objects(storage).values()), total)

    fresh = Checkpointer(tmp_path / "fresh", storage_uri=s3_uri, storage_options=s3_options(s3_store))
    restored = fresh.restore()
    fresh.close()
    assert restored is not None and restored.step == 30
    for name, tensor in fine_tune_state(30, 30)["model"].items():
        assert torch.equal(restored["model"][name], tensor), name
