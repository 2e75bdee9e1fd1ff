"""``spotguard sidecar``: the in-pod uploader beside the trainer.

Argument parsing only; heavy imports (boto3, torch, kubernetes) happen in
the handler so ``spotguard --help`` stays fast. ``spotguard run`` is
:mod:`spotguard.run.cli`'s; the options both share are in :mod:`spotguard.sidecar.args`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from spotguard.cliutil import command, configure_logging, options_from
from spotguard.contract import env
from spotguard.contract.env import add_option, cli_default
from spotguard.sidecar.args import add_uploader_args, uploader_args

log = logging.getLogger("spotguard.sidecar")

DEFAULT_CHECKPOINT_DIR = "/var/lib/spotguard/checkpoints"
DEFAULT_METRICS_PORT = env.METRICS_PORT.default
# Created by kubelet in every container; absent elsewhere (then no report).
DEFAULT_TERMINATION_LOG = env.TERMINATION_LOG.default


def register(subparsers: Any) -> None:
    """Add ``sidecar`` to the top-level parser."""
    p = command(subparsers, "sidecar", _sidecar)
    add_option(p, env.STORAGE_URI)
    add_option(p, env.CHECKPOINT_DIR, type=Path, fallback=Path(DEFAULT_CHECKPOINT_DIR))
    add_option(p, env.CONTROL_DIR, type=Path, shown="CHECKPOINT_DIR/.control")
    p.add_argument(
        "--trainer-pid-file",
        type=Path,
        default=None,
        help="file holding the trainer's pid (default CONTROL_DIR/trainer.pid)",
    )
    for var in (env.GRACE_SECONDS, env.SAFETY_MARGIN_SECONDS, env.FINISH_SECONDS, env.SIDECAR_MODE, env.METRICS_PORT):
        add_option(p, var)
    for var in (env.METRICS_ADDR, env.PROACTIVE_INTERVAL):
        add_option(p, var)
    add_uploader_args(p)
    add_option(p, env.TERMINATION_LOG, type=Path)
    add_option(p, env.PREEMPTED_EXIT_CODE, type=int)
    p.add_argument("--poll-interval", type=float, default=0.25, help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


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
    """in-pod uploader: ship checkpoints, handle SIGTERM and notices, serve metrics

    Watch the shared checkpoint directory, upload and verify each committed checkpoint, and on SIGTERM or a
    preemption notice get an emergency checkpoint verified in storage before the deadline.
    """
    from spotguard.signalsafe import SignalLatch

    # First thing: kubelet may send SIGTERM while we are still starting up
    # (importing boto3, reaching storage); that is a preemption to handle,
    # not a reason to die without a checkpoint or a report.
    latch = SignalLatch()
    latch.install()

    from spotguard.contract.control import control_dir_from_env
    from spotguard.sidecar.mainloop import SidecarOptions, run_sidecar, write_termination_text
    from spotguard.sidecar.metrics import SidecarMetrics
    from spotguard.sidecar.service import AgentConfig, CheckpointAgent, default_markers
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
        shared = uploader_args(args)
        storage = open_storage(args.storage)
    except (ValueError, StorageError) as exc:
        return fail(str(exc))
    ckdir: Path = args.checkpoint_dir
    control_dir = args.control_dir or control_dir_from_env(ckdir)
    # The checked uploader options, then those of the same names as their flags as parsed (grace_seconds, ...).
    config = options_from(
        AgentConfig,
        shared,
        args,
        checkpoint_dir=ckdir,
        control_dir=control_dir,
        safety_margin_seconds=args.safety_margin,
        poll_seconds=args.poll_interval,
        proactive_interval_seconds=args.proactive_interval or None,
        trainer_markers=default_markers(ckdir),
    )
    metrics = SidecarMetrics(namespace=os.environ.get("POD_NAMESPACE") or "", job=cli_default(env.JOB) or "")
    agent = CheckpointAgent(config, storage, metrics, shared.retention)
    if args.trainer_pid_file is not None:
        agent.channel.pid_file = args.trainer_pid_file
    options = SidecarOptions(
        exit_with_trainer=args.mode == "classic",
        metrics_port=args.metrics_port or None,
        metrics_addr=args.metrics_addr,
        notice_interval_seconds=shared.notice_interval_seconds,
        termination_log=termination_log,
        preempted_exit_code=args.preempted_exit_code,
    )
    try:
        return run_sidecar(agent, options, shared.notice_sources, latch)
    except OSError as exc:
        return fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - any crash is told in the termination log, then raised again
        write_termination_text(termination_log, f"spotguard: internal error: {type(exc).__name__}: {exc}")
        raise
