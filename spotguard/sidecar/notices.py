"""Early preemption notices from cloud metadata services and Kubernetes.

Each source is a small class whose ``poll()`` returns a :class:`Notice` or
``None``. Sources talk HTTP with short timeouts; a source that cannot be
reached answers ``None`` (and remembers why in ``last_error``) rather than
raising, because a missing metadata service must never stop the sidecar.

No source is enabled unless configured (``--notices`` /
``SPOTGUARD_NOTICES``). The default endpoints are the providers'
link-local metadata addresses; every endpoint can be overridden.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Protocol

from spotguard import notice_relay
from spotguard.contract import env as envvars
from spotguard.contract.env import from_env

log = logging.getLogger(__name__)

# Provider defaults (documented): the link-local metadata services.
AWS_IMDS_ENDPOINT = "http://169.254.169.254"
GCE_METADATA_ENDPOINT = "http://metadata.google.internal"
AZURE_METADATA_ENDPOINT = "http://169.254.169.254"

# GCE gives a preempted VM about 30 s between the notice and the stop.
GCE_NOTICE_SECONDS = 30.0
# Kubernetes: used when the pod carries no grace period of its own.
K8S_DEFAULT_GRACE_SECONDS = 30.0

HTTP_TIMEOUT_SECONDS = 2.0
KNOWN_SOURCES = ("aws", "gce", "azure", "k8s")


@dataclass(frozen=True)
class Notice:
    """An announcement that this machine or pod is going away (or may soon).

    ``source`` is a bounded metric label (``aws``, ``aws_rebalance``, ``gce``,
    ``azure``, ``k8s``); ``key`` identifies one event so the same notice seen
    on every poll is acted on once; ``deadline`` is when the machine is
    expected to be gone (unix seconds), ``None`` if the provider does not say;
    ``preempt`` is False for advisory notices (AWS rebalance
    recommendation), which call for a proactive checkpoint only.
    """

    source: str
    key: str
    deadline: float | None
    preempt: bool
    detail: str = ""
    event_id: str | None = None


class NoticeSource(Protocol):
    """What the notice watcher needs from a source."""

    name: str
    last_error: str | None

    def poll(self) -> Notice | None:
        """Return the current notice, or None when there is none (or no answer)."""
        ...

    def acknowledge(self, notice: Notice) -> None:
        """Tell the provider we are ready (only Azure uses this)."""
        ...


@dataclass
class HttpResponse:
    """Status and body of one small metadata request."""

    status: int
    body: bytes


def http_request(
    url: str,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
    data: bytes | None = None,
    timeout: float = HTTP_TIMEOUT_SECONDS,
) -> HttpResponse:
    """One HTTP request; HTTP error statuses are returned, not raised.

    Proxies are bypassed: metadata services are always on the local link,
    and a proxy would only see (and could log) the request.
    """
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return HttpResponse(resp.status, resp.read())
    except urllib.error.HTTPError as exc:
        return HttpResponse(exc.code, exc.read() if exc.fp is not None else b"")


def parse_rfc3339(text: str) -> float:
    """Parse ``2026-01-02T03:04:05Z`` (fractional seconds and offsets too)."""
    value = text.strip()
    if value.endswith("Z"):
        value = value[:-1] + "+00:00"
    parsed = datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def parse_http_date(text: str) -> float:
    """Parse an RFC 1123 date as Azure uses: ``Mon, 19 Sep 2016 18:29:47 GMT``."""
    return parsedate_to_datetime(text.strip()).timestamp()


def _json_object(body: bytes) -> dict[str, Any]:
    value = json.loads(body.decode("utf-8"))
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


class MetadataNotices:
    """What the cloud providers' sources share: their metadata service at ``endpoint``
    (the provider's :attr:`default_endpoint` unless given), each request bounded by
    ``timeout``, the last failure to get an answer in ``last_error``."""

    name = ""
    default_endpoint = ""

    def __init__(
        self, endpoint: str | None = None, timeout: float = HTTP_TIMEOUT_SECONDS, clock: Callable[[], float] = time.time
    ) -> None:
        self.endpoint = (endpoint or self.default_endpoint).rstrip("/")
        self.timeout = timeout
        self.clock = clock
        self.last_error: str | None = None

    def acknowledge(self, notice: Notice) -> None:
        """Nothing: the provider takes no acknowledgement."""


class AwsSpotNotices(MetadataNotices):
    """AWS EC2: spot ``instance-action`` and the rebalance recommendation.

    Uses the IMDSv2 token flow (``PUT /latest/api/token``, then the token in
    ``X-aws-ec2-metadata-token``); a refused token (401) is fetched again
    once. ``instance-action`` 404 means no interruption is scheduled.
    """

    name = "aws"
    default_endpoint = AWS_IMDS_ENDPOINT
    TOKEN_TTL_SECONDS = 21600
    _token: str | None = None  # the IMDSv2 session token, and when to fetch another
    _token_expires = 0.0

    def _fetch_token(self) -> str:
        resp = http_request(
            f"{self.endpoint}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_SECONDS)},
            timeout=self.timeout,
        )
        if resp.status != 200:
            raise OSError(f"IMDSv2 token request answered HTTP {resp.status}")
        self._token = resp.body.decode("ascii").strip()
        # Refresh well before expiry so a poll never races the TTL.
        self._token_expires = self.clock() + self.TOKEN_TTL_SECONDS * 0.9
        return self._token

    def _get(self, path: str) -> HttpResponse:
        token = self._token if self._token and self.clock() < self._token_expires else None
        if token is None:
            token = self._fetch_token()
        url = f"{self.endpoint}{path}"
        resp = http_request(url, headers={"X-aws-ec2-metadata-token": token}, timeout=self.timeout)
        if resp.status == 401:
            token = self._fetch_token()
            resp = http_request(url, headers={"X-aws-ec2-metadata-token": token}, timeout=self.timeout)
        return resp

    def poll(self) -> Notice | None:
        """Return an interruption notice, else a rebalance recommendation, else None."""
        try:
            notice = self._instance_action() or self._rebalance()
        except (OSError, ValueError, KeyError) as exc:
            self.last_error = f"aws metadata: {exc}"
            return None
        self.last_error = None
        return notice

    def _document(self, path: str, what: str) -> dict[str, Any] | None:
        """The JSON document at ``path``, or None when the service answers 404 (nothing scheduled)."""
        resp = self._get(path)
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise OSError(f"{what} answered HTTP {resp.status}")
        return _json_object(resp.body)

    def _instance_action(self) -> Notice | None:
        doc = self._document("/latest/meta-data/spot/instance-action", "spot/instance-action")
        if doc is None:
            return None
        action = str(doc.get("action", ""))
        when = str(doc["time"])
        return Notice(
            source="aws",
            key=f"aws:{action}:{when}",
            deadline=parse_rfc3339(when),
            preempt=True,
            detail=f"spot instance-action {action} at {when}",
        )

    def _rebalance(self) -> Notice | None:
        doc = self._document("/latest/meta-data/events/recommendations/rebalance", "rebalance recommendation")
        if doc is None:
            return None
        when = str(doc.get("noticeTime", ""))
        return Notice(
            source="aws_rebalance",
            key=f"aws_rebalance:{when}",
            deadline=None,
            preempt=False,
            detail=f"rebalance recommendation at {when}",
        )


class GcePreemptionNotices(MetadataNotices):
    """GCE: ``instance/preempted`` answers ``TRUE`` once the VM is being preempted."""

    name = "gce"
    default_endpoint = GCE_METADATA_ENDPOINT

    def __init__(
        self,
        endpoint: str = GCE_METADATA_ENDPOINT,
        timeout: float = HTTP_TIMEOUT_SECONDS,
        notice_seconds: float = GCE_NOTICE_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(endpoint, timeout, clock)
        self.notice_seconds = notice_seconds
        self._first_seen: float | None = None

    def poll(self) -> Notice | None:
        """Return a notice while the metadata server says ``TRUE``."""
        try:
            resp = http_request(
                f"{self.endpoint}/computeMetadata/v1/instance/preempted",
                headers={"Metadata-Flavor": "Google"},
                timeout=self.timeout,
            )
            if resp.status != 200:
                raise OSError(f"instance/preempted answered HTTP {resp.status}")
        except OSError as exc:
            self.last_error = f"gce metadata: {exc}"
            return None
        self.last_error = None
        if resp.body.decode("ascii", "replace").strip().upper() != "TRUE":
            return None
        if self._first_seen is None:
            self._first_seen = self.clock()
        return Notice(
            source="gce",
            key="gce:preempted",
            # GCE gives no time; the notice period starts when we first see it.
            deadline=self._first_seen + self.notice_seconds,
            preempt=True,
            detail="instance/preempted is TRUE",
        )


class AzureScheduledEvents(MetadataNotices):
    """Azure: Scheduled Events of type ``Preempt``; acknowledged with ``StartRequests``."""

    name = "azure"
    default_endpoint = AZURE_METADATA_ENDPOINT
    API_VERSION = "2020-07-01"
    _reported: frozenset[str] = frozenset()  # the events reported so far

    @property
    def url(self) -> str:
        """The Scheduled Events document URL."""
        return f"{self.endpoint}/metadata/scheduledevents?api-version={self.API_VERSION}"

    def poll(self) -> Notice | None:
        """Return the first ``Preempt`` event, if any."""
        try:
            resp = http_request(self.url, headers={"Metadata": "true"}, timeout=self.timeout)
            if resp.status != 200:
                raise OSError(f"scheduledevents answered HTTP {resp.status}")
            doc = _json_object(resp.body)
            events = [e for e in doc.get("Events") or [] if isinstance(e, dict) and e.get("EventType") == "Preempt"]
            # Report each event once before repeating the first: a second
            # Preempt event must not hide behind one already being handled.
            events.sort(key=lambda e: str(e.get("EventId")) in self._reported)
            for event in events:
                event_id = str(event["EventId"])
                not_before = str(event.get("NotBefore") or "")
                # An empty NotBefore means the event has already started.
                deadline = parse_http_date(not_before) if not_before else self.clock()
                self.last_error = None
                self._reported |= {event_id}
                return Notice(
                    source="azure",
                    key=f"azure:{event_id}",
                    deadline=deadline,
                    preempt=True,
                    detail=f"scheduled event Preempt {event_id} not before {not_before or 'now'}",
                    event_id=event_id,
                )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.last_error = f"azure metadata: {exc}"
            return None
        self.last_error = None
        return None

    def acknowledge(self, notice: Notice) -> None:
        """Approve the event so the platform may proceed without waiting out NotBefore."""
        if notice.event_id is None:
            return
        body = json.dumps({"StartRequests": [{"EventId": notice.event_id}]}).encode()
        try:
            resp = http_request(
                self.url,
                method="POST",
                headers={"Metadata": "true", "Content-Type": "application/json"},
                data=body,
                timeout=self.timeout,
            )
        except OSError as exc:
            self.last_error = f"azure acknowledge: {exc}"
            log.warning("azure: could not acknowledge event %s: %s", notice.event_id, exc)
            return
        if resp.status != 200:
            self.last_error = f"azure acknowledge answered HTTP {resp.status}"
            log.warning("azure: acknowledging event %s answered HTTP %s", notice.event_id, resp.status)


@dataclass(eq=False)  # a source is itself, whatever its settings
class KubernetesDisruptionNotices:
    """The pod's own ``DisruptionTarget`` condition (set on node shutdown,
    eviction or preemption by current Kubernetes versions).

    In a pod of the operator's (``SPOTGUARD_NOTICE_URL`` set): asks the
    operator's notice relay, showing the pod's projected token from
    ``SPOTGUARD_NOTICE_TOKEN_FILE`` (read at every poll: kubelet renews it);
    the pod needs no rights of its own (:mod:`spotguard.notice_relay`).
    Otherwise reads the pod named by ``POD_NAME``/``POD_NAMESPACE`` from the
    API itself: with ``KUBECONFIG`` (outside a cluster, ``spotguard run``), or
    the in-cluster ServiceAccount (which then needs ``get`` on pods). The
    deadline is the pod's ``deletionTimestamp`` when set, else now plus its
    grace period.
    """

    name = "k8s"  # unannotated: a class attribute, not a field

    pod_name: str | None
    namespace: str | None
    kubeconfig: str | None = None
    timeout: float = HTTP_TIMEOUT_SECONDS
    clock: Callable[[], float] = time.time
    _: KW_ONLY
    relay_url: str | None = None
    token_file: str = notice_relay.TOKEN_FILE
    last_error: str | None = field(default=None, init=False)
    _api: Any = field(default=None, init=False, repr=False)
    _first_seen: float | None = field(default=None, init=False, repr=False)

    def _core_api(self) -> Any:
        if self._api is None:
            from kubernetes import client, config  # heavy: only when enabled

            if self.kubeconfig:
                api_client = config.new_client_from_config(config_file=self.kubeconfig)
            elif os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config()
                api_client = client.ApiClient()
            else:
                api_client = config.new_client_from_config()
            self._api = client.CoreV1Api(api_client)
        return self._api

    def poll(self) -> Notice | None:
        """Return a notice once the pod has a true ``DisruptionTarget`` condition."""
        if self.relay_url:
            view = self._ask_relay(self.relay_url)
            if view is None:
                return None
            self.last_error = None
            return disruption_notice(view, self._first_seen_now())
        try:
            pod = self._core_api().read_namespaced_pod(self.pod_name, self.namespace, _request_timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - any API/config failure means "no answer"
            self.last_error = f"k8s: reading pod {self.namespace}/{self.pod_name}: {exc}"
            return None
        self.last_error = None
        return disruption_notice(pod.to_dict(), self._first_seen_now())

    def _ask_relay(self, url: str) -> dict[str, Any] | None:
        """The relay's view of this pod; None (and ``last_error``) when it did not answer it."""
        try:
            token = read_token(self.token_file)
            resp = http_request(url, headers={"Authorization": f"Bearer {token}"}, timeout=self.timeout)
            if resp.status != 200:
                self.last_error = f"k8s: the notice relay {url} answered HTTP {resp.status}: {relay_error(resp.body)}"
                return None
            return _json_object(resp.body)
        except (OSError, ValueError) as exc:
            self.last_error = f"k8s: the notice relay {url}: {exc}"
            return None

    def _first_seen_now(self) -> float:
        if self._first_seen is None:
            self._first_seen = self.clock()
        return self._first_seen

    def acknowledge(self, notice: Notice) -> None:
        """Kubernetes takes no acknowledgement."""


