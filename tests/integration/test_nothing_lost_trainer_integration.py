"""What the trainer side must never lose: a step whose local checkpoint was
refused, an emergency save nobody ships, an emergency upload the store
refused once; and what ``spotguard run`` must not hand its command (the
storage credentials).

Real storage throughout: file://, or the real S3 store, behind a proxy that
can fail on demand.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import assert_state_matches, commit_local, s3_options, step_tensors
from sidecar_helpers import Proc, base_env, reaping, s3_storage, spotguard_argv, store_proxy

from spotguard.checkpoint import latest_verified, list_local_committed, read_local_manifest, verify_local_checkpoint
from spotguard.checkpoint.format.manifest import MANIFEST_NAME, checkpoint_name
from spotguard.trainer import Checkpointer

pytestmark = pytest.mark.integration


def steps_of(directory: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in list_local_committed(directory)]


def refused_copies(directory: Path, step: int) -> list[Path]:
    return sorted(directory.glob(f"{checkpoint_name(step)}.refused-*"))


# -- a refused local checkpoint ------------------------------------------------


def damage(path: Path, how: str) -> None:
    if how == "flipped byte":
        data = next(p for p in sorted(path.iterdir()) if p.suffix == ".safetensors")
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif how == "garbled manifest":
        (path / MANIFEST_NAME).write_text("{not json")
    else:  # a file nobody checksummed nor scanned
        (path / "extra.pt").write_bytes(b"planted")


@pytest.mark.parametrize("how", ["flipped byte", "garbled manifest", "unlisted file"])
def test_a_refused_local_checkpoint_is_moved_aside_and_its_step_commits_again(tmp_path: Path, how: str) -> None:
    ckdir = tmp_path / "ckpts"
    first = Checkpointer(ckdir, keep_local=10, async_save=False)
    for step in (1, 2, 3):
        first.save(step, step_tensors(step))
    first.close()
    damage(ckdir / checkpoint_name(3), how)

    again = Checkpointer(ckdir, keep_local=10, async_save=False)
    restored = again.restore()
    assert restored is not None
    if how != "unlisted file":  # restore() reads only listed files; a framework's resume refuses it
        assert restored.step == 2
        again = Checkpointer(ckdir, keep_local=10, async_save=False)
        again.restore()
    else:
        assert again.resume_folder() == ckdir / checkpoint_name(2)
    path = again.save(3, step_tensors(3), blocking=True)
    again.close()

    assert path == ckdir / checkpoint_name(3)
    result = verify_local_checkpoint(path)
    assert result.ok, result.reason
    assert not (path / "extra.pt").exists()
    aside = refused_copies(ckdir, 3)
    assert len(aside) == 1  # kept for a look, never deleted
    assert not verify_local_checkpoint(aside[0]).ok or (aside[0] / "extra.pt").exists()
    assert steps_of(ckdir) == [1, 2, 3]  # listings do not see the refused copy
    resumed = Checkpointer(ckdir, keep_local=10, async_save=False).restore()
    assert resumed is not None and resumed.step == 3
    assert_state_matches(resumed.state, 3)


def test_a_valid_checkpoint_at_the_same_step_is_kept(tmp_path: Path) -> None:
    ckdir = tmp_path / "ckpts"
    first = Checkpointer(ckdir, keep_local=10, async_save=False)
    first.save(3, step_tensors(3))
    first.close()
    before = read_local_manifest(ckdir / checkpoint_name(3)).to_json()
    other = Checkpointer(ckdir, keep_local=10, async_save=False)
    assert other.save(3, step_tensors(4), blocking=True) == ckdir / checkpoint_name(3)
    other.close()
    assert read_local_manifest(ckdir / checkpoint_name(3)).to_json() == before
    assert refused_copies(ckdir, 3) == []


# -- the fsync of an emergency save ------------------------------------------------


def count_data_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of checkpoint data files fsynced from now on (manifests and directories left out)."""
    synced: list[str] = []
    real = os.fsync

    def counting(fd: int) -> None:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            target = Path(os.readlink(f"/proc/self/fd/{fd}"))
            if target.parent.name.startswith(".tmp-ckpt-") and target.name != MANIFEST_NAME:
                synced.append(target.name)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return synced


