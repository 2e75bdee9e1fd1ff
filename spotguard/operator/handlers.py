"""kopf wiring: settings, the per-job daemon, watches on pods and nodes, the webhook.

Handlers stay thin: they only wake the job's daemon, which runs
``reconcile`` (observe -> decide -> apply -> report) in a worker thread. Each
TrainingJob has exactly one daemon in a running operator, so a job's decisions
are never made concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf

from spotguard.operator import reconcile as rc
from spotguard.operator.decide import TERMINAL_PHASES
from spotguard.operator.hostports import DEFAULT_RANGE as DEFAULT_HOST_PORT_RANGE
from spotguard.operator.metrics import OperatorMetrics
from spotguard.operator.podbuilder import (
    DEFAULT_IMAGE,
    DEFAULT_NOTICE_CLUSTER_ROLE,
    LABEL_INJECT,
    LABEL_JOB,
    OperatorConfig,
    server_supports_native_sidecars,
)
from spotguard.operator.probe import CheckpointProbe
from spotguard.operator.spec import GROUP, PLURAL, VERSION, SpecError

log = logging.getLogger("spotguard.operator")

FINALIZER = "spotguard.dev/finalizer"
#: How long a silent replica is presumed alive (kopf's default is 60 s).
PEERING_LIFETIME_SECONDS = 20
ANNOTATION_PREFIX = "spotguard.dev"


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
    #: Host ports handed to jobs with hostNetwork (first, last).
    host_port_range: tuple[int, int] = DEFAULT_HOST_PORT_RANGE
    #: ClusterRole bound to the pods' ServiceAccount of a job with the k8s notice source.
    notice_cluster_role: str = DEFAULT_NOTICE_CLUSTER_ROLE
    webhook: bool = False
    webhook_addr: str = "0.0.0.0"
    webhook_port: int = 9443
    webhook_host: str | None = None
    webhook_cert: str | None = None
    webhook_key: str | None = None
    webhook_manage: str | None = None
    metrics: OperatorMetrics | None = None


def api_clients() -> tuple[Any, Any]:
    """CoreV1Api and CustomObjectsApi from in-cluster config or KUBECONFIG (own Configuration)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    token = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
    if os.environ.get("KUBERNETES_SERVICE_HOST") and token.exists():
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(client_configuration=cfg)
    api = client.ApiClient(cfg)
    return client.CoreV1Api(api), client.CustomObjectsApi(api)


def detect_native_sidecars(core: Any) -> bool:
    """Ask ``/version`` whether the server runs native sidecars (>= 1.29)."""
    from kubernetes import client

    info = client.VersionApi(core.api_client).get_code()
    return server_supports_native_sidecars(str(info.major), str(info.minor))


