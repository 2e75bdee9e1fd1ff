"""``spotguard jobs ls|describe|checkpoints|preempt``: TrainingJobs as the person running them sees them.

Argument parsing, the apiserver and storage calls, and the output; what is
printed is built by the pure :mod:`spotguard.jobs.render`. The cluster is
reached as kubectl reaches it: ``--kubeconfig``, else ``$KUBECONFIG`` or
``~/.kube/config``, else the in-cluster ServiceAccount. Errors a user can cause
(no kubeconfig, no such job, no credentials for the store, an eviction a
PodDisruptionBudget refuses) are one line on stderr and exit status 1; usage
errors exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from spotguard.cliutil import command, depth_flags, error, progress_flag, usage
from spotguard.progress import steps

EXIT_OK = 0
EXIT_FAIL = 1

#: (connect, read) seconds for one apiserver request.
REQUEST_TIMEOUT = (10, 60)
#: How often ``preempt --wait`` looks at the job.
POLL_SECONDS = 0.5
DEFAULT_PREEMPT_TIMEOUT = 600.0
#: ``-o``: kubectl's names (``table`` is kubectl's default, unnamed there).
OUTPUTS = ("table", "json", "yaml")
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def register(subparsers: Any) -> None:
    """Add ``jobs`` and its subcommands to the top-level parser."""
    jobs = subparsers.add_parser(
        "jobs",
        help="list, describe and preempt TrainingJobs, list their checkpoints (kubectl-like)",
        description="Inspect TrainingJobs and drive a preemption drill. The cluster is reached as kubectl "
        "reaches it: --kubeconfig, else $KUBECONFIG or ~/.kube/config, else the in-cluster ServiceAccount.",
    )
    sub = jobs.add_subparsers(dest="jobs_command", metavar="SUBCOMMAND")
    jobs.set_defaults(func=lambda args: usage(jobs))

    p = command(sub, "ls", _guard(cmd_ls))
    _cluster_flags(p)
    p.add_argument("-A", "--all-namespaces", action="store_true", help="list the jobs of every namespace")
    _output_flag(p)

    p = command(sub, "describe", _guard(cmd_describe))
    _job_flags(p)
    _output_flag(p)

    p = command(sub, "checkpoints", _guard(cmd_checkpoints))
    _job_flags(p)
    p.add_argument(
        "--endpoint-url",
        metavar="URL",
        help="S3 endpoint (default: spec.checkpoint.endpoint, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)",
    )
    p.add_argument("--region", metavar="REGION", help="S3 region (default: spec.checkpoint.region, else AWS_REGION)")
    depth_flags(p)
    _output_flag(p)
    progress_flag(p)

    p = command(sub, "preempt", _guard(cmd_preempt))
    _job_flags(p)
    p.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wait until the next attempt runs or the job ends (default: --wait)",
    )
    p.add_argument(
        "--timeout",
        type=_pos_float,
        default=DEFAULT_PREEMPT_TIMEOUT,
        metavar="SECONDS",
        help=f"give up waiting after this long, exit status 1 (default {DEFAULT_PREEMPT_TIMEOUT:g})",
    )
    progress_flag(p)


# -- plumbing --------------------------------------------------------------------


class UserError(Exception):
    """A problem the user can fix; printed as one line."""


def _cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, else the in-cluster ServiceAccount)",
    )
    p.add_argument("--context", metavar="NAME", help="kubeconfig context (default: its current context)")
    p.add_argument("-n", "--namespace", metavar="NS", help='namespace (default: the context\'s, else "default")')


def _job_flags(p: argparse.ArgumentParser) -> None:
    """A command about one job: where the cluster is, and the job's NAME."""
    _cluster_flags(p)
    p.add_argument("name", metavar="NAME")


def _output_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", choices=OUTPUTS, default="table", help="output format (default: table)")