@pytest.mark.parametrize("uploader", ["none", "stale", "failing", "live"])
def test_an_emergency_save_skips_fsync_only_while_an_uploader_says_it_ships(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uploader: str
) -> None:
    from spotguard.sidecar.metrics import SidecarMetrics
    from spotguard.sidecar.service import AgentConfig, CheckpointAgent
    from spotguard.storage import open_storage

    ckdir, ctl = tmp_path / "ckpts", tmp_path / "ctl"
    root = tmp_path / "store"
    if uploader == "failing":
        root.write_text("a file where the store's directory should be")  # every upload fails
    storage = open_storage(f"file://{root}")
    agent = CheckpointAgent(AgentConfig(checkpoint_dir=ckdir, control_dir=ctl), storage, SidecarMetrics())
    ck = Checkpointer(ckdir, storage_uri=storage.uri, control_dir=ctl, async_save=False)
    synced = count_data_fsyncs(monkeypatch)
    ck.save(1, step_tensors(1))  # a routine save: always fsynced
    assert synced
    synced.clear()
    if uploader in ("live", "failing"):
        agent.step()  # a round of the uploader's loop: it ships ckpt-1, or fails to, and says so
        from spotguard.contract.control import HEARTBEAT_FILE, parse_heartbeat

        beat = parse_heartbeat((ctl / HEARTBEAT_FILE).read_bytes())
        assert beat.shipping is (uploader == "live") is (agent.shipper.last_shipped is not None)
    elif uploader == "stale":
        from spotguard.contract.control import write_heartbeat

        write_heartbeat(ctl, shipping=True, now=time.time() - 60)  # an uploader that stopped a minute ago
    ck.request_checkpoint("sigterm", preempt=True, deadline=time.time() + 20)
    path = ck.save(2, step_tensors(2))
    ck.close()
    assert path is not None and verify_local_checkpoint(path).ok
    assert bool(synced) is (uploader != "live"), synced
    if uploader == "live":
        agent.step()  # and it ships it
        assert agent.shipper.last_shipped is not None and agent.shipper.last_shipped.step == 2


# -- the in-process emergency upload ---------------------------------------------------


