"""kopf wiring: settings, the per-job daemon, watches on pods and nodes; the process around it.

Handlers stay thin: they only wake the job's daemon, which runs
``reconcile`` (observe -> decide -> apply -> report) in a worker thread. Each
TrainingJob has exactly one daemon in a running operator, so a job's decisions
are never made concurrently.

With several replicas (``--leader-elect``) only the one that holds the Lease
runs kopf at all; the others stand by (``spotguard.operator.leader``). kopf
itself always runs standalone: no kopf peering.

Every replica, leader or standby, serves the admission webhooks
(``spotguard.operator.admission``), and its probes (``spotguard.operator.probes``)
with the notice relay (``spotguard.operator.notices``) on their port, from start
to exit, each in a thread of its own: none is leader-elected, and none uses
kopf (whose webhook server and liveness endpoint live and die with kopf, that
is, with the leadership). With ``--webhook-cert-secret`` every replica also
keeps the webhooks' certificate (``spotguard.operator.webhookcert``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf

from spotguard.contract import env
from spotguard.operator import kubeapi
from spotguard.operator import reconcile as rc
from spotguard.operator.admission import AdmissionServer, manage_configurations
from spotguard.operator.apierrors import api_reason
from spotguard.operator.hostports import DEFAULT_RANGE as DEFAULT_HOST_PORT_RANGE
from spotguard.operator.jobstatus import TERMINAL_PHASES
from spotguard.operator.leader import LeaderElector, StandbyLiveness, Timing, fence_requests, new_identity
from spotguard.operator.metrics import OperatorMetrics
from spotguard.operator.notices import NoticeRelay
from spotguard.operator.podbuilder import (
    DEFAULT_IMAGE,
    LABEL_JOB,
    OperatorConfig,
    server_supports_native_sidecars,
)
from spotguard.operator.probe import MAX_OBJECT_BYTES, READ_TIMEOUT_SECONDS, CheckpointProbe
from spotguard.operator.probes import Health, ProbeServer
from spotguard.operator.spec import GROUP, PLURAL, VERSION
from spotguard.operator.webhookcert import CertificateKeeper, host_names
from spotguard.signalsafe import SignalEvent
from spotguard.version import __version__

log = logging.getLogger("spotguard.operator")

FINALIZER = "spotguard.dev/finalizer"
ANNOTATION_PREFIX = "spotguard.dev"
#: Seconds the operator's requests wait on the apiserver by default (``--api-timeout-seconds``).
API_TIMEOUT_SECONDS: float = env.API_TIMEOUT_SECONDS.default


@dataclass
class OperatorOptions:
    """What ``spotguard operator`` was asked to do (from the command line)."""

    namespaces: list[str] = field(default_factory=list)  # empty: all namespaces
    image: str = DEFAULT_IMAGE
    image_pull_policy: str | None = None
    native_sidecar: str = "auto"  # auto | on | off
    resync_seconds: float = 30.0
    checkpoint_poll_seconds: float = 30.0
    #: Read storage (and credentials Secrets) to report each job's newest verified checkpoint.
    read_checkpoints: bool = True
    #: Threads of the storage probe's own pool (reads that hang on a dead store wait here).
    probe_workers: int = 4
    #: How often the probe reads a job's checkpoints in full although its ``latest`` pointer is unchanged (0: always).
    checkpoint_full_read_seconds: float = 1800.0
    #: Endpoints (HOST[:PORT] patterns) a job's store may be at besides the cloud's own; see ``endpoints.py``.
    allowed_endpoints: tuple[str, ...] = ()
    #: How long a request waits on the apiserver, to connect and for each part of the answer.
    api_timeout_seconds: float = API_TIMEOUT_SECONDS
    #: How long one read of a job's checkpoints may take, and the largest pointer or manifest it reads.
    checkpoint_read_timeout_seconds: float = READ_TIMEOUT_SECONDS
    checkpoint_max_object_bytes: int = MAX_OBJECT_BYTES
    #: Host ports handed to jobs with hostNetwork (first, last).
    host_port_range: tuple[int, int] = DEFAULT_HOST_PORT_RANGE
    #: The nodes' directory a job's hostPath staging must lie under (None: hostPath staging is refused).
    staging_host_path_prefix: str | None = None
    #: The notice relay's URL the sidecars of jobs with the k8s source poll (None: they read their pod directly).
    notice_url: str | None = None
    webhook: bool = False
    webhook_addr: str = "0.0.0.0"
    webhook_port: int = 9443
    webhook_host: str | None = None
    webhook_cert: str | None = None
    webhook_key: str | None = None
    webhook_manage: str | None = None
    #: The Secret (in the operator's namespace) the operator keeps the serving certificate in (None: files given).
    webhook_cert_secret: str | None = None
    webhook_cert_namespace: str = "default"
    #: The webhook configurations whose caBundle the operator keeps (the chart's).
    webhook_configuration: str | None = None
    webhook_cert_days: float = 365.0
    metrics: OperatorMetrics | None = None
    #: This process: the Lease's holderIdentity, Events' reportingInstance, the pods' annotation.
    identity: str = field(default_factory=new_identity)
    #: Called before every write for a job (the leader election's fence; none when alone).
    fence: Callable[[], None] = kubeapi.no_fence


@dataclass(frozen=True)
class Election:
    """``--leader-elect``: the Lease the replicas elect their leader with, and its durations."""

    namespace: str
    name: str
    timing: Timing = field(default_factory=Timing)


def user_agent(identity: str) -> str:
    """The operator's User-Agent: its writes are told apart by replica in the apiserver's audit log."""
    return f"spotguard-operator/{__version__} ({identity})"


def api_client(identity: str | None = None, timeout: float = API_TIMEOUT_SECONDS) -> Any:
    """A kubernetes ApiClient from in-cluster config or KUBECONFIG (own Configuration) whose requests
    wait ``timeout`` seconds at most to connect, and as long for each part of the answer, unless a call
    says otherwise (``_request_timeout``). The client's own default is to wait for ever: a request on a
    connection that died without a word (a network fault, an apiserver restarted behind a load balancer)
    would hold its reconcile thread, and with the few the operator has, every job's, for good."""
    from kubernetes import client, config

    cfg = client.Configuration()
    token = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
    if os.environ.get("KUBERNETES_SERVICE_HOST") and token.exists():
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(client_configuration=cfg)
    api = _timed_client_class()(cfg)
    api.request_timeout = (timeout, timeout)  # (connect, read): urllib3's read timeout is per socket read
    if identity:
        api.user_agent = user_agent(identity)
    return api


