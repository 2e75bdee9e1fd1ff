"""A trainer's restore: into its own tensors, and without checksumming again what ``spotguard run`` verified.

Real parts: the Checkpointer's own saves, a real ``spotguard run`` supervisor's
start-up recovery (:meth:`Supervisor.recover`) restoring from a file:// store,
and the trainer's ``Checkpointer.restore`` reading what it left. The bytes a
verification reads are counted at the reader every local verification goes
through (``local_reader``), not timed.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import spotguard
from spotguard.checkpoint import upload_checkpoint
from spotguard.checkpoint.format.manifest import checkpoint_name
from spotguard.checkpoint.local import commit
from spotguard.checkpoint.local.inplace import live_places
from spotguard.contract.control import read_verified_local
from spotguard.run.supervisor import RunConfig, Supervisor
from spotguard.sidecar.metrics import SidecarMetrics
from spotguard.storage import open_storage
from spotguard.trainer import Checkpointer

pytestmark = pytest.mark.integration


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and AdamW after one step (the optimizer has its moments), with a NaN, a
    signed zero and a bfloat16 layer, so that bit-exactness means bits."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.Linear(64, 8).to(torch.bfloat16))
    with torch.no_grad():
        model[0].bias[:2] = torch.tensor([float("nan"), -0.0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(3, 96)
    model[1](model[0](x).nan_to_num().to(torch.bfloat16)).float().sum().backward()
    opt.step()
    return model, opt


def as_bytes(tree: Any) -> dict[str, bytes]:
    """Every tensor of a state dict tree as raw bytes, by path."""
    out: dict[str, bytes] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out[prefix] = v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        elif isinstance(v, dict):
            for k, item in v.items():
                walk(f"{prefix}/{k}", item)
        elif isinstance(v, list | tuple):
            for i, item in enumerate(v):
                walk(f"{prefix}/{i}", item)

    walk("", tree)
    return out


def saved(ckdir: Path, seed: int = 1, step: int = 5) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Save a trained state at ``step``; the bytes of its model and optimizer state dicts."""
    model, opt = trained(seed)
    ck = Checkpointer(ckdir, async_save=False)
    ck.save(step, spotguard.torch_state(model, opt))
    ck.close()
    return as_bytes(model.state_dict()), as_bytes(opt.state_dict())


