"""A Hugging Face ``Trainer`` run that survives preemption: two lines of spotguard.

A tiny causal language model (GPT-2 architecture, 2 layers, built from a
config in code: nothing is downloaded) learns a synthetic token dataset::

    spotguard run --storage s3://my-bucket/jobs/hf -- python examples/train_hf.py --steps 200
    spotguard run --storage s3://my-bucket/jobs/hf -- \\
        torchrun --nproc-per-node 2 examples/train_hf.py --steps 200

The spotguard part is the callback and the resume path::

    trainer = Trainer(..., callbacks=[SpotguardCallback()])
    trainer.train(resume_from_checkpoint=spotguard_resume_path())

SIGTERM to ``spotguard run`` (a spot preemption) makes every rank agree on
one step; the Trainer writes its own ``checkpoint-N`` folder there, spotguard
commits it (manifest with checksums), the supervisor uploads and verifies it
and exits 143. The same command resumes from the newest verified checkpoint.
A run preempted any number of times ends with the same bytes as an
uninterrupted one: the Trainer restores model, optimizer, scheduler and every
RNG (dropout is on) and replays the shuffled data order up to the saved step.

Output (rank 0): ``resumed from step K`` or ``starting from scratch``;
``step N loss X``; ``preempted after step N`` (every rank) or ``finished N steps``; at the
end ``final digest HEX`` (sha256 over weights, optimizer and scheduler state
and every rank's RNG, in a canonical order) so runs can be compared.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from spotguard.demo.common import StateDigest
from spotguard.integrations.huggingface import SpotguardCallback, spotguard_resume_path

try:
    from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging
except ImportError as exc:  # pragma: no cover - the import above already explains
    raise ImportError("this example needs transformers: pip install 'spotguard[hf]'") from exc

VOCAB = 64
SEQ_LEN = 16
DATASET_SIZE = 96


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=48, help="optimizer steps in all (default 48)")
    p.add_argument("--save-every", type=int, default=10, help="the Trainer's own save_steps (default 10)")
    p.add_argument("--save-total-limit", type=int, default=None, help="the Trainer's save_total_limit")
    p.add_argument("--batch-size", type=int, default=4, help="samples per rank per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep after each step (seconds)")
    p.add_argument("--output-dir", default="hf-output", help="the Trainer's output_dir")
    return p.parse_args(argv)


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Synthetic sequences with structure to learn (each is an arithmetic
    progression modulo the vocabulary), the same for a given seed."""

    def __init__(self, seed: int, size: int = DATASET_SIZE) -> None:
        gen = torch.Generator().manual_seed(seed + 17)
        start = torch.randint(0, VOCAB, (size, 1), generator=gen)
        stride = torch.randint(1, 5, (size, 1), generator=gen)
        self.ids = (start + stride * torch.arange(SEQ_LEN)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(seed: int) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 with dropout on, so the resumed RNG matters."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ_LEN,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


class Progress(TrainerCallback):
    """Prints ``step N loss X`` (rank 0) and sleeps ``delay`` after each step."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any) -> None:
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step} loss {logs['loss']:.6f}", flush=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.delay:
            time.sleep(self.delay)


def state_digest(trainer: Trainer) -> str:
    """sha256 over weights, optimizer and scheduler state and the RNG of every
    rank, in a canonical order (collective under torch.distributed)."""
    digest = StateDigest()

    def add(name: str, value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                add(f"{name}.{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                add(f"{name}[{i}]", item)
        else:
            digest.add(name, value)

    assert trainer.model is not None and trainer.optimizer is not None and trainer.lr_scheduler is not None
    add("model", trainer.model.state_dict())
    opt = trainer.optimizer.state_dict()
    add("optimizer.state", opt["state"])
    add("optimizer.param_groups", [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]])
    add("scheduler", trainer.lr_scheduler.state_dict())
    mine = rng_digest()
    if dist.is_available() and dist.is_initialized():
        every: list[bytes] = [b""] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    for rank, part in enumerate(every):
        add(f"rng.{rank}", part.hex())
    return digest.hexdigest()


def rng_digest() -> bytes:
    """This rank's python, numpy and torch RNG states."""
    buf = io.BytesIO()
    buf.write(repr(random.getstate()).encode())
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    buf.write(f"{kind} {pos} {has_gauss} {gauss}".encode())
    buf.write(np.asarray(keys).tobytes())
    buf.write(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available():
        buf.write(torch.cuda.get_rng_state().numpy().tobytes())
    return hashlib.sha256(buf.getvalue()).digest()


def training_args(args: argparse.Namespace) -> TrainingArguments:
    """Deterministic settings: fixed seeds, one thread, the Trainer's shuffling
    sampler (seeded by ``data_seed``), gloo when torchrun starts several ranks."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=3e-3,
        weight_decay=0.01,
        warmup_steps=4,
        lr_scheduler_type="cosine",
        seed=args.seed,
        data_seed=args.seed + 1,
        save_strategy="steps",
        save_steps=args.save_every,
        save_total_limit=args.save_total_limit,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        ddp_backend="gloo" if distributed else None,
        dataloader_num_workers=0,
        full_determinism=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Train; 0 also when preempted (the checkpoint is committed)."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    targs = training_args(args)  # joins the process group under torchrun
    spotguard = SpotguardCallback()
    trainer = Trainer(
        model=build_model(args.seed),
        args=targs,
        train_dataset=TokenDataset(args.seed),
        callbacks=[spotguard, Progress(args.step_delay)],
    )
    trainer.remove_callback(PrinterCallback)  # Progress prints one line per step instead
    resume = spotguard_resume_path()
    if trainer.is_world_process_zero():
        if resume is None:
            print("starting from scratch", flush=True)
        else:
            print(f"resumed from step {int(os.path.basename(resume).rsplit('-', 1)[1])}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    step = trainer.state.global_step
    if spotguard.preempted:
        # Every rank says where it stopped: they agree on one step.
        if targs.world_size > 1:
            print(f"preempted after step {step} (rank {targs.process_index} of {targs.world_size})", flush=True)
        else:
            print(f"preempted after step {step}", flush=True)
        return 0
    digest = state_digest(trainer)
    if trainer.is_world_process_zero():
        print(f"finished {step} steps", flush=True)
        print(f"final digest {digest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
