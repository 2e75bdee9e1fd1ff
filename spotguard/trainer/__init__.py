"""The training-side API: :class:`Checkpointer`, :func:`torch_state` and :func:`deterministic`.

Importing this package does not import torch; the state helpers use torch
and numpy only when they are already imported by the training code.
"""

from __future__ import annotations

from spotguard.contract.control import (
    ACK_FILE,
    EXIT_FILE,
    PID_FILE,
    REQUEST_FILE,
    CheckpointRequest,
    parse_request,
)
from spotguard.trainer.checkpointer import Checkpointer
from spotguard.trainer.determinism import deterministic
from spotguard.trainer.state import RestoredState, capture_rng, restore_rng, torch_state

__all__ = [
    "ACK_FILE",
    "EXIT_FILE",
    "PID_FILE",
    "REQUEST_FILE",
    "CheckpointRequest",
    "Checkpointer",
    "RestoredState",
    "capture_rng",
    "deterministic",
    "parse_request",
    "restore_rng",
    "torch_state",
]
