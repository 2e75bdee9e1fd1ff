"""Options that ``spotguard sidecar`` and ``spotguard run`` share: notices, retention, incremental uploads.

Argument parsing only: heavy imports happen inside the functions that need them.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spotguard.contract import env
from spotguard.contract.env import add_option


def add_notice_args(p: argparse.ArgumentParser) -> None:
    from spotguard.sidecar import notices as n

    add_option(p, env.NOTICES)
    add_option(p, env.AWS_IMDS_ENDPOINT, fallback=n.AWS_IMDS_ENDPOINT)
    add_option(p, env.GCE_METADATA_ENDPOINT, fallback=n.GCE_METADATA_ENDPOINT)
    add_option(p, env.AZURE_METADATA_ENDPOINT, fallback=n.AZURE_METADATA_ENDPOINT)
    for var in (env.NOTICE_INTERVAL, env.NOTICE_STOPS_TRAINING):
        add_option(p, var)


def add_retention_args(p: argparse.ArgumentParser) -> None:
    """Retention options shared by ``sidecar`` and ``run`` (defaults from ``SPOTGUARD_KEEP_*``)."""
    g = p.add_argument_group(
        "retention",
        "which checkpoints stay in storage (a checkpoint is kept "
        "if any rule keeps it; the newest verified one always is; no rule: keep all)",
    )
    for var in (*env.RETENTION, env.KEEP_LOCAL):
        add_option(g, var)


def retention_from_args(args: argparse.Namespace) -> Any | None:
    """The retention policy the options ask for, or None to keep everything.

    Raises ValueError (one line) for an inconsistent policy.
    """
    from spotguard.trainer.config import retention_from_args as policy_of

    return policy_of(args)


def add_incremental_arg(p: argparse.ArgumentParser) -> None:
    # The environment's value stays a string here: incremental_from_args
    # checks it, for the subcommand being run only.
    add_option(p, env.INCREMENTAL)


def incremental_from_args(args: argparse.Namespace) -> bool:
    """Whether uploads are incremental: the option, else ``SPOTGUARD_INCREMENTAL``, else on.

    Raises ValueError (one line, naming the variable) for a value that is no boolean, and,
    when incremental, for an upload lease the uploader's own chunk sweep cannot honour
    (:func:`check_sweep_lease`).
    """
    incremental = env.option_or_env(env.INCREMENTAL, args.incremental)
    if incremental:
        check_sweep_lease()
    return incremental


def check_sweep_lease(environ: Mapping[str, str] | None = None) -> None:
    """Refuse an upload lease (``SPOTGUARD_GC_LEASE_SECONDS``) longer than the grace of the chunk
    sweep the uploader's housekeeping runs: a chunk of an upload stalled for less than the lease
    could be deleted under it. ValueError (one line) saying what to set."""
    from spotguard.checkpoint.store.gc import DEFAULT_ORPHAN_GRACE
    from spotguard.checkpoint.store.intents import lease_seconds

    lease = lease_seconds(environ)
    if lease > DEFAULT_ORPHAN_GRACE:
        raise ValueError(
            f"{env.GC_LEASE_SECONDS.name}={lease:g} is longer than the grace of the uploader's chunk sweep "
            f"({DEFAULT_ORPHAN_GRACE:g}s): a chunk of an upload that stalled for less than the lease could be "
            f"deleted; set {env.GC_LEASE_SECONDS.name} to at most {DEFAULT_ORPHAN_GRACE:g}"
        )


def notice_stops_training_from_args(args: argparse.Namespace) -> bool:
    """Whether a notice's checkpoint stops training: the option, else ``SPOTGUARD_NOTICE_STOPS_TRAINING``.

    Raises ValueError (one line, naming the variable) for a value that is no boolean.
    """
    return env.option_or_env(env.NOTICE_STOPS_TRAINING, args.notice_stops_training)


def notice_sources(args: argparse.Namespace) -> list[Any]:
    from spotguard.sidecar.notices import NoticeSettings, build_sources, parse_sources

    settings = NoticeSettings.from_env()
    settings.sources = parse_sources(args.notices or "")
    settings.aws_endpoint = args.aws_imds_endpoint
    settings.gce_endpoint = args.gce_metadata_endpoint
    settings.azure_endpoint = args.azure_metadata_endpoint
    settings.interval_seconds = args.notice_interval
    return build_sources(settings)


def save_every_seconds() -> float | None:
    # The trainer validates this setting; here it only feeds a metric.
    try:
        value = env.from_env(env.SAVE_EVERY_SECONDS)
    except ValueError:
        return None
    return value or None


def add_uploader_args(p: argparse.ArgumentParser) -> None:
    """The options an uploader takes, ``spotguard sidecar`` or ``spotguard run``: notices, retention, incremental."""
    add_notice_args(p)
    add_retention_args(p)
    add_incremental_arg(p)


@dataclass(frozen=True)
class UploaderArgs:
    """What :func:`add_uploader_args`' options ask for, checked (see :func:`uploader_args`)."""

    retention: Any | None
    keep_local: int
    incremental: bool
    notice_sources: list[Any]
    notice_interval_seconds: float
    notice_stops_training: bool
    #: The trainer's time interval, for a metric only.
    save_every_seconds: float | None


def uploader_args(args: argparse.Namespace) -> UploaderArgs:
    """The uploader's options of ``args``, checked.

    Raises ValueError (one line, naming the option or variable) for an
    inconsistent retention policy, a variable's text that is no boolean, an
    unknown notice source or an upload lease the chunk sweep cannot honour.
    """
    return UploaderArgs(
        retention=retention_from_args(args),
        keep_local=args.keep_local,
        incremental=incremental_from_args(args),
        notice_sources=notice_sources(args),
        notice_interval_seconds=args.notice_interval,
        notice_stops_training=notice_stops_training_from_args(args),
        save_every_seconds=save_every_seconds(),
    )