def _pos_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {raw}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0: {raw}")
    return value


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Run a command, turning errors a user can cause into one line and exit 1."""

    def run(args: argparse.Namespace) -> int:
        from spotguard.storage import StorageError

        try:
            return fn(args)
        except UserError as exc:
            error(str(exc))
        except StorageError as exc:
            error(str(exc))
        except KeyboardInterrupt:
            error("interrupted")
            return 130
        except Exception as exc:  # noqa: BLE001 - any client's connection error gets a message; the rest raised again
            message = _connection_error(exc, args)
            if message is None:
                raise
            error(message)
        return EXIT_FAIL

    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


def _connection_error(exc: Exception, args: argparse.Namespace) -> str | None:
    """One line for an apiserver that cannot be reached, or None for an error that is not that."""
    import urllib3.exceptions

    if isinstance(exc, urllib3.exceptions.HTTPError):
        host = getattr(args, "_server", None) or "the Kubernetes API server"
        reason = getattr(exc, "reason", None) or exc
        return f"cannot reach {host}: {reason} (check the kubeconfig's server, or --context)"
    return None


class Progress:
    """Progress lines on stderr: only when it is a TTY, or with ``--progress``."""

    def __init__(self, enabled: bool | None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.start = time.monotonic()

    def line(self, text: str) -> None:
        if self.enabled:
            self.stream.write(f"[{time.monotonic() - self.start:6.1f}s] {text}\n")
            self.stream.flush()


# -- the cluster -------------------------------------------------------------------


@dataclass
class Kube:
    """Clients on one API connection, and the namespace the command works in."""

    api: Any
    core: Any
    custom: Any
    namespace: str
    server: str


def connect(args: argparse.Namespace) -> Kube:
    """Load the kubeconfig (or the in-cluster account) as kubectl does; pick the namespace."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    cfg = client.Configuration()
    explicit = args.kubeconfig
    default_file = Path(os.path.expanduser("~/.kube/config"))
    namespace: str | None = None
    try:
        if explicit or os.environ.get("KUBECONFIG") or default_file.exists():
            path = explicit  # None: $KUBECONFIG (several files merged) or ~/.kube/config
            if explicit and not Path(explicit).is_file():
                raise UserError(f"kubeconfig {explicit} does not exist")
            config.load_kube_config(config_file=path, context=args.context, client_configuration=cfg)
            contexts, active = config.list_kube_config_contexts(config_file=path)
            chosen = next((c for c in contexts if c.get("name") == args.context), None) if args.context else active
            namespace = ((chosen or {}).get("context") or {}).get("namespace")
        else:
            config.load_incluster_config(client_configuration=cfg)
            if _SA_NAMESPACE.is_file():
                namespace = _SA_NAMESPACE.read_text().strip() or None
    except ConfigException as exc:
        if explicit:
            where = f"kubeconfig {explicit}"
        elif os.environ.get("KUBECONFIG"):
            where = f"KUBECONFIG={os.environ['KUBECONFIG']}"
        elif default_file.exists():
            where = f"kubeconfig {default_file}"
        else:
            where = "no kubeconfig ($KUBECONFIG, ~/.kube/config) and not in a pod"
        hint = "pass --kubeconfig FILE or set KUBECONFIG"
        if args.context:
            hint = "choose a context that `kubectl config get-contexts` lists"
        raise UserError(f"no usable Kubernetes configuration ({where}): {str(exc).rstrip('.')}; {hint}") from None
    args._server = cfg.host
    api = client.ApiClient(cfg)
    api.user_agent = f"spotguard-jobs/{_version()}"
    return Kube(
        api, client.CoreV1Api(api), client.CustomObjectsApi(api), args.namespace or namespace or "default", cfg.host
    )


def _version() -> str:
    from spotguard.version import __version__

    return __version__


def _api_message(exc: BaseException) -> str:
    from spotguard.operator.apierrors import api_reason

    return api_reason(exc)


def _unserved(exc: BaseException) -> bool:
    """A 404 that says the API path is not served at all (no such resource type), not that an object is missing."""
    import json

    if getattr(exc, "status", None) != 404:
        return False
    try:
        doc = json.loads(getattr(exc, "body", None) or "")
    except (TypeError, ValueError):
        return True  # "404 page not found": plain text, no Status
    details = doc.get("details") if isinstance(doc, dict) else None
    return not (isinstance(details, dict) and details.get("name"))


