"""Options that ``spotguard sidecar`` and ``spotguard run`` share: notices, retention, incremental uploads.

Argument parsing only: heavy imports happen inside the functions that need them.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from spotguard.contract import env
from spotguard.contract.env import cli_default


def add_notice_args(p: argparse.ArgumentParser) -> None:
    from spotguard.sidecar import notices as n

    p.add_argument(
        "--notices",
        default=cli_default(env.NOTICES),
        help="early notice sources to poll, comma-separated from aws,gce,azure,k8s "
        "(env SPOTGUARD_NOTICES; default none)",
    )
    p.add_argument("--aws-imds-endpoint", default=cli_default(env.AWS_IMDS_ENDPOINT) or n.AWS_IMDS_ENDPOINT)
    p.add_argument("--gce-metadata-endpoint", default=cli_default(env.GCE_METADATA_ENDPOINT) or n.GCE_METADATA_ENDPOINT)
    p.add_argument(
        "--azure-metadata-endpoint", default=cli_default(env.AZURE_METADATA_ENDPOINT) or n.AZURE_METADATA_ENDPOINT
    )
    p.add_argument(
        "--notice-interval",
        type=float,
        default=cli_default(env.NOTICE_INTERVAL),
        help="seconds between notice polls (default 2)",
    )
    p.add_argument(
        "--notice-stops-training",
        action="store_true",
        default=cli_default(env.NOTICE_STOPS_TRAINING),
        help="stop training after a notice's checkpoint instead of continuing until SIGTERM",
    )


def add_retention_args(p: argparse.ArgumentParser) -> None:
    """Retention options shared by ``sidecar`` and ``run`` (defaults from ``SPOTGUARD_KEEP_*``)."""
    g = p.add_argument_group(
        "retention",
        "which checkpoints stay in storage (a checkpoint is kept "
        "if any rule keeps it; the newest verified one always is; no rule: keep all)",
    )
    g.add_argument(
        "--keep-last", type=int, default=cli_default(env.KEEP_LAST), help="keep the N newest (env SPOTGUARD_KEEP_LAST)"
    )
    g.add_argument(
        "--keep-best",
        type=int,
        default=cli_default(env.KEEP_BEST),
        help="keep the M best by --best-metric (env SPOTGUARD_KEEP_BEST)",
    )
    g.add_argument(
        "--best-metric",
        default=cli_default(env.BEST_METRIC),
        help="metric for --keep-best, as saved with each checkpoint (env SPOTGUARD_BEST_METRIC)",
    )
    g.add_argument(
        "--best-mode",
        choices=("min", "max"),
        default=cli_default(env.BEST_MODE),
        help="whether lower or higher --best-metric is better (env SPOTGUARD_BEST_MODE, default min)",
    )
    g.add_argument(
        "--keep-every",
        type=int,
        default=cli_default(env.KEEP_EVERY),
        help="keep every checkpoint whose step is a multiple of K (env SPOTGUARD_KEEP_EVERY)",
    )
    g.add_argument(
        "--keep-local",
        type=int,
        default=cli_default(env.KEEP_LOCAL),
        help="local checkpoints kept after a newer one is verified in storage (env SPOTGUARD_KEEP_LOCAL, default 1)",
    )


def retention_from_args(args: argparse.Namespace) -> Any | None:
    """The retention policy the options ask for, or None to keep everything.

    Raises ValueError (one line) for an inconsistent policy.
    """
    from spotguard.checkpoint import RetentionPolicy

    policy = RetentionPolicy(
        keep_last=args.keep_last,
        keep_best=args.keep_best,
        metric=args.best_metric or None,
        mode=(args.best_mode or "min").strip().lower(),
        keep_every=args.keep_every,
    )
    return None if policy.keeps_everything else policy


def add_incremental_arg(p: argparse.ArgumentParser) -> None:
    # The environment's value stays a string here: incremental_from_args
    # checks it, for the subcommand being run only.
    p.add_argument(
        "--incremental",
        action=argparse.BooleanOptionalAction,
        default=cli_default(env.INCREMENTAL),
        help="upload only the data storage does not hold yet: checkpoints are stored as "
        "content-addressed chunks shared between checkpoints of the job (env "
        f"{env.INCREMENTAL.name}, default on; --no-incremental uploads whole files)",
    )


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
