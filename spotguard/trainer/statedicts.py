"""Model and optimizer state dicts under torch.distributed, and whether to take them so.

The lowest floor of the trainer: :func:`~spotguard.trainer.state.torch_state`
and the distributed Checkpointer (``distributed``) both use it, and it uses
neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_active = 0  # distributed Checkpointers alive in this process
#: What torch's ``get_state_dict`` works out about a model before it takes the state (every
#: parameter's FQNs, its FSDP modules: ``_verify_options``), for the last model asked about while a
#: distributed Checkpointer is alive: (model, what it was made from, torch's answer). Forgotten when
#: the last such Checkpointer closes (it holds the model).
_info: tuple[Any, Any, Any] | None = None


def enter() -> None:
    """A distributed Checkpointer was built: :func:`active` until its :func:`leave`."""
    global _active
    _active += 1


def leave() -> None:
    """A distributed Checkpointer was closed."""
    global _active, _info
    _active = max(0, _active - 1)
    if not _active:
        _info = None


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
        both = _get_state_dict_reusing_info(model, optimizer)
        out["model"], out["optimizer"] = both if both is not None else get_state_dict(model, optimizer)
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


def _get_state_dict_reusing_info(model: Any, optimizer: Any) -> tuple[Any, Any] | None:
    """torch's ``get_state_dict(model, optimizer)``, step by step as torch takes it, but with what it
    works out about the model (``_verify_options``: every parameter's FQNs, walking the modules once
    per name; at a thousand parameters, a third of the call) reused while the model's parameters and
    buffers are the same objects under the same names. None where this torch release has other steps
    (the caller then calls ``get_state_dict`` itself)."""
    global _info
    import torch
    from torch.distributed.checkpoint import state_dict as sd

    steps = ("_gc_context", "_verify_options", "_get_model_state_dict", "_get_optim_state_dict", "_verify_state_dict")
    if not _active or not all(callable(getattr(sd, name, None)) for name in steps):
        return None
    optimizers = (optimizer,) if isinstance(optimizer, torch.optim.Optimizer) else tuple(optimizer)
    with sd._gc_context():
        made_of = (
            len(optimizers),
            tuple((name, id(p)) for name, p in model.named_parameters(remove_duplicate=False)),
            tuple((name, id(b)) for name, b in model.named_buffers(remove_duplicate=False)),
        )
        if _info is not None and _info[0] is model and _info[1] == made_of:
            info = _info[2]
        else:
            _info = None
            info = sd._verify_options(model, optimizers, optim_only=False)
            _info = (model, made_of, info)
        model_state = sd._get_model_state_dict(model, info)
        optim_state = sd._get_optim_state_dict(model, optimizers, info)
        sd._verify_state_dict(model_state, optim_state, info)
    return model_state, optim_state
