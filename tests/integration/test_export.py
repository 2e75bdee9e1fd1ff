"""``spotguard ckpt export --format hf``: verified checkpoints become model
folders that ``from_pretrained`` loads with the very weights trained.

A tiny GPT-2 (two layers, from a config in code, tied embeddings) trains a
few steps under the Hugging Face Trainer with spotguard's callback, which
commits and uploads every ``checkpoint-N`` folder to the real S3 store; the
exported folder gives the logits the model in training gave at that step,
without its training state. A plain spotguard state of the same kind of
model (``module.``-prefixed, as DDP names it) becomes a folder with the
``--config`` it is given. ``--best``, ``--average``, sharding, a non-empty
destination and a damaged checkpoint are checked on the way.

The CLI runs in this process (``spotguard.cli.main``: importing torch and
transformers once keeps the test short), except the refusal, which runs as
a user runs it, for its exit status and its one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import flip_a_stored_byte, s3_options, subprocess_env
from safetensors import safe_open

from spotguard.checkpoint import (
    latest_verified,
    list_checkpoint_names,
    snapshot_state,
    upload_checkpoint,
    write_checkpoint,
)
from spotguard.checkpoint.store.stored import read_manifest
from spotguard.cli import main as spotguard
from spotguard.storage import open_storage
from testenv.require import require_module

transformers = require_module("transformers")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from spotguard.demo import train_hf  # noqa: E402
from spotguard.integrations import _core  # noqa: E402
from spotguard.integrations.huggingface import SpotguardCallback  # noqa: E402

pytestmark = pytest.mark.integration

IDS = train_hf.TokenDataset(5).ids[:4]
TRAINING_STATE = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", "training_args.bin"}


def name(step: int) -> str:
    return f"ckpt-{step:012d}"


def logits_of(model: Any) -> torch.Tensor:
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=IDS).logits.clone()
    model.train(was)
    return out


def load(dest: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(dest)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the model's 64 tokens, built in code (nothing downloaded)."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(train_hf.VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t0", pad_token="t0")


def export(*args: str) -> int:
    return spotguard(["ckpt", "export", *args, "--format", "hf"])


def mean_of(*states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ``--average`` must give: the mean in float64, in each tensor's own dtype."""
    return {k: (sum(s[k].double() for s in states) / len(states)).to(states[0][k].dtype) for k in states[0]}