@contextmanager
def api_errors(kube: Kube, what: str, *, name: str | None = None) -> Iterator[None]:
    """Turn apiserver refusals into one line that says what to do; ``name`` makes 404 'not found'."""
    from kubernetes.client.exceptions import ApiException

    try:
        yield
    except ApiException as exc:
        status, message = exc.status, _api_message(exc)
        if _unserved(exc):
            raise UserError(
                "the TrainingJob API (trainingjobs.spotguard.dev) is not served by "
                f"{kube.server}: install spotguard's chart (or kubectl apply -f "
                "crds/trainingjob.yaml)"
            ) from None
        if status == 404 and name is not None:
            raise UserError(f"trainingjob {name} not found in namespace {kube.namespace}") from None
        if status == 401:
            raise UserError(
                f"{kube.server} refused the credentials (401 Unauthorized): log in again or check the kubeconfig's user"
            ) from None
        if status == 403:
            raise UserError(
                f"not allowed to {what}: {message} (reading needs the built-in view role in the "
                "namespace, which spotguard's chart extends to TrainingJobs)"
            ) from None
        raise UserError(f"cannot {what} ({status}): {message}") from None


def get_job(kube: Kube, name: str) -> dict[str, Any]:
    from spotguard.operator.spec import GROUP, PLURAL, VERSION

    with api_errors(kube, f"read trainingjob {name} in namespace {kube.namespace}", name=name):
        job: dict[str, Any] = kube.custom.get_namespaced_custom_object(
            GROUP, VERSION, kube.namespace, PLURAL, name, _request_timeout=REQUEST_TIMEOUT
        )
    return job


def _now() -> datetime:
    return datetime.now(UTC)


def _print_output(obj: Any, output: str) -> None:
    from spotguard.jobs.render import dump

    print(dump(obj, output))


# -- ls ------------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    """list TrainingJobs: phase, attempt, preemptions, failures, verified step, placement"""
    from spotguard.jobs import render
    from spotguard.operator.spec import GROUP, PLURAL, VERSION

    kube = connect(args)
    where = "every namespace" if args.all_namespaces else f"namespace {kube.namespace}"
    with api_errors(kube, f"list trainingjobs in {where}"):
        if args.all_namespaces:
            listed = kube.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, _request_timeout=REQUEST_TIMEOUT)
        else:
            listed = kube.custom.list_namespaced_custom_object(
                GROUP, VERSION, kube.namespace, PLURAL, _request_timeout=REQUEST_TIMEOUT
            )
    items = list(listed.get("items") or [])
    if args.output != "table":
        _print_output(render.job_list(items), args.output)
        return EXIT_OK
    if not items:
        print(f"No trainingjobs found in {where}.", file=sys.stderr)
        return EXIT_OK
    print(render.ls_table(items, _now(), all_namespaces=args.all_namespaces))
    return EXIT_OK


# -- describe ---------------------------------------------------------------------------


def _job_events(kube: Kube, name: str) -> list[dict[str, Any]]:
    from spotguard.operator.spec import KIND

    selector = f"involvedObject.kind={KIND},involvedObject.name={name}"
    with api_errors(kube, f"list the Events in namespace {kube.namespace}"):
        listed = kube.core.list_namespaced_event(
            kube.namespace, field_selector=selector, _request_timeout=REQUEST_TIMEOUT
        )
    return [kube.api.sanitize_for_serialization(e) for e in listed.items]


def _job_pods(kube: Kube, name: str) -> list[dict[str, Any]]:
    from spotguard.operator.podbuilder import LABEL_JOB

    with api_errors(kube, f"list the pods in namespace {kube.namespace}"):
        listed = kube.core.list_namespaced_pod(
            kube.namespace, label_selector=f"{LABEL_JOB}={name}", _request_timeout=REQUEST_TIMEOUT
        )
    return [kube.api.sanitize_for_serialization(p) for p in listed.items]


def cmd_describe(args: argparse.Namespace) -> int:
    """a job's phase, conditions, attempts, every preemption and failure with its cause, pods"""
    from spotguard.jobs import render

    kube = connect(args)
    job = get_job(kube, args.name)
    desc = render.describe(job, _job_events(kube, args.name), _job_pods(kube, args.name), _now())
    if args.output != "table":
        _print_output(desc, args.output)
    else:
        print(render.render_describe(desc, _now()))
    return EXIT_OK