def read_token(path: str) -> str:
    """The projected token in ``path``; raises OSError (naming the file, never its content) when absent or empty."""
    with open(path, encoding="ascii") as f:
        token = f.read().strip()
    if not token:
        raise OSError(f"the token file {path} is empty")
    return token


def relay_error(body: bytes) -> str:
    """Pure: the notice relay's own reason in an error answer (``{"error": ...}``), else the body's start."""
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return str(doc["error"])
    return body[:200].decode("utf-8", "replace").strip() or "(no body)"


def disruption_notice(pod: Mapping[str, Any], now: float) -> Notice | None:
    """Pure: the notice implied by a pod object (``to_dict()`` shape), if any."""
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") != "DisruptionTarget" or str(cond.get("status")) != "True":
            continue
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        deletion = meta.get("deletion_timestamp") or meta.get("deletionTimestamp")
        if isinstance(deletion, datetime):
            deadline = deletion.timestamp()
        elif isinstance(deletion, str) and deletion:
            deadline = parse_rfc3339(deletion)
        else:
            grace = spec.get("termination_grace_period_seconds")
            if grace is None:
                grace = spec.get("terminationGracePeriodSeconds")
            deadline = now + float(grace if grace is not None else K8S_DEFAULT_GRACE_SECONDS)
        reason = cond.get("reason") or "DisruptionTarget"
        return Notice(
            source="k8s",
            key=f"k8s:{meta.get('uid', '')}:{reason}",
            deadline=deadline,
            preempt=True,
            detail=f"pod condition DisruptionTarget ({reason}): {cond.get('message') or ''}".strip(),
        )
    return None


