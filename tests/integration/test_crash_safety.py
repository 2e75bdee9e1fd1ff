"""Crash safety: SIGKILL the writer or the uploader at stratified instants, then check
that nothing partial is ever reported complete or verified, and that the newest
verified checkpoint loads with exactly the content it was saved with.

Trials in four modes (a Checkpointer writing locally, an uploader with retention
writing to file://, one writing to S3, one to Google Cloud Storage's JSON API):
``testenv.trials`` sets how many (5 a mode
in ``make test``, 20 in ``make soak``) and the seed. Trial i of n kills at
(i + U)/n of two measured cycles, and the stage each kill hit (from the worker's
last line) is printed. Where a random kill lands depends on the machine's load;
the stages themselves are each hit for certain by the aimed kills below.

Then kills aimed at protocol stages, each asserted from what the store or the disk
shows:
- inside a local save (mid-file, before the rename, after the rename): the worker
  stops itself there and the test kills it;
- each stage of the upload protocol (during data, after data, after the manifest,
  after the pointer, during retention): the fault proxy (``testenv/faultproxy.py``)
  holds the first request of the stage and the test kills the uploader while it waits;
- a distributed checkpoint's uploader killed mid-part (a multipart upload's second
  part held) and mid-commit (the global manifest's write held): the pointer never
  moves and the step never verifies until every part is stored and committed.

This file is also the uploader those trials run (``python THIS upload-one`` /
``upload-part``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import HELPERS, assert_state_matches, commit_local, s3_options, subprocess_env, write_part

from spotguard.checkpoint import (
    MANIFEST_NAME,
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
from spotguard.checkpoint.local.commit import WRITER_TMP_PREFIX
from spotguard.storage import NotFoundError, Storage, open_storage
from testenv import trials

pytestmark = pytest.mark.integration

WORKER = HELPERS / "crash_worker.py"
TRIALS_PER_MODE = trials.count(full=20, quick=5)
NUMEL = 200_000


@dataclass
class Outcome:
    trial: int
    mode: str
    delay: float
    last_event: str
    newest: int | None
    skipped: int

    @property
    def stage(self) -> str:
        return stage_of(self.mode, self.last_event)


#: Where a worker was, from the first word of its last line (see ckpt_helpers/crash_worker.py).
WRITE_STAGES = {"ready": "starting", "begin": "inside a save", "committed": "between saves"}
UPLOAD_STAGES = {
    "ready": "starting",
    "begin": "local commit",
    "committed": "inside an upload",
    "uploaded": "retention or next commit",
    "gc": "after retention",
}


def stage_of(mode: str, last_event: str) -> str:
    table = WRITE_STAGES if mode == "write" else UPLOAD_STAGES
    return table[last_event.split()[0]]


def run_and_kill(args: list[str], env: dict[str, str], delay: float, until: str | None = None) -> tuple[str, float]:
    """Start the worker, wait until it is ready, let it work ``delay`` seconds (or, with
    ``until``, until it prints a line starting so), SIGKILL it. Returns its last event and
    how long it worked."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
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
    complete, torn = [], set()
    for name in list_checkpoint_names(storage):
        try:
            read_manifest(storage, name)
        except NotFoundError:
            continue
        except ManifestError as exc:
            # The test S3 store (SeaweedFS) was seen to keep an empty object where a PUT of the
            # manifest was cut by the uploader's kill (S3 itself stores nothing): such a
            # checkpoint must be passed over, never taken. Anything else unreadable is a bug.
            assert storage.read_bytes(f"{name}/{MANIFEST_NAME}") == b"", f"{name}: manifest unreadable: {exc}"
            torn.add(name)
            continue
        result = verify_checkpoint(storage, name)
        assert result.ok, f"{name} has a manifest but does not verify: {result.problems}"
        complete.append(name)
    info, skipped = latest_verified(storage)
    assert all("manifest.json: missing" in s.reason or s.name in torn for s in skipped), skipped
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
    print(
        f"{'trial':>5}  {'mode':<12} {'kill after':>10}  {'last event':<16} {'stage':<24} {'newest verified':>15}"
        "  skipped"
    )
    for o in outcomes:
        newest = "-" if o.newest is None else str(o.newest)
        print(
            f"{o.trial:>5}  {o.mode:<12} {o.delay:>9.3f}s  {o.last_event:<16} {o.stage:<24} {newest:>15}  {o.skipped}"
        )
    kinds: dict[str, int] = {}
    for o in outcomes:
        kinds[f"{o.mode}: {o.stage}"] = kinds.get(f"{o.mode}: {o.stage}", 0) + 1
    summary = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
    print(f"{len(outcomes)} trials, all safe; killed: {summary}")


