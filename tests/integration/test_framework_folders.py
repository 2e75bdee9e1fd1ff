"""A framework's own checkpoint folders committed as spotguard checkpoints,
against the real S3 store: upload and verify, a code-running pickle planted in
storage refused at resume with a walk-back, and two "nodes" (two torchrun
agents, each with its own directories) committing one global checkpoint from
their folders and resuming it.

Run as a script under torchrun, this file is the worker of the two-node tests.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sidecar_helpers import free_port, worker_env

from testenv.require import require_tool

TORCHRUN = Path(sys.executable).with_name("torchrun")


class Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("true",))


def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--frame", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--differ", action="store_true", help="node 1 writes the shared file differently")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    from spotguard.integrations import _core

    assert _core.ensure_process_group()  # from torchrun's environment, before any framework
    import torch.distributed as dist

    rank = dist.get_rank()
    ck = _core.checkpointer(directory=args.dir, upload=True, save_every_steps=2)
    assert ck.distributed
    resumed = ck.resume_folder()
    start = 0 if resumed is None else int(resumed.name.rsplit("-", 1)[1]) + 1
    files = sorted(p.relative_to(resumed).as_posix() for p in resumed.rglob("*") if p.is_file()) if resumed else []
    committed = {}
    for step in range(start, start + args.steps):
        frame = Path(args.frame) / f"checkpoint-{step}"
        if ck.should_save(step):
            frame.mkdir(parents=True, exist_ok=True)
            # The "framework": every rank its own RNG file; the model written on every node.
            (frame / f"rng_state_{rank}.pth").write_bytes(pickle.dumps({"rank": rank, "step": step}, protocol=2))
            node = int(os.environ["GROUP_RANK"])
            model = b"model %d" % step + (b" node %d" % node if args.differ else b"")
            if int(os.environ["LOCAL_RANK"]) == 0:
                (frame / "model.safetensors").write_bytes(model)
            ck.commit_folder(step, frame)  # linked now, committed in the background
            shutil.rmtree(frame)  # the framework's rotation may delete its folder right away
            ck.wait()
            done = ck.last_committed
            committed[step] = str(done) if done is not None and done.name.endswith(f"{step:012d}") else "None"
    _core.reset()
    Path(args.out, f"info-{rank}.json").write_text(
        json.dumps({"resumed": str(resumed) if resumed else None, "files": files, "committed": committed})
    )
    dist.destroy_process_group()
    return 0


# -- the tests ---------------------------------------------------------------------


def write_folder(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_planted_code_pickle_in_storage_is_refused_and_resume_walks_back(
    s3_store: Any, s3_uri: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from ckpt_helpers import replace_stored_file, s3_options

    from spotguard.checkpoint.store.verify_stored import verify_checkpoint
    from spotguard.storage import open_storage
    from spotguard.trainer.checkpointer import Checkpointer

    opts = s3_options(s3_store)
    ck = Checkpointer(tmp_path / "a", storage_uri=s3_uri, storage_options=opts, upload=True, handle_signals=False)
    for step in (5, 10):
        src = write_folder(
            tmp_path / f"checkpoint-{step}",
            {"model.safetensors": b"w%d" % step, "rng_state.pth": pickle.dumps({"s": step}, protocol=2)},
        )
        assert ck.commit_folder(step, src, blocking=True) is not None
    ck.close()
    storage = open_storage(s3_uri, **opts)
    assert verify_checkpoint(storage, "ckpt-000000000010").ok
    # An attacker with write access replaces the newest checkpoint's pickle and fixes its manifest.
    replace_stored_file(storage, "ckpt-000000000010", "rng_state.pth", pickle.dumps(Evil()))
    fresh = Checkpointer(tmp_path / "b", storage_uri=s3_uri, storage_options=opts, handle_signals=False)
    with caplog.at_level(logging.WARNING):
        path = fresh.resume_folder()
    fresh.close()
    assert path is not None and path.name == "ckpt-000000000005"
    assert (path / "model.safetensors").read_bytes() == b"w5"
    assert "rng_state.pth: pickle would import" in caplog.text and "ckpt-000000000010" in caplog.text
    assert not (tmp_path / "b" / "ckpt-000000000010").exists()  # never staged for the framework


def two_nodes(base: Path, s3_store: Any, s3_uri: str, *extra: str) -> list[dict[str, Any]]:
    port = free_port()
    out = base / "out"
    out.mkdir(exist_ok=True)
    procs = []
    env = worker_env(s3_store) | {"SPOTGUARD_STORAGE_URI": s3_uri}
    for node in (0, 1):
        cmd = [
            str(TORCHRUN),
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            __file__,
            "--dir",
            str(base / f"node{node}" / "spotguard"),
            "--frame",
            str(base / f"node{node}" / "frame"),
            "--out",
            str(out),
            *extra,
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, output[-6000:]
    return [json.loads((out / f"info-{r}.json").read_text()) for r in (0, 1)]


def test_two_nodes_commit_their_folders_as_one_checkpoint_and_resume_it(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    require_tool("torchrun", path=TORCHRUN)
    from ckpt_helpers import s3_options

    from spotguard.checkpoint.store.verify_stored import verify_checkpoint
    from spotguard.storage import open_storage

    infos = two_nodes(tmp_path, s3_store, s3_uri)
    assert [sorted(i["committed"]) for i in infos] == [["2"], ["2"]]
    storage = open_storage(s3_uri, **s3_options(s3_store))
    verdict = verify_checkpoint(storage, "ckpt-000000000002")
    assert verdict.ok, verdict.reason
    assert verdict.manifest is not None and verdict.manifest.is_global
    paths = [e.path for e in verdict.manifest.files if not e.path.startswith("parts/")]
    # The model both nodes wrote is listed once (by node 0); each rank's own file once.
    assert sorted(paths) == ["model.safetensors", "rng_state_0.pth", "rng_state_1.pth"]
    # New machines: nothing local; both nodes fetch the whole checkpoint and agree on it.
    for node in (0, 1):
        shutil.rmtree(tmp_path / f"node{node}")
    infos = two_nodes(tmp_path, s3_store, s3_uri, "--steps", "1")
    for info in infos:
        assert info["resumed"] is not None and info["resumed"].endswith("ckpt-000000000002")
        assert info["files"] == [
            "manifest.json",
            "model.safetensors",
            "parts/00000.json",
            "parts/00001.json",
            "rng_state_0.pth",
            "rng_state_1.pth",
        ]


def test_two_nodes_with_different_contents_at_one_path_commit_nothing(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    require_tool("torchrun", path=TORCHRUN)
    infos = two_nodes(tmp_path, s3_store, s3_uri, "--differ")
    assert [i["committed"] for i in infos] == [{"2": "None"}, {"2": "None"}]
    for node in (0, 1):
        assert not list((tmp_path / f"node{node}" / "spotguard").glob("ckpt-*"))
        assert not list((tmp_path / f"node{node}" / "spotguard").glob(".tmp-*"))


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