# -- checkpoints --------------------------------------------------------------------------


def _open_job_storage(job: Mapping[str, Any], args: argparse.Namespace, kube: Kube) -> tuple[Any, str]:
    """The job's checkpoint root opened with the user's credentials; (storage, what to say when they fail)."""
    from spotguard.jobs.render import job_storage
    from spotguard.storage import open_storage

    uri = job_storage(job)
    if uri is None:
        raise UserError(f"trainingjob {args.name} has no spec.checkpoint.storage")
    ckpt = (job.get("spec") or {}).get("checkpoint") or {}
    options: dict[str, Any] = {}
    if uri.startswith("s3://"):
        endpoint = args.endpoint_url or ckpt.get("endpoint")
        region = args.region or ckpt.get("region")
        if endpoint:
            options["endpoint_url"] = endpoint
        if region:
            options["region"] = region
    secret = ckpt.get("credentialsSecret")
    secret_name = secret.get("name") if isinstance(secret, Mapping) else secret
    hint = f"reading {uri} with your own credentials"
    if secret_name:
        hint += f"; the job's pods use the keys in Secret {secret_name} of namespace {kube.namespace}"
    env_endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if uri.startswith("s3://") and not options.get("endpoint_url") and not env_endpoint:
        hint += "; for a store other than AWS S3 pass --endpoint-url URL"
    return open_storage(uri, **options), hint


def cmd_checkpoints(args: argparse.Namespace) -> int:
    """a job's checkpoints in storage: step, time, size, verified yes/no

    List the checkpoints under the job's storage root (spec.checkpoint.storage/<namespace>/<name>). The store
    is read with your own credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or AWS_PROFILE), at the spec's
    checkpoint.endpoint unless --endpoint-url is given.
    """
    from spotguard.checkpoint import list_checkpoint_names, read_latest_pointer, verify_checkpoint
    from spotguard.jobs import render
    from spotguard.storage import CredentialsError, NotFoundError

    kube = connect(args)
    job = get_job(kube, args.name)
    storage, hint = _open_job_storage(job, args, kube)
    progress = Progress(args.progress)
    rows: list[dict[str, Any]] = []
    try:
        storage.check()
        names = list_checkpoint_names(storage)
        pointer = read_latest_pointer(storage)
        for name in steps(names, "verifying", progress.enabled, progress.stream):
            result = verify_checkpoint(storage, name, checksums=not args.quick, deep=args.deep)
            m = result.manifest
            step = int(name.split("-")[1])
            rows.append(
                {
                    "step": step,
                    "name": name,
                    "uri": storage.uri_for(name),
                    "created": m.created if m else None,
                    "size": m.total_size if m else None,
                    "verified": result.ok,
                    "method": result.method,
                    "problems": list(result.problems),
                    "latest": pointer == step,
                }
            )
    except CredentialsError as exc:
        raise UserError(f"{exc} ({hint})") from None
    except NotFoundError as exc:
        raise UserError(f"{exc} (the storage of trainingjob {args.name}: {storage.uri})") from None
    if args.output != "table":
        _print_output(
            {"trainingjob": args.name, "namespace": kube.namespace, "uri": storage.uri, "checkpoints": rows},
            args.output,
        )
        return EXIT_OK
    if not rows:
        print(f"no checkpoints of trainingjob {args.name} yet at {storage.uri}")
        return EXIT_OK
    print(render.checkpoints_table(rows, _now(), quick=args.quick))
    if any(r["latest"] for r in rows):
        print("(* the step the latest pointer names)")
    return EXIT_OK


# -- preempt ------------------------------------------------------------------------------


def target_pod(name: str, status: Mapping[str, Any]) -> tuple[int, str]:
    """The attempt to preempt and its pod: rank 0's for a gang, else ``status.currentPod``."""
    from spotguard.operator.jobstatus import member_pod_name, pod_name

    attempt = status.get("attempt")
    if not isinstance(attempt, int) or attempt < 1:
        raise UserError(
            f"trainingjob {name} has no pod yet (phase {status.get('phase') or 'Pending'}): "
            "preempt it once its first attempt's pod exists"
        )
    nodes = status.get("nodes")
    if isinstance(nodes, int) and nodes > 1:
        return attempt, member_pod_name(name, attempt, 0, nodes)
    current = status.get("currentPod")
    return attempt, current if isinstance(current, str) and current else pod_name(name, attempt)