@pytest.mark.trials
def test_crash_safety(tmp_path: Path, s3_store: Any, s3_uri: str, gcs_store: Any, gs_uri: str) -> None:
    rng = trials.rng("crash-safety")
    print(f"\ncrash-safety seed {trials.seed()}, {TRIALS_PER_MODE} trials a mode")
    outcomes: list[Outcome] = []
    file_uri = f"file://{tmp_path}/remote/job"
    stores: dict[str, tuple[str, Storage, dict[str, str]]] = {
        "upload-file": (file_uri, open_storage(file_uri), subprocess_env()),
        "upload-s3": (s3_uri, open_storage(s3_uri, **s3_options(s3_store)), subprocess_env(s3_store)),
        # Google Cloud Storage: its JSON API server (generation preconditions, server CRC32C).
        "upload-gs": (gs_uri, open_storage(gs_uri, **gcs_store.options()), subprocess_env(**gcs_store.env())),
    }
    had_verified: dict[str, bool] = {}
    trial = 0
    for mode in ("write", *stores):
        # The first trial of a mode runs until one cycle is complete and measures it; the
        # others are killed at stratified instants over two cycles (trial i of n at
        # (i + U)/n of them), so a handful of kills covers every part of the cycle.
        cycle = 0.3
        instants = trials.stratified(TRIALS_PER_MODE - 1, rng)
        for i in range(TRIALS_PER_MODE):
            trial += 1
            start = (i + 1) * 1000
            until = ("committed" if mode == "write" else "uploaded") if i == 0 else None
            delay = 2 * cycle * instants[i - 1] if i else 0.0
            if mode == "write":
                directory = tmp_path / "local-write"
                last, worked = run_and_kill(["write", str(directory), str(start)], subprocess_env(), delay, until)
                newest, skipped = check_local(directory), 0
            else:
                uri, storage, env = stores[mode]
                last, worked = run_and_kill(
                    ["upload", uri, str(tmp_path / f"local-{mode}"), str(start)], env, delay, until
                )
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
    assert len(outcomes) == (1 + len(stores)) * TRIALS_PER_MODE
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
    # The first listing is the verification's, before the pointer moves.
    Stage("after pointer", "GET", r"list-type=2", "new", skip=1),
    # The first multi-object delete is the upload's own intent's (spotguard.checkpoint.store.intents).
    Stage("retention: before the manifest goes", "POST", r"\?delete", "new", skip=1),
    Stage("retention: after the manifest went", "POST", r"\?delete", "new", skip=2),
]
STAGE_NUMEL = NUMEL  # check_storage loads with this size
STAGE_KEEP_LAST = 2


def deleted_keys(records: list[Any]) -> list[str]:
    """Keys named in the multi-object deletes the proxy forwarded, but for the
    uploads' own intents (``gc/uploads/``, removed once an upload is done)."""
    import re

    keys: list[str] = []
    for rec in records:
        if rec.method == "POST" and rec.query.startswith("delete") and rec.status == 200 and rec.body:
            keys += [k for k in re.findall(r"<Key>([^<]+)</Key>", rec.body.decode()) if "/gc/uploads/" not in k]
    return keys


def kill_when_held(proc: subprocess.Popen[str], held: Any, proxy: Any, stage: str) -> list[Any]:
    """SIGKILL ``proc`` once the fault proxy holds its request ``held`` (then drop that
    request); the requests the store saw before it, to tell which stage the kill hit."""
    try:
        reached = held.wait(120)
    finally:
        proc.kill()
        out, _ = proc.communicate(timeout=60)
        held.release(forward=False)
    assert reached, f"{stage}: the uploader never got there; output:\n{out}"
    assert held.record is not None
    log = list(proxy.log)
    return log[: log.index(held.record)]


