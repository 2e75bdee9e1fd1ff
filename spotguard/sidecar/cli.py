"""``spotguard sidecar`` and ``spotguard run``.

Argument parsing only; heavy imports (boto3, torch, kubernetes) happen in
the handlers so ``spotguard --help`` stays fast. ``spotguard demo`` is
:mod:`spotguard.demo.cli`'s: the demo sits above the sidecar.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from spotguard.contract import env
from spotguard.contract.env import cli_default

log = logging.getLogger("spotguard.sidecar")

DEFAULT_CHECKPOINT_DIR = "/var/lib/spotguard/checkpoints"
DEFAULT_METRICS_PORT = env.METRICS_PORT.default
# Created by kubelet in every container; absent elsewhere (then no report).
DEFAULT_TERMINATION_LOG = env.TERMINATION_LOG.default


def register(subparsers: Any) -> None:
    """Add ``sidecar`` and ``run`` to the top-level parser."""
    _register_sidecar(subparsers)
    _register_run(subparsers)


# -- sidecar ------------------------------------------------------------------


def _register_sidecar(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sidecar",
        help="in-pod uploader: ship checkpoints, handle SIGTERM and notices, serve metrics",
        description="Watch the shared checkpoint directory, upload and verify each committed "
        "checkpoint, and on SIGTERM or a preemption notice get an emergency checkpoint "
        "verified in storage before the deadline.",
    )
    p.add_argument(
        "--storage",
        default=cli_default(env.STORAGE_URI),
        help="job's checkpoint root, s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or file:///PATH "
        "(env SPOTGUARD_STORAGE_URI)",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path(cli_default(env.CHECKPOINT_DIR) or DEFAULT_CHECKPOINT_DIR),
        help=f"shared local checkpoint directory (env SPOTGUARD_CHECKPOINT_DIR, default {DEFAULT_CHECKPOINT_DIR})",
    )
    p.add_argument(
        "--control-dir",
        type=Path,
        default=None,
        help="control channel directory (env SPOTGUARD_CONTROL_DIR, default CHECKPOINT_DIR/.control)",
    )
    p.add_argument(
        "--trainer-pid-file",
        type=Path,
        default=None,
        help="file holding the trainer's pid (default CONTROL_DIR/trainer.pid)",
    )
    p.add_argument(
        "--grace-seconds",
        type=float,
        default=cli_default(env.GRACE_SECONDS),
        help="time between SIGTERM and the kill (env SPOTGUARD_GRACE_SECONDS, default 30)",
    )
    p.add_argument(
        "--safety-margin",
        type=float,
        default=cli_default(env.SAFETY_MARGIN_SECONDS),
        help="seconds kept free at the end of the grace period (default 5)",
    )
    p.add_argument(
        "--finish-seconds",
        type=float,
        default=cli_default(env.FINISH_SECONDS),
        help="after the trainer exits on its own, how long its last checkpoint may take "
        "to be verified, other nodes' parts included (env SPOTGUARD_FINISH_SECONDS, "
        "default 600)",
    )
    p.add_argument(
        "--mode",
        choices=("classic", "native"),
        default=cli_default(env.SIDECAR_MODE),
        help="classic: exit once the trainer has exited and everything is shipped; "
        "native (Kubernetes native sidecar): run until SIGTERM",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=cli_default(env.METRICS_PORT),
        help=f"Prometheus metrics port, 0 to disable (default {DEFAULT_METRICS_PORT})",
    )
    p.add_argument(
        "--metrics-addr", default=cli_default(env.METRICS_ADDR), help="address to serve metrics on (default 0.0.0.0)"
    )
    _add_notice_args(p)
    p.add_argument(
        "--proactive-interval",
        type=float,
        default=cli_default(env.PROACTIVE_INTERVAL),
        help="when the emergency checkpoint would not fit the grace period, request "
        "a checkpoint every this many seconds (0: never, the default)",
    )
    _add_retention_args(p)
    _add_incremental_arg(p)
    p.add_argument(
        "--termination-log",
        type=Path,
        default=cli_default(env.TERMINATION_LOG),
        help=f"write a JSON report here on exit, for the operator (default {DEFAULT_TERMINATION_LOG} when it exists)",
    )
    p.add_argument("--poll-interval", type=float, default=0.25, help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=_sidecar)


def _add_notice_args(p: argparse.ArgumentParser) -> None:
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


def _add_retention_args(p: argparse.ArgumentParser) -> None:
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


def _add_incremental_arg(p: argparse.ArgumentParser) -> None:
    # The environment's value stays a string here: incremental_from_args
    # checks it, for the subcommand being run only.
    p.add_argument(
        "--incremental",
        action=argparse.BooleanOptionalAction,
        default=cli_default(env.INCREMENTAL),
        help="upload only the data storage does not hold yet: checkpoints are stored as "
        "content-addressed chunks shared between checkpoints of the job (env "
        f"{env.INCREMENTAL.name}, default off)",
    )


def incremental_from_args(args: argparse.Namespace) -> bool:
    """Whether uploads are incremental: the option, else ``SPOTGUARD_INCREMENTAL``, else off.

    Raises ValueError (one line, naming the variable) for a value that is no boolean.
    """
    return env.option_or_env(env.INCREMENTAL, args.incremental)


def notice_stops_training_from_args(args: argparse.Namespace) -> bool:
    """Whether a notice's checkpoint stops training: the option, else ``SPOTGUARD_NOTICE_STOPS_TRAINING``.

    Raises ValueError (one line, naming the variable) for a value that is no boolean.
    """
    return env.option_or_env(env.NOTICE_STOPS_TRAINING, args.notice_stops_training)


def _notice_sources(args: argparse.Namespace) -> list[Any]:
    from spotguard.sidecar.notices import NoticeSettings, build_sources, parse_sources

    settings = NoticeSettings.from_env()
    settings.sources = parse_sources(args.notices or "")
    settings.aws_endpoint = args.aws_imds_endpoint
    settings.gce_endpoint = args.gce_metadata_endpoint
    settings.azure_endpoint = args.azure_metadata_endpoint
    settings.interval_seconds = args.notice_interval
    return build_sources(settings)


def _save_every_seconds() -> float | None:
    # The trainer validates this setting; here it only feeds a metric.
    try:
        value = env.from_env(env.SAVE_EVERY_SECONDS)
    except ValueError:
        return None
    return value or None


def _termination_log(path: Path) -> Path | None:
    # The default only applies where kubelet created the file; an explicit
    # other path is created.
    if str(path) == DEFAULT_TERMINATION_LOG and not path.exists():
        return None
    return path


def _fail(message: str) -> int:
    print(f"spotguard: error: {message}", file=sys.stderr)
    return 2


def _sidecar(args: argparse.Namespace) -> int:
    from spotguard.sidecar.service import SignalLatch

    # First thing: kubelet may send SIGTERM while we are still starting up
    # (importing boto3, reaching storage); that is a preemption to handle,
    # not a reason to die without a checkpoint or a report.
    latch = SignalLatch()
    latch.install()

    from spotguard.contract.control import control_dir_from_env
    from spotguard.sidecar.mainloop import SidecarOptions, run_sidecar, write_termination_text
    from spotguard.sidecar.metrics import SidecarMetrics
    from spotguard.sidecar.service import AgentConfig, CheckpointAgent, default_markers
    from spotguard.sidecar.supervisor import configure_logging
    from spotguard.storage import StorageError, open_storage

    configure_logging(args.verbose)
    termination_log = _termination_log(args.termination_log)

    def fail(message: str) -> int:
        # Also where kubectl and the operator read it: the pod's failure names it.
        write_termination_text(termination_log, f"spotguard: error: {message}")
        return _fail(message)

    if not args.storage:
        return fail(f"no storage: pass --storage URI or set {env.STORAGE_URI.name}")
    try:
        sources = _notice_sources(args)
        storage = open_storage(args.storage)
        retention = retention_from_args(args)
        incremental = incremental_from_args(args)
        notice_stops_training = notice_stops_training_from_args(args)
    except (ValueError, StorageError) as exc:
        return fail(str(exc))
    ckdir: Path = args.checkpoint_dir
    control_dir = args.control_dir or control_dir_from_env(ckdir)
    config = AgentConfig(
        checkpoint_dir=ckdir,
        control_dir=control_dir,
        grace_seconds=args.grace_seconds,
        safety_margin_seconds=args.safety_margin,
        finish_seconds=args.finish_seconds,
        poll_seconds=args.poll_interval,
        keep_local=args.keep_local,
        proactive_interval_seconds=args.proactive_interval or None,
        notice_stops_training=notice_stops_training,
        trainer_markers=default_markers(ckdir),
        save_every_seconds=_save_every_seconds(),
        incremental=incremental,
    )
    metrics = SidecarMetrics(namespace=os.environ.get("POD_NAMESPACE") or "", job=cli_default(env.JOB) or "" or "")
    agent = CheckpointAgent(config, storage, metrics, retention)
    if args.trainer_pid_file is not None:
        agent.channel.pid_file = args.trainer_pid_file
    options = SidecarOptions(
        exit_with_trainer=args.mode == "classic",
        metrics_port=args.metrics_port or None,
        metrics_addr=args.metrics_addr,
        notice_interval_seconds=args.notice_interval,
        termination_log=termination_log,
    )
    try:
        return run_sidecar(agent, options, sources, latch)
    except OSError as exc:
        return fail(str(exc))
    except Exception as exc:
        write_termination_text(termination_log, f"spotguard: internal error: {type(exc).__name__}: {exc}")
        raise


# -- run ----------------------------------------------------------------------


def _register_run(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="supervise a training command without Kubernetes (restore, ship, preempt, restart)",
        description="Run CMD with the Checkpointer's environment: restore the newest verified "
        "checkpoint first, upload and verify checkpoints as they are written, treat "
        "SIGTERM/SIGINT as a preemption (emergency checkpoint, upload, verify, exit), restart "
        "after a crash. Run the same command again after a preemption to resume.",
        usage="spotguard run [options] -- CMD [ARG ...]",
    )
    p.add_argument(
        "--storage",
        default=cli_default(env.STORAGE_URI),
        help="checkpoint root, s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or file:///PATH (default file://WORKDIR/store)",
    )
    p.add_argument(
        "--workdir", type=Path, default=Path(".spotguard"), help="local state: checkpoints, lock (default ./.spotguard)"
    )
    p.add_argument(
        "--checkpoint-dir", type=Path, default=None, help="local checkpoint directory (default WORKDIR/checkpoints)"
    )
    p.add_argument("--max-restarts", type=int, default=3, help="restarts after the command fails (default 3)")
    p.add_argument(
        "--grace-seconds",
        type=float,
        default=cli_default(env.GRACE_SECONDS),
        help="time allowed for the emergency checkpoint after SIGTERM (default 30)",
    )
    p.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        help="seconds before the first restart, doubling with each failure that made no progress (default 1)",
    )
    p.add_argument("--backoff-max", type=float, default=60.0, help="longest wait before a restart (default 60)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (default off)")
    p.add_argument("--metrics-addr", default="127.0.0.1")
    p.add_argument("--job", default=cli_default(env.JOB) or "", help="job name for metrics/logs")
    p.add_argument(
        "--pass-credentials",
        action="store_true",
        help="hand the command the storage credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_SESSION_TOKEN, ...) and SPOTGUARD_STORAGE_URI; by default it gets neither, as "
        "spotguard run restores and uploads for it",
    )
    _add_notice_args(p)
    _add_retention_args(p)
    _add_incremental_arg(p)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from spotguard.sidecar.metrics import RUN_PORT_HINT, SidecarMetrics
    from spotguard.sidecar.supervisor import (
        EXIT_USAGE,
        RunConfig,
        SetupError,
        Supervisor,
        configure_logging,
        workdir_lock,
    )
    from spotguard.storage import StorageError, open_storage

    configure_logging(args.verbose)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        _fail("no command: spotguard run [options] -- CMD [ARG ...]")
        return EXIT_USAGE
    workdir = args.workdir.resolve()
    ckdir = (args.checkpoint_dir or workdir / "checkpoints").resolve()
    storage_uri = args.storage or (workdir / "store").as_uri()
    try:
        retention = retention_from_args(args)
        incremental = incremental_from_args(args)
        notice_stops_training = notice_stops_training_from_args(args)
        sources = _notice_sources(args)
    except ValueError as exc:
        _fail(str(exc))
        return EXIT_USAGE
    config = RunConfig(
        command=command,
        workdir=workdir,
        storage_uri=storage_uri,
        checkpoint_dir=ckdir,
        max_restarts=args.max_restarts,
        grace_seconds=args.grace_seconds,
        backoff_seconds=args.backoff,
        backoff_max_seconds=args.backoff_max,
        metrics_port=args.metrics_port or None,
        metrics_addr=args.metrics_addr,
        job=args.job,
        save_every_seconds=_save_every_seconds(),
        keep_local=args.keep_local,
        retention=retention,
        notice_sources=sources,
        notice_interval_seconds=args.notice_interval,
        notice_stops_training=notice_stops_training,
        incremental=incremental,
        pass_credentials=args.pass_credentials,
    )
    try:
        with workdir_lock(workdir):
            storage = open_storage(storage_uri)
            metrics = SidecarMetrics(namespace="", job=args.job, component="run")
            if config.metrics_port:
                # A busy port is a warning: the run goes on without metrics.
                metrics.serve_or_warn(config.metrics_port, config.metrics_addr, RUN_PORT_HINT)
            return Supervisor(config, storage, metrics).run()
    except (SetupError, StorageError) as exc:
        _fail(str(exc))
        return EXIT_USAGE
