"""Crash safety: SIGKILL the writer or the uploader at random instants, then check that
nothing partial is ever reported complete or verified, and that the newest verified
checkpoint loads with exactly the content it was saved with.

60 trials: 20 kill a Checkpointer writing locally, 20 kill an uploader (with
retention) writing to file://, 20 to S3. The outcome of every trial is printed.

Then kills aimed at each stage of the upload protocol (during data, after data,
after the manifest, after the pointer, during retention): the fault proxy
(``testenv/faultproxy.py``) holds the first request of the stage, the test kills
the uploader while it waits, and the proxy's request log shows which stage the
kill hit. This file is also the uploader those trials run (``python THIS upload-one``).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import HELPERS, assert_state_matches, commit_local, s3_options, subprocess_env

from spotguard.checkpoint import (
    ManifestError,
    latest_verified,
    list_checkpoint_names,
    list_local_committed,
    load_checkpoint_state,
    read_latest_pointer,
    read_manifest,
    restore_checkpoint,
    verify_checkpoint,
    verify_local_checkpoint,
)
from spotguard.storage import NotFoundError, Storage, open_storage

pytestmark = pytest.mark.integration

WORKER = HELPERS / "crash_worker.py"
TRIALS_PER_MODE = 20
NUMEL = 200_000


@dataclass
class Outcome:
    trial: int
    mode: str
    delay: float
    last_event: str
    newest: int | None
    skipped: int


def run_and_kill(args: list[str], env: dict[str, str], delay: float, until: str | None = None) -> tuple[str, float]:
    """Start the worker, wait until it is ready, let it work ``delay`` seconds (or, with
    ``until``, until it prints a line starting so), SIGKILL it. Returns its last event and
    how long it worked."""
    proc = subprocess.Popen([sys.executable, str(WORKER), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().strip()
        assert first == "ready", (first, proc.stderr.read() if proc.stderr else "")
        started = time.monotonic()
        if until is None:
            time.sleep(delay)
        else:
            while not (line := proc.stdout.readline()).startswith(until):
                assert line, f"worker ended before {until!r}: {proc.stderr.read() if proc.stderr else ''}"
        worked = time.monotonic() - started
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"worker ended on its own: {err}"
    lines = [line for line in out.splitlines() if line]
    return (lines[-1] if lines else (until or "ready")), worked


def check_local(directory: Path) -> int | None:
    """Every committed local checkpoint verifies; the newest loads with its own content."""
    committed = list_local_committed(directory)
    for path in committed:
        result = verify_local_checkpoint(path)
        assert result.ok, f"{path.name} is committed but broken: {result.problems}"
    if not committed:
        return None
    newest = committed[-1]
    step = int(newest.name.split("-")[1])
    assert_state_matches(load_checkpoint_state(newest), step, NUMEL)
    return step


def check_storage(storage: Storage, scratch: Path) -> tuple[int | None, int]:
    """Every stored checkpoint with a manifest verifies (a manifest is only ever
    uploaded after its data and deleted before it); the newest verified restores
    and loads with its own content; the pointer is never ahead of it."""
    complete = []
    for name in list_checkpoint_names(storage):
        try:
            read_manifest(storage, name)
        except NotFoundError:
            continue
        except ManifestError as exc:  # pragma: no cover - would be a bug
            raise AssertionError(f"{name}: manifest unreadable after a crash: {exc}") from None
        result = verify_checkpoint(storage, name)
        assert result.ok, f"{name} has a manifest but does not verify: {result.problems}"
        complete.append(name)
    info, skipped = latest_verified(storage)
    assert all("manifest.json: missing" in s.reason for s in skipped), skipped
    if info is None:
        assert not complete
        return None, len(skipped)
    assert info.name == complete[-1]
    restored = restore_checkpoint(storage, info.name, scratch)
    assert_state_matches(load_checkpoint_state(Path(restored.uri)), info.step, NUMEL)
    pointer = read_latest_pointer(storage)
    assert pointer is None or pointer <= info.step
    return info.step, len(skipped)


def print_table(outcomes: list[Outcome]) -> None:
    print()
    print(f"{'trial':>5}  {'mode':<12} {'kill after':>10}  {'last event':<16} {'newest verified':>15}  skipped")
    for o in outcomes:
        newest = "-" if o.newest is None else str(o.newest)
        print(f"{o.trial:>5}  {o.mode:<12} {o.delay:>9.3f}s  {o.last_event:<16} {newest:>15}  {o.skipped}")
    kinds: dict[str, int] = {}
    for o in outcomes:
        kind = o.last_event.split()[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    summary = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
    print(f"{len(outcomes)} trials, all safe; killed after: {summary}")


def test_crash_safety(tmp_path: Path, s3_store: Any, s3_uri: str) -> None:
    seed = int(os.environ.get("SPOTGUARD_TEST_SEED") or random.SystemRandom().randrange(1 << 30))
    rng = random.Random(seed)
    print(f"\ncrash-safety seed {seed}")
    outcomes: list[Outcome] = []
    file_uri = f"file://{tmp_path}/remote/job"
    stores: dict[str, tuple[str, Storage, dict[str, str]]] = {
        "upload-file": (file_uri, open_storage(file_uri), subprocess_env()),
        "upload-s3": (s3_uri, open_storage(s3_uri, **s3_options(s3_store)), subprocess_env(s3_store)),
    }
    had_verified: dict[str, bool] = {}
    trial = 0
    for mode in ("write", "upload-file", "upload-s3"):
        # The first trial of a mode runs until one cycle is complete and measures it; the
        # others are killed at random instants within about two cycles (a loaded machine
        # is slower, and the kills must still land everywhere in the cycle).
        cycle = 0.3
        for i in range(TRIALS_PER_MODE):
            trial += 1
            start = (i + 1) * 1000
            until = ("committed" if mode == "write" else "uploaded") if i == 0 else None
            delay = rng.uniform(0.0, 2 * cycle)
            if mode == "write":
                directory = tmp_path / "local-write"
                last, worked = run_and_kill(["write", str(directory), str(start)], subprocess_env(), delay, until)
                newest, skipped = check_local(directory), 0
            else:
                uri, storage, env = stores[mode]
                last, worked = run_and_kill(["upload", uri, str(tmp_path / f"local-{mode}"), str(start)], env,
                                            delay, until)  # fmt: skip
                with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
                    newest, skipped = check_storage(storage, Path(scratch))
            if until is not None:
                cycle, delay = max(cycle, worked), worked
            # Once a checkpoint was complete, a crash never leaves us with none.
            if had_verified.get(mode):
                assert newest is not None, f"trial {trial}: lost every checkpoint"
            had_verified[mode] = had_verified.get(mode, False) or newest is not None
            outcomes.append(Outcome(trial, mode, delay, last, newest, skipped))
    print_table(outcomes)
    assert len(outcomes) >= 50
    assert all(had_verified.values()), "a mode never produced a single checkpoint: the trials tested nothing"


# -- kills aimed at each protocol stage ----------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """Where to stop the uploader: the request to hold (method, regex over the target,
    after ``skip`` matching ones), and what storage must show after the kill."""

    name: str
    method: str
    path: str
    newest: str  # "new": the checkpoint being uploaded is the newest verified; "previous": the one before
    skip: int = 0


STAGES = [
    Stage("during data", "PUT", r"/{new}/model\.safetensors$", "previous"),
    Stage("after data", "PUT", r"/{new}/manifest\.json$", "previous"),
    Stage("after manifest", "PUT", r"/latest$", "new"),
    Stage("after pointer", "GET", r"list-type=2", "new"),
    Stage("retention: before the manifest goes", "POST", r"\?delete", "new"),
    Stage("retention: after the manifest went", "POST", r"\?delete", "new", skip=1),
]
STAGE_NUMEL = NUMEL  # check_storage loads with this size
STAGE_KEEP_LAST = 2


def deleted_keys(records: list[Any]) -> list[str]:
    """Keys named in the multi-object deletes the proxy forwarded."""
    import re

    keys: list[str] = []
    for rec in records:
        if rec.method == "POST" and rec.query.startswith("delete") and rec.status == 200 and rec.body:
            keys += re.findall(r"<Key>([^<]+)</Key>", rec.body.decode())
    return keys


def test_kills_aimed_at_each_upload_stage(tmp_path: Path, s3_store: Any, s3_uri: str) -> None:
    from testenv.faultproxy import FaultProxy

    storage = open_storage(s3_uri, **s3_options(s3_store))
    local = tmp_path / "local"
    rows: list[str] = []
    with FaultProxy(s3_store.endpoint_url) as proxy:
        env = subprocess_env(s3_store, AWS_ENDPOINT_URL_S3=proxy.url, AWS_ENDPOINT_URL=proxy.url)

        def upload_one(step: int) -> subprocess.Popen[str]:
            return subprocess.Popen([sys.executable, __file__, "upload-one", s3_uri, str(local), str(step)],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip

        # Two complete checkpoints first (in this process), so that retention has something to delete.
        from spotguard.checkpoint import upload_checkpoint

        for step in (1, 2):
            upload_checkpoint(commit_local(local, step, STAGE_NUMEL), storage)
        verified = [1, 2]
        for number, stage in enumerate(STAGES, start=3):
            new = f"ckpt-{number:012d}"
            proxy.log.clear()
            held = proxy.hold(method=stage.method, path=stage.path.format(new=new), skip=stage.skip)
            proc = upload_one(number)
            try:
                reached = held.wait(120)
            finally:
                proc.kill()
                out, _ = proc.communicate(timeout=60)
                held.release(forward=False)
            assert reached, f"{stage.name}: the uploader never got there; output:\n{out}"
            assert held.record is not None
            log = list(proxy.log)
            at = log.index(held.record)
            before = log[:at]
            # Which stage the kill hit, from what the store had answered before it.
            stored = {r.key.split("/", 1)[-1] for r in before if r.status == 200 and r.method in ("PUT", "POST")}
            data_done = {f"{new}/model.safetensors", f"{new}/optimizer.safetensors", f"{new}/state.json"} <= stored
            manifest_done = f"{new}/manifest.json" in stored
            pointer_done = any(r.method == "PUT" and r.key.endswith("/latest") and r.status == 200 for r in before)
            hit = {
                "during data": not data_done and not manifest_done,
                "after data": data_done and not manifest_done,
                "after manifest": manifest_done and not pointer_done,
                "after pointer": pointer_done,
            }
            if stage.name.startswith("retention"):
                assert pointer_done, stage.name
                # Deleting a checkpoint starts with its manifest (alone), then its data.
                first = deleted_keys(before)
                assert len(first) == (0 if stage.skip == 0 else 1), first
                assert all(k.endswith("/manifest.json") for k in first), first
            else:
                assert hit[stage.name], (stage.name, hit, sorted(stored))

            if stage.newest == "new":
                verified.append(number)
            with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
                newest, skipped = check_storage(storage, Path(scratch))
            assert newest == max(verified), (stage.name, newest, verified)
            # Nothing at or above the newest verified checkpoint was deleted.
            gone = deleted_keys(log)
            assert all(int(k.split("ckpt-")[1][:12]) < newest for k in gone if "ckpt-" in k), gone
            pointer = read_latest_pointer(storage)
            rows.append(f"{stage.name:<38} held {held.record.method:<4} {held.record.target[-48:]:<48} "
                        f"newest verified {newest}, pointer {pointer}, skipped {skipped}")  # fmt: skip
    print("\n" + "\n".join(rows))


def _upload_one(uri: str, directory: Path, step: int) -> None:
    """One checkpoint: commit locally, upload (data, manifest, pointer), apply retention."""
    from spotguard.checkpoint import RetentionPolicy, apply_retention, upload_checkpoint

    storage = open_storage(uri)
    path = commit_local(directory, step, STAGE_NUMEL)
    upload_checkpoint(path, storage)
    apply_retention(storage, RetentionPolicy(keep_last=STAGE_KEEP_LAST))


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "upload-one":
    _upload_one(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
