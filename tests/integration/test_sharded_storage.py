"""Distributed (sharded) checkpoints in a real S3 store: part uploads by independent
uploaders, the global commit and its race, verification naming parts, walking back,
garbage collection, restore and the shipper's awaiting parts."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import PART_LAYOUT, PART_WORLD, part_files, s3_options, subprocess_env, write_part
from sidecar_helpers import Proc, base_env, reaping, spotguard_argv

from spotguard.checkpoint import (
    MANIFEST_NAME,
    FileEntry,
    RetentionPolicy,
    Sharding,
    build_global_manifest,
    checkpoint_name,
    collect_garbage,
    commit_global,
    find_orphans,
    latest_verified,
    list_checkpoint_names,
    read_latest_pointer,
    read_parts,
    restore_checkpoint,
    restore_latest,
    update_latest_pointer,
    upload_checkpoint,
    verify_checkpoint,
    verify_local_checkpoint,
)
from spotguard.checkpoint.format.manifest import new_manifest, parse_manifest, part_manifest_path
from spotguard.sidecar.deadline import ThroughputTracker
from spotguard.sidecar.metrics import SidecarMetrics
from spotguard.sidecar.shipper import CheckpointShipper
from spotguard.storage import Storage, open_storage
from spotguard.storage.checksum import checksum_bytes
from testenv import trials

pytestmark = pytest.mark.integration

WORLD = PART_WORLD
LAYOUT = PART_LAYOUT  # part (node) -> global ranks
#: Races of two uploaders on one step (``testenv.trials``: full in ``make soak``).
RACE_TRIALS = trials.count(full=10, quick=4)


@pytest.fixture
def stores(s3_store: Any, s3_uri: str) -> tuple[Storage, Storage]:
    """Two independent uploaders' views (separate clients) of one job root."""
    return open_storage(s3_uri, **s3_options(s3_store)), open_storage(s3_uri, **s3_options(s3_store))


def upload_both(tmp_path: Path, stores: tuple[Storage, Storage], step: int) -> None:
    for index, storage in enumerate(stores):
        upload_checkpoint(write_part(tmp_path / f"node{index}", step, index), storage)


def test_two_uploaders_commit_once(tmp_path: Path, stores: tuple[Storage, Storage]) -> None:
    a, b = stores
    first = upload_checkpoint(write_part(tmp_path / "node0", 10, 0), a)
    assert (first.committed, first.parts_present, first.parts_total, first.pointer_updated) == (False, 1, 2, False)
    assert a.stat(f"{checkpoint_name(10)}/{MANIFEST_NAME}") is None
    assert a.stat(f"{checkpoint_name(10)}/{part_manifest_path(0)}") is not None
    waiting = verify_checkpoint(a, checkpoint_name(10))
    assert not waiting.ok and "parts present: 1 of 2" in waiting.reason and "missing part 1" in waiting.reason
    assert (waiting.parts_present, waiting.parts_total) == ([0], 2)

    second = upload_checkpoint(write_part(tmp_path / "node1", 10, 1), b)
    assert (second.committed, second.parts_present, second.parts_total, second.pointer_updated) == (True, 2, 2, True)
    # The first uploader comes back: the manifest is there, written once.
    again = commit_global(a, checkpoint_name(10))
    assert (again.status, again.present, again.total, again.missing) == ("exists", [0, 1], 2, [])

    parts, problems = read_parts(a, checkpoint_name(10))
    assert problems == [] and sorted(parts) == [0, 1]
    for index in (0, 1):
        local = (tmp_path / f"node{index}" / checkpoint_name(10) / MANIFEST_NAME).read_bytes()
        assert parts[index][0] == local  # byte-identical to the node's local manifest
    stored = a.read_bytes(f"{checkpoint_name(10)}/{MANIFEST_NAME}")
    assert stored == build_global_manifest(parts.values()).to_json()
    result = verify_checkpoint(b, checkpoint_name(10))
    assert result.ok, result.problems
    assert result.manifest is not None and result.manifest.is_global
    paths = {f.path for f in result.manifest.files}
    assert {part_manifest_path(0), part_manifest_path(1), "dcp/.metadata", "dcp/__3_0.distcp"} <= paths
    assert result.method == "mixed"  # .metadata is read back (pickle scan), the rest by store checksum
    assert read_latest_pointer(a) == 10


