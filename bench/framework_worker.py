"""One training run of the framework benchmarks (a subprocess of bench.frameworks).

    python -m bench.framework_worker hf|lightning --mode plain|spotguard --steps N --save-every S --width W --out F

Times every step from one batch's start to the next, and writes the median
gap after a step that saved a checkpoint and after one that did not: the
difference is what a checkpoint stalls training. ``plain`` is the framework
alone (the Trainer's ``save_steps``, Lightning's ``ModelCheckpoint``);
``spotguard`` adds spotguard's callback (which commits each framework
checkpoint as a spotguard checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class Clock:
    """Step boundaries: a step's end, and the next step's start."""

    def __init__(self) -> None:
        self.begins: dict[int, float] = {}
        self.ends: dict[int, float] = {}

    def summary(self, saved: set[int], skip: int) -> dict[str, Any]:
        gaps_save, gaps_plain, steps = [], [], []
        for s, end in self.ends.items():
            nxt = self.begins.get(s + 1)
            if nxt is None or s < skip:
                continue
            (gaps_save if s in saved else gaps_plain).append(nxt - end)
            if s in self.begins and s not in saved and (s - 1) not in saved:
                steps.append(nxt - self.begins[s])
        return {
            "step_seconds": statistics.median(steps),
            "gap_save": statistics.median(gaps_save) if gaps_save else None,
            "gap_plain": statistics.median(gaps_plain),
            "saves": len(gaps_save),
        }


def run_hf(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    clock = Clock()

    class Timing(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, _args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.begins[state.global_step + 1] = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.ends[state.global_step] = time.perf_counter()

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=512, n_positions=64)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 512, (256, 32), generator=g)]
    saving = args.save_every > 0
    targs = TrainingArguments(
        output_dir=str(work / "out"),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-4,
        save_strategy="steps" if saving else "no",
        save_steps=args.save_every or 500,
        save_total_limit=2,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    callbacks: list[Any] = [Timing()]
    if args.mode == "spotguard":
        from spotguard.integrations.huggingface import SpotguardCallback

        callbacks.append(SpotguardCallback())
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks)
    trainer.train()
    saved = {s for s in range(1, args.steps + 1) if saving and s % args.save_every == 0}
    return clock.summary(saved, skip=3)


def run_lightning(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    clock = Clock()

    class Timing(pl.Callback):  # type: ignore[misc]
        def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
            clock.begins[trainer.global_step + 1] = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            clock.ends[trainer.global_step] = time.perf_counter()

    class Model(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            w = args.width
            layers: list[Any] = []
            for _ in range(args.layers):
                layers += [torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Dropout(0.1)]
            self.net = torch.nn.Sequential(*layers, torch.nn.Linear(w, 1))

        def training_step(self, batch: Any, _i: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    x = torch.randn(512, args.width)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]), batch_size=8, shuffle=True)
    saving = args.save_every > 0
    # The timing callback first: its batch end comes before any checkpoint is written.
    callbacks: list[Any] = [Timing()]
    if args.mode == "spotguard":
        from spotguard.integrations.lightning import SpotguardCallback

        callbacks.append(SpotguardCallback())
    elif saving:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=str(work / "out"), every_n_train_steps=args.save_every, save_top_k=-1)
        )
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=args.mode == "plain" and saving,
        default_root_dir=str(work),
    )
    trainer.fit(Model(), loader)
    saved = {s for s in range(1, args.steps + 1) if saving and s % args.save_every == 0}
    return clock.summary(saved, skip=3)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=["hf", "lightning"])
    parser.add_argument("--mode", choices=["plain", "spotguard"], required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sg-bench-fw-") as tmp:
        work = Path(tmp)
        os.environ["SPOTGUARD_CHECKPOINT_DIR"] = str(work / "spotguard")
        if args.save_every:
            os.environ["SPOTGUARD_SAVE_EVERY_STEPS"] = str(args.save_every)
        result = (run_hf if args.framework == "hf" else run_lightning)(args, work)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