def test_kills_aimed_at_each_upload_stage(tmp_path: Path, s3_store: Any, s3_uri: str) -> None:
    from testenv.faultproxy import FaultProxy

    storage = open_storage(s3_uri, **s3_options(s3_store))
    local = tmp_path / "local"
    rows: list[str] = []
    with FaultProxy(s3_store.endpoint_url) as proxy:
        env = subprocess_env(s3_store, AWS_ENDPOINT_URL_S3=proxy.url, AWS_ENDPOINT_URL=proxy.url)

        def upload_one(step: int) -> subprocess.Popen[str]:
            return subprocess.Popen(
                [sys.executable, __file__, "upload-one", s3_uri, str(local), str(step)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )

        # Two complete checkpoints first (in this process), so that retention has something to delete.
        from spotguard.checkpoint import upload_checkpoint

        for step in (1, 2):
            upload_checkpoint(commit_local(local, step, STAGE_NUMEL), storage)
        verified = [1, 2]
        for number, stage in enumerate(STAGES, start=3):
            new = f"ckpt-{number:012d}"
            proxy.log.clear()
            held = proxy.hold(method=stage.method, path=stage.path.format(new=new), skip=stage.skip)
            before = kill_when_held(upload_one(number), held, proxy, stage.name)
            log = list(proxy.log)
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
                assert len(first) == stage.skip - 1, first
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
            rows.append(
                f"{stage.name:<38} held {held.record.method:<4} {held.record.target[-48:]:<48} "
                f"newest verified {newest}, pointer {pointer}, skipped {skipped}"
            )
    print("\n" + "\n".join(rows))


# -- kills aimed inside a local save ---------------------------------------------------------

#: Where the save stops itself (the test kills it there) and the step the directory must then hold.
SAVE_STAGES = {"mid-file": "previous", "before rename": "previous", "after rename": "new"}


@pytest.mark.parametrize("where", list(SAVE_STAGES))
def test_kills_aimed_inside_a_local_save(tmp_path: Path, where: str) -> None:
    """The saving process stops at ``where`` (mid-way through the first data file,
    with data and manifest written but before the rename, right after the rename)
    and is SIGKILLed there: the directory holds the previous checkpoint or the new
    one, complete, never a partial one, and a save of the same step afterwards works."""
    directory = tmp_path / "ckpts"
    for step in (1, 2):
        commit_local(directory, step, NUMEL)
    proc = subprocess.Popen(
        [sys.executable, __file__, "save-held", str(directory), "3", where],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line == f"held {where}", f"the save never got to {where!r}: {line}{proc.stdout.read()}"
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    partial = [p.name for p in directory.iterdir() if p.name.startswith(f"{WRITER_TMP_PREFIX}{3:012d}-")]
    newest = check_local(directory)
    assert newest == (3 if SAVE_STAGES[where] == "new" else 2), (where, newest, sorted(os.listdir(directory)))
    if SAVE_STAGES[where] == "previous":
        assert partial, f"{where}: no partial save of step 3 on disk: the kill did not land inside the save"
    # The process that comes next saves the same step again (or keeps the committed one).
    commit_local(directory, 3, NUMEL)
    assert check_local(directory) == 3


def _save_held(directory: Path, step: int, where: str) -> None:
    """Save ``step`` and stop for good at ``where`` (see SAVE_STAGES), saying so."""
    import spotguard.checkpoint.local.commit as local

    def hold() -> None:
        print(f"held {where}", flush=True)
        time.sleep(3600)

    if where == "mid-file":
        write_all, calls = local._write_all, [0]  # noqa: SLF001 - the seam of a file's writes

        def held_write(fd: int, chunk: Any) -> None:
            write_all(fd, chunk)
            calls[0] += 1
            if calls[0] == 2:  # the safetensors header and the first tensor: the file is incomplete
                hold()

        local._write_all = held_write  # noqa: SLF001
    elif where == "before rename":
        rename = os.rename

        def held_rename(src: Any, dst: Any) -> None:
            hold()
            rename(src, dst)

        os.rename = held_rename
    else:
        fsync_dir = local.fsync_dir

        def held_fsync_dir(path: Path) -> None:
            if Path(path) == directory:  # the parent, fsynced right after the rename
                hold()
            fsync_dir(path)

        local.fsync_dir = held_fsync_dir
    commit_local(directory, step, NUMEL)
    raise SystemExit(f"the save of step {step} ended without reaching {where!r}")


# -- a distributed checkpoint's uploader killed mid-part and mid-commit ---------------------

MiB = 1 << 20


@pytest.mark.parametrize("where", ["mid-part", "mid-commit"])
def test_uploader_killed_mid_part_or_mid_commit_never_moves_the_pointer(
    tmp_path: Path, s3_store: Any, s3_uri: str, where: str
) -> None:
    """Step 10 of a two-part distributed checkpoint is complete; of step 20, part 0 is
    stored. Part 1's uploader is then SIGKILLed while the store holds one of its
    multipart upload's parts (``mid-part``: its data is half there), or while it
    writes the global manifest (``mid-commit``: every part is stored and verified,
    the commit not). Either way step 20 is not a checkpoint: it does not verify, the
    pointer stays at 10, and resume takes 10. Part 1 shipped again by a new uploader
    commits step 20 and moves the pointer. A protocol that moved the pointer (or
    wrote the global manifest) before every part was stored and verified fails here."""
    from spotguard.checkpoint import MANIFEST_NAME, checkpoint_name, upload_checkpoint
    from spotguard.checkpoint.format.manifest import part_manifest_path
    from testenv.faultproxy import FaultProxy

    storage = open_storage(s3_uri, **s3_options(s3_store))
    for index in (0, 1):
        upload_checkpoint(write_part(tmp_path / f"node{index}", 10, index), storage)
    first = upload_checkpoint(write_part(tmp_path / "node0", 20, 0), storage)
    assert not first.committed and read_latest_pointer(storage) == 10
    big = 12 * MiB if where == "mid-part" else 0
    part = write_part(tmp_path / "node1", 20, 1, big=big)
    name = checkpoint_name(20)
    with FaultProxy(s3_store.endpoint_url) as proxy:
        env = subprocess_env(s3_store, AWS_ENDPOINT_URL_S3=proxy.url, AWS_ENDPOINT_URL=proxy.url)
        if where == "mid-part":
            held = proxy.hold(method="PUT", path=rf"/{name}/dcp/__2_0\.distcp\?.*\bpartNumber=2(&|$)")
        else:
            held = proxy.hold(method="PUT", path=rf"/{name}/{MANIFEST_NAME}$")
        proc = subprocess.Popen(
            [sys.executable, __file__, "upload-part", s3_uri, str(part)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        before = kill_when_held(proc, held, proxy, where)
    ok = {(r.method, r.key.split("/", 1)[-1], r.query.split("=")[0]) for r in before if r.status == 200}
    part_manifest = f"{name}/{part_manifest_path(1)}"
    if where == "mid-part":
        # The multipart upload was started and its manifest not sent: the kill hit mid-data.
        assert ("POST", f"{name}/dcp/__2_0.distcp", "uploads") in ok, sorted(ok)
        assert not any(k == part_manifest for _, k, _ in ok), sorted(ok)
    else:
        # Every file and the part manifest were stored: the kill hit the commit itself.
        assert ("PUT", part_manifest, "") in ok, sorted(ok)
    assert storage.stat(f"{name}/{MANIFEST_NAME}") is None, "a global manifest without a complete commit"
    assert read_latest_pointer(storage) == 10, "the pointer moved before every part was stored and verified"
    result = verify_checkpoint(storage, name)
    assert not result.ok and "manifest.json: missing" in result.reason, result.reason
    with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
        info, _ = latest_verified(storage)
        assert info is not None and info.step == 10
        restored = restore_checkpoint(storage, info.name, Path(scratch))
        assert verify_local_checkpoint(Path(restored.uri)).ok
    # A new uploader ships part 1 again: step 20 commits, verifies, and the pointer moves.
    again = upload_checkpoint(part, storage)
    assert again.committed and again.pointer_updated, again
    assert verify_checkpoint(storage, name).ok
    assert read_latest_pointer(storage) == 20


def _upload_part(uri: str, part: Path) -> None:
    """Upload one part of a distributed checkpoint; large files in 5 MiB multipart parts."""
    from spotguard.checkpoint import upload_checkpoint

    storage = open_storage(uri, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    upload_checkpoint(part, storage)


def _upload_one(uri: str, directory: Path, step: int) -> None:
    """One checkpoint: commit locally, upload (data, manifest, pointer), apply retention."""
    from spotguard.checkpoint import RetentionPolicy, apply_retention, upload_checkpoint

    storage = open_storage(uri)
    path = commit_local(directory, step, STAGE_NUMEL)
    upload_checkpoint(path, storage)
    apply_retention(storage, RetentionPolicy(keep_last=STAGE_KEEP_LAST))


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "upload-one":
    _upload_one(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
elif __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "save-held":
    _save_held(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
elif __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "upload-part":
    _upload_part(sys.argv[2], Path(sys.argv[3]))