def test_a_part_that_is_the_only_part_commits_at_once(tmp_path: Path, stores: tuple[Storage, Storage]) -> None:
    storage = stores[0]
    ckpt = write_part(tmp_path / "node0", 5, 0, layout={0: (0, 1)}, world_size=2)
    result = upload_checkpoint(ckpt, storage)
    assert (result.committed, result.parts_present, result.parts_total, result.pointer_updated) == (True, 1, 1, True)
    assert verify_checkpoint(storage, checkpoint_name(5)).ok


def together(fn: Callable[[int], Any]) -> list[Any]:
    """``fn(0)`` and ``fn(1)`` in two threads released at the same instant; their results."""
    barrier = threading.Barrier(2)
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def commit_then_point(storage: Storage, step: int) -> tuple[str, bool, bytes]:
    """What an uploader does once its part is stored: commit, verify, move the pointer."""
    status = commit_global(storage, checkpoint_name(step)).status
    assert verify_checkpoint(storage, checkpoint_name(step)).ok
    moved = update_latest_pointer(storage, step)
    return status, moved, storage.read_bytes(f"{checkpoint_name(step)}/{MANIFEST_NAME}")


@pytest.mark.trials
def test_racing_global_commits_write_one_manifest_and_move_the_pointer_once(
    tmp_path: Path, s3_store: Any, s3_uri: str
) -> None:
    for trial in range(RACE_TRIALS):
        step = 100 + trial
        locals_ = [write_part(tmp_path / f"node{i}", step, i) for i in (0, 1)]
        stores = [open_storage(s3_uri, **s3_options(s3_store)) for _ in (0, 1)]
        # Both parts stored (data verified, part manifest) without committing...
        for i in (0, 1):
            stores[i].upload_files(
                [
                    (p, f"{checkpoint_name(step)}/{p.relative_to(locals_[i]).as_posix()}")
                    for p in sorted(locals_[i].rglob("*"))
                    if p.is_file() and p.name != MANIFEST_NAME
                ]
            )
            stores[i].write_bytes(
                f"{checkpoint_name(step)}/{part_manifest_path(i)}", (locals_[i] / MANIFEST_NAME).read_bytes()
            )
        # ...then both uploaders find every part present at the same instant.
        outcomes = together(lambda i: commit_then_point(stores[i], step))  # noqa: B023
        statuses = [o[0] for o in outcomes]
        moved = [o[1] for o in outcomes]
        seen = [o[2] for o in outcomes]
        assert sorted(statuses) == ["exists", "written"], (trial, statuses)
        assert sum(moved) == 1, (trial, moved)
        assert seen[0] == seen[1] and seen[0]
        assert read_latest_pointer(stores[0]) == step


@pytest.mark.trials
def test_racing_part_uploads_commit_once(tmp_path: Path, s3_store: Any, s3_uri: str) -> None:
    """Whole uploads started together: each commits or finds the other did; one pointer move."""
    for trial in range(RACE_TRIALS):
        step = 200 + trial
        locals_ = [write_part(tmp_path / f"node{i}", step, i) for i in (0, 1)]
        stores = [open_storage(s3_uri, **s3_options(s3_store)) for _ in (0, 1)]
        results = together(lambda i: upload_checkpoint(locals_[i], stores[i]))  # noqa: B023
        assert any(r.committed for r in results), trial
        assert sum(r.pointer_updated for r in results) == 1, (trial, results)
        # A part that found the other missing commits on its next try, without uploading again.
        for i, r in enumerate(results):
            if not r.committed:
                assert commit_global(stores[i], checkpoint_name(step)).status == "exists"
        assert verify_checkpoint(stores[0], checkpoint_name(step)).ok
        assert stores[0].read_bytes(f"{checkpoint_name(step)}/{MANIFEST_NAME}") == stores[1].read_bytes(
            f"{checkpoint_name(step)}/{MANIFEST_NAME}"
        )


