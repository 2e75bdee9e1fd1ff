"""``python -m testenv.processnode run|preempt|nodes``."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path

from testenv.processnode.agent import Agent
from testenv.processnode.api import ApiError, Kube
from testenv.processnode.common import MODES, PreemptError, log
from testenv.processnode.control import ProcessNodes
from testenv.processnode.node import NodeSettings

DESCRIPTION = "Process node: a test-support stand-in for kubelet."


def _run(args: argparse.Namespace) -> int:
    labels = {}
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"processnode: --label {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        labels[key] = value
    settings = NodeSettings(
        prefix=args.name_prefix,
        cpu=args.cpu,
        memory=args.memory,
        pods=args.pods,
        gpus=args.gpus,
        instance_type=args.instance_type,
        taint=args.taint,
        labels=labels,
    )
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        kube = Kube(args.kubeconfig)
    except Exception as exc:  # noqa: BLE001 - a user error: one line
        print(f"processnode: cannot load kubeconfig {args.kubeconfig}: {exc}", file=sys.stderr)
        return 2
    agent = Agent(
        kube,
        Path(args.state_dir).resolve(),
        args.nodes,
        settings,
        args.shutdown_grace_period,
        delete_nodes=not args.keep_nodes,
        client_ca=args.client_ca_file,
        host_ports=args.host_service,
        host_services=args.host_services_dir and args.host_services_dir.resolve(),
        writable_host_paths=[p.resolve() for p in args.writable_host_path],
    )
    try:
        agent.start()
        while not stop.wait(1.0):
            pass
    except ApiError as exc:
        print(f"processnode: apiserver refused: {exc}", file=sys.stderr)
        return 1
    finally:
        log.info("stopping")
        agent.stop()
    return 0


def _preempt(args: argparse.Namespace) -> int:
    try:
        result = ProcessNodes(args.state_dir).preempt(
            args.pod, args.namespace, args.mode, args.grace_period, not args.no_wait
        )
    except (PreemptError, RuntimeError) as exc:
        print(f"processnode: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


def _nodes(args: argparse.Namespace) -> int:
    try:
        print("\n".join(ProcessNodes(args.state_dir).node_names()))
    except RuntimeError as exc:
        print(f"processnode: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testenv.processnode", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="register nodes and run their pods until SIGTERM/SIGINT")
    run.add_argument("--kubeconfig", required=True)
    run.add_argument("--state-dir", required=True, help="logs, volumes and control.json go here")
    run.add_argument("--nodes", type=int, default=2)
    run.add_argument("--name-prefix", default="spot-gpu")
    run.add_argument("--cpu", default="16")
    run.add_argument("--memory", default="64Gi")
    run.add_argument("--pods", default="110")
    run.add_argument("--gpus", type=int, default=1, help="nvidia.com/gpu per node")
    run.add_argument("--instance-type", default="g5.4xlarge")
    run.add_argument("--taint", action="store_true", help="taint nodes spotguard.dev/spot=true:NoSchedule")
    run.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="extra node label")
    run.add_argument("--shutdown-grace-period", type=int, default=30, help="seconds, for --mode shutdown")
    run.add_argument("--keep-nodes", action="store_true", help="leave the Node objects when stopping")
    run.add_argument(
        "--client-ca-file", type=Path, default=None, help="serve logs only to clients with a certificate from this CA"
    )
    run.add_argument(
        "--host-service",
        type=int,
        action="append",
        default=[],
        metavar="PORT",
        help="a host port (127.0.0.1) that pods may reach besides the apiserver's; repeatable",
    )
    run.add_argument(
        "--host-services-dir",
        type=Path,
        default=None,
        help="pods may also reach the host ports registered here, one file per port (default: STATE_DIR/host-services)",
    )
    run.add_argument(
        "--writable-host-path",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="a host directory bound at its own path into every container with a read-only root, so that neither"
        " the root nor a volume above it (an emptyDir at /tmp) hides it: the test world's files, such as a"
        " file:// store; repeatable",
    )
    run.set_defaults(func=_run)

    pre = sub.add_parser("preempt", help="make the node running a pod die (drain, shutdown, kill)")
    pre.add_argument("--state-dir", required=True)
    pre.add_argument("--pod", required=True)
    pre.add_argument("--namespace", default="default")
    pre.add_argument("--mode", choices=MODES, required=True)
    pre.add_argument("--grace-period", type=int, default=None, help="shutdown grace period override (s)")
    pre.add_argument("--no-wait", action="store_true", help="return once the preemption has started")
    pre.set_defaults(func=_preempt)

    nodes = sub.add_parser("nodes", help="list the agent's live nodes")
    nodes.add_argument("--state-dir", required=True)
    nodes.set_defaults(func=_nodes)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s: %(message)s")
    return int(args.func(args))
