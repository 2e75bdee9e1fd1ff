"""A trainer for the incremental-checkpoint benchmark, run under ``spotguard run``.

Two shapes of training state:

- ``finetune``: a frozen base of ``--frozen-bytes`` (a few large float32
  tensors, ``requires_grad=False``, distinct random values) and a small
  trainable adapter (two low-rank matrices of ``--trainable-bytes`` in all)
  trained with AdamW: only the adapter and its optimizer state change from
  one step to the next.
- ``full``: a stack of Linear layers trained with AdamW, parameters and both
  moments ``--trainable-bytes`` in all: every tensor changes at every step.

Checkpoints at steps 1 and 2 (the first stores everything; in the second a
frozen base moves to its part's kept file), then steps until a preemption
asks for a checkpoint, saves it and exits: the preemption's checkpoint is a
training run's usual one, after others. Prints ``ready`` once the routine
checkpoints are taken.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Iterator
from typing import Any

FROZEN_TENSOR = 64 * 1024 * 1024  # bytes per frozen tensor (the last one may be smaller)
WIDTH = 2048
#: Routine checkpoints before the preemption (steps 1..ROUTINE).
ROUTINE = 2
#: Between steps (the adapter's step itself takes about a millisecond): a preemption's request waits
#: up to this long for the next step boundary, the same at every size; it was 50 ms, which made the
#: wait a quarter of an incremental SIGTERM -> verified and most of its spread.
STEP_PAUSE = 0.01


def frozen_tensors(frozen_bytes: int, device: str = "cpu", dtype: Any = None) -> Iterator[Any]:
    """The frozen base's tensors, one after the other: the same values for the same arguments.

    Random values, shifted by each tensor's own offset: no two chunks of the base are alike
    (and gigabytes are made in a second or two, not drawn one by one)."""
    import torch

    dtype = dtype or torch.float32
    size = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device=device).manual_seed(0)
    block = torch.empty(FROZEN_TENSOR // size, device=device).uniform_(-0.05, 0.05, generator=gen)
    left, index = frozen_bytes // size, 0
    while left > 0:
        n = min(FROZEN_TENSOR // size, left)
        index += 1
        yield (block[:n] + 1e-3 * index).to(dtype)
        left -= n


def finetune_model(
    frozen_bytes: int, trainable_bytes: int, device: str = "cpu", dtype: Any = None, zero_base: bool = False
) -> tuple[Any, Any, Any]:
    """A frozen base plus a low-rank adapter, AdamW over the adapter: (model, optimizer, step function).
    ``zero_base``: the base's tensors are zeros of the same shapes (a restore must fill them)."""
    import torch

    base = torch.nn.ParameterList()
    for t in frozen_tensors(frozen_bytes, device, dtype):
        base.append(torch.nn.Parameter(torch.zeros_like(t) if zero_base else t, requires_grad=False))
    # Adapter parameters: trainable_bytes / 3 (AdamW keeps two moments of the same size).
    rank = max(1, trainable_bytes // 3 // 4 // (2 * WIDTH))
    down = torch.nn.Linear(WIDTH, rank, bias=False, device=device)
    up = torch.nn.Linear(rank, WIDTH, bias=False, device=device)
    model = torch.nn.ModuleDict({"base": base, "down": down, "up": up})
    opt = torch.optim.AdamW([down.weight, up.weight], lr=1e-3)

    def step() -> None:
        x = torch.randn(8, WIDTH, device=device)
        loss = (up(down(x)) - x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def base_equal(model: Any, frozen_bytes: int, device: str, dtype: Any) -> bool:
    """Every tensor of the model's base bitwise equal to the seed's (compared on the device, one at a time)."""
    import torch

    base = list(model["base"])
    expected = frozen_tensors(frozen_bytes, device, dtype)
    return all(torch.equal(p.detach(), t) for p, t in zip(base, expected, strict=True))


def adapter_digest(model: Any, opt: Any, step: int) -> str:
    """SHA-256 of the adapter's weights, the optimizer's state (moments and step counts) and ``step``."""
    import torch

    h = hashlib.sha256(str(step).encode())
    tensors = [model["down"].weight, model["up"].weight]
    for param_state in opt.state_dict()["state"].values():
        tensors += [param_state[k] for k in sorted(param_state)]
    for t in tensors:
        t = torch.as_tensor(t).detach().cpu().contiguous()
        h.update(t.view(torch.uint8).numpy().tobytes() if t.dim() else t.numpy().tobytes())
    return h.hexdigest()


def full_model(trainable_bytes: int) -> tuple[Any, Any, Any]:
    """Linear layers and AdamW, parameters + moments = ``trainable_bytes``: (model, optimizer, step function)."""
    import torch

    torch.manual_seed(0)
    layers = max(1, round(trainable_bytes / 3 / (WIDTH * WIDTH * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        loss = model(torch.randn(4, WIDTH)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("shape", choices=["finetune", "full"])
    p.add_argument("--frozen-bytes", type=int, default=0)
    p.add_argument("--trainable-bytes", type=int, required=True)
    p.add_argument("--device", default="cpu", help="finetune: where the model lives (cpu, cuda)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="finetune: the base's dtype")
    p.add_argument("--resume-steps", type=int, default=None, help="finetune: restore, check, train this many steps")
    p.add_argument("--reference-steps", type=int, default=None, help="finetune: train this many steps, no checkpoints")
    args = p.parse_args()

    import torch

    import spotguard

    torch.set_num_threads(1)  # the supervisor and the store share the machine's cores
    torch.manual_seed(0)  # the adapter's first weights: the same in every run
    dtype = getattr(torch, args.dtype)
    if args.shape == "full":
        model, opt, train_step = full_model(args.trainable_bytes)
    else:
        model, opt, train_step = finetune_model(
            args.frozen_bytes, args.trainable_bytes, args.device, dtype, zero_base=args.resume_steps is not None
        )
    if args.reference_steps is not None:
        for _ in range(args.reference_steps):
            train_step()
        print(
            f"final step {args.reference_steps} digest {adapter_digest(model, opt, args.reference_steps)}", flush=True
        )
        return 0
    ckpt = spotguard.Checkpointer.from_env()
    step = 0
    if args.resume_steps is not None:
        t0 = time.perf_counter()
        restored = ckpt.restore(model, opt)
        if restored is None:
            print("nothing to restore", flush=True)
            return 1
        seconds = time.perf_counter() - t0
        step = int(restored.step)
        same = base_equal(model, args.frozen_bytes, args.device, dtype)
        print(
            f"resumed from step {step} digest {adapter_digest(model, opt, step)} "
            f"base_equal={'yes' if same else 'no'} seconds={seconds:.2f}",
            flush=True,
        )
        for _ in range(args.resume_steps):
            step += 1
            train_step()
        ckpt.close()
        print(f"final step {step} digest {adapter_digest(model, opt, step)}", flush=True)
        return 0
    while True:
        step += 1
        train_step()
        if step <= ROUTINE:
            ckpt.save(step, spotguard.torch_state(model, opt))
            if step == ROUTINE:
                print("ready", flush=True)
        elif ckpt.should_save(step):
            ckpt.save(step, spotguard.torch_state(model, opt))
        if ckpt.preempted:
            print(f"preempted after step {step} digest {adapter_digest(model, opt, step)}", flush=True)
            return 0
        time.sleep(STEP_PAUSE)


if __name__ == "__main__":
    sys.exit(main())