def evict(kube: Kube, pod: str) -> str:
    """Evict ``pod`` as ``kubectl drain`` does; returns what was done ("evicted" or "deleted").

    ``policy/v1`` first; a server older than 1.22 refuses that version and
    gets ``policy/v1beta1``. A server with no Eviction API at all gets a
    graceful delete (no PodDisruptionBudget is consulted then; said on stderr).
    """
    from kubernetes.client.exceptions import ApiException

    refused: list[str] = []
    for version in ("policy/v1", "policy/v1beta1"):
        body = {"apiVersion": version, "kind": "Eviction", "metadata": {"name": pod, "namespace": kube.namespace}}
        try:
            kube.core.create_namespaced_pod_eviction(pod, kube.namespace, body, _request_timeout=REQUEST_TIMEOUT)
            return "evicted"
        except ApiException as exc:
            message = _api_message(exc).rstrip(".")
            if exc.status == 429:
                raise UserError(
                    f"the eviction of pod {pod} was refused: {message}. A PodDisruptionBudget allows no disruption "
                    f"now: see `kubectl get pdb -n {kube.namespace}`; retry when more of its pods are ready, or "
                    "relax the budget for the drill"
                ) from None
            if exc.status == 404 and not _unserved(exc):
                raise UserError(
                    f"pod {pod} not found in namespace {kube.namespace}: the attempt ended meanwhile? "
                    f"see `spotguard jobs describe` for the job"
                ) from None
            if exc.status == 403:
                raise UserError(
                    f"not allowed to evict pod {pod}: {message} (needs create on pods/eviction, as the "
                    "built-in edit role has)"
                ) from None
            unserved = exc.status == 400 and ("no kind" in message or "registered for version" in message)
            if unserved or exc.status in (404, 405):
                refused.append(f"{version}: {message}")
                continue
            raise UserError(f"cannot evict pod {pod} ({exc.status}): {message}") from None
    print(
        f"spotguard: the apiserver offers no Eviction API ({'; '.join(refused)}): deleting pod {pod} gracefully "
        "instead (no PodDisruptionBudget is consulted)",
        file=sys.stderr,
    )
    with api_errors(kube, f"delete pod {pod}"):
        kube.core.delete_namespaced_pod(pod, kube.namespace, _request_timeout=REQUEST_TIMEOUT)
    return "deleted"


def cmd_preempt(args: argparse.Namespace) -> int:
    """preemption drill: evict the current attempt's pod and watch the job resume

    Evict the current attempt's pod (rank 0's for a job of several nodes) through the Eviction API, as
    `kubectl drain` does, so the trainer gets its emergency checkpoint and the operator starts the next
    attempt; then wait until that attempt runs (or the job ends).
    """
    from spotguard.operator.jobstatus import SUSPENDED, TERMINAL_PHASES

    kube = connect(args)
    job = get_job(kube, args.name)
    st = job.get("status") or {}
    phase = st.get("phase")
    if phase in TERMINAL_PHASES:
        raise UserError(f"trainingjob {args.name} has ended ({phase}): nothing to preempt")
    if phase == SUSPENDED:
        raise UserError(f"trainingjob {args.name} is suspended: no pod runs (set spec.suspend to false first)")
    attempt, pod = target_pod(args.name, st)
    last = st.get("lastPodEnd") or {}
    if last.get("attempt") == attempt:
        raise UserError(
            f"attempt {attempt} of trainingjob {args.name} has ended already ({last.get('kind')}: "
            f"{last.get('reason')}); the next one starts {st.get('restartAt') or 'soon'}: "
            "preempt that one once it exists"
        )
    progress = Progress(args.progress)
    done = evict(kube, pod)
    print(f"{done} pod {pod} (attempt {attempt} of trainingjob {args.name})", flush=True)
    if not args.wait:
        return EXIT_OK
    return follow(kube, args.name, attempt, pod, args.timeout, progress)