@functools.cache
def _timed_client_class() -> type:
    """``kubernetes.client.ApiClient`` with a default for ``_request_timeout`` (made once, on first use:
    the kubernetes package is imported only where the operator runs)."""
    from kubernetes import client

    class TimedApiClient(client.ApiClient):  # type: ignore[misc]
        request_timeout: tuple[float, float] | None = None

        def call_api(self, *args: Any, **kwargs: Any) -> Any:
            # Every generated API method passes ``_request_timeout`` by name (None where not given).
            if kwargs.get("_request_timeout") is None:
                kwargs["_request_timeout"] = self.request_timeout
            return super().call_api(*args, **kwargs)

    return TimedApiClient


def api_clients(identity: str | None = None, timeout: float = API_TIMEOUT_SECONDS) -> tuple[Any, Any]:
    """CoreV1Api and CustomObjectsApi on one :func:`api_client`."""
    from kubernetes import client

    api = api_client(identity, timeout)
    return client.CoreV1Api(api), client.CustomObjectsApi(api)


def kopf_session(info: kopf.ConnectionInfo, identity: str, fence: Callable[[], None]) -> kopf.AiohttpSession:
    """kopf's HTTP session as kopf makes it from ``info``, plus the operator's User-Agent (kopf's own
    writes, its finalizer and Events, are told apart by replica too) and the fence before each request."""
    from importlib.metadata import version

    import aiohttp

    async def fenced(*_: Any) -> None:
        fence()

    trace = aiohttp.TraceConfig()
    if fence is not kubeapi.no_fence:
        # Before the request, and again once its connection is at hand (a new one may take a while).
        for hook in (trace.on_request_start, trace.on_connection_create_end, trace.on_connection_reuseconn):
            hook.append(fenced)
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ssl=info.as_ssl_context()),
        headers={**info.as_http_headers(), "User-Agent": f"{user_agent(identity)} kopf/{version('kopf')}"},
        proxy=info.proxy_url,
        trust_env=info.trust_env,
        trace_configs=[trace],
    )
    return kopf.AiohttpSession(
        aiohttp_session=session,
        server=info.server,
        priority=info.priority,
        default_namespace=info.default_namespace,
        expiration=info.expiration,
    )