def test_a_missing_part_is_named_and_resume_walks_back(tmp_path: Path, stores: tuple[Storage, Storage]) -> None:
    a, b = stores
    upload_both(tmp_path, stores, 10)
    upload_checkpoint(write_part(tmp_path / "node1", 20, 1), b)  # part 0 of step 20 never arrives
    result = verify_checkpoint(a, checkpoint_name(20))
    assert not result.ok
    assert result.problems[0] == "manifest.json: missing; parts present: 1 of 2 (part 1); missing part 0"
    info, skipped = latest_verified(a)
    assert info is not None and info.step == 10
    assert [s.name for s in skipped] == [checkpoint_name(20)] and "missing part 0" in skipped[0].reason
    restored = restore_latest(a, tmp_path / "restore")
    assert restored is not None and restored.step == 10


def test_parts_of_two_saves_of_a_step_never_make_one_checkpoint(
    tmp_path: Path, stores: tuple[Storage, Storage]
) -> None:
    """A part left by an earlier attempt at the same step (its node died
    before the other parts arrived) is not combined with a later attempt's:
    the step commits only once the node ships the later save's part."""
    a, b = stores
    name = checkpoint_name(30)
    upload_checkpoint(write_part(tmp_path / "attempt1", 30, 0, save_id="a1"), a)  # then the node died
    late = upload_checkpoint(write_part(tmp_path / "attempt2-node1", 30, 1, save_id="b2"), b)
    assert not late.committed and a.stat(f"{name}/{MANIFEST_NAME}") is None
    waiting = commit_global(a, name)
    assert waiting.status == "waiting" and waiting.missing == []
    assert waiting.problem is not None and "another save" in waiting.problem
    result = verify_checkpoint(a, name)
    assert not result.ok and "another save" in result.reason
    assert latest_verified(a)[0] is None
    done = upload_checkpoint(write_part(tmp_path / "attempt2-node0", 30, 0, save_id="b2"), a)
    assert done.committed
    verdict = verify_checkpoint(b, name)
    assert verdict.ok, verdict.problems
    assert verdict.manifest is not None and verdict.manifest.sharding is not None
    assert verdict.manifest.sharding.save_id == "b2"


def test_a_corrupted_file_names_its_part(tmp_path: Path, stores: tuple[Storage, Storage]) -> None:
    a, _ = stores
    upload_both(tmp_path, stores, 30)
    key = f"{checkpoint_name(30)}/dcp/__2_0.distcp"
    data = bytearray(a.read_bytes(key))
    data[10] ^= 0xFF
    a.write_bytes(key, bytes(data))
    result = verify_checkpoint(a, checkpoint_name(30))
    assert not result.ok
    assert len(result.problems) == 1
    assert result.problems[0].startswith("dcp/__2_0.distcp: crc32c checksum mismatch")
    assert result.problems[0].endswith("(part 1)")
    deep = verify_checkpoint(a, checkpoint_name(30), deep=True)
    assert not deep.ok and deep.problems[0].endswith("(part 1)")
    # A part manifest damaged in storage is named as such.
    a.write_bytes(f"{checkpoint_name(30)}/{part_manifest_path(0)}", b"{}")
    problems = verify_checkpoint(a, checkpoint_name(30)).problems
    assert any(p.startswith("parts/00000.json: size") and p.endswith("(manifest of part 0)") for p in problems)


def test_a_global_manifest_that_is_not_its_parts_fails(tmp_path: Path, stores: tuple[Storage, Storage]) -> None:
    a, _ = stores
    upload_both(tmp_path, stores, 35)
    name = checkpoint_name(35)
    good = parse_manifest(a.read_bytes(f"{name}/{MANIFEST_NAME}"))
    a.write_bytes(f"{name}/extra.json", b"x")
    forged = new_manifest(
        35, [*good.files, FileEntry("extra.json", 1, checksum_bytes(b"x", "crc32c"))], "crc32c", sharding=good.sharding
    )
    a.write_bytes(f"{name}/{MANIFEST_NAME}", forged.to_json())
    result = verify_checkpoint(a, name)
    assert not result.ok
    assert result.problems == [
        "manifest.json: does not match the part manifests (lists 'extra.json', which no part lists)"
    ]


