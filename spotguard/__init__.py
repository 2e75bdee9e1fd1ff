"""spotguard: keep long ML training runs alive on preemptible (spot) GPUs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spotguard.version import __version__

__all__ = ["Checkpointer", "__version__", "deterministic", "torch_state"]

if TYPE_CHECKING:
    from spotguard.trainer import Checkpointer, deterministic, torch_state


def __getattr__(name: str) -> Any:
    # Lazy, so `import spotguard` (and `spotguard --help`) stays light.
    if name in ("Checkpointer", "deterministic", "torch_state"):
        from spotguard import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'spotguard' has no attribute {name!r}")
