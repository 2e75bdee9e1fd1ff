"""What a Checkpointer is configured with: one frozen :class:`CheckpointerConfig`.

Each field is one keyword of ``Checkpointer(...)``. A field that the operator
or ``spotguard run`` may set names its ``SPOTGUARD_*`` variable in the
contract's table (:mod:`spotguard.contract.env`), which gives its default,
its meaning (the help text) and its command-line flag. A value given any of
three ways lands in the same field:

    CheckpointerConfig(keep_local=3)                              # Checkpointer(directory, keep_local=3)
    CheckpointerConfig.from_env({"SPOTGUARD_KEEP_LOCAL": "3"})    # Checkpointer.from_env()
    CheckpointerConfig.from_args(parser.parse_args(["--keep-local", "3"]))  # after add_arguments(parser)

The Checkpointer builds it once and hands it to each of its parts
(:mod:`~spotguard.trainer.policy`, :mod:`~spotguard.trainer.persist`,
:mod:`~spotguard.trainer.shipping`, :mod:`~spotguard.trainer.restore`, ...);
nothing changes it afterwards. Also here, because it follows from the
configuration alone: :func:`local_pruner`, who deletes local checkpoints.
"""

from __future__ import annotations

import argparse
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from spotguard.checkpoint.store.retention import RetentionPolicy
from spotguard.contract import env
from spotguard.contract.control import CONTROL_SUBDIR
from spotguard.storage.checksum import DEFAULT_ALGORITHM, check_algorithm

PRUNE_SELF = "self"
PRUNE_UPLOADER = "uploader"
PRUNE_LOCAL_ONLY = "local-only"

#: Field metadata: the field's variable in the contract's table, and whether 0 there means "unset".
_VAR = "spotguard.var"
_ZERO_IS_UNSET = "spotguard.zero_is_unset"
_TABLE = object()


def _setting(var: env.Var[Any, Any], default: Any = _TABLE, *, zero_is_unset: bool = False) -> Any:
    """A field set by ``var``: its default is the table's unless the Checkpointer's differs."""
    value = var.default if default is _TABLE else default
    return field(default=value, metadata={_VAR: var, _ZERO_IS_UNSET: zero_is_unset})


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


@dataclass(frozen=True, kw_only=True)
class CheckpointerConfig:
    """Everything a Checkpointer runs with; see :class:`~spotguard.trainer.Checkpointer` for each field.

    Fields without a variable (``storage_options``, ``upload``, ``async_save``,
    ``reuse_host_buffers``, ``distributed``) are keywords only; ``retention``
    comes from the ``SPOTGUARD_KEEP_*`` rules. Checked once when built: a
    value that cannot work raises ValueError naming the field.
    """

    directory: Path = _setting(env.CHECKPOINT_DIR, Path("checkpoints"))
    storage_uri: str | None = _setting(env.STORAGE_URI)
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    save_every_steps: int | None = _setting(env.SAVE_EVERY_STEPS, zero_is_unset=True)
    save_every_seconds: float | None = _setting(env.SAVE_EVERY_SECONDS, zero_is_unset=True)
    checksum: str = _setting(env.CHECKSUM, DEFAULT_ALGORITHM)
    #: As given: None is ``<directory>/.control`` (:attr:`control_path`), an uploader's own otherwise.
    control_dir: Path | None = _setting(env.CONTROL_DIR)
    keep_local: int = _setting(env.KEEP_LOCAL)
    retention: RetentionPolicy | None = None
    #: Only true with a storage URI.
    upload: bool = False
    job: str | None = _setting(env.JOB)
    attempt: int | None = _setting(env.ATTEMPT)
    async_save: bool = True
    reuse_host_buffers: bool = True
    distributed: bool | None = None
    incremental: bool = _setting(env.INCREMENTAL)
    emergency_staging: Path | None = _setting(env.EMERGENCY_STAGING)
    staging_reserve: bool = _setting(env.STAGING_RESERVE)
    staging_arena: bool = _setting(env.STAGING_ARENA)
    final_verify_seconds: float = _setting(env.FINAL_VERIFY_SECONDS)

    def __post_init__(self) -> None:
        # Normalized here, so that whoever builds it may pass text for paths and "" for none.
        set_ = object.__setattr__
        set_(self, "directory", Path(self.directory))
        set_(self, "storage_uri", self.storage_uri or None)
        set_(self, "storage_options", MappingProxyType(dict(self.storage_options)))
        set_(self, "control_dir", Path(self.control_dir) if self.control_dir else None)
        set_(self, "emergency_staging", Path(self.emergency_staging) if self.emergency_staging else None)
        set_(self, "upload", bool(self.upload and self.storage_uri))
        set_(self, "checksum", check_algorithm(self.checksum))
        if self.save_every_steps is not None and self.save_every_steps < 1:
            raise ValueError("save_every_steps must be at least 1")
        if self.save_every_seconds is not None and self.save_every_seconds <= 0:
            raise ValueError("save_every_seconds must be positive")
        for f in fields(self):
            var: env.Var[Any, Any] | None = f.metadata.get(_VAR)
            value = getattr(self, f.name)
            if var is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if var.bound == "non-negative" and value < 0:
                raise ValueError(f"{f.name} must not be negative, not {value!r}")
            if var.bound == "positive" and value <= 0:
                raise ValueError(f"{f.name} must be more than 0, not {value!r}")

    @property
    def control_path(self) -> Path:
        """The control channel directory: ``control_dir``, else ``<directory>/.control``."""
        return self.control_dir or self.directory / CONTROL_SUBDIR

    @property
    def local_pruner(self) -> str:
        """Who deletes the local checkpoints (:func:`local_pruner`)."""
        return local_pruner(self.upload, self.storage_uri, self.control_dir is not None)

    # -- the three ways in ------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **keywords: Any) -> CheckpointerConfig:
        """From the ``SPOTGUARD_*`` environment (default: this process's); ``keywords`` override it.

        An unset variable (or 0 for an interval) leaves the field's default;
        a malformed one raises ValueError naming the variable.
        """
        environ = os.environ if environ is None else environ
        values = _given(lambda var, _name: env.from_env(var, environ))
        policy = RetentionPolicy.from_env(environ)
        if not policy.keeps_everything:
            values["retention"] = policy
        return cls(**{**values, **_without_none_directory(keywords)})

    @classmethod
    def add_arguments(
        cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup, environ: Mapping[str, str] | None = None
    ) -> None:
        """Add a flag for each field the table names (``--checkpoint-dir``, ``--keep-local``, ...)
        and the retention rules' to ``parser``; their defaults come from the environment."""
        for f in fields(cls):
            if _VAR in f.metadata:
                fallback = None if f.default is MISSING else f.default
                env.add_option(parser, f.metadata[_VAR], dest=f.name, fallback=fallback, environ=environ)
        for var in env.RETENTION:
            env.add_option(parser, var, environ=environ)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **keywords: Any) -> CheckpointerConfig:
        """From the flags :meth:`add_arguments` added, as parsed; ``keywords`` override them.

        Raises ValueError (one line, naming the variable) for a boolean's
        environment text that is no boolean, or an inconsistent retention.
        """

        def given(var: env.Var[Any, Any], name: str) -> Any:
            value = getattr(args, name, None)
            return env.parse(var, value) if isinstance(value, str) else value

        values = _given(given)
        retention = retention_from_args(args)
        if retention is not None:
            values["retention"] = retention
        return cls(**{**values, **_without_none_directory(keywords)})