def test_gc_keeps_parts_waiting_for_their_other_parts(tmp_path: Path, stores: tuple[Storage, Storage]) -> None:
    a, b = stores
    upload_checkpoint(write_part(tmp_path / "node0", 5, 0), a)  # never completed, older than the verified
    upload_both(tmp_path, stores, 10)
    upload_both(tmp_path, stores, 20)
    upload_checkpoint(write_part(tmp_path / "node0", 30, 0), a)  # waiting for part 1
    later = time.time() + 10 * 3600  # long after any grace
    assert find_orphans(a, grace=0, newest_verified=checkpoint_name(20), now=later) == [checkpoint_name(5)]
    assert find_orphans(a, grace=0, newest_verified=None, now=later) == []
    report = collect_garbage(a, RetentionPolicy(keep_last=1), orphan_grace=0, stale_upload_age=0)
    assert report.newest_verified == checkpoint_name(20)
    assert report.orphans == [checkpoint_name(5)]
    assert report.waiting == [checkpoint_name(30)]
    assert report.deleted == [checkpoint_name(10)]
    assert list_checkpoint_names(a) == [checkpoint_name(20), checkpoint_name(30)]
    # The waiting part is intact: when part 1 arrives the step commits and verifies.
    done = upload_checkpoint(write_part(tmp_path / "node1", 30, 1), b)
    assert done.committed and verify_checkpoint(a, checkpoint_name(30)).ok
    report = collect_garbage(a, RetentionPolicy(keep_last=1), orphan_grace=0, stale_upload_age=0)
    assert list_checkpoint_names(a) == [checkpoint_name(30)]


def test_restore_downloads_every_part(tmp_path: Path, stores: tuple[Storage, Storage]) -> None:
    a, _ = stores
    upload_both(tmp_path, stores, 40)
    info = restore_checkpoint(a, checkpoint_name(40), tmp_path / "restore")
    local = Path(info.uri)
    check = verify_local_checkpoint(local)
    assert check.ok, check.problems
    manifest = parse_manifest((local / MANIFEST_NAME).read_bytes())
    assert manifest.is_global and manifest.sharding is not None and manifest.sharding.ranks == (0, 1, 2, 3)
    for index in (0, 1):
        node = tmp_path / f"node{index}" / checkpoint_name(40)
        assert (local / part_manifest_path(index)).read_bytes() == (node / MANIFEST_NAME).read_bytes()
        for path in part_files(40, index, LAYOUT[index]):
            assert (local / path).read_bytes() == (node / path).read_bytes()
    # A restored copy (global manifest, locally complete) uploads like a single-process checkpoint.
    again = upload_checkpoint(local, a, update_pointer=False)
    assert again.committed and verify_checkpoint(a, checkpoint_name(40)).ok


def test_a_part_is_not_uploaded_over_a_step_committed_from_other_parts(
    tmp_path: Path, stores: tuple[Storage, Storage]
) -> None:
    a, _ = stores
    upload_both(tmp_path, stores, 50)
    # The same part shipped again (a restarted uploader): nothing to do, committed.
    same = upload_checkpoint(tmp_path / "node0" / checkpoint_name(50), a)
    assert same.committed and same.bytes == 0
    # Another run's part 0 of the same step: refused, the committed checkpoint stays intact.
    other = write_part(tmp_path / "other", 50, 0)
    with pytest.raises(ValueError, match="already committed in storage with a different part 0"):
        upload_checkpoint(other, a)
    assert verify_checkpoint(a, checkpoint_name(50)).ok


def shipper_for(directory: Path, storage: Storage, keep_local: int = 1) -> tuple[CheckpointShipper, SidecarMetrics]:
    metrics = SidecarMetrics()
    tracker = ThroughputTracker(grace_seconds=30.0, safety_margin_seconds=1.0)
    return CheckpointShipper(directory, storage, metrics, tracker, keep_local=keep_local), metrics


def failures(metrics: SidecarMetrics) -> float:
    return sum(
        s.value
        for m in metrics.registry.collect()
        if m.name == "spotguard_checkpoint_failures"
        for s in m.samples
        if s.name.endswith("_total")
    )


