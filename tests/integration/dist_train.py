"""Test trainer: ``examples/train_ddp.py`` with sharded state.

The example's loop unchanged, with the model sharded by FSDP2
(``fully_shard``: each rank holds a shard of every parameter and of the
optimizer state, as DTensors) instead of replicated by DDP. Run it like
the example, under torchrun.
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
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


if __name__ == "__main__":
    example = load_example()
    example.parallelize = fsdp
    sys.exit(example.main())