def detect_native_sidecars(core: Any) -> bool:
    """Ask ``/version`` whether the server runs native sidecars (>= 1.29)."""
    from kubernetes import client

    info = client.VersionApi(core.api_client).get_code()
    return server_supports_native_sidecars(str(info.major), str(info.minor))


def operator_config(options: OperatorOptions, core: Any) -> OperatorConfig:
    """What shapes every pod: the image, its pull policy, the sidecar mode (``auto`` asks the server)."""
    native = detect_native_sidecars(core) if options.native_sidecar == "auto" else options.native_sidecar == "on"
    return OperatorConfig(
        image=options.image,
        image_pull_policy=options.image_pull_policy,
        native_sidecar=native,
        notice_url=options.notice_url,
        host_path_prefix=options.staging_host_path_prefix,
    )


@dataclass
class Runtime:
    """Per-process state the async handlers share (lives in kopf's memo)."""

    ctx: kubeapi.Context
    #: None when the operator may not read checkpoints (``--no-read-checkpoints``).
    probe: CheckpointProbe | None = None
    wakers: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    pokes: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)

    def waker(self, namespace: str, name: str) -> asyncio.Event:
        """The event that wakes a job's daemon (created on first use)."""
        return self.wakers.setdefault((namespace, name), asyncio.Event())

    def wake(self, namespace: str, name: str) -> None:
        """Wake one job's daemon, if it runs."""
        event = self.wakers.get((namespace, name))
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        """Wake every job's daemon (a node vanished)."""
        for event in self.wakers.values():
            event.set()

    def poke(self, namespace: str, name: str) -> asyncio.Event:
        """The event that asks a job's storage probe for a read now."""
        return self.pokes.setdefault((namespace, name), asyncio.Event())

    def start_probe(self, namespace: str, name: str) -> asyncio.Task[str] | None:
        """Start polling one job's storage (None when checkpoints are not read)."""
        if self.probe is None:
            return None
        return asyncio.create_task(
            self.probe.run(namespace, name, lambda: self.wake(namespace, name), self.poke(namespace, name))
        )

    def wake_port_waiters(self) -> None:
        """Wake the jobs that wait for host ports (a job that held some finished or went)."""
        for namespace, name in self.ctx.waiting_for_ports():
            self.wake(namespace, name)

    def forget(self, namespace: str, name: str) -> None:
        """Drop everything kept for a deleted job."""
        self.ctx.set_waiting_for_ports((namespace, name), False)
        self.ctx.metrics.forget(namespace, name)
        self.ctx.verified.forget(namespace, name)
        self.ctx.phases.pop((namespace, name), None)
        self.ctx.jobs.pop((namespace, name), None)
        if self.probe is not None:
            self.probe.forget(namespace, name)
        self.wakers.pop((namespace, name), None)
        self.pokes.pop((namespace, name), None)