def test_shipper_awaits_the_other_parts_then_ships(tmp_path: Path, stores: tuple[Storage, Storage]) -> None:
    a, b = stores
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    upload_both(tmp_path, stores, 10)
    shipper, metrics = shipper_for(node0, a)
    shipper.adopt_existing()  # the committed part 10 is recognised as shipped
    assert checkpoint_name(10) in shipper.shipped

    write_part(node0, 20, 0)
    assert shipper.ship() == []
    assert checkpoint_name(20) in shipper.awaiting and "parts 1/2" in shipper.awaiting[checkpoint_name(20)]
    assert shipper.failed == {} and failures(metrics) == 0
    assert shipper.last_shipped is not None and shipper.last_shipped.step == 10
    puts = a.stat(f"{checkpoint_name(20)}/dcp/__0_0.distcp")
    assert puts is not None
    # Another round: the commit is tried again; nothing is uploaded again; never pruned.
    assert shipper.ship() == []
    after = a.stat(f"{checkpoint_name(20)}/dcp/__0_0.distcp")
    assert after is not None and after.modified == puts.modified
    shipper.housekeeping()
    assert (node0 / checkpoint_name(20) / MANIFEST_NAME).is_file()

    # A restarted uploader recognises the stored part as awaiting, without uploading it again.
    restarted, restarted_metrics = shipper_for(node0, a)
    restarted.adopt_existing()
    assert checkpoint_name(20) in restarted.awaiting and checkpoint_name(10) in restarted.shipped

    # The other node's uploader stores its part (and commits: it finds both).
    assert upload_checkpoint(write_part(node1, 20, 1), b, update_pointer=False).committed
    assert [s.name for s in restarted.ship(housekeeping=False)] == [checkpoint_name(20)]
    again = a.stat(f"{checkpoint_name(20)}/dcp/__0_0.distcp")
    assert again is not None and again.modified == puts.modified and failures(restarted_metrics) == 0
    done = shipper.ship()
    assert [s.name for s in done] == [checkpoint_name(20)]
    assert shipper.awaiting == {} and shipper.failed == {} and failures(metrics) == 0
    assert read_latest_pointer(a) == 20
    shipper.housekeeping()
    assert not (node0 / checkpoint_name(10)).exists()  # older than the newest verified: pruned
    assert (node0 / checkpoint_name(20)).is_dir()


def test_emergency_rounds_make_progress_on_awaiting_parts(tmp_path: Path, stores: tuple[Storage, Storage]) -> None:
    a, b = stores
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    shipper, metrics = shipper_for(node0, a)
    write_part(node0, 20, 0)
    assert shipper.ship() == [] and checkpoint_name(20) in shipper.awaiting
    write_part(node0, 30, 0)  # the preemption's save
    assert shipper.ship(newest_only=True, housekeeping=False) == []
    assert set(shipper.awaiting) == {checkpoint_name(20), checkpoint_name(30)}
    upload_checkpoint(write_part(node1, 20, 1), b, update_pointer=False)
    upload_checkpoint(write_part(node1, 30, 1), b, update_pointer=False)
    done = shipper.ship(newest_only=True, housekeeping=False)
    assert [s.step for s in done] == [20, 30]
    assert shipper.last_shipped is not None and shipper.last_shipped.step == 30
    assert shipper.awaiting == {} and failures(metrics) == 0
    assert read_latest_pointer(a) == 30


