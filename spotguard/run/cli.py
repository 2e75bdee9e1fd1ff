"""``spotguard run``: supervise a training command on a machine without Kubernetes.

Argument parsing only; heavy imports (boto3, torch) happen in the handler so
``spotguard --help`` stays fast. The supervisor itself is :mod:`spotguard.run.supervisor`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from spotguard.cliutil import command, configure_logging, error, options_from
from spotguard.contract import env
from spotguard.contract.env import add_option
from spotguard.sidecar.args import add_uploader_args, uploader_args


def register(subparsers: Any) -> None:
    """Add ``run`` to the top-level parser."""
    p = command(subparsers, "run", _run, usage="spotguard run [options] -- CMD [ARG ...]")
    add_option(p, env.STORAGE_URI, shown="file://WORKDIR/store")
    p.add_argument(
        "--workdir", type=Path, default=Path(".spotguard"), help="local state: checkpoints, lock (default ./.spotguard)"
    )
    p.add_argument(
        "--checkpoint-dir", type=Path, default=None, help="local checkpoint directory (default WORKDIR/checkpoints)"
    )
    p.add_argument("--max-restarts", type=int, default=3, help="restarts after the command fails (default 3)")
    add_option(p, env.GRACE_SECONDS, help="time allowed for the emergency checkpoint after SIGTERM")
    p.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        help="seconds before the first restart, doubling with each failure that made no progress (default 1)",
    )
    p.add_argument("--backoff-max", type=float, default=60.0, help="longest wait before a restart (default 60)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (default off)")
    p.add_argument("--metrics-addr", default="127.0.0.1")
    add_option(p, env.JOB, fallback="")
    # The environment's value stays a string here: _run checks it (env.option_or_env).
    add_option(
        p,
        env.PASS_CREDENTIALS,
        help="hand the command the cloud credential variables (AWS_ACCESS_KEY_ID, AWS_PROFILE, "
        "AWS_WEB_IDENTITY_TOKEN_FILE, GOOGLE_APPLICATION_CREDENTIALS, AZURE_CLIENT_SECRET, ...) and "
        "SPOTGUARD_STORAGE_URI; by default it gets none of them, as spotguard run restores and uploads for it",
    )
    add_option(p, env.RESTORE_GRANT)
    add_uploader_args(p)
    p.add_argument(
        "--no-memory-staging",
        dest="memory_staging",
        action="store_false",
        help="write a preemption's checkpoint to the checkpoint directory, not to /dev/shm first",
    )
    p.add_argument(
        "--reserve-staging",
        dest="staging_reserve",
        action="store_true",
        help="after each routine checkpoint, set aside in /dev/shm the memory a preemption's checkpoint of "
        "that size takes (faster emergency save; holds that memory between checkpoints)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command")


def _run(args: argparse.Namespace) -> int:
    """supervise a training command without Kubernetes (restore, ship, preempt, restart)

    Run CMD with the Checkpointer's environment: restore the newest verified checkpoint first, upload and
    verify checkpoints as they are written, treat SIGTERM/SIGINT as a preemption (emergency checkpoint,
    upload, verify, exit), restart after a crash. Run the same command again after a preemption to resume.
    """
    from spotguard.run.supervisor import EXIT_USAGE, RunConfig, SetupError, Supervisor, workdir_lock
    from spotguard.sidecar.metrics import RUN_PORT_HINT, SidecarMetrics
    from spotguard.storage import StorageError, open_storage

    configure_logging(args.verbose)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        error("no command: spotguard run [options] -- CMD [ARG ...]")
        return EXIT_USAGE
    if args.staging_reserve and not args.memory_staging:
        error("--reserve-staging sets memory aside in the memory staging: drop --no-memory-staging or it")
        return EXIT_USAGE
    workdir = args.workdir.resolve()
    ckdir = (args.checkpoint_dir or workdir / "checkpoints").resolve()
    storage_uri = args.storage or (workdir / "store").as_uri()
    try:
        shared = uploader_args(args)
        pass_credentials = env.option_or_env(env.PASS_CREDENTIALS, args.pass_credentials)
        restore_grant = env.option_or_env(env.RESTORE_GRANT, args.restore_grant)
    except ValueError as exc:
        error(str(exc))
        return EXIT_USAGE
    # The checked uploader options, then those of the same names as their flags as parsed (max_restarts, job, ...).
    config = options_from(
        RunConfig,
        shared,
        args,
        command=command,
        workdir=workdir,
        storage_uri=storage_uri,
        checkpoint_dir=ckdir,
        backoff_seconds=args.backoff,
        backoff_max_seconds=args.backoff_max,
        metrics_port=args.metrics_port or None,
        pass_credentials=pass_credentials,
        restore_grant=restore_grant,
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
        error(str(exc))
        return EXIT_USAGE