def build_registry(options: OperatorOptions) -> kopf.OperatorRegistry:
    """Register every handler on a fresh registry (no module-level state)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.AiohttpSession | None:
        # In-cluster ServiceAccount, else KUBECONFIG (as the kubernetes client resolves them).
        info = kopf.login_via_client(**kwargs)
        return None if info is None else kopf_session(info, options.identity, options.fence)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, memo: Any, logger: kopf.Logger, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
        )
        # Without timeouts a watch can stall silently behind a dead connection.
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.watching.connect_timeout = 10
        settings.networking.request_timeout = 60
        settings.posting.level = logging.WARNING
        settings.posting.reporting_component = "spotguard-operator"
        settings.posting.reporting_instance = options.identity[:128]
        # Least privilege: no list/watch of CRDs and namespaces; the CRD must exist at start.
        settings.scanning.disabled = True
        # Only spotguard's pods are watched, filtered by the apiserver.
        settings.watching.label_selectors["v1", "pods"] = LABEL_JOB
        # No kopf webhooks: every replica serves admission itself (spotguard.operator.admission).
        core, custom = api_clients(options.identity, options.api_timeout_seconds)
        if options.fence is not kubeapi.no_fence:
            fence_requests(core.api_client, options.fence)  # core and custom share it
        config = operator_config(options, core)
        logger.info("sidecar mode: %s", "native" if config.native_sidecar else "classic")
        ctx = kubeapi.Context(
            core=core,
            custom=custom,
            config=config,
            metrics=options.metrics or OperatorMetrics(),
            resync_seconds=options.resync_seconds,
            checkpoint_poll_seconds=options.checkpoint_poll_seconds,
            read_checkpoints=options.read_checkpoints,
            namespaces=tuple(options.namespaces),
            host_port_range=options.host_port_range,
            instance=options.identity,
            fence=options.fence,
        )
        probe = (
            CheckpointProbe(
                ctx,
                workers=options.probe_workers,
                full_read_seconds=options.checkpoint_full_read_seconds,
                allowed_endpoints=options.allowed_endpoints,
                read_timeout=options.checkpoint_read_timeout_seconds,
                max_object_bytes=options.checkpoint_max_object_bytes,
            )
            if options.read_checkpoints
            else None
        )
        if probe is None:
            logger.info("not reading checkpoints: no Secret and no store is read")
        memo.runtime = Runtime(ctx=ctx, probe=probe)

    @kopf.on.cleanup(registry=registry)
    def stop_probe(memo: Any, **_: Any) -> None:
        runtime: Runtime | None = getattr(memo, "runtime", None)
        if runtime is not None and runtime.probe is not None:
            runtime.probe.shutdown()

    @kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, cancellation_timeout=5.0)
    async def run_job(
        name: str, namespace: str | None, memo: Any, stopped: kopf.DaemonStopped, logger: kopf.Logger, **_: Any
    ) -> None:
        """One loop per TrainingJob: reconcile when woken, on a backoff timer, or every resync."""
        runtime: Runtime = memo.runtime
        ns = namespace or ""
        key = (ns, name)
        waker = runtime.waker(ns, name)
        probe = runtime.start_probe(ns, name)
        try:
            while not stopped:
                waker.clear()
                before = runtime.ctx.phases.get(key)
                try:
                    delay = await asyncio.to_thread(rc.reconcile, runtime.ctx, ns, name)
                except Exception as exc:  # noqa: BLE001 - a failed reconcile must not end the job's loop; retried
                    logger.warning("reconcile failed, retrying: %s", api_reason(exc))
                    delay = 5.0
                after = runtime.ctx.phases.get(key)
                finished_now = after in TERMINAL_PHASES and before != after
                if finished_now:
                    runtime.wake_port_waiters()
                if probe is not None and not probe.done():
                    if finished_now:
                        runtime.poke(ns, name).set()  # read the final checkpoint now
                elif after not in TERMINAL_PHASES or finished_now:
                    # The probe stopped with the job finished, and the job runs again.
                    probe = runtime.start_probe(ns, name)
                resync = runtime.ctx.resync_seconds
                if delay is None:
                    timeout = resync
                elif after in TERMINAL_PHASES:
                    timeout = max(0.05, delay)
                else:
                    # A far-off look (a long backoff, a pod not yet unschedulable for long) never
                    # stretches the safety-net resync of a live job.
                    timeout = max(0.05, min(delay, resync))
                await woken_or_stopped(waker, stopped, timeout)
        finally:
            if probe is not None:
                probe.cancel()

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def job_event(name: str, namespace: str | None, memo: Any, **_: Any) -> None:
        memo.runtime.wake(namespace or "", name)

    @kopf.on.event("v1", "pods", labels={LABEL_JOB: kopf.PRESENT}, registry=registry)
    async def pod_event(body: kopf.Body, labels: kopf.Labels, namespace: str | None, memo: Any, **_: Any) -> None:
        memo.runtime.ctx.remember_report(namespace or "", body)
        memo.runtime.wake(namespace or "", labels[LABEL_JOB])

    @kopf.on.event("v1", "nodes", registry=registry)
    async def node_event(type: str, memo: Any, **_: Any) -> None:
        # A vanished node: its pods are preempted now, not when the pod GC notices (~1 min).
        if type == "DELETED":
            memo.runtime.wake_all()

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry, optional=True)
    async def job_deleted(name: str, namespace: str | None, memo: Any, logger: kopf.Logger, **_: Any) -> None:
        """Remove the job's pods at once (owner references would too, later); never its checkpoints."""
        runtime: Runtime = memo.runtime
        ns = namespace or ""
        await asyncio.to_thread(_delete_job_pods, runtime.ctx, ns, name)
        runtime.forget(ns, name)
        runtime.wake_port_waiters()
        logger.info("deleted the pods of %s/%s; its checkpoints are kept", ns, name)

    return registry


