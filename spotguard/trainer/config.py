"""What a Checkpointer is configured with: the ``SPOTGUARD_*`` environment and its settings.

Two small dataclasses, read once: :class:`EnvConfig` is what the operator or
``spotguard run`` put in the environment (``Checkpointer.from_env`` turns it
into constructor keywords); :class:`Settings` is what the Checkpointer runs
with, checked once at construction. The Checkpointer's attributes of the
same names read and assign the settings, so its parts
(:mod:`~spotguard.trainer.policy`, :mod:`~spotguard.trainer.persist`,
:mod:`~spotguard.trainer.shipping`, :mod:`~spotguard.trainer.restore`) and
the user always see one value. Also here, because it follows from the
configuration alone: :func:`local_pruner`, who deletes local checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotguard.checkpoint.store.retention import RetentionPolicy
from spotguard.contract.env import (
    ATTEMPT,
    CHECKPOINT_DIR,
    CHECKSUM,
    CONTROL_DIR,
    EMERGENCY_STAGING,
    FINAL_VERIFY_SECONDS,
    INCREMENTAL,
    JOB,
    SAVE_EVERY_SECONDS,
    SAVE_EVERY_STEPS,
    STAGING_ARENA,
    STAGING_RESERVE,
    STORAGE_URI,
    from_env,
)
from spotguard.storage.checksum import DEFAULT_ALGORITHM, check_algorithm

PRUNE_SELF = "self"
PRUNE_UPLOADER = "uploader"
PRUNE_LOCAL_ONLY = "local-only"


def local_pruner(upload: bool, storage_uri: str | None, shares_control_dir: bool) -> str:
    """Pure: who deletes this trainer's local checkpoints.

    Only the uploader prunes, and only what is safe in storage:

    - ``self``: the Checkpointer uploads itself (``upload=True``), so it
      prunes checkpoints older than one it verified in storage;
    - ``uploader``: a storage URI or a shared control directory means a
      sidecar or ``spotguard run`` ships the checkpoints; it prunes, the
      trainer never does (a checkpoint deleted before its upload is lost);
    - ``local-only``: nothing ever ships them; a newer local checkpoint
      supersedes an older one by design, so ``keep_local`` / the retention
      policy prune locally.
    """
    if upload:
        return PRUNE_SELF
    if storage_uri or shares_control_dir:
        return PRUNE_UPLOADER
    return PRUNE_LOCAL_ONLY


@dataclass(frozen=True)
class EnvConfig:
    """The Checkpointer's configuration in the ``SPOTGUARD_*`` environment
    (set by the operator or ``spotguard run``); unset means the default."""

    directory: str | None
    storage_uri: str | None
    control_dir: str | None
    save_every_steps: int | None
    save_every_seconds: float | None
    checksum: str
    job: str | None
    attempt: int | None
    retention: RetentionPolicy | None
    incremental: bool = True
    emergency_staging: str | None = None
    staging_reserve: bool = False
    staging_arena: bool = True
    final_verify_seconds: float = 0.0

    @classmethod
    def read(cls, env: Mapping[str, str]) -> EnvConfig:
        """Parse ``env``; a malformed number raises ValueError naming the variable."""
        storage_uri = from_env(STORAGE_URI, env) or None
        control_dir = from_env(CONTROL_DIR, env) or None
        save_every_steps = from_env(SAVE_EVERY_STEPS, env) or None
        save_every_seconds = from_env(SAVE_EVERY_SECONDS, env) or None
        checksum = from_env(CHECKSUM, env) or DEFAULT_ALGORITHM
        job = from_env(JOB, env) or None
        attempt = from_env(ATTEMPT, env)
        policy = RetentionPolicy.from_env(env)
        return cls(
            directory=from_env(CHECKPOINT_DIR, env) or None,
            storage_uri=storage_uri,
            control_dir=control_dir,
            save_every_steps=save_every_steps,
            save_every_seconds=save_every_seconds,
            checksum=checksum,
            job=job,
            attempt=attempt,
            retention=None if policy.keeps_everything else policy,
            incremental=from_env(INCREMENTAL, env),
            emergency_staging=from_env(EMERGENCY_STAGING, env) or None,
            staging_reserve=from_env(STAGING_RESERVE, env),
            staging_arena=from_env(STAGING_ARENA, env),
            final_verify_seconds=from_env(FINAL_VERIFY_SECONDS, env),
        )

    def kwargs(self) -> dict[str, Any]:
        """The Checkpointer's keyword arguments this environment sets
        (``retention`` only when it keeps less than everything)."""
        out: dict[str, Any] = {
            "storage_uri": self.storage_uri,
            "control_dir": self.control_dir,
            "save_every_steps": self.save_every_steps,
            "save_every_seconds": self.save_every_seconds,
            "checksum": self.checksum,
            "job": self.job,
            "attempt": self.attempt,
            "incremental": self.incremental,
            "emergency_staging": self.emergency_staging,
            "staging_reserve": self.staging_reserve,
            "staging_arena": self.staging_arena,
            "final_verify_seconds": self.final_verify_seconds,
        }
        if self.retention is not None:
            out["retention"] = self.retention
        return out


@dataclass
class Settings:
    """What a Checkpointer runs with (see its constructor for each field).

    ``upload`` is only true with a storage URI; ``local_pruner`` is
    :func:`local_pruner`'s answer. Mutable: assigning a Checkpointer
    attribute of the same name assigns the field.
    """

    directory: Path
    storage_uri: str | None
    storage_options: dict[str, Any]
    save_every_steps: int | None
    save_every_seconds: float | None
    checksum: str
    control_dir: Path
    keep_local: int
    retention: RetentionPolicy | None
    upload: bool
    local_pruner: str
    job: str | None
    attempt: int | None
    async_save: bool
    #: With ``upload``: store checkpoints as shared content-addressed chunks (only new chunks are sent).
    incremental: bool = True
    #: Memory file system shared with the uploader for an emergency save (see :mod:`spotguard.checkpoint.local.staged`).
    emergency_staging: Path | None = None
    #: Set memory aside in ``emergency_staging`` after a routine save (see :mod:`spotguard.checkpoint.local.reserve`).
    staging_reserve: bool = False
    #: Move host buffers into arenas in ``emergency_staging`` after each routine save (see
    #: :mod:`spotguard.checkpoint.local.arena`).
    staging_arena: bool = True
    #: A trainer that finished waits on its way out, at most this long, for its last checkpoint to be
    #: verified by the uploader (see :mod:`spotguard.contract.final`); 0: no wait.
    final_verify_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.save_every_steps is not None and self.save_every_steps < 1:
            raise ValueError("save_every_steps must be at least 1")
        if self.save_every_seconds is not None and self.save_every_seconds <= 0:
            raise ValueError("save_every_seconds must be positive")
        self.checksum = check_algorithm(self.checksum)
        if self.final_verify_seconds < 0:
            raise ValueError("final_verify_seconds must not be negative")