@dataclass
class NoticeSettings:
    """Which sources to poll and where (flags override environment)."""

    sources: list[str] = field(default_factory=list)
    aws_endpoint: str = AWS_IMDS_ENDPOINT
    gce_endpoint: str = GCE_METADATA_ENDPOINT
    azure_endpoint: str = AZURE_METADATA_ENDPOINT
    pod_name: str | None = None
    pod_namespace: str | None = None
    kubeconfig: str | None = None
    #: The operator's notice relay for the k8s source (in its pods), and the token the pod shows it.
    relay_url: str | None = None
    relay_token_file: str = notice_relay.TOKEN_FILE
    interval_seconds: float = 2.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NoticeSettings:
        """Read ``SPOTGUARD_NOTICES`` and the endpoint variables."""
        environ = os.environ if env is None else env
        return cls(
            sources=parse_sources(from_env(envvars.NOTICES, environ)),
            aws_endpoint=from_env(envvars.AWS_IMDS_ENDPOINT, environ) or AWS_IMDS_ENDPOINT,
            gce_endpoint=from_env(envvars.GCE_METADATA_ENDPOINT, environ) or GCE_METADATA_ENDPOINT,
            azure_endpoint=from_env(envvars.AZURE_METADATA_ENDPOINT, environ) or AZURE_METADATA_ENDPOINT,
            pod_name=environ.get("POD_NAME") or None,
            pod_namespace=environ.get("POD_NAMESPACE") or None,
            kubeconfig=environ.get("KUBECONFIG") or None,
            relay_url=from_env(envvars.NOTICE_URL, environ) or None,
            relay_token_file=from_env(envvars.NOTICE_TOKEN_FILE, environ) or notice_relay.TOKEN_FILE,
            interval_seconds=from_env(envvars.NOTICE_INTERVAL, environ),
        )