async def woken_or_stopped(waker: asyncio.Event, stopped: kopf.DaemonStopped, timeout: float) -> None:
    """Wait until the daemon is woken, asked to stop (the operator stops: at once, so that a leader
    hands its Lease over quickly), or ``timeout`` passes."""

    async def stopping() -> None:
        await stopped.wait()

    waits = [asyncio.ensure_future(waker.wait()), asyncio.ensure_future(stopping())]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def _delete_job_pods(ctx: kubeapi.Context, namespace: str, name: str) -> None:
    pods = ctx.core.list_namespaced_pod(namespace, label_selector=f"{LABEL_JOB}={name}")
    for pod in pods.items:
        kubeapi.delete_pod(ctx, namespace, pod.metadata.name, force=False)


def certificate_keeper(options: OperatorOptions) -> CertificateKeeper | None:
    """This replica's keeper of the webhook's certificate (``--webhook-cert-secret``), or None."""
    if not options.webhook_cert_secret:
        return None
    from kubernetes import client

    assert options.webhook_cert and options.webhook_key and options.webhook_host
    api = api_client(options.identity, options.api_timeout_seconds)
    return CertificateKeeper(
        client.CoreV1Api(api),
        client.AdmissionregistrationV1Api(api),
        options.webhook_cert_namespace,
        options.webhook_cert_secret,
        host_names(options.webhook_host),
        options.webhook_cert,
        options.webhook_key,
        configuration=options.webhook_configuration or options.webhook_manage,
        serving_days=options.webhook_cert_days,
    )