def test_a_finished_trainers_last_part_waits_for_a_slower_node_past_the_grace_period(
    tmp_path: Path, stores: tuple[Storage, Storage], s3_store: Any, s3_uri: str
) -> None:
    """Both nodes' trainers finish at the same step, but one uploader is a backlog behind the other: the
    faster one waits for the other part (the grace period does not count: nobody is killing the pod), then
    exits 0 with the final checkpoint verified. It once gave up after the grace period, failing the job."""
    from spotguard.contract.control import EXIT_FILE

    a, b = stores
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    write_part(node0, 20, 0)
    (node0 / ".control").mkdir()
    (node0 / ".control" / EXIT_FILE).write_text(json.dumps({"pid": None, "preempted": False, "last_step": 20}))
    grace = 2.0
    with reaping() as procs:
        sidecar = Proc(
            spotguard_argv(
                "sidecar",
                "--checkpoint-dir",
                str(node0),
                "--storage",
                s3_uri,
                "--grace-seconds",
                str(grace),
                "--safety-margin",
                "0.5",
                "--metrics-port",
                "0",
                "--termination-log",
                str(tmp_path / "termination-log"),
            ),
            base_env(subprocess_env(s3_store)),
            tmp_path / "sidecar.log",
        )
        procs.append(sidecar)
        sidecar.wait_for_line(lambda ln: "stage=await" in ln and checkpoint_name(20) in ln)
        time.sleep(grace + 3)
        assert sidecar.popen.poll() is None, f"gave up on the other node's part:\n{sidecar.tail()}"
        assert read_latest_pointer(a) is None
        assert upload_checkpoint(write_part(node1, 20, 1), b, update_pointer=False).committed
        assert sidecar.wait(60) == 0, sidecar.tail()
    assert read_latest_pointer(a) == 20
    assert json.loads((tmp_path / "termination-log").read_text())["step"] == 20


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotguard.cli", *args], env=env, capture_output=True, text=True, timeout=180
    )


def test_cli_ls_verify_gc_name_ranks_and_parts(
    tmp_path: Path, stores: tuple[Storage, Storage], s3_store: Any, s3_uri: str
) -> None:
    a, b = stores
    env = subprocess_env(s3_store)
    upload_both(tmp_path, stores, 10)
    upload_both(tmp_path, stores, 20)
    upload_checkpoint(write_part(tmp_path / "node0", 30, 0), a)  # part 1 missing
    key = f"{checkpoint_name(20)}/ranks/00003/state.json"
    a.write_bytes(key, a.read_bytes(key).replace(b"3", b"9"))

    proc = cli(env, "ckpt", "ls", s3_uri)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["STEP", "CREATED", "SIZE", "SHARDS", "METRICS", "VERIFIED"]
    assert lines[1].split()[0] == "10" and "4 ranks/2 parts" in lines[1] and lines[1].rstrip().endswith("yes")
    assert lines[2].split()[0] == "20*" and "4 ranks/2 parts" in lines[2] and "(part 1)" in lines[2]
    assert "ranks/00003/state.json" in lines[2]
    assert lines[3].split()[0] == "30" and "parts 1/2" in lines[3] and "missing part 1" in lines[3]
    doc = json.loads(cli(env, "ckpt", "ls", s3_uri, "--json").stdout)
    rows = {r["step"]: r for r in doc["checkpoints"]}
    assert rows[10]["sharding"] == {"world_size": 4, "parts": 2, "parts_present": [0, 1], "complete": True}
    assert rows[30]["sharding"] == {"world_size": None, "parts": 2, "parts_present": [0], "complete": False}

    ok = cli(env, "ckpt", "verify", f"{s3_uri}/ckpt-10")
    assert ok.returncode == 0 and "4 ranks in 2 parts" in ok.stdout, ok.stdout + ok.stderr
    bad = cli(env, "ckpt", "verify", f"{s3_uri}/ckpt-20")
    assert bad.returncode == 1
    assert "ckpt-000000000020/ranks/00003/state.json: crc32c checksum mismatch" in bad.stdout
    assert bad.stdout.rstrip().endswith("(part 1)")
    waiting = cli(env, "ckpt", "verify", f"{s3_uri}/ckpt-30")
    assert waiting.returncode == 1
    assert "ckpt-000000000030/manifest.json: missing; parts present: 1 of 2 (part 0); missing part 1" in waiting.stdout

    gc = cli(
        {**env, "SPOTGUARD_GC_LEASE_SECONDS": "0.001"},
        "ckpt",
        "gc",
        s3_uri,
        "--keep-last",
        "1",
        "--orphan-grace",
        "0.001",
    )  # nothing else writes: the shortest lease and grace
    assert gc.returncode == 0, gc.stderr
    assert f"keep    {checkpoint_name(30)}  (distributed checkpoint waiting for its other parts)" in gc.stdout
    assert list_checkpoint_names(a) == [checkpoint_name(10), checkpoint_name(20), checkpoint_name(30)]


