"""Model and optimizer state dicts under torch.distributed, and whether to take them so.

The lowest floor of the trainer: :func:`~spotguard.trainer.state.torch_state`
and the distributed Checkpointer (``distributed``) both use it, and it uses
neither.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

_active = 0  # distributed Checkpointers alive in this process
#: What torch's ``get_state_dict`` works out about a model before it takes the state (every
#: parameter's FQNs, its FSDP modules: ``_verify_options``), for the last model asked about while a
#: distributed Checkpointer is alive: (model, what it was made from, torch's answer, the FQNs torch
#: looked up by name, its frozen parameters' detached aliases by state dict key: :class:`_Aliases`).
#: Forgotten when the last such Checkpointer closes (it holds the model).
_info: tuple[Any, Any, Any, dict[Any, set[str]], _Aliases] | None = None
#: The parameters of torch's ``_get_fqns`` that :func:`_remember_fqns` knows.
_FQNS_PARAMS = ("model", "name", "dsd_fqn_modifiers", "skip_ddp_prefix", "skip_compiler_prefix")
#: In the thread taking a state dict by :func:`_get_state_dict_reusing_info`: (model, its FQNs by name,
#: its frozen parameters' aliases).
_looking_up = threading.local()


class _Aliases:
    """A model's frozen parameters' detached aliases, as its ``state_dict()`` holds them, kept from one
    state dict to the next.

    ``model.state_dict()`` detaches every parameter: for a DTensor (FSDP2, TP) a dispatch through
    DTensor's Python layer, about 25 µs each, most of a state dict of hundreds of frozen shards (13 of
    15 ms at 512 per rank). A frozen parameter's alias from the previous state dict is the very view
    a new ``detach()`` would make (the same local shard, storage, offset, shape, strides, dtype and
    sharding spec; a detached alias holds no other state), so it is handed again while all of those
    are what they were, the parameter is the same object and still frozen (``requires_grad=False``),
    and neither its version counter nor its local shard's moved (an in-place write through torch, a
    parameter unfrozen: a new alias, as before). A write that bypasses the version counters (through
    ``.data``) changes no view: the alias shows it as a new one would, and the stage finds it by write
    tracking or by comparing the bytes, as before; ``p.data = other`` is another storage.
    """

    def __init__(self) -> None:
        self._by_key: dict[str, tuple[tuple[Any, ...], tuple[Any, ...], Any]] = {}
        self._now: dict[str, tuple[tuple[Any, ...], tuple[Any, ...], Any]] = {}
        self.reused = 0  # aliases handed again by the last state dict (read by the tests)

    def detached(self, key: str, value: Any) -> Any:
        """``value.detach()``, or the alias of the last state dict at ``key`` where it is the same view."""
        import torch

        if not isinstance(value, torch.Tensor):
            return value
        if not isinstance(value, torch.nn.Parameter) or value.requires_grad:
            return value.detach()
        objects, facts = _made_of(value)
        kept = self._by_key.get(key)
        if (
            kept is not None
            and kept[0][0] is objects[0]
            and kept[0][1] is objects[1]
            and kept[0][2] is objects[2]
            and kept[1] == facts
        ):
            alias = kept[2]
            self.reused += 1
        else:
            alias = value.detach()
        self._now[key] = (objects, facts, alias)
        return alias

    def begin(self) -> None:
        self._now, self.reused = {}, 0

    def end(self) -> None:
        """Only the aliases of this state dict are kept (a parameter gone is not held)."""
        self._by_key, self._now = self._now, {}


def _made_of(param: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """What a frozen parameter's detached alias is a view of: the objects (the parameter, its local
    shard: itself but for a DTensor, the DTensor's spec), compared by identity, and the facts (both
    version counters, the local shard's address, offset, shape, strides and dtype, whether it is
    frozen), compared by equality. The alias holds its storage, whose memory no other storage can
    then take: another storage under the local shard has another address."""
    local = getattr(param, "_local_tensor", param)
    objects = (param, local, getattr(param, "_spec", None))
    facts = (
        param._version,
        local._version,
        local.data_ptr(),
        local.storage_offset(),
        tuple(local.shape),
        local.stride(),
        local.dtype,
        param.requires_grad,
    )
    return objects, facts


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
    _remember_fqns(sd)
    _hand_aliases(sd)
    optimizers = (optimizer,) if isinstance(optimizer, torch.optim.Optimizer) else tuple(optimizer)
    with sd._gc_context():
        made_of = (
            len(optimizers),
            tuple((name, id(p)) for name, p in model.named_parameters(remove_duplicate=False)),
            tuple((name, id(b)) for name, b in model.named_buffers(remove_duplicate=False)),
        )
        known = _info if _info is not None and _info[0] is model and _info[1] == made_of else None
        fqns: dict[Any, set[str]] = known[3] if known is not None else {}
        aliases = known[4] if known is not None else _Aliases()
        _looking_up.model = (model, fqns, None)
        aliases.begin()
        try:
            if known is not None:
                info = known[2]
            else:
                _info = None
                info = sd._verify_options(model, optimizers, optim_only=False)
                _info = (model, made_of, info, fqns, aliases)
            # FSDP1's state dict hooks take ``keep_vars`` their own way: its state dicts are torch's alone.
            _looking_up.model = (model, fqns, None if info.fsdp_modules else aliases)
            model_state = sd._get_model_state_dict(model, info)
            optim_state = sd._get_optim_state_dict(model, optimizers, info)
            sd._verify_state_dict(model_state, optim_state, info)
            aliases.end()
        finally:
            _looking_up.model = None
    return model_state, optim_state


def _remember_fqns(sd: Any) -> None:
    """Have torch's ``_get_fqns`` (a parameter's or buffer's name -> its FQNs, by walking the modules on
    the name's path) answer from what it said before, for the model whose state dicts
    :func:`_get_state_dict_reusing_info` is taking in this thread, and as before for any other call.

    torch looks up every state dict key's FQNs and, in the optimizer's step, every model parameter's,
    frozen or not, at every save: about 10 µs each, a few hundredths of a second per save at a thousand
    parameters, the same answers each time while the parameters are the same objects under the same
    names (when they are not, :func:`_get_state_dict_reusing_info` starts a new memo). Installed once,
    only over the ``_get_fqns`` this module knows (its parameters by name); each answer is a new set, as
    torch's is."""
    import inspect

    real = getattr(sd, "_get_fqns", None)
    if real is None or getattr(real, "_spotguard_remembers", False):
        return
    try:
        if tuple(inspect.signature(real).parameters) != _FQNS_PARAMS:
            return
    except (TypeError, ValueError):
        return

    def _get_fqns(model: Any, name: str, *args: Any, **kwargs: Any) -> set[str]:
        memo = getattr(_looking_up, "model", None)
        if memo is None or memo[0] is not model:
            return real(model, name, *args, **kwargs)  # type: ignore[no-any-return]
        key = (name, args, tuple(sorted(kwargs.items())))
        found = memo[1].get(key)
        if found is None:
            found = memo[1][key] = set(real(model, name, *args, **kwargs))
        return set(found)

    remembering: Callable[..., set[str]] = _get_fqns
    remembering._spotguard_remembers = True  # type: ignore[attr-defined]
    sd._get_fqns = remembering