@pytest.fixture
def read_for_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Bytes read by local verifications from now on (one count per call of the reader)."""
    counted: list[int] = [0]
    real = commit.local_reader

    def counting(root: Path) -> Any:
        read = real(root)

        def chunks(path: str) -> Iterator[bytes]:
            for chunk in read(path):
                counted[0] += len(chunk)
                yield chunk

        return chunks

    monkeypatch.setattr(commit, "local_reader", counting)
    yield counted


def test_restore_reads_into_the_trainers_own_tensors_bit_exact(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    want_model, want_opt = saved(ckdir)
    model, opt = trained(seed=2)  # other values, same shapes, moments present
    params = [p.data_ptr() for p in model.parameters()]
    moments = [t.data_ptr() for s in opt.state.values() for t in s.values() if t.dim() > 0]
    restored = Checkpointer(ckdir, async_save=False).restore(model, opt)
    assert restored is not None and restored.step == 5
    assert [p.data_ptr() for p in model.parameters()] == params
    assert [t.data_ptr() for s in opt.state.values() for t in s.values() if t.dim() > 0] == moments
    # The restored state's tensors are the live ones: nothing was read elsewhere and copied.
    for (name, p), saved_t in zip(model.named_parameters(), restored["model"].values(), strict=True):
        assert saved_t.data_ptr() == p.data_ptr(), name
    assert as_bytes(model.state_dict()) == want_model
    assert as_bytes(opt.state_dict()) == want_opt
    assert restored.in_place_bytes == sum(len(b) for b in want_model.values()) + sum(
        len(b) for k, b in want_opt.items() if k.startswith("/state/")
    )


def test_restore_into_a_fresh_optimizer_and_a_changed_shape(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    want_model, want_opt = saved(ckdir)
    # A fresh optimizer has no moments yet: they are read into new tensors, bit-exact.
    model, _ = trained(seed=3)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    Checkpointer(ckdir, async_save=False).restore(model, fresh)
    assert as_bytes(model.state_dict()) == want_model
    assert as_bytes(fresh.state_dict()) == want_opt
    # A layer of another shape is not written in place: load_state_dict refuses it, as before.
    other = torch.nn.Sequential(torch.nn.Linear(96, 32), torch.nn.Linear(32, 8).to(torch.bfloat16))
    before = as_bytes(other.state_dict())
    with pytest.raises(RuntimeError, match="size mismatch"):
        Checkpointer(ckdir, async_save=False).restore(other, None)
    assert as_bytes(other.state_dict())["/0.weight"] == before["/0.weight"]


def test_live_places_follow_the_state_documents_tree() -> None:
    model, opt = trained(seed=4)
    state = spotguard.torch_state(model, opt)
    from spotguard.checkpoint.local.codec import snapshot_state

    doc = snapshot_state(state).doc["state"]
    places = live_places(doc, {"model": model.state_dict(), "optimizer": opt.state_dict()})
    found = {id(t) for t in places.values()}
    for t in model.state_dict().values():
        assert any(p.data_ptr() == t.data_ptr() for p in places.values())
    for s in opt.state_dict()["state"].values():
        assert all(id(t) in found for t in s.values())
    assert live_places(doc, {"model": {}}) == {}


def supervisor(tmp_path: Path, store: str) -> Supervisor:
    config = RunConfig(
        command=["true"], workdir=tmp_path / "work", storage_uri=store, checkpoint_dir=tmp_path / "work" / "ck"
    )
    return Supervisor(config, open_storage(store), SidecarMetrics())


def test_what_spotguard_run_restored_is_not_checksummed_again(tmp_path: Path, read_for_checks: list[int]) -> None:
    store = f"file://{tmp_path / 'store'}"
    sup = supervisor(tmp_path, store)
    ckdir = sup.config.checkpoint_dir
    want_model, _ = saved(ckdir)
    upload_checkpoint(ckdir / checkpoint_name(5), open_storage(store))
    shutil.rmtree(ckdir)  # a new machine: the checkpoint is only in storage
    sup.recover()
    assert checkpoint_name(5) in read_verified_local(sup.config.control_dir)
    read_for_checks[0] = 0
    model, opt = trained(seed=2)
    restored = Checkpointer(ckdir, control_dir=sup.config.control_dir, async_save=False).restore(model, opt)
    assert restored is not None and restored.step == 5
    assert read_for_checks[0] == 0 and restored.checked_bytes == 0
    assert as_bytes(model.state_dict()) == want_model


def test_what_changed_after_the_verification_is_checksummed_again(tmp_path: Path, read_for_checks: list[int]) -> None:
    store = f"file://{tmp_path / 'store'}"
    sup = supervisor(tmp_path, store)
    ckdir = sup.config.checkpoint_dir
    saved(ckdir)
    sup.recover()  # the newest local one, checksummed by the supervisor and vouched for
    assert checkpoint_name(5) in read_verified_local(sup.config.control_dir)
    # The same bytes written again: nothing differs but the file's change time.
    data = ckdir / checkpoint_name(5) / "model.safetensors"
    data.write_bytes(data.read_bytes())
    read_for_checks[0] = 0
    model, opt = trained(seed=2)
    restored = Checkpointer(ckdir, control_dir=sup.config.control_dir, async_save=False).restore(model, opt)
    assert restored is not None
    total = sum(f.stat().st_size for f in (ckdir / checkpoint_name(5)).iterdir() if f.name != "manifest.json")
    assert read_for_checks[0] == total == restored.checked_bytes
    # Damage under the same size: the checksum catches it, nothing is loaded, the trainer starts fresh.
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    before = as_bytes(model.state_dict())
    assert Checkpointer(ckdir, control_dir=sup.config.control_dir, async_save=False).restore(model, opt) is None
    assert as_bytes(model.state_dict()) == before


def test_what_the_restore_init_container_restored_is_not_checksummed_again(
    tmp_path: Path, read_for_checks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from spotguard.cli import main

    store = f"file://{tmp_path / 'store'}"
    ckdir = tmp_path / "ck"
    want_model, _ = saved(ckdir)
    upload_checkpoint(ckdir / checkpoint_name(5), open_storage(store))
    shutil.rmtree(ckdir)  # a new pod: its checkpoint volume is empty
    monkeypatch.delenv("SPOTGUARD_CONTROL_DIR", raising=False)  # the pod's default: <checkpoint dir>/.control
    assert main(["restore", "--storage", store, "--dest", str(ckdir)]) == 0
    read_for_checks[0] = 0
    model, opt = trained(seed=2)
    restored = Checkpointer(ckdir, async_save=False).restore(model, opt)
    assert restored is not None and restored.step == 5
    assert read_for_checks[0] == 0 and restored.checked_bytes == 0
    assert as_bytes(model.state_dict()) == want_model
