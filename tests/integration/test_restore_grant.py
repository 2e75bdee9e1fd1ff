"""A trainer's resume through the restore grant: from the store straight into its own tensors.

Real parts: the S3 test store (SeaweedFS) signing and answering presigned
ranged GETs, the grant written by the function ``spotguard run`` writes it
with (:func:`make_grant`), the trainer's ``Checkpointer.restore``, and a real
``spotguard run`` for the end-to-end resume. Every test also checks that no
presigned URL reached a log line (debug included).
"""

from __future__ import annotations

import inspect
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import open_test_storage, s3_options
from sidecar_helpers import base_env, spotguard_argv

from spotguard.checkpoint import snapshot_state, upload_checkpoint, write_checkpoint
from spotguard.checkpoint.restore.grant import make_grant
from spotguard.contract.grant import ANSWER_FILE, GRANT_FILE, read_answer, read_grant, write_grant
from spotguard.storage import Storage
from spotguard.trainer import Checkpointer, torch_state

pytestmark = pytest.mark.integration

MiB = 1 << 20
SECRET = "X-Amz-Signature"


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and AdamW after one step (its moments exist), a bfloat16 layer and a NaN among
    them; 1.5 MiB of float32 weights, so that a tensor spans several 1 MiB ranges."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 768), torch.nn.Linear(768, 8).to(torch.bfloat16))
    with torch.no_grad():
        model[0].bias[:2] = torch.tensor([float("nan"), -0.0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(3, 512)
    model[1](model[0](x).nan_to_num().to(torch.bfloat16)).float().sum().backward()
    opt.step()
    return model, opt


def raw(tree: Any) -> dict[str, bytes]:
    """Every tensor of a state dict tree as raw bytes, by path."""
    out: dict[str, bytes] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out[prefix] = v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        elif isinstance(v, dict):
            for k, item in v.items():
                walk(f"{prefix}/{k}", item)

    walk("", tree)
    return out


def live_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, bytes]:
    return raw({"model": model.state_dict(), "optimizer": opt.state_dict()["state"]})


def addresses(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[int]:
    moments = [t.data_ptr() for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return [p.data_ptr() for p in model.parameters()] + moments


def upload_steps(storage: Storage, tmp_path: Path, steps: tuple[int, ...], incremental: bool) -> dict[int, Any]:
    """Checkpoints of ``trained(step)`` at each step, in storage; their state's bytes by step."""
    saved: dict[int, Any] = {}
    for step in steps:
        model, opt = trained(step)
        ckpt = write_checkpoint(tmp_path / "local", step, snapshot_state(torch_state(model, opt)))
        upload_checkpoint(ckpt, storage, incremental=incremental)
        saved[step] = live_bytes(model, opt)
    return saved


def resume(directory: Path, **options: Any) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer, list[int]]:
    """A trainer that built its own model and optimizer (other values, same shapes) and restores."""
    model, opt = trained(99)
    before = addresses(model, opt)
    ck = Checkpointer(directory, async_save=False, control_dir=directory / ".control", **options)
    try:
        restored = ck.restore(model, opt, restore_rng=False)
    finally:
        ck.close()
    return restored, model, opt, before


@pytest.fixture(autouse=True)
def no_url_logged(caplog: pytest.LogCaptureFixture) -> Any:
    caplog.set_level(logging.DEBUG)
    yield
    for when in ("setup", "call"):  # caplog.text holds only the teardown's records here
        logged = [r.getMessage() for r in caplog.get_records(when)]
        assert logged or when == "setup"
        assert not [m for m in logged if SECRET in m]


@pytest.mark.parametrize("incremental", [False, True], ids=["files", "chunks"])
def test_a_resume_through_the_grant_is_bit_exact_into_the_live_tensors(
    s3_store: Any, request: pytest.FixtureRequest, tmp_path: Path, incremental: bool
) -> None:
    storage = open_test_storage("s3", request, tmp_path)
    saved = upload_steps(storage, tmp_path, (1, 2), incremental)
    control = tmp_path / "trainer" / ".control"
    grant = make_grant(storage)
    assert grant is not None and [c.name for c in grant.checkpoints] == ["ckpt-000000000002", "ckpt-000000000001"]
    assert SECRET not in repr(grant)
    write_grant(control, grant)
    assert stat.S_IMODE(os.stat(control / GRANT_FILE).st_mode) == 0o600

    restored, model, opt, before = resume(tmp_path / "trainer")
    assert restored is not None and restored.step == 2
    assert live_bytes(model, opt) == saved[2]
    assert addresses(model, opt) == before  # read straight into the tensors the trainer had
    assert restored.in_place_bytes > MiB
    assert not (control / GRANT_FILE).exists()  # its URLs are not left on disk
    found = read_answer(control)
    assert found is not None and (found.grant, found.name) == (grant.id, "ckpt-000000000002")
    assert not list((tmp_path / "trainer").glob("ckpt-*"))  # no local copy before the load


def test_a_flipped_byte_in_a_granted_object_walks_back_to_the_next(
    s3_store: Any, request: pytest.FixtureRequest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = open_test_storage("s3", request, tmp_path, read_chunk_size=MiB)
    saved = upload_steps(storage, tmp_path, (1, 2), incremental=False)
    grant = make_grant(storage)
    assert grant is not None
    write_grant(tmp_path / "trainer" / ".control", grant)
    key = "ckpt-000000000002/model.safetensors"
    data = bytearray(storage.read_bytes(key))
    data[len(data) // 2] ^= 0x01  # one bit, inside a tensor, same size
    storage.write_bytes(key, bytes(data))

    restored, model, opt, before = resume(tmp_path / "trainer")
    assert restored is not None and restored.step == 1
    assert live_bytes(model, opt) == saved[1]
    assert addresses(model, opt) == before
    assert "skipping checkpoint" in caplog.text and "model.safetensors" in caplog.text
    found = read_answer(tmp_path / "trainer" / ".control")
    assert found is not None and found.name == "ckpt-000000000001"


@pytest.mark.parametrize("how", ["expired", "refused", "file-store"])
def test_without_a_usable_grant_the_trainer_resumes_as_today(
    s3_store: Any, request: pytest.FixtureRequest, tmp_path: Path, how: str
) -> None:
    """An expired grant, one the store refuses (HTTP 403), a store that cannot sign (file://):
    the trainer restores from storage itself, as without a grant, to the same bytes."""
    kind = "file" if how == "file-store" else "s3"
    storage = open_test_storage(kind, request, tmp_path)
    saved = upload_steps(storage, tmp_path, (1, 2), incremental=False)
    control = tmp_path / "trainer" / ".control"
    grant = make_grant(storage, now=0.0 if how == "expired" else None)
    if how == "file-store":
        assert grant is None
    else:
        assert grant is not None
        if how == "refused":
            for checkpoint in grant.checkpoints:
                for key, url in checkpoint.objects.items():
                    checkpoint.objects[key] = url.replace(f"{SECRET}=", f"{SECRET}=0")  # type: ignore[index]
        write_grant(control, grant)
    options = {"storage_options": s3_options(s3_store)} if kind == "s3" else {}
    restored, model, opt, before = resume(tmp_path / "trainer", storage_uri=storage.uri, **options)
    assert restored is not None and restored.step == 2
    assert live_bytes(model, opt) == saved[2]
    assert addresses(model, opt) == before
    assert (tmp_path / "trainer" / "ckpt-000000000002").is_dir()  # today's path: restored to disk first
    assert read_grant(control) is None
    if grant is not None:
        found = read_answer(control)
        assert found is not None and found.name is None and not found.wait


TRAIN = """
import sys
from typing import Any
import torch
from spotguard.trainer import Checkpointer, torch_state
{helpers}
model, opt = trained(int(sys.argv[1]))
ck = Checkpointer.from_env(async_save=False)
restored = ck.restore(model, opt, restore_rng=False)
if restored is None:
    ck.save(5, torch_state(model, opt))
    ck.close()
    sys.exit(0)
assert restored.name == "ckpt-000000000005", restored.name
assert restored.path.endswith("ckpt-000000000005")
assert live_bytes(model, opt) == live_bytes(*trained(7)), "not the saved bytes"
open(sys.argv[2], "w").write(str(restored.checked_bytes))
ck.close()
"""


def test_spotguard_run_resumes_through_the_grant_and_copies_it_after(
    s3_store: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Step 5 of ``trained(7)`` is in storage; ``spotguard run`` in a new work directory grants
    the command reads of it, the command streams it into its own tensors, and the supervisor
    restores the local copy after (the stored manifest, checked)."""
    storage = open_test_storage("s3", request, tmp_path)
    model, opt = trained(7)
    upload_checkpoint(write_checkpoint(tmp_path / "local", 5, snapshot_state(torch_state(model, opt))), storage)
    script = tmp_path / "train.py"
    helpers = "\n".join(inspect.getsource(f) for f in (trained, raw, live_bytes))
    script.write_text(TRAIN.format(helpers=helpers), encoding="utf-8")
    out = tmp_path / "checked"
    cmd = spotguard_argv("run", "--storage", storage.uri, "--workdir", str(tmp_path / "work"))
    proc = subprocess.run(
        [*cmd, "--", sys.executable, str(script), "3", str(out)],
        env=base_env(s3_store.env()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "granted the command reads of ckpt-000000000005" in proc.stderr
    assert SECRET not in proc.stderr + proc.stdout
    assert int(out.read_text()) > 0  # checked on the way in, not a vouched local copy
    ckdir = next(p for p in (tmp_path / "work").rglob("ckpt-000000000005") if p.is_dir())
    assert (ckdir / "manifest.json").read_bytes() == storage.read_bytes("ckpt-000000000005/manifest.json")
    assert not list((tmp_path / "work").rglob(GRANT_FILE)) and not list((tmp_path / "work").rglob(ANSWER_FILE))


#: A command that resumes by its own means: it reads the checkpoint directory as it starts.
READS_THE_DIRECTORY = """
import os, pathlib, sys
ck = pathlib.Path(os.environ["SPOTGUARD_CHECKPOINT_DIR"])
control = pathlib.Path(os.environ.get("SPOTGUARD_CONTROL_DIR") or ck / ".control")
found = sorted(p.name for p in ck.glob("ckpt-*") if (p / "manifest.json").is_file())
granted = (control / sys.argv[1]).exists()
print(f"found {found} granted {granted}")
"""


@pytest.mark.parametrize("flag", ["--no-restore-grant", "SPOTGUARD_RESTORE_GRANT=false"])
def test_spotguard_run_without_the_grant_restores_before_the_command_starts(
    s3_store: Any, request: pytest.FixtureRequest, tmp_path: Path, flag: str
) -> None:
    """Turned off (the flag, or its variable), ``spotguard run`` restores the checkpoint into the
    checkpoint directory before the command starts, as before the grant: a command that reads
    the directory itself finds it there, and no grant."""
    storage = open_test_storage("s3", request, tmp_path)
    model, opt = trained(7)
    upload_checkpoint(write_checkpoint(tmp_path / "local", 5, snapshot_state(torch_state(model, opt))), storage)
    script = tmp_path / "reads.py"
    script.write_text(READS_THE_DIRECTORY, encoding="utf-8")
    env = base_env(s3_store.env())
    args = [flag] if flag.startswith("--") else []
    if not args:
        key, value = flag.split("=")
        env[key] = value
    cmd = spotguard_argv("run", "--storage", storage.uri, "--workdir", str(tmp_path / "work"), *args)
    proc = subprocess.run(
        [*cmd, "--", sys.executable, str(script), GRANT_FILE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "found ['ckpt-000000000005'] granted False" in proc.stdout, proc.stdout + proc.stderr
    assert "granted the command" not in proc.stderr


def test_a_refused_grant_under_spotguard_run_waits_for_the_supervisors_copy(
    s3_store: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A trainer without the store of its own (as under ``spotguard run``) whose grant the store
    refuses asks the supervisor for a local copy, waits for it, and loads it in place."""
    import threading

    from spotguard.contract.control import write_heartbeat
    from spotguard.run.supervisor import RunConfig, Supervisor
    from spotguard.sidecar.metrics import SidecarMetrics

    storage = open_test_storage("s3", request, tmp_path)
    saved = upload_steps(storage, tmp_path, (1, 2), incremental=False)
    config = RunConfig(
        command=["true"], workdir=tmp_path / "work", storage_uri=storage.uri, checkpoint_dir=tmp_path / "work" / "ck"
    )
    sup = Supervisor(config, storage, SidecarMetrics())
    sup.recover()  # grants, restores nothing
    control = config.control_dir
    grant = read_grant(control)
    assert grant is not None and not list(config.checkpoint_dir.glob("ckpt-*"))
    for checkpoint in grant.checkpoints:
        for key, url in checkpoint.objects.items():
            checkpoint.objects[key] = url.replace(f"{SECRET}=", f"{SECRET}=0")  # type: ignore[index]
    write_grant(control, grant)

    got: list[Any] = []
    trainer = threading.Thread(target=lambda: got.append(resume(config.checkpoint_dir)))
    trainer.start()
    while trainer.is_alive():
        write_heartbeat(control, shipping=True)
        sup.granting.follow()
        trainer.join(0.05)
    sup.granting.end()
    restored, model, opt, before = got[0]
    assert restored is not None and restored.step == 2
    assert restored.checked_bytes == 0  # the supervisor's copy, verified as it was restored
    assert live_bytes(model, opt) == saved[2]
    assert addresses(model, opt) == before


def test_a_framework_folder_resume_declines_the_grant_and_waits_for_the_copy(tmp_path: Path) -> None:
    """A grant is for one process's state: ``resume_folder`` (a framework loads its own folder)
    answers it with nothing loaded, waits for the uploader's copy, and resumes from that."""
    import threading

    from spotguard.contract.control import write_heartbeat
    from spotguard.contract.grant import GrantedCheckpoint, RestoreGrant, write_done

    directory = tmp_path / "trainer"
    control = directory / ".control"
    name = "ckpt-000000000003"
    write_grant(control, RestoreGrant("g7", "s3://b/job", 2e9, (GrantedCheckpoint(name, b"{}", {}),)))

    def uploader() -> None:
        for _ in range(500):
            if (found := read_answer(control)) is not None:
                break
            write_heartbeat(control, shipping=True)
            threading.Event().wait(0.02)
        else:
            return  # never answered: the trainer went on without the copy
        assert (found.grant, found.name, found.wait) == ("g7", None, True)
        write_checkpoint(directory, 3, snapshot_state({"model": {"w": torch.ones(3)}}))  # the copy
        write_done(control, "g7", name)

    helper = threading.Thread(target=uploader)
    helper.start()
    ck = Checkpointer(directory, async_save=False, control_dir=control)
    try:
        folder = ck.resume_folder()
    finally:
        ck.close()
        helper.join()
    assert folder == directory / name
    assert read_grant(control) is None