def _hand_aliases(sd: Any) -> None:
    """Have torch's ``_state_dict_fn`` (a model's ``state_dict`` to call) give, for the model whose state
    dicts :func:`_get_state_dict_reusing_info` is taking in this thread, its ``state_dict(keep_vars=True)``
    with each tensor detached as ``keep_vars=False`` would, but a frozen parameter's alias handed again
    where it is the same view (:class:`_Aliases`); as before for any other call, for a model whose class
    has a ``state_dict`` of its own, and for one torch patched (``_patch_model_state_dict``). Installed
    once, only over the ``_state_dict_fn`` this module knows (its parameters by name)."""
    import inspect

    import torch

    real = getattr(sd, "_state_dict_fn", None)
    if real is None or getattr(real, "_spotguard_aliases", False):
        return
    try:
        if tuple(inspect.signature(real).parameters) != ("obj", "api"):
            return
    except (TypeError, ValueError):
        return

    def _state_dict_fn(obj: Any, api: str) -> Any:
        call = real(obj, api)
        memo = getattr(_looking_up, "model", None)
        if (
            memo is None
            or memo[0] is not obj
            or memo[2] is None
            or api != "state_dict"
            or getattr(call, "__func__", None) is not torch.nn.Module.state_dict
            or getattr(call, "__self__", None) is not obj
        ):
            return call
        aliases: _Aliases = memo[2]

        def state_dict() -> Any:
            state = call(keep_vars=True)
            for key, value in state.items():
                state[key] = aliases.detached(key, value)
            return state

        return state_dict

    handing: Callable[..., Any] = _state_dict_fn
    handing._spotguard_aliases = True  # type: ignore[attr-defined]
    sd._state_dict_fn = handing