def keyword_parameters() -> list[inspect.Parameter]:
    """Pure: the configuration's fields as keyword parameters with their defaults (for a signature)."""
    return [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=f.default if f.default is not MISSING else f.default_factory(),  # type: ignore[operator]
            annotation=f.type,
        )
        for f in fields(CheckpointerConfig)
        if f.name != "directory"
    ]


def _given(read: Callable[[env.Var[Any, Any], str], Any]) -> dict[str, Any]:
    """The fields whose variable ``read(var, field name)`` gives a value (None or a 0 that means unset: none)."""
    values: dict[str, Any] = {}
    for f in fields(CheckpointerConfig):
        var = f.metadata.get(_VAR)
        if var is None:
            continue
        value = read(var, f.name)
        if value is None or (f.metadata[_ZERO_IS_UNSET] and not value):
            continue
        values[f.name] = value
    return values


def _without_none_directory(keywords: dict[str, Any]) -> dict[str, Any]:
    # ``directory=None`` asks for the environment's (or the default) directory, as before.
    return {k: v for k, v in keywords.items() if not (k == "directory" and v is None)}


def retention_from_args(args: argparse.Namespace) -> RetentionPolicy | None:
    """The retention policy the ``--keep-*`` / ``--best-*`` flags ask for, or None to keep everything.

    Raises ValueError (one line) for an inconsistent policy.
    """
    policy = RetentionPolicy(
        keep_last=args.keep_last,
        keep_best=args.keep_best,
        metric=args.best_metric or None,
        mode=(args.best_mode or "min").strip().lower(),
        keep_every=args.keep_every,
    )
    return None if policy.keeps_everything else policy


def reference() -> str:
    """Pure: the Markdown table of every setting the environment or a flag gives (docs/configuration.md)."""
    rows = ["| keyword | environment | flag | default | meaning |", "| --- | --- | --- | --- | --- |"]
    named = [(f.name, f.metadata[_VAR], f.default) for f in fields(CheckpointerConfig) if _VAR in f.metadata]
    for name, var, default in [*named, *(("retention", var, var.default) for var in env.RETENTION)]:
        meaning = var.meaning.replace("<", "&lt;")
        rows.append(f"| `{name}` | `{var.name}` | `{var.option}` | `{default}` | {meaning} |")
    return "\n".join(rows) + "\n"