def test_an_in_process_emergency_upload_is_retried_until_the_store_answers(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    storage = s3_storage(s3_store, s3_uri)  # the test's own view, not through the proxy
    with store_proxy(s3_store) as proxy:
        options = {**s3_options(s3_store), "endpoint_url": proxy.url, "max_attempts": 1}
        ck = Checkpointer(
            tmp_path / "ckpts", storage_uri=s3_uri, storage_options=options, upload=True, async_save=False
        )
        ck.save(1, step_tensors(1))
        assert latest_verified(storage)[0].step == 1  # type: ignore[union-attr]
        proxy.fail_for(1.5)
        t0 = time.time()
        ck.request_checkpoint("sigterm", preempt=True, deadline=t0 + 20)
        assert ck.save(2, step_tensors(2)) is not None
        ck.close()
        refused = [r for r in proxy.since(t0) if r[3] == 500]
    assert refused, "the store never refused anything"
    info, _ = latest_verified(storage)
    assert info is not None and info.step == 2
    assert ck.preempted


# -- spotguard run and the storage credentials -------------------------------------------

CHILD = """
import json, os, time
import numpy as np
from spotguard.contract.control import uploader_shipping
from spotguard.trainer import Checkpointer

print("env", json.dumps(sorted(k for k in os.environ if k.startswith(("AWS_", "SPOTGUARD_")))), flush=True)
ck = Checkpointer.from_env()
restored = ck.restore()
print("restored", restored.step if restored else None, flush=True)
deadline = time.time() + 20
while not uploader_shipping(ck.control_dir) and time.time() < deadline:
    time.sleep(0.05)
print("uploader shipping", uploader_shipping(ck.control_dir), flush=True)
step = (restored.step if restored else 0) + 1
ck.save(step, {"w": np.arange(4, dtype=np.float32) + step}, blocking=True)
ck.close()
"""


def test_run_hands_the_command_no_storage_credentials_and_it_still_resumes(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    """A fresh machine: nothing local, a checkpoint in storage. The supervisor
    stages it; the command, without credentials or storage URI, resumes from
    it, sees the supervisor's heartbeat, and its next checkpoint is shipped."""
    from spotguard.checkpoint import upload_checkpoint

    storage = s3_storage(s3_store, s3_uri)
    upload_checkpoint(commit_local(tmp_path / "elsewhere", 1), storage)
    argv = spotguard_argv(
        "run",
        "--workdir",
        str(tmp_path / "work"),
        "--storage",
        s3_uri,
        "--max-restarts",
        "0",
        "--",
        sys.executable,
        "-c",
        CHILD,
    )
    with reaping() as procs:
        proc = Proc(argv, base_env(s3_store.env()), tmp_path / "run.log")
        procs.append(proc)
        names = set(json.loads(proc.wait_for_line(lambda ln: ln.startswith("env ")).split(" ", 1)[1]))
        assert not names & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "SPOTGUARD_STORAGE_URI"}, names
        assert {"SPOTGUARD_CHECKPOINT_DIR", "SPOTGUARD_CONTROL_DIR", "AWS_ENDPOINT_URL_S3"} <= names
        assert proc.wait(60) == 0, proc.tail()
    assert "restored 1" in proc.lines, proc.tail()
    assert "uploader shipping True" in proc.lines, proc.tail()
    assert latest_verified(storage)[0].step == 2  # type: ignore[union-attr]


@pytest.mark.parametrize("passed", [False, True])
def test_run_passes_the_storage_credentials_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, passed: bool
) -> None:
    from spotguard.run.supervisor import RunConfig, Supervisor
    from spotguard.sidecar.metrics import SidecarMetrics
    from spotguard.storage import open_storage

    for key, value in {
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_SESSION_TOKEN": "t",
        "SPOTGUARD_STORAGE_URI": "s3://elsewhere/x",
        "AWS_ENDPOINT_URL_S3": "http://e",
    }.items():
        monkeypatch.setenv(key, value)
    uri = f"file://{tmp_path}/store"
    config = RunConfig(
        command=["true"], workdir=tmp_path, storage_uri=uri, checkpoint_dir=tmp_path / "ckpts", pass_credentials=passed
    )
    env = Supervisor(config, open_storage(uri), SidecarMetrics()).child_env()
    secrets = {k: env.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")}
    if passed:
        assert secrets == {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t"}
        assert env["SPOTGUARD_STORAGE_URI"] == uri
    else:
        assert secrets == dict.fromkeys(secrets)
        assert "SPOTGUARD_STORAGE_URI" not in env
    assert env["AWS_ENDPOINT_URL_S3"] == "http://e"  # where the store is: not a secret
    assert env["SPOTGUARD_CHECKPOINT_DIR"] == str(tmp_path / "ckpts")


# -- a trainer gone with a backlog -------------------------------------------------------


def test_a_gone_trainers_newest_checkpoint_ships_first_and_alone(tmp_path: Path) -> None:
    """A slow store leaves routine checkpoints queued; when the trainer exits (a gang member stopped because
    another node went), its newest checkpoint is what the time left is for: shipped first, the older ones
    never (they could only make storage look older)."""
    from spotguard.sidecar.metrics import SidecarMetrics
    from spotguard.sidecar.service import AgentConfig, CheckpointAgent
    from spotguard.storage import open_storage

    ckdir, ctl = tmp_path / "ckpts", tmp_path / "ctl"
    storage = open_storage(f"file://{tmp_path / 'store'}")
    agent = CheckpointAgent(AgentConfig(checkpoint_dir=ckdir, control_dir=ctl), storage, SidecarMetrics())
    for step in (20, 40, 60, 77):  # a backlog: nothing shipped yet; 77 is the trainer's last save
        commit_local(ckdir, step)
    uploaded: list[str] = []
    real = storage.upload_files

    def noting(files: Any, *args: Any, **kwargs: Any) -> Any:
        files = list(files)
        uploaded.extend(sorted({key.split("/", 1)[0] for _, key in files}))
        return real(files, *args, **kwargs)

    storage.upload_files = noting  # type: ignore[method-assign]
    assert agent.flush(time.time() + 60)
    assert latest_verified(storage)[0].step == 77  # type: ignore[union-attr]
    assert uploaded == [checkpoint_name(77)], uploaded