@dataclass
class Runtime:
    """Per-process state the async handlers share (lives in kopf's memo)."""

    ctx: rc.Context
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
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # In-cluster ServiceAccount, else KUBECONFIG (as the kubernetes client resolves them).
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, memo: Any, logger: kopf.Logger, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        # Several replicas (peering): kopf pauses every operator that sees another of the
        # same priority, so each replica draws its own; the highest acts, the others wait.
        # A replica that dies without a goodbye (force-deleted pod, lost node) is presumed
        # dead after its lifetime, and the next one takes over.
        settings.peering.priority = secrets.randbelow(1 << 30) + 1
        settings.peering.lifetime = PEERING_LIFETIME_SECONDS
        # One ClusterKopfPeering (the chart's) for the replicas, also when they watch
        # only some namespaces (kopf would look for a KopfPeering in each of them).
        settings.peering.clusterwide = True
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
        # Least privilege: no list/watch of CRDs and namespaces; the CRD must exist at start.
        settings.scanning.disabled = True
        # Only spotguard's pods are watched, filtered by the apiserver.
        settings.watching.label_selectors["v1", "pods"] = LABEL_JOB
        if options.webhook:
            settings.admission.server = NamespaceAwareWebhookServer(
                kopf.WebhookServer(
                    addr=options.webhook_addr,
                    port=options.webhook_port,
                    host=options.webhook_host,
                    certfile=options.webhook_cert,
                    pkeyfile=options.webhook_key,
                )
            )
            settings.admission.managed = options.webhook_manage
        core, custom = api_clients()
        native = detect_native_sidecars(core) if options.native_sidecar == "auto" else options.native_sidecar == "on"
        logger.info("sidecar mode: %s", "native" if native else "classic")
        ctx = rc.Context(
            core=core,
            custom=custom,
            config=OperatorConfig(
                image=options.image, image_pull_policy=options.image_pull_policy, native_sidecar=native
            ),
            metrics=options.metrics or OperatorMetrics(),
            resync_seconds=options.resync_seconds,
            checkpoint_poll_seconds=options.checkpoint_poll_seconds,
            read_checkpoints=options.read_checkpoints,
            namespaces=tuple(options.namespaces),
            host_port_range=options.host_port_range,
            notice_cluster_role=options.notice_cluster_role,
        )
        probe = CheckpointProbe(ctx, workers=options.probe_workers) if options.read_checkpoints else None
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
                except Exception as exc:
                    logger.warning("reconcile failed, retrying: %s", rc.api_reason(exc))
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
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waker.wait(), timeout=timeout)
        finally:
            if probe is not None:
                probe.cancel()

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def job_event(name: str, namespace: str | None, memo: Any, **_: Any) -> None:
        memo.runtime.wake(namespace or "", name)

    @kopf.on.event("v1", "pods", labels={LABEL_JOB: kopf.PRESENT}, registry=registry)
    async def pod_event(labels: kopf.Labels, namespace: str | None, memo: Any, **_: Any) -> None:
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

    if options.webhook:
        from spotguard.operator.webhook import apply_to_patch

        @kopf.on.mutate(
            "v1",
            "pods",
            labels={LABEL_INJECT: "true"},
            operations=["CREATE"],
            id="inject-sidecar",
            side_effects=False,
            registry=registry,
        )
        def inject_sidecar(body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any) -> None:
            config = memo.runtime.ctx.config
            try:
                apply_to_patch(body, patch, body.metadata.namespace, config)
            except SpecError as exc:
                raise kopf.AdmissionError(f"spotguard: {exc}", code=400) from None

    return registry


def copy_request_namespace(request: Any) -> None:
    """Copy an admission request's namespace into its object, where handlers can see it.

    A pod being created often has no ``metadata.namespace`` yet; the admission
    request carries it beside the object, and kopf hands handlers only the object.
    """
    req = request.get("request") if isinstance(request, dict) else None
    obj = req.get("object") if isinstance(req, dict) else None
    if isinstance(obj, dict) and req and req.get("namespace"):
        meta = obj.setdefault("metadata", {})
        if isinstance(meta, dict) and not meta.get("namespace"):
            meta["namespace"] = req["namespace"]


class NamespaceAwareWebhookServer:
    """kopf's webhook server, plus the request's namespace copied into the object.

    Built on kopf's public server protocol only (a server is an async iterator
    factory called with the webhook function; the function takes the request
    and keyword arguments): it wraps the function it is given, and overrides
    nothing of kopf's own server.
    """

    def __init__(self, inner: Callable[[Any], AsyncIterator[Any]]) -> None:
        self.inner = inner

    async def __call__(self, fn: Callable[..., Awaitable[Any]]) -> AsyncIterator[Any]:
        async def with_namespace(request: Any, **kwargs: Any) -> Any:
            copy_request_namespace(request)
            return await fn(request, **kwargs)

        async for client_config in self.inner(with_namespace):
            yield client_config


def _delete_job_pods(ctx: rc.Context, namespace: str, name: str) -> None:
    pods = ctx.core.list_namespaced_pod(namespace, label_selector=f"{LABEL_JOB}={name}")
    for pod in pods.items:
        rc.delete_pod(ctx, namespace, pod.metadata.name, force=False)


def run(options: OperatorOptions, *, liveness: str | None, peering: str | None) -> None:
    """Run the operator until SIGTERM/SIGINT."""
    kopf.configure(verbose=False)
    # kopf reports every handler run at INFO; the operator's own log says what matters.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    registry = build_registry(options)
    kopf.run(
        registry=registry,
        clusterwide=not options.namespaces,
        namespaces=options.namespaces,
        standalone=peering is None,
        peering_name=peering,
        liveness_endpoint=liveness,
        memo=kopf.Memo(),
    )