def parse_sources(text: str) -> list[str]:
    """Parse ``aws,gce`` into a list; unknown names are a user error."""
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in KNOWN_SOURCES]
    if unknown:
        raise ValueError(f"unknown notice source(s) {', '.join(unknown)}; choose from {', '.join(KNOWN_SOURCES)}")
    return list(dict.fromkeys(names))


def build_sources(settings: NoticeSettings) -> list[NoticeSource]:
    """Instantiate the configured sources."""
    sources: list[NoticeSource] = []
    for name in settings.sources:
        if name == "aws":
            sources.append(AwsSpotNotices(settings.aws_endpoint))
        elif name == "gce":
            sources.append(GcePreemptionNotices(settings.gce_endpoint))
        elif name == "azure":
            sources.append(AzureScheduledEvents(settings.azure_endpoint))
        elif name == "k8s":
            if not settings.relay_url and (not settings.pod_name or not settings.pod_namespace):
                raise ValueError(
                    f"notice source k8s needs {envvars.NOTICE_URL.name} (in a pod of the operator's), or POD_NAME"
                    " and POD_NAMESPACE (to read the pod from the API)"
                )
            sources.append(
                KubernetesDisruptionNotices(
                    settings.pod_name,
                    settings.pod_namespace,
                    settings.kubeconfig,
                    relay_url=settings.relay_url,
                    token_file=settings.relay_token_file,
                )
            )
    return sources


