"""Capturing and restoring a torch training state, RNGs included.

:func:`torch_state` gathers everything exact resume needs into a plain tree
(state dicts, RNG states, user extras) that the checkpoint codec can store
without pickle; :class:`RestoredState` puts it back.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from spotguard.trainer import statedicts

_KIND = "kind"
_VALUE = "value"


def capture_rng() -> dict[str, Any]:
    """The global RNG states: python ``random``, numpy's legacy global
    generator, torch CPU and (when initialized) every CUDA device."""
    rng: dict[str, Any] = {"python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        rng["numpy"] = np.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        rng["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = list(torch.cuda.get_rng_state_all())
    return rng


def restore_rng(rng: Mapping[str, Any]) -> None:
    """Put back RNG states captured by :func:`capture_rng`."""
    if "python" in rng:
        random.setstate(_as_tuple(rng["python"]))
    if "numpy" in rng:
        import numpy as np

        np.random.set_state(rng["numpy"])
    if "torch" in rng or "cuda" in rng:
        import torch

        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        cuda_states = rng.get("cuda")
        if cuda_states and torch.cuda.is_available():
            if len(cuda_states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(list(cuda_states))
            else:
                for i, s in enumerate(cuda_states[: torch.cuda.device_count()]):
                    torch.cuda.set_rng_state(s, i)


_restore_global_rng = restore_rng  # load_into's keyword shadows the name


def _as_tuple(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_as_tuple(v) for v in value)
    return value


#: The kinds of RNG object an extra is saved as by its state (see :func:`generator_kind`).
GENERATOR_KINDS = ("torch_generator", "numpy_generator", "numpy_randomstate", "python_random")


def generator_kind(obj: Any) -> str | None:
    """Pure: which of :data:`GENERATOR_KINDS` the RNG object ``obj`` is (a ``torch.Generator``,
    ``numpy.random.Generator``, ``numpy.random.RandomState`` or ``random.Random``); None for
    anything else."""
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is not None and isinstance(obj, torch.Generator):
        return "torch_generator"
    if np is not None:
        if isinstance(obj, np.random.Generator):
            return "numpy_generator"
        if isinstance(obj, np.random.RandomState):
            return "numpy_randomstate"
    if isinstance(obj, random.Random):
        return "python_random"
    return None


def generator_state(obj: Any, kind: str) -> Any:
    """The state of the RNG object ``obj`` of ``kind`` (see :func:`generator_kind`)."""
    if kind == "numpy_generator":
        return obj.bit_generator.state
    if kind == "python_random":
        return obj.getstate()
    return obj.get_state()  # a torch.Generator or a numpy RandomState


def set_generator_state(obj: Any, kind: str, state: Any) -> None:
    """Put back into the RNG object ``obj`` of ``kind`` what :func:`generator_state` returned
    (also after the codec stored its tuples as lists)."""
    if kind == "numpy_generator":
        obj.bit_generator.state = state
    elif kind == "python_random":
        obj.setstate(_as_tuple(state))
    else:
        obj.set_state(state)


def _capture_extra(value: Any) -> dict[str, Any]:
    kind = generator_kind(value)
    if kind is not None:
        return {_KIND: kind, _VALUE: generator_state(value, kind)}
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return {_KIND: "state_dict", _VALUE: value.state_dict()}
    return {_KIND: "value", _VALUE: value}


def _restore_extra(entry: Mapping[str, Any], target: Any, name: str) -> None:
    kind = entry.get(_KIND)
    value = entry.get(_VALUE)
    if kind in GENERATOR_KINDS:
        set_generator_state(target, kind, value)
    elif kind == "state_dict":
        target.load_state_dict(value)
    else:
        raise TypeError(f"extra {name!r} was saved as a plain value; read it from state.extra[{name!r}]")


def torch_state(model: Any = None, optimizer: Any = None, scheduler: Any = None, **extra: Any) -> dict[str, Any]:
    """Everything exact resume needs, as a tree the checkpointer can store.

    ``model``, ``optimizer`` and ``scheduler`` contribute their
    ``state_dict()``; the global RNGs (python, numpy, torch CPU and CUDA) are
    captured now. Each keyword in ``extra`` is stored by kind: a
    ``torch.Generator``, ``numpy.random.Generator``/``RandomState`` or
    ``random.Random`` by its RNG state, an object with ``state_dict()`` /
    ``load_state_dict()`` (a sampler, a ``GradScaler``) by its state dict, and
    anything else (epoch, batch index, a dict of counters) as a value.
    Call it right at the save, so the state is captured at that instant.

    Under torch.distributed (a distributed Checkpointer exists, or a process
    group of more than one rank is initialized) model and optimizer state
    come from ``torch.distributed.checkpoint.state_dict.get_state_dict``.
    """
    state: dict[str, Any] = {}
    if statedicts.active():
        # Sharded state dicts (FQN keys, DTensor shards) that DCP can reshard.
        state.update(statedicts.get_state_dicts(model, optimizer))
    else:
        if model is not None:
            state["model"] = model.state_dict()
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    state["rng"] = capture_rng()
    state["extra"] = {name: _capture_extra(value) for name, value in extra.items()}
    return state


@dataclass(eq=False)  # compared as the mapping it is, not field by field
class RestoredState(Mapping[str, Any]):
    """A loaded checkpoint: the saved state tree plus where it came from.

    Behaves as a read-only mapping of the saved state (``state["model"]``).
    ``step`` is the step passed to ``save``; resume with ``step + 1``.

    ``exact`` is False when a distributed checkpoint was restored on a
    different number of ranks (``resharded_from``: the world size that wrote
    it): model and optimizer are resharded, per-rank RNG states and data
    positions cannot be exact.
    """

    state: dict[str, Any]
    _: KW_ONLY
    step: int
    name: str
    path: str
    epoch: int | None = None
    metrics: Mapping[str, float | None] = field(default_factory=dict)
    #: False when resharded (see the class docstring).
    exact: bool = True
    #: The world size that wrote a checkpoint restored on a different one.
    resharded_from: int | None = None
    #: Loaded under torch.distributed (model/optimizer as sharded state dicts).
    sharded: bool = False
    #: This rank's own saved state was loaded (not rank 0's stand-in).
    rank_state_own: bool = True
    #: Bytes checksummed before loading (0 when the uploader had just verified the very files).
    checked_bytes: int = 0
    #: Bytes read straight into the trainer's own tensors (their memory is the restored state's).
    in_place_bytes: int = 0

    def __post_init__(self) -> None:
        self.metrics = dict(self.metrics or {})  # its own copy (None taken as none, as before)

    def __getitem__(self, key: str) -> Any:
        return self.state[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)

    def __repr__(self) -> str:
        return f"RestoredState(name={self.name!r}, step={self.step}, parts={sorted(self.state)})"

    @property
    def extra(self) -> dict[str, Any]:
        """The keyword extras passed to :func:`torch_state`, by name: plain
        values as saved, objects as their saved state."""
        raw = self.state.get("extra") or {}
        out: dict[str, Any] = {}
        for name, entry in raw.items():
            if isinstance(entry, Mapping) and _KIND in entry:
                out[name] = entry.get(_VALUE)
            else:
                out[name] = entry
        return out

    def load_into(
        self,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        *,
        restore_rng: bool = True,
        strict: bool = True,
        **objects: Any,
    ) -> dict[str, Any]:
        """Load the saved state into live objects, in place.

        Restores ``model``/``optimizer``/``scheduler`` from their state dicts,
        the global RNGs (unless ``restore_rng=False``), and each keyword
        object from the extra of the same name (generators, samplers, ...).
        Returns :attr:`extra`.
        """
        if self.sharded and (model is not None or optimizer is not None):
            for key, obj in (("model", model), ("optimizer", optimizer)):
                if obj is not None and key not in self.state:
                    raise KeyError(f"checkpoint {self.name} holds no {key} state")
            statedicts.set_state_dicts(model, optimizer, self.state, strict=strict)
            model = optimizer = None
        if model is not None:
            if "model" not in self.state:
                raise KeyError(f"checkpoint {self.name} holds no model state")
            model.load_state_dict(self.state["model"], strict=strict)
        if optimizer is not None:
            if "optimizer" not in self.state:
                raise KeyError(f"checkpoint {self.name} holds no optimizer state")
            optimizer.load_state_dict(self.state["optimizer"])
        if scheduler is not None:
            if "scheduler" not in self.state:
                raise KeyError(f"checkpoint {self.name} holds no scheduler state")
            scheduler.load_state_dict(self.state["scheduler"])
        extras = self.state.get("extra") or {}
        for name, target in objects.items():
            if name not in extras:
                raise KeyError(f"checkpoint {self.name} holds no extra named {name!r}")
            _restore_extra(extras[name], target, name)
        if restore_rng and isinstance(self.state.get("rng"), Mapping):
            _restore_global_rng(self.state["rng"])
        return self.extra