def write_dcp_part(root: Path, step: int, index: int, scale: float) -> Path:
    """A real DCP checkpoint (no process group) split over two parts: part 0 holds
    the DCP files and rank 0's state, part 1 rank 1's state."""
    import torch
    import torch.distributed.checkpoint as dcp

    ckpt = root / checkpoint_name(step)
    files: dict[str, bytes] = {f"ranks/{index:05d}/state.json": json.dumps({"rank": index}).encode()}
    if index == 0:
        out = root / f"dcp-{step}"
        state = {
            "model": {
                "fc.weight": torch.full((3, 2), scale),
                "fc.bias": torch.arange(2.0) * scale,
                "steps": torch.tensor([step]),
            },
            "optimizer": {"state": {"fc.weight": {"exp_avg": torch.ones(3, 2)}}},
        }
        dcp.save(state, checkpoint_id=str(out), no_dist=True)
        files.update({f"dcp/{p.name}": p.read_bytes() for p in out.iterdir()})
    entries = []
    for path, data in sorted(files.items()):
        (ckpt / path).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / path).write_bytes(data)
        entries.append(FileEntry(path, len(data), checksum_bytes(data, "crc32c")))
    manifest = new_manifest(step, entries, "crc32c", sharding=Sharding(2, 2, index, (index,)))
    (ckpt / MANIFEST_NAME).write_bytes(manifest.to_json())
    return ckpt


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_cli_average_of_sharded_checkpoints(
    tmp_path: Path, stores: tuple[Storage, Storage], s3_store: Any, s3_uri: str
) -> None:
    import torch
    from safetensors.torch import load_file

    for step, scale in [(10, 1.0), (20, 3.0)]:
        for index in (0, 1):
            upload_checkpoint(write_dcp_part(tmp_path / f"node{index}", step, index, scale), stores[index])
    assert verify_checkpoint(stores[0], checkpoint_name(20)).ok
    env = subprocess_env(s3_store)
    out = tmp_path / "avg.safetensors"
    proc = cli(env, "ckpt", "average", s3_uri, "--last", "2", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "averaged 3 tensors of state part 'model' over steps 20, 10" in proc.stdout
    avg = load_file(str(out))
    assert torch.equal(avg["fc.weight"], torch.full((3, 2), 2.0))
    assert torch.equal(avg["fc.bias"], torch.arange(2.0) * 2.0)
    assert torch.equal(avg["steps"], torch.tensor([20]))  # integers from the newest
    opt = cli(env, "ckpt", "average", s3_uri, "--last", "1", "--part", "optimizer", str(tmp_path / "o.safetensors"))
    assert opt.returncode == 0, opt.stderr
    assert set(load_file(str(tmp_path / "o.safetensors"))) == {"state.fc.weight.exp_avg"}
    wrong = cli(env, "ckpt", "average", s3_uri, "--last", "1", "--part", "ema", str(tmp_path / "x.safetensors"))
    assert wrong.returncode == 1 and "has no state part 'ema'" in wrong.stderr


def test_a_preemption_in_a_backlog_gets_the_shipper_back_before_the_next_checkpoint(
    tmp_path: Path, stores: tuple[Storage, Storage]
) -> None:
    """A slow store leaves a backlog; a SIGTERM must not wait for all of it before the emergency path."""
    a, _ = stores
    node0 = tmp_path / "node0"
    for step in (10, 20, 30):
        write_part(node0, step, 0, layout={0: (0,)}, world_size=1)
    shipper, _ = shipper_for(node0, a)

    def stop_after_first() -> bool:
        # The signal arrives once the first checkpoint is shipped (one arriving
        # during its upload stops that upload: test_sigterm_first.py).
        return checkpoint_name(10) in shipper.shipped

    done = shipper.ship(housekeeping=False, should_stop=stop_after_first)
    assert [s.name for s in done] == [checkpoint_name(10)]
    assert checkpoint_name(20) not in shipper.shipped and checkpoint_name(30) not in shipper.shipped
    # The emergency path then ships the newest only.
    newest = shipper.ship(newest_only=True, housekeeping=False)
    assert [s.name for s in newest] == [checkpoint_name(30)]