class NoticeWatcher:
    """Polls sources in a background thread; calls ``on_notice`` once per new notice."""

    def __init__(
        self,
        sources: Iterable[NoticeSource],
        on_notice: Callable[[Notice, NoticeSource], None],
        interval_seconds: float = 2.0,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.sources = list(sources)
        self.on_notice = on_notice
        self.on_error = on_error
        self.interval_seconds = interval_seconds
        self._seen: set[str] = set()
        self._errors: dict[str, str | None] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> list[Notice]:
        """Poll every source once; return (and dispatch) the notices not seen before."""
        fresh: list[Notice] = []
        for source in self.sources:
            notice = source.poll()
            self._log_error_change(source)
            if notice is None or notice.key in self._seen:
                continue
            self._seen.add(notice.key)
            fresh.append(notice)
            try:
                self.on_notice(notice, source)
            except Exception:  # a bad handler must not kill the watcher
                log.exception("notice handler failed for %s", notice.key)
        return fresh

    def _log_error_change(self, source: NoticeSource) -> None:
        # Log when a source starts or stops failing, not on every poll.
        previous = self._errors.get(source.name)
        if source.last_error != previous:
            if source.last_error:
                log.warning("notice source %s unavailable: %s", source.name, source.last_error)
                if self.on_error is not None:
                    self.on_error(source.name)
            elif previous:
                log.info("notice source %s reachable again", source.name)
            self._errors[source.name] = source.last_error

    def start(self) -> None:
        """Start polling in a daemon thread (no-op without sources)."""
        if not self.sources or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="spotguard-notices", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.interval_seconds)

    def stop(self) -> None:
        """Stop polling and wait briefly for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_seconds + HTTP_TIMEOUT_SECONDS * 4)
            self._thread = None
