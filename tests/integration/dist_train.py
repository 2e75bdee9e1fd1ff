"""Test trainer: ``examples/train_ddp.py`` with sharded state.

The example's loop unchanged, with the model sharded by FSDP2
(``fully_shard``: each rank holds a shard of every parameter and of the
optimizer state, as DTensors) instead of replicated by DDP. Run it like
the example, under torchrun. ``--frozen-mib N`` makes it a fine-tune: a
frozen base of N MiB (a table the optimizer never changes, sharded like
the rest) in front of the trained layers.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("train_ddp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fsdp(model: Any, device: Any) -> Any:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    model = model.to(device)
    for layer in model:
        if isinstance(layer, nn.Linear) or getattr(layer, "frozen", False):
            fully_shard(layer)
    return fully_shard(model)


def with_frozen_base(build: Any, mib: int) -> Any:
    """``build`` with a frozen base of ``mib`` MiB in front of its layers (the same
    bytes on every rank and in every run)."""
    import torch
    from torch import nn

    class FrozenBase(nn.Module):
        frozen = True

        def __init__(self) -> None:
            super().__init__()
            table = torch.randn(mib << 16, 4, generator=torch.Generator().manual_seed(1234))
            self.table = nn.Parameter(table, requires_grad=False)

        def forward(self, x: Any) -> Any:
            return x + self.table[:1, :1].sum() * 0.0

    def built(*args: Any, **kwargs: Any) -> Any:
        model = build(*args, **kwargs)
        return nn.Sequential(FrozenBase(), *model)

    return built


def take_frozen_mib(argv: list[str]) -> int:
    """Remove ``--frozen-mib N`` from ``argv``; N (0 when absent)."""
    if "--frozen-mib" not in argv:
        return 0
    at = argv.index("--frozen-mib")
    mib = int(argv[at + 1])
    del argv[at : at + 2]
    return mib


if __name__ == "__main__":
    example = load_example()
    example.parallelize = fsdp
    frozen_mib = take_frozen_mib(sys.argv)
    if frozen_mib:
        example.build_model = with_frozen_base(example.build_model, frozen_mib)
    sys.exit(example.main())