def admission_server(options: OperatorOptions, keeper: CertificateKeeper | None = None) -> AdmissionServer:
    """This replica's admission server (``--webhook``): the configuration is found once, at its start."""
    assert options.webhook_cert and options.webhook_key

    def config() -> OperatorConfig:
        core, _ = api_clients(options.identity, options.api_timeout_seconds)
        return operator_config(options, core)

    manage = None
    if options.webhook_manage:
        name, cert = options.webhook_manage, options.webhook_cert
        base_url = f"https://{options.webhook_host or options.webhook_addr}:{options.webhook_port}"

        def manage() -> None:
            if keeper is not None and keeper.bundle is not None:
                bundle = keeper.bundle.ca_crt  # the keeper puts a renewed CA in later
            else:
                with open(cert, "rb") as f:  # a self-signed certificate, or the chain up to its CA
                    bundle = f.read()
            manage_configurations(api_client(options.identity, options.api_timeout_seconds), name, base_url, bundle)

    return AdmissionServer(
        options.webhook_addr,
        options.webhook_port,
        options.webhook_cert,
        options.webhook_key,
        config,
        namespaces=options.namespaces,
        manage=manage,
    )


def run(options: OperatorOptions, *, liveness: str | None, election: Election | None = None) -> None:
    """Run the operator until SIGTERM/SIGINT; with ``election``, kopf only while this replica leads.

    Admission (``--webhook``) and the probes (``liveness``, and ``/readyz`` and
    the notice relay on its port) are served from the start to the end, whatever the role.
    """
    kopf.configure(verbose=False)
    # kopf reports every handler run at INFO; the operator's own log says what matters.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    log.info("operator instance %s", options.identity)
    stop = SignalEvent()  # set by a signal handler while the main thread may wait on it
    keeper = certificate_keeper(options) if options.webhook else None
    admission = admission_server(options, keeper) if options.webhook else None
    health = Health(admission, options.identity)
    elector: LeaderElector | None = None
    with contextlib.ExitStack() as serving:
        if keeper is not None:
            # Every replica: writes carry the resourceVersion read, so concurrent renewals do not clash.
            serving.enter_context(keeper)
        if admission is not None:
            serving.enter_context(admission)
        relay = None
        if liveness:
            # The relay's own client: never fenced (it writes no job's state), the same in every role.
            core = api_clients(options.identity, options.api_timeout_seconds)[0]
            relay = NoticeRelay(core, options.namespaces, options.identity)
        try:
            serving.enter_context(ProbeServer(liveness, health, relay))
        except OSError as exc:
            log.critical("cannot serve the liveness and readiness probes at %s: %s", liveness, exc.strerror or exc)
            raise SystemExit(2) from None
        if election is not None:
            from kubernetes import client

            leases = client.CoordinationV1Api(api_client(options.identity, options.api_timeout_seconds))
            elector = LeaderElector(leases, election.namespace, election.name, options.identity, election.timing)
            fence_requests(leases.api_client, elector.fence_renewal)
            # Until kopf runs (it installs its own handlers), SIGTERM/SIGINT only stop the standby.
            stop.open()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set_soon())
            health.standby = StandbyLiveness(elector)
            if not elector.acquire(stop):
                log.info("stopped while standing by")
                return
            health.standby, health.leading = None, True
            elector.start_renewing()
            options.fence = elector.fence
        try:
            with contextlib.suppress(asyncio.CancelledError):
                asyncio.run(_operate(options, stop, health))
        finally:
            if elector is not None:
                elector.release()


async def _operate(options: OperatorOptions, stopped: threading.Event, health: Health) -> None:
    """kopf (standalone) in this loop, until SIGTERM/SIGINT, also one that came before kopf took them."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)  # until kopf puts its own handlers in place
    if stopped.is_set():  # checked after the loop took the signals: none is lost in between
        return
    health.kopf_loop = loop
    try:
        await kopf.operator(
            registry=build_registry(options),
            clusterwide=not options.namespaces,
            namespaces=options.namespaces,
            standalone=True,
            # The probes are spotguard's own (spotguard.operator.probes): kopf's endpoint would serve
            # only its one path, and only from now on.
            liveness_endpoint=None,
            ready_flag=health.kopf_started,
            memo=kopf.Memo(),
        )
    finally:
        health.kopf_loop = None
