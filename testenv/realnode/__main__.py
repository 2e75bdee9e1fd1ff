"""``python -m testenv.realnode run``: real nodes in the foreground until SIGTERM or SIGINT.

    python -m testenv.realnode run --kubeconfig K --client-ca CA --state-dir D --nodes 2 [--registry 127.0.0.1:PORT]

Writes ``D/ready.json`` (``{"nodes": [...]}``) once every node is Ready with its
GPUs; on SIGTERM it stops them and leaves nothing (``RealNodes.stop``). The dev
cluster (``make dev-cluster REAL=1``) runs it as one of its services.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from pathlib import Path

from testenv.realnode.nodes import RealNodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testenv.realnode")
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="start real nodes and keep them until SIGTERM")
    run.add_argument("--kubeconfig", required=True, type=Path)
    run.add_argument("--client-ca", required=True, type=Path, help="the CA of the apiserver's kubelet client cert")
    run.add_argument("--state-dir", required=True, type=Path)
    run.add_argument("--nodes", type=int, default=2)
    run.add_argument("--registry", help="a plain-http registry (127.0.0.1:PORT) the nodes pull from")
    run.add_argument(
        "--host-services-dir", type=Path, help="the host ports pods may reach besides the apiserver's (hostservices)"
    )
    args = parser.parse_args(argv)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    ready = args.state_dir / "ready.json"
    with contextlib.suppress(OSError):
        ready.unlink()
    nodes = RealNodes.start(
        args.kubeconfig,
        args.client_ca,
        args.state_dir,
        count=args.nodes,
        registry=args.registry,
        host_services=args.host_services_dir,
    )
    try:
        ready.write_text(json.dumps({"nodes": nodes.node_names()}))
        print(f"real nodes ready: {', '.join(nodes.node_names())}", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        nodes.stop()
        with contextlib.suppress(OSError):
            ready.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
