"""``spotguard operator``: run the TrainingJob controller (and, if asked, the webhook)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any
from urllib.parse import urlsplit

from spotguard.cliutil import options_from
from spotguard.contract import env
from spotguard.contract.env import add_option
from spotguard.notice_relay import POD_PATH


def register(subparsers: Any) -> None:
    """Add the ``operator`` subcommand."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "operator",
        help="run the Kubernetes operator for TrainingJobs",
        description="Run the TrainingJob operator: one pod per attempt with the restore init container and"
        " the checkpoint sidecar, rescheduled after preemptions, with status, Events and metrics.",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeatable); default: all namespaces",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces (the default)")
    add_option(p, env.IMAGE)
    p.add_argument("--image-pull-policy", choices=["Always", "IfNotPresent", "Never"], default=None)
    p.add_argument(
        "--native-sidecar",
        choices=["auto", "on", "off"],
        default="auto",
        help="inject the sidecar as a native sidecar (Kubernetes >= 1.29); auto asks the server",
    )
    p.add_argument("--metrics-port", type=int, default=8080, help="Prometheus metrics port (0: off)")
    p.add_argument("--metrics-address", default="0.0.0.0", help="address the metrics server binds")
    p.add_argument(
        "--liveness",
        default="http://0.0.0.0:8081/healthz",
        metavar="URL",
        help="liveness endpoint URL; readiness is /readyz on the same port ('' disables both)",
    )
    le = p.add_argument_group(
        "leader election (several replicas: the one that holds a coordination.k8s.io Lease acts, the others"
        " stand by; durations as in client-go)"
    )
    le.add_argument(
        "--leader-elect",
        action="store_true",
        help="elect a leader among the replicas; default: run alone (never run two without it)",
    )
    le.add_argument(
        "--leader-elect-resource-name",
        default="spotguard-operator-leader",
        metavar="NAME",
        help="the Lease's name (the chart's <fullname>-leader)",
    )
    le.add_argument(
        "--leader-elect-resource-namespace",
        default=None,
        metavar="NS",
        help="the Lease's namespace; default: the operator's own (env POD_NAMESPACE, else the ServiceAccount's)",
    )
    le.add_argument(
        "--leader-elect-lease-duration",
        type=int,
        default=15,
        metavar="SECONDS",
        help="a standby takes over when the leader has not renewed for this long (default 15)",
    )
    le.add_argument(
        "--leader-elect-renew-deadline",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="the leader exits when it could not renew for this long; shorter than the lease duration (default 10)",
    )
    le.add_argument(
        "--leader-elect-retry-period",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how often the leader renews and standbys look (default 2)",
    )
    # Replaced by --leader-elect: refused with a pointer, not silently ignored.
    p.add_argument("--peering", default=None, help=argparse.SUPPRESS)
    for var in (env.RESYNC_SECONDS, env.CHECKPOINT_POLL_SECONDS):
        add_option(p, var, metavar="SECONDS")
    add_option(
        p,
        env.READ_CHECKPOINTS,
        help="read each job's storage (with its credentials Secret) to report the newest verified checkpoint"
        " in its status; --no-read-checkpoints: never read a Secret or a store",
    )
    add_option(
        p,
        env.HOST_PORT_RANGE,
        metavar="FIRST-LAST",
        help="host ports for jobs with hostNetwork: each gets a pair no other job holds (master port, sidecar"
        " metrics port); keep it outside the cluster's NodePort range",
    )
    add_option(
        p,
        env.STAGING_HOST_PATH_PREFIX,
        metavar="DIR",
        help="the nodes' directory under which a job's spec.checkpoint.staging.hostPath must lie (a local NVMe"
        " mount the platform prepared); unset: every hostPath staging is refused",
    )
    p.add_argument(
        "--notice-url",
        default=None,
        metavar="URL",
        help="where the sidecars of jobs with the k8s notice source ask for their pod's disruption state: this"
        " operator's notice relay (/notices/v1/pod on the --liveness port) through its Service, e.g."
        " http://spotguard.spotguard-system.svc:8081/notices/v1/pod (the chart sets it); without it those"
        " sidecars read their pod from the API themselves, which needs get on pods for the pods' account",
    )
    # Earlier releases bound a ClusterRole per job; the relay needs none. Accepted (and ignored, with a
    # warning) so that an operator started with an older command line still starts.
    p.add_argument("--notice-cluster-role", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--probe-workers",
        type=int,
        default=4,
        help="threads that read storage for job status, apart from those that handle pods (default 4)",
    )
    wh = p.add_argument_group(
        "admission webhooks, served by every replica (sidecar injection for pods labelled spotguard.dev/inject,"
        " TrainingJob updates that would throw progress away refused)"
    )
    wh.add_argument(
        "--webhook",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve the webhooks over HTTPS: /mutate-pods, /validate-trainingjobs",
    )
    wh.add_argument("--webhook-address", default="0.0.0.0", help="address the webhook server binds")
    wh.add_argument("--webhook-port", type=int, default=9443)
    wh.add_argument(
        "--webhook-host", default=None, help="hostname the apiserver uses to reach the webhook (with --webhook-manage)"
    )
    wh.add_argument(
        "--webhook-cert", default=None, metavar="FILE", help="TLS certificate (PEM); read again when it changes"
    )
    wh.add_argument("--webhook-key", default=None, metavar="FILE", help="TLS private key (PEM)")
    wh.add_argument(
        "--webhook-manage",
        default=None,
        metavar="NAME",
        help="create/update the Mutating- and ValidatingWebhookConfiguration NAME itself, with the URL"
        " https://HOST:PORT/... and the certificate file as their CA bundle (else the chart does)",
    )
    wh.add_argument(
        "--webhook-cert-secret",
        default=None,
        metavar="NAME",
        help="keep the serving certificate in this Secret of the operator's namespace: created (a self-signed CA"
        " and a certificate for --webhook-host) at the first start, renewed before it expires, written to"
        " --webhook-cert/--webhook-key for the server (default: files in a new private directory)",
    )
    wh.add_argument(
        "--webhook-configuration",
        default=None,
        metavar="NAME",
        help="with --webhook-cert-secret: keep the caBundle of the Mutating- and ValidatingWebhookConfiguration"
        " NAME (those the chart installs) set to the Secret's CA",
    )
    wh.add_argument(
        "--webhook-cert-days",
        type=float,
        default=365.0,
        metavar="DAYS",
        help="with --webhook-cert-secret: life of the serving certificate (renewed when a third is left; default 365)",
    )
    add_option(
        p,
        env.CHECKPOINT_FULL_READ_SECONDS,
        metavar="SECONDS",
        help="read each job's checkpoints in full at least this often; in between a poll that finds the latest"
        " pointer unchanged costs one conditional request (0: read everything at every poll)",
    )
    add_option(
        p,
        env.ALLOWED_ENDPOINTS,
        metavar="HOST[:PORT],...",
        help="storage endpoints a TrainingJob may name (spec.checkpoint.endpoint, its Secret's AWS_ENDPOINT_URL)"
        " that the operator connects to with the job's credentials; '*' is one DNS label, or alone every"
        " endpoint. The cloud's own (AWS S3, Google Cloud Storage, over HTTPS) and a job that names none are"
        " always allowed; empty: those only",
    )
    add_option(
        p,
        env.CHECKPOINT_READ_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help="how long one read of a job's checkpoints may take; past it the job gets CheckpointsReadable=False"
        " (StoreTooSlow) and other jobs go on",
    )
    add_option(p, env.CHECKPOINT_MAX_OBJECT_BYTES, metavar="BYTES")
    add_option(
        p,
        env.API_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help="how long the operator waits on the apiserver, to connect and for each part of an answer, before"
        " the request fails and is retried: a connection that died without a word (a network fault, an"
        " apiserver restarted behind a load balancer) holds no job's reconcile for longer",
    )
    p.set_defaults(func=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    """Entry point of ``spotguard operator``."""
    if args.webhook and args.webhook_cert_secret:
        problem = cert_secret_problem(args)
        if problem:
            print(f"spotguard operator: {problem}", file=sys.stderr)
            return 2
        if not (args.webhook_cert and args.webhook_key):
            # Written by the operator itself: a private directory of this process.
            directory = tempfile.mkdtemp(prefix="spotguard-webhook-")
            args.webhook_cert, args.webhook_key = f"{directory}/tls.crt", f"{directory}/tls.key"
    elif args.webhook and not (args.webhook_cert and args.webhook_key):
        print(
            "spotguard operator: --webhook needs --webhook-cert and --webhook-key, or --webhook-cert-secret",
            file=sys.stderr,
        )
        return 2
    for path in (args.webhook_cert, args.webhook_key):
        if args.webhook and not args.webhook_cert_secret and path and not os.path.isfile(path):
            print(f"spotguard operator: no such file: {path}", file=sys.stderr)
            return 2
    if args.webhook and args.webhook_manage and not args.webhook_host and args.webhook_address in ("0.0.0.0", "::"):
        print(
            "spotguard operator: --webhook-manage needs --webhook-host, the name or address the apiserver reaches"
            " this webhook server at (the configuration's URL)",
            file=sys.stderr,
        )
        return 2
    if args.peering is not None:
        print("spotguard operator: --peering (kopf peering) was replaced by --leader-elect (a Lease)", file=sys.stderr)
        return 2
    if args.notice_cluster_role is not None:
        print(
            "spotguard operator: warning: --notice-cluster-role is ignored: the operator binds no role any more;"
            " sidecars with the k8s notice source ask the operator (--notice-url)",
            file=sys.stderr,
        )
    problem = notice_url_problem(args.notice_url, args.liveness)
    if problem:
        print(f"spotguard operator: --notice-url: {problem}", file=sys.stderr)
        return 2
    from spotguard.operator.hostports import NODEPORT_RANGE, format_range, overlaps_nodeports, parse_range
    from spotguard.operator.leader import Timing

    timing = Timing(args.leader_elect_lease_duration, args.leader_elect_renew_deadline, args.leader_elect_retry_period)
    if args.leader_elect and timing.problem():
        print(f"spotguard operator: --leader-elect-*: {timing.problem()}", file=sys.stderr)
        return 2

    try:
        read_checkpoints = env.option_or_env(env.READ_CHECKPOINTS, args.read_checkpoints)
    except ValueError as exc:
        print(f"spotguard operator: {exc}", file=sys.stderr)
        return 2
    from spotguard.operator.endpoints import parse_patterns

    try:
        allowed_endpoints = parse_patterns(args.allowed_endpoints or "")
    except ValueError as exc:
        print(f"spotguard operator: --allowed-endpoints: {exc}", file=sys.stderr)
        return 2
    if args.checkpoint_read_timeout_seconds <= 0 or args.checkpoint_max_object_bytes <= 0:
        print(
            "spotguard operator: --checkpoint-read-timeout-seconds and --checkpoint-max-object-bytes must be"
            " more than 0",
            file=sys.stderr,
        )
        return 2
    if not args.api_timeout_seconds > 0:
        print("spotguard operator: --api-timeout-seconds must be more than 0", file=sys.stderr)
        return 2
    try:
        host_port_range = parse_range(args.host_port_range)
    except ValueError as exc:
        print(f"spotguard operator: --host-port-range: {exc}", file=sys.stderr)
        return 2
    from spotguard.operator.staging import parse_host_path_prefix

    try:
        host_path_prefix = parse_host_path_prefix(args.staging_host_path_prefix)
    except ValueError as exc:
        print(f"spotguard operator: --staging-host-path-prefix: {exc}", file=sys.stderr)
        return 2
    if overlaps_nodeports(*host_port_range):
        print(
            f"spotguard operator: warning: --host-port-range {format_range(host_port_range)} overlaps Kubernetes'"
            f" default NodePort range {format_range(NODEPORT_RANGE)}",
            file=sys.stderr,
        )
    problem = preflight()
    if problem:
        print(f"spotguard operator: {problem}", file=sys.stderr)
        return 2
    from prometheus_client import start_http_server

    from spotguard.operator.handlers import Election, OperatorOptions, run
    from spotguard.operator.metrics import OperatorMetrics
    from spotguard.operator.podbuilder import DEFAULT_IMAGE

    metrics = OperatorMetrics()
    if args.metrics_port:
        try:
            start_http_server(args.metrics_port, addr=args.metrics_address, registry=metrics.registry)
        except OSError as exc:
            print(
                f"spotguard operator: cannot serve metrics on {args.metrics_address}:{args.metrics_port}: "
                f"{exc.strerror}",
                file=sys.stderr,
            )
            return 2
    # The options of the same names as their flags come as parsed; these are checked or renamed.
    options = options_from(
        OperatorOptions,
        args,
        namespaces=list(args.namespace),
        image=args.image or DEFAULT_IMAGE,
        read_checkpoints=read_checkpoints,
        probe_workers=max(1, args.probe_workers),
        checkpoint_full_read_seconds=max(0.0, args.checkpoint_full_read_seconds),
        allowed_endpoints=allowed_endpoints,
        host_port_range=host_port_range,
        staging_host_path_prefix=host_path_prefix,
        notice_url=args.notice_url or None,
        webhook_addr=args.webhook_address,
        webhook_cert_namespace=own_namespace(),
        metrics=metrics,
    )
    election = None
    if args.leader_elect:
        namespace = args.leader_elect_resource_namespace or own_namespace()
        election = Election(namespace, args.leader_elect_resource_name, timing)
    run(options, liveness=args.liveness or None, election=election)
    return 0


def cert_secret_problem(args: argparse.Namespace) -> str | None:
    """Pure: why ``--webhook-cert-secret`` cannot work as asked (one line), or None."""
    if not args.webhook_host:
        return (
            "--webhook-cert-secret needs --webhook-host, the name the apiserver reaches the webhook at"
            " (the certificate is made for it), e.g. spotguard.spotguard-system.svc"
        )
    if bool(args.webhook_cert) != bool(args.webhook_key):
        return "--webhook-cert and --webhook-key go together (where the kept certificate and key are written)"
    if not 0 < args.webhook_cert_days <= 3650:
        return (
            f"--webhook-cert-days must be more than 0 and at most 3650 (the CA's life), not {args.webhook_cert_days:g}"
        )
    return None


def notice_url_problem(url: str | None, liveness: str | None) -> str | None:
    """Pure: why ``--notice-url`` cannot work (one line), or None.

    The relay is served with the probes (``--liveness``): without them nothing answers.
    """
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return f"{url!r} is not an http:// URL (the relay is served over plain HTTP, on the probes port)"
    if parts.path != POD_PATH:
        return f"{url!r} must end in {POD_PATH} (the relay's pod path)"
    if not liveness:
        return "the relay is served on the --liveness port, which is off ('')"
    return None


def own_namespace() -> str:
    """The operator's namespace: ``POD_NAMESPACE`` (the chart sets it), else its ServiceAccount's, else default."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def preflight() -> str | None:
    """One line saying why the operator cannot start (no cluster, no CRD), or None."""
    from kubernetes.client import ApisApi
    from kubernetes.config import ConfigException

    from spotguard.operator.handlers import api_clients
    from spotguard.operator.spec import GROUP, PLURAL, VERSION

    try:
        core, _custom = api_clients()
    except (ConfigException, OSError) as exc:
        return f"no Kubernetes configuration (in-cluster ServiceAccount or KUBECONFIG): {exc}"
    try:
        groups = ApisApi(core.api_client).get_api_versions(_request_timeout=30)
    except Exception as exc:  # noqa: BLE001 - any client, network or API error means the cluster is unreachable
        return f"cannot reach the Kubernetes API: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    served = {v.group_version for g in groups.groups or [] for v in g.versions or []}
    if f"{GROUP}/{VERSION}" not in served:
        return (
            f"the {PLURAL}.{GROUP} CRD ({VERSION}) is not installed: "
            "kubectl apply -f crds/trainingjob.yaml (or install the Helm chart)"
        )
    return None