def assert_same_weights(model: Any, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


class Record(TrainerCallback):
    """The model as it is at each save: its logits on IDS and its weights."""

    def __init__(self) -> None:
        self.logits: dict[int, torch.Tensor] = {}
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        self.logits[state.global_step] = logits_of(model)
        self.weights[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def s3_env(s3_store: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The AWS environment of the test store, for the CLI in this process."""
    for key, value in s3_store.env().items():
        monkeypatch.setenv(key, value)
    yield


def test_trainer_checkpoints_export_as_the_model_in_training(
    s3_store: Any, s3_uri: str, s3_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trainer checkpoints of steps 2, 4, 6 in S3: the newest, the best by
    loss and the average of the last two export as the model trained; with
    the newest damaged, exporting it is refused (naming the file) and the
    newest verified one is taken instead."""
    torch.manual_seed(0)
    record = Record()
    callback = SpotguardCallback(
        directory=str(tmp_path / "ck"),
        storage_uri=s3_uri,
        storage_options=s3_options(s3_store),
        upload=True,
        handle_signals=False,
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=6,
        save_steps=2,
        logging_steps=1,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=train_hf.build_model(0),
        args=args,
        train_dataset=train_hf.TokenDataset(0),
        processing_class=tiny_tokenizer(),
        callbacks=[callback, record],
    )
    try:
        trainer.train()
    finally:
        _core.reset()  # finishes the uploads
    storage = open_storage(s3_uri, **s3_options(s3_store))
    info, _ = latest_verified(storage)
    assert info is not None and info.step == 6 and sorted(record.logits) == [2, 4, 6]
    stored = {f.path for f in read_manifest(storage, name(6)).files}
    assert {"optimizer.pt", "model.safetensors", "config.json", "tokenizer.json"} <= stored, stored

    # The newest verified checkpoint (the storage root, no name).
    newest = tmp_path / "newest"
    assert export(s3_uri, str(newest)) == 0
    out = capsys.readouterr().out
    assert f"exported {name(6)} (step 6)" in out and f"hf upload USER/MODEL {newest}" in out
    files = {p.name for p in newest.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files, files
    assert not files & TRAINING_STATE and not any(f.startswith("rng_state") for f in files), files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left
    assert torch.equal(logits_of(load(newest)), record.logits[6])
    AutoTokenizer.from_pretrained(newest)

    # The best by the loss the Trainer logged (recorded in each manifest).
    losses = {s: read_manifest(storage, name(s)).metrics["loss"] for s in (2, 4, 6)}
    best = min(sorted(losses, reverse=True), key=lambda s: losses[s])  # a tie goes to the newer one
    assert export(s3_uri, str(tmp_path / "best"), "--best", "loss", "--mode", "min") == 0
    assert f"exported {name(best)} (step {best})" in capsys.readouterr().out
    assert torch.equal(logits_of(load(tmp_path / "best")), record.logits[best])

    # The average of the last two: the Trainer's folder gives the config, the weights are new.
    assert export(s3_uri, str(tmp_path / "avg"), "--average", "2") == 0
    assert "the average of steps 6, 4" in capsys.readouterr().out
    assert_same_weights(load(tmp_path / "avg"), mean_of(record.weights[6], record.weights[4]))

    # Damage: one flipped byte in the newest checkpoint's weights.
    flip_a_stored_byte(storage, name(6), "model.safetensors")
    refused = tmp_path / "refused"
    proc = subprocess.run(
        [sys.executable, "-m", "spotguard.cli", "ckpt", "export", f"{s3_uri}/ckpt-6", str(refused), "--format", "hf"],
        env=subprocess_env(s3_store),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{name(6)} does not verify" in proc.stderr and "model.safetensors" in proc.stderr, proc.stderr
    assert "checksum mismatch" in proc.stderr, proc.stderr
    assert not refused.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # Without a name, the newest checkpoint that verifies.
    fallback = tmp_path / "fallback"
    assert export(s3_uri, str(fallback)) == 0
    captured = capsys.readouterr()
    skipped = next(line for line in captured.err.splitlines() if f"skipped {name(6)}: " in line)
    assert "model.safetensors" in skipped and f"exported {name(4)}" in captured.out  # the file, or its chunk
    assert torch.equal(logits_of(load(fallback)), record.logits[4])


def test_plain_state_exports_with_its_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A spotguard state holding a GPT-2's ``state_dict`` under DDP's
    ``module.`` prefix (tied embeddings stored twice), steps 1, 2 and 3 (the
    last stored incrementally), exported with ``--config`` (a model directory
    with a tokenizer)."""
    uri = f"file://{tmp_path}/remote"
    storage = open_storage(uri)
    config_dir = tmp_path / "config"
    train_hf.build_model(99).save_pretrained(config_dir)  # its own weights must not come along
    tiny_tokenizer().save_pretrained(config_dir)
    built = {step: train_hf.build_model(step) for step in (1, 2, 3)}
    weights = {step: {k: v.detach().clone() for k, v in m.state_dict().items()} for step, m in built.items()}
    for step, loss in [(1, 0.5), (2, 0.2), (3, 0.4)]:
        state = {"model": {f"module.{k}": v for k, v in built[step].state_dict().items()}, "step": step}
        local = write_checkpoint(tmp_path / "local", step, snapshot_state(state), metrics={"loss": loss})
        upload_checkpoint(local, storage, incremental=step == 3)
    assert read_manifest(storage, name(3)).chunked

    dest = tmp_path / "dest"
    assert export(f"{uri}/ckpt-2", str(dest), "--config", str(config_dir)) == 0
    out = capsys.readouterr().out
    assert "removed the key prefix 'module.'" in out
    assert "left out lm_head.weight: tied to transformer.wte.weight" in out
    assert {p.name for p in dest.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    with safe_open(str(dest / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys()) and f.metadata()["format"] == "pt"
    model = load(dest)
    assert torch.equal(logits_of(model), logits_of(built[2]))
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # tied again on load
    AutoTokenizer.from_pretrained(dest)

    # A spotguard state has no config of its own; a non-empty DEST is kept unless --force.
    assert export(uri, str(tmp_path / "x")) == 1
    assert "pass --config" in capsys.readouterr().err
    assert export(f"{uri}/ckpt-1", str(dest), "--config", str(config_dir)) == 1
    assert "is not empty" in capsys.readouterr().err
    assert torch.equal(logits_of(load(dest)), logits_of(built[2]))
    assert export(f"{uri}/ckpt-1", str(dest), "--config", str(config_dir / "config.json"), "--force") == 0
    assert {p.name for p in dest.iterdir()} == {"config.json", "model.safetensors"}
    assert torch.equal(logits_of(load(dest)), logits_of(built[1]))

    # The lowest loss is step 2, not the newest.
    assert export(uri, str(tmp_path / "best"), "--best", "loss", "--mode", "min", "--config", str(config_dir)) == 0
    assert f"exported {name(2)} (step 2)" in capsys.readouterr().out
    assert torch.equal(logits_of(load(tmp_path / "best")), logits_of(built[2]))

    # The mean of steps 3 (incremental) and 2, as computed here.
    assert export(uri, str(tmp_path / "avg"), "--average", "2", "--config", str(config_dir)) == 0
    assert "the average of steps 3, 2" in capsys.readouterr().out
    assert_same_weights(load(tmp_path / "avg"), mean_of(weights[3], weights[2]))

    # Sharded above 20 KB: the standard index, and the same model.
    sharded = tmp_path / "sharded"
    assert export(uri, str(sharded), "--config", str(config_dir), "--max-shard-size", "20KB") == 0
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert not (sharded / "model.safetensors").exists()
    assert torch.equal(logits_of(load(sharded)), logits_of(built[3]))
    assert list_checkpoint_names(storage) == [name(1), name(2), name(3)]  # storage untouched
