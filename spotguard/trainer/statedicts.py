"""Model and optimizer state dicts under torch.distributed, and whether to take them so.

The lowest floor of the trainer: :func:`~spotguard.trainer.state.torch_state`
and the distributed Checkpointer (``distributed``) both use it, and it uses
neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_active = 0  # distributed Checkpointers alive in this process


def enter() -> None:
    """A distributed Checkpointer was built: :func:`active` until its :func:`leave`."""
    global _active
    _active += 1


def leave() -> None:
    """A distributed Checkpointer was closed."""
    global _active
    _active = max(0, _active - 1)


def active() -> bool:
    """Whether :func:`~spotguard.torch_state` should capture sharded state
    dicts: a distributed Checkpointer exists in this process (one built with
    ``distributed=False``, e.g. by rank 0 alone, gets plain state dicts)."""
    return _active > 0


def get_state_dicts(model: Any, optimizer: Any) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` through torch's distributed
    state-dict API (FQN keys, wrappers' prefixes stripped, DTensor shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    out: dict[str, Any] = {}
    if model is not None and optimizer is not None:
        out["model"], out["optimizer"] = get_state_dict(model, optimizer)
    elif model is not None:
        out["model"] = get_model_state_dict(model)
    elif optimizer is not None:
        raise ValueError("a distributed optimizer state needs its model (torch_state(model, optimizer, ...))")
    return out


def set_state_dicts(model: Any, optimizer: Any, state: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load model/optimizer state dicts made by :func:`get_state_dicts`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    options = StateDictOptions(strict=strict)
    if model is not None and optimizer is not None:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options
        )
    elif model is not None:
        set_model_state_dict(model, state["model"], options=options)