@dataclass
class _Seen:
    """What ``follow`` has reported already (each step once)."""

    stopping: bool = False
    gone: bool = False
    ended: bool = False
    created: int = 0
    waiting: str = ""


def follow(kube: Kube, name: str, attempt: int, pod: str, timeout: float, progress: Progress) -> int:
    """Report the preempted attempt's end, the next attempt's creation, and its pods running.

    Exit 0 when an attempt after ``attempt`` runs, or the job succeeded or was
    suspended; 1 when it failed, or ``timeout`` passed first.
    """
    from kubernetes.client.exceptions import ApiException

    from spotguard.operator.jobstatus import FAILED, RUNNING, SUCCEEDED, SUSPENDED, attempt_pods

    deadline = time.monotonic() + timeout
    seen = _Seen()
    st: dict[str, Any] = {}
    while True:
        st = dict(get_job(kube, name).get("status") or {})
        if not seen.gone:
            try:
                p = kube.core.read_namespaced_pod(pod, kube.namespace, _request_timeout=REQUEST_TIMEOUT)
                if p.metadata.deletion_timestamp is not None and not seen.stopping:
                    seen.stopping = True
                    grace = p.metadata.deletion_grace_period_seconds
                    progress.line(
                        f"pod {pod} is stopping"
                        + (f" (grace period {grace}s: the trainer saves an emergency checkpoint)" if grace else "")
                    )
            except ApiException as exc:
                if exc.status != 404:
                    raise
                seen.gone = True
                progress.line(f"pod {pod} is gone")
        last = st.get("lastPodEnd") or {}
        raw = st.get("attempt")
        current = raw if isinstance(raw, int) else attempt
        if not seen.ended and (last.get("attempt") == attempt or current > attempt):
            seen.ended = True
            if last.get("attempt") == attempt:
                cause = f": {last['message']}" if last.get("message") else ""
                counts = f"; preemptions {st.get('preemptions', 0)}, failures {st.get('failures', 0)}"
                progress.line(f"attempt {attempt} ended: {last.get('kind')} ({last.get('reason')}){cause}{counts}")
            else:
                progress.line(f"attempt {attempt} ended")
        if current > attempt and seen.created != current:
            seen.created = current
            pods = attempt_pods(name, current, st["nodes"] if isinstance(st.get("nodes"), int) else 1)
            progress.line(f"attempt {current} created ({'pod' if len(pods) == 1 else 'pods'} {', '.join(pods)})")
        phase = st.get("phase")
        if current > attempt and phase == RUNNING:
            progress.line(f"attempt {current} running")
            print(
                f"trainingjob {name}: attempt {current} is running (pod {st.get('currentPod')}); "
                f"preemptions {st.get('preemptions', 0)}, failures {st.get('failures', 0)}"
            )
            return EXIT_OK
        if phase == SUCCEEDED:
            print(f"trainingjob {name} succeeded (attempt {current})")
            return EXIT_OK
        if phase == SUSPENDED and seen.ended:
            print(f"trainingjob {name} is suspended: no next attempt starts until spec.suspend is false")
            return EXIT_OK
        if phase == FAILED:
            failed: dict[str, Any] = next((c for c in st.get("conditions") or [] if c.get("type") == "Failed"), {})
            raise UserError(f"trainingjob {name} failed: {failed.get('reason')}: {failed.get('message')}")
        if seen.ended and st.get("restartAt") and seen.waiting != st["restartAt"]:
            seen.waiting = str(st["restartAt"])
            progress.line(f"the next attempt starts at {st['restartAt']} (backoff)")
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_SECONDS)
    now = st.get("attempt")
    state = (
        f"attempt {now} is {st.get('phase')}"
        if now != attempt
        else f"attempt {attempt} has not ended yet (phase {st.get('phase')})"
    )
    running: dict[str, Any] = next((c for c in st.get("conditions") or [] if c.get("type") == "Running"), {})
    detail = f": {running.get('message')}" if running.get("message") and now != attempt else ""
    raise UserError(
        f"timed out after {timeout:g}s waiting for trainingjob {name} to run its next attempt: {state}{detail}"
    )
