"""`spotguard ckpt ...` and `spotguard restore`, end to end, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import commit_local, s3_options, subprocess_env
from safetensors.torch import load_file

from spotguard.checkpoint import list_checkpoint_names, snapshot_state, upload_checkpoint, write_checkpoint
from spotguard.storage import Storage, open_storage

pytestmark = pytest.mark.integration


def name(step: int) -> str:
    return f"ckpt-{step:012d}"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotguard.cli", *args],
        env=env or subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_line_error(proc: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spotguard: error: ") and fragment in lines[0], proc.stderr


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Storage, dict[str, str]]:
    """(URI, storage, environment for the CLI) holding checkpoints 10, 20 (good) and 30 (damaged)."""
    if request.param == "file":
        uri = f"file://{tmp_path}/remote/job"
        storage = open_storage(uri)
        env = subprocess_env()
    else:
        s3_store = request.getfixturevalue("s3_store")
        uri = request.getfixturevalue("s3_uri")
        storage = open_storage(uri, **s3_options(s3_store))
        env = subprocess_env(s3_store)
    for step, loss in [(10, 0.5), (20, 0.25), (30, 0.125)]:
        upload_checkpoint(commit_local(tmp_path / "local", step, metrics={"loss": loss}), storage)
    key = f"{name(30)}/model.safetensors"
    data = storage.read_bytes(key)
    storage.write_bytes(key, data[:-1] + bytes([data[-1] ^ 0xFF]))
    return uri, storage, env


def test_ls(target: tuple[str, Storage, dict[str, str]]) -> None:
    uri, _, env = target
    proc = cli("ckpt", "ls", uri, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["STEP", "CREATED", "SIZE", "METRICS", "VERIFIED"]
    assert lines[1].split()[0] == "10" and lines[1].rstrip().endswith("yes") and "loss=0.5" in lines[1]
    assert lines[2].split()[0] == "20" and lines[2].rstrip().endswith("yes")
    assert lines[3].split()[0] == "30*" and "no: model.safetensors: crc32c checksum mismatch" in lines[3]
    assert "KiB" in lines[1]

    doc = json.loads(cli("ckpt", "ls", uri, "--json", env=env).stdout)
    rows = {r["step"]: r for r in doc["checkpoints"]}
    assert [rows[s]["verified"] for s in (10, 20, 30)] == [True, True, False]
    assert rows[20]["metrics"] == {"loss": 0.25} and rows[30]["latest"] is True
    assert rows[30]["problems"][0].startswith("model.safetensors: crc32c checksum mismatch")

    quick = json.loads(cli("ckpt", "ls", uri, "--json", "--quick", env=env).stdout)
    assert all(r["verified"] for r in quick["checkpoints"])  # sizes are intact; only a read finds the flip


def test_ls_empty(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    proc = cli("ckpt", "ls", f"file://{tmp_path}/empty")
    assert proc.returncode == 0 and proc.stdout.strip() == f"no checkpoints at file://{tmp_path}/empty"


def test_verify(target: tuple[str, Storage, dict[str, str]]) -> None:
    uri, _, env = target
    good = cli("ckpt", "verify", f"{uri}/{name(20)}", env=env)
    assert good.returncode == 0 and good.stdout.startswith(f"{name(20)}: ok (3 files"), good.stdout
    short = cli("ckpt", "verify", f"{uri}/ckpt-10", env=env)
    assert short.returncode == 0 and short.stdout.startswith(f"{name(10)}: ok")
    bad = cli("ckpt", "verify", f"{uri}/{name(30)}/", env=env)
    assert bad.returncode == 1
    assert f"{uri}/{name(30)}/model.safetensors: crc32c checksum mismatch" in bad.stdout
    assert "1 of 1 checkpoint(s) failed verification" in bad.stderr
    everything = cli("ckpt", "verify", uri, env=env)
    assert everything.returncode == 1 and everything.stdout.count(": ok") == 2 and "FAILED" in everything.stdout


def test_restore(target: tuple[str, Storage, dict[str, str]], tmp_path: Path) -> None:
    uri, _, env = target
    # Bytes: text mode would read each carriage return as a line break.
    raw = subprocess.run(
        [sys.executable, "-m", "spotguard.cli", "ckpt", "restore", uri, str(tmp_path / "dest"), "--progress"],
        env=env,
        capture_output=True,
        timeout=120,
    )
    proc = subprocess.CompletedProcess(raw.args, raw.returncode, raw.stdout.decode(), raw.stderr.decode())
    assert proc.returncode == 0, proc.stderr
    assert f"skipped {name(30)}: model.safetensors: crc32c checksum mismatch" in proc.stderr
    assert b"\r" not in raw.stderr  # asked for off a terminal: plain lines, as a pod's log wants them
    assert "restoring ckpt-000000000020: 100%" in proc.stderr
    assert proc.stdout.startswith(f"restored {name(20)} (step 20")
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == [name(20)]

    one = cli("ckpt", "restore", f"{uri}/{name(10)}", str(tmp_path / "dest2"), env=env)
    assert one.returncode == 0 and (tmp_path / "dest2" / name(10) / "manifest.json").is_file()
    assert one.stderr == ""  # no progress bar when stderr is not a terminal

    broken = cli("ckpt", "restore", f"{uri}/{name(30)}", str(tmp_path / "dest3"), env=env)
    one_line_error(broken, "model.safetensors: crc32c checksum mismatch")
    assert not (tmp_path / "dest3" / name(30)).exists()


def test_restore_with_nothing_to_restore(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    proc = cli("ckpt", "restore", f"file://{tmp_path}/empty", str(tmp_path / "dest"))
    one_line_error(proc, f"nothing to restore: no verified checkpoint at file://{tmp_path}/empty")


def test_init_container_restore(target: tuple[str, Storage, dict[str, str]], tmp_path: Path) -> None:
    uri, _, env = target
    proc = cli("restore", "--storage", uri, "--dest", str(tmp_path / "ck"), env=env)
    assert proc.returncode == 0 and f"restored {name(20)}" in proc.stdout, proc.stderr
    assert (tmp_path / "ck" / name(20) / "manifest.json").is_file()
    via_env = cli("restore", env=env | {"SPOTGUARD_STORAGE_URI": uri, "SPOTGUARD_CHECKPOINT_DIR": str(tmp_path / "e")})
    assert via_env.returncode == 0 and (tmp_path / "e" / name(20)).is_dir()


def test_init_container_restore_with_nothing_yet(tmp_path: Path) -> None:
    (tmp_path / "remote").mkdir()
    proc = cli("restore", "--storage", f"file://{tmp_path}/remote", "--dest", str(tmp_path / "ck"))
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"no verified checkpoint at file://{tmp_path}/remote yet; the trainer starts fresh"
    missing = cli("restore", "--dest", str(tmp_path / "ck"))
    one_line_error(missing, "no storage URI: pass --storage URI or set SPOTGUARD_STORAGE_URI")


def test_gc(target: tuple[str, Storage, dict[str, str]]) -> None:
    uri, storage, env = target
    dry = cli("ckpt", "gc", uri, "--keep-last", "1", "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert f"would delete {name(10)}  (retention)" in dry.stdout
    assert f"keep    {name(20)}  (newest verified)" in dry.stdout
    assert f"keep    {name(30)}  (newer than the newest verified, last 1)" in dry.stdout
    assert list_checkpoint_names(storage) == [name(10), name(20), name(30)]
    real = cli("ckpt", "gc", uri, "--keep-last", "1", env=env)
    assert real.returncode == 0 and f"deleted {name(10)}  (retention)" in real.stdout
    assert list_checkpoint_names(storage) == [name(20), name(30)]
    bad = cli("ckpt", "gc", uri, "--keep-best", "2", env=env)
    one_line_error(bad, "--keep-best needs --metric NAME")
    # A grace shorter than the upload lease is refused before anything is read or deleted.
    short = cli("ckpt", "gc", uri, "--keep-last", "1", "--orphan-grace", "0", env=env)
    one_line_error(short, "an orphan grace of 0s is shorter than the upload lease (60s)")
    assert list_checkpoint_names(storage) == [name(20), name(30)]


def test_gc_keep_best(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/remote"
    storage = open_storage(uri)
    for step, acc in [(1, 0.9), (2, 0.5), (3, 0.7), (4, 0.1)]:
        upload_checkpoint(commit_local(tmp_path / "local", step, metrics={"acc": acc}), storage)
    proc = cli("ckpt", "gc", uri, "--keep-last", "1", "--keep-best", "1", "--metric", "acc", "--mode", "max")
    assert proc.returncode == 0, proc.stderr
    assert list_checkpoint_names(storage) == [name(1), name(4)]


def test_gc_takes_retention_as_the_uploaders_do(tmp_path: Path) -> None:
    """``ckpt gc``'s rules are the uploaders' options: the same flags, their defaults from the same variables."""
    uri = f"file://{tmp_path}/remote"
    storage = open_storage(uri)
    for step, acc in [(1, 0.9), (2, 0.5), (3, 0.7), (4, 0.1)]:
        upload_checkpoint(commit_local(tmp_path / "local", step, metrics={"acc": acc}), storage)
    by_env = cli("ckpt", "gc", uri, "--dry-run", env=subprocess_env(SPOTGUARD_KEEP_LAST="2"))
    assert by_env.returncode == 0, by_env.stderr
    assert f"would delete {name(2)}  (retention)" in by_env.stdout and f"keep    {name(3)}" in by_env.stdout
    proc = cli("ckpt", "gc", uri, "--keep-last", "1", "--keep-best", "1", "--best-metric", "acc", "--best-mode", "max")
    assert proc.returncode == 0, proc.stderr
    assert list_checkpoint_names(storage) == [name(1), name(4)]


def test_average(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/remote"
    storage = open_storage(uri)
    g = torch.Generator().manual_seed(0)
    weights = {}
    for step in (1, 2, 3, 4):
        w = torch.randn(4, 5, generator=g)
        weights[step] = w
        state = {"model": {"w": w, "h": w.to(torch.bfloat16), "count": torch.tensor(step)}, "optimizer": {}}
        upload_checkpoint(write_checkpoint(tmp_path / "local", step, snapshot_state(state)), storage)
    out = tmp_path / "avg.safetensors"
    proc = cli("ckpt", "average", uri, "--last", "3", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "over steps 4, 3, 2" in proc.stdout
    avg = load_file(str(out))
    expected = torch.stack([weights[s].double() for s in (2, 3, 4)]).mean(0).float()
    assert torch.allclose(avg["w"], expected, rtol=0, atol=1e-6) and avg["w"].dtype == torch.float32
    assert avg["h"].dtype == torch.bfloat16
    assert torch.equal(avg["count"], torch.tensor(4))  # integer tensors come from the newest

    too_many = cli("ckpt", "average", uri, "--last", "9", str(tmp_path / "x.safetensors"))
    one_line_error(too_many, "only 4 verified checkpoint(s)")
    wrong_part = cli("ckpt", "average", uri, "--last", "1", "--part", "ema", str(tmp_path / "x.safetensors"))
    one_line_error(wrong_part, "has no ema.safetensors")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["ckpt", "ls", "az://bucket/x"], "unsupported storage URI scheme 'az'"),
        # No credentials anywhere (NO_GCE_CHECK keeps the test off the metadata server's address).
        (["ckpt", "ls", "gs://bucket/x"], "no Google Cloud credentials found"),
        (["ckpt", "verify", "file:///definitely/not/here"], "directory /definitely/not/here does not exist"),
        (["ckpt", "ls", "s3://"], "no bucket in 's3://'"),
    ],
)
def test_user_errors_are_one_line(args: list[str], fragment: str) -> None:
    one_line_error(cli(*args), fragment)


def test_s3_user_errors_are_one_line(s3_store: Any, tmp_path: Path) -> None:
    env = subprocess_env(s3_store)
    missing = cli("ckpt", "ls", "s3://no-such-bucket-here/x", env=env)
    one_line_error(missing, "bucket 'no-such-bucket-here' does not exist")
    bare = {k: v for k, v in env.items() if not k.startswith("AWS_")}
    bare |= {
        "AWS_ENDPOINT_URL_S3": s3_store.endpoint_url,
        "AWS_DEFAULT_REGION": s3_store.region,
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    one_line_error(cli("ckpt", "ls", f"s3://{s3_store.bucket}/x", env=bare), "no AWS credentials found")
    wrong = env | {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    proc = cli("ckpt", "ls", f"s3://{s3_store.bucket}/x", env=wrong)
    one_line_error(proc, "denied")
    assert "not-the-secret" not in proc.stderr


def test_help_is_fast_and_complete() -> None:
    proc = cli("ckpt", "--help")
    assert proc.returncode == 0
    for sub in ("ls", "verify", "restore", "gc", "average"):
        assert sub in proc.stdout
    code = "import sys, spotguard.cli as c; c.build_parser(); print('torch' in sys.modules, 'boto3' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env())
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_verify_deep_reads_back(target: tuple[str, Storage, dict[str, str]]) -> None:
    """S3 verification trusts the checksums the store computed on receipt; ``--deep``
    reads every byte back (the file backend always does); both say which they did."""
    uri, _, env = target
    fast = cli("ckpt", "verify", f"{uri}/{name(20)}", env=env)
    deep = cli("ckpt", "verify", f"{uri}/{name(20)}", "--deep", env=env)
    assert fast.returncode == 0 and deep.returncode == 0, fast.stderr + deep.stderr
    assert deep.stdout.rstrip().endswith("by read-back)"), deep.stdout
    if uri.startswith("s3://"):
        assert "by store-checksum)" in fast.stdout or "by mixed)" in fast.stdout, fast.stdout
    else:
        assert fast.stdout.rstrip().endswith("by read-back)"), fast.stdout
    rows = json.loads(cli("ckpt", "ls", uri, "--json", "--deep", env=env).stdout)["checkpoints"]
    assert {r["method"] for r in rows} == {"read-back"}
    bad = cli("ckpt", "verify", f"{uri}/{name(30)}", "--deep", env=env)
    assert bad.returncode == 1 and "crc32c checksum mismatch" in bad.stdout
