"""What the framework integrations share: one Checkpointer per process, and a
process group for resume helpers that run before the framework starts."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import Any

from spotguard.trainer.checkpointer import Checkpointer

log = logging.getLogger(__name__)

_lock = threading.Lock()
_shared: Checkpointer | None = None


def checkpointer(**overrides: Any) -> Checkpointer:
    """The process-wide Checkpointer of the integrations, built on first use
    from the ``SPOTGUARD_*`` environment (``Checkpointer.from_env``, signal
    handlers installed when called from the main thread); ``overrides`` count
    only on that first call. Collective when torch.distributed is initialized
    with more than one rank at that moment."""
    global _shared
    with _lock:
        if _shared is None or _shared.closed:
            _shared = Checkpointer.from_env(**overrides)
        elif overrides:
            log.debug("spotguard's Checkpointer already exists; ignoring %s", sorted(overrides))
        return _shared


def reset() -> None:
    """Close the shared Checkpointer (finishing its writes) and forget it."""
    global _shared
    with _lock:
        shared, _shared = _shared, None
    if shared is not None:
        shared.close()


def torchrun_world_size(environ: dict[str, str] | os._Environ[str] | None = None) -> int:
    """Pure: the world size torchrun (or a TrainingJob) announces, 1 without."""
    env = os.environ if environ is None else environ
    try:
        return max(1, int(env.get("WORLD_SIZE", "1") or 1))
    except ValueError:
        return 1


def process_group_backend(cuda: bool) -> str:
    """Pure: the backend spotguard initializes: gloo for CPU tensors, and
    nccl for CUDA tensors when there is a GPU (what the frameworks pick)."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def ensure_process_group() -> bool:
    """Under torchrun (``WORLD_SIZE`` > 1) with no default process group yet,
    initialize one from torchrun's environment, so a resume helper called
    before the framework starts is collective (every rank resumes the same
    checkpoint). Lightning and accelerate reuse an initialized group. Returns
    whether a group of more than one rank exists afterwards."""
    if torchrun_world_size() <= 1:
        return False
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return False
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend=process_group_backend(cuda))
        # Registered before any Checkpointer of this process exists, so it runs after the Checkpointer's
        # own exit handler has finished its writes and settled its collectives (atexit runs last first).
        atexit.register(_destroy_process_group_at_exit)
        log.info(
            "initialized torch.distributed (%s, %d ranks) for spotguard's resume",
            dist.get_backend(),
            dist.get_world_size(),
        )
    return dist.get_world_size() > 1


def _destroy_process_group_at_exit() -> None:
    """Destroy the process group :func:`ensure_process_group` initialized, at a
    clean exit, while the interpreter is still whole.

    Neither Lightning nor Hugging Face destroys a group it did not create, and
    a gloo group left to the interpreter's teardown can abort the process as
    it exits, after training finished ("terminate called without an active
    exception", SIGABRT: a successful run then looks failed). Not after an
    uncaught exception: the other ranks may still be in a collective with
    this one, and the exit is a failure anyway."""
    import torch.distributed as dist

    if getattr(sys, "last_value", None) is not None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - exiting anyway; say why the group was left as it is
        log.warning("could not destroy the process group at exit: %s", exc)
