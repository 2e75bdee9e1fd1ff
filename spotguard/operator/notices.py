"""The notice relay: every operator replica tells a pod its own disruption state.

Why a relay: a sidecar with the ``k8s`` notice source polls its pod for a
``DisruptionTarget`` condition. Reading the pod itself would need rights of
the pod's own (a RoleBinding per job, made by the operator), and Kubernetes
lets an account that may create RoleBindings bind any role whose rules it
holds, the operator's own ClusterRole included: RBAC cannot close that. So the
operator creates no RoleBinding and no ServiceAccount at all; it reads the pod
for the sidecar (it may ``get pods`` anyway) and answers with that pod only.

Who is asking: the sidecar presents a projected ServiceAccount token of its
pod (``Authorization: Bearer``; audience :data:`~spotguard.notice_relay.AUDIENCE`,
bound to the pod, mounted into the sidecar container only). The operator
verifies it with a TokenReview for that audience (``create`` on
``tokenreviews``, as ``system:auth-delegator`` has), requires it to be
authenticated for that audience, and takes the pod from the review's
``user.extra``: ``authentication.kubernetes.io/pod-name`` and ``pod-uid``
(set for pod-bound tokens; seen on Kubernetes 1.20 and later), the namespace
from the username ``system:serviceaccount:<namespace>:<account>``. The pod
read must have that uid (a token of an earlier pod of the same name answers
nothing) and be spotguard's (labelled ``spotguard.dev/job``, or injected by
the webhook), in a namespace the operator serves. The answer is the minimal
view of :func:`pod_view`. The wire protocol is in :mod:`spotguard.notice_relay`.

Why plain HTTP (the relay is served on the probes port, which every replica
serves from start to exit, leader or standby; see
:mod:`spotguard.operator.probes`): what crosses the network is a token whose
audience the apiserver refuses, bound to one pod (worthless once the pod is
gone) and short-lived (10 minutes, renewed by kubelet), and the answer is only
that pod's own disruption state, which its own sidecar is meant to see. A
captured token lets its holder ask the same question, or post one of the
fixed Event reasons on that same pod (rate-limited). Nothing here can read
another pod, a Secret, or act on the cluster. A cluster that encrypts pod
traffic (a service mesh, WireGuard in the CNI) covers it like any other.

Load: each pod is read at most once per :data:`POD_CACHE_SECONDS` and each
token reviewed at most once per :data:`REVIEW_CACHE_SECONDS`, whether it
passed or not (keyed by the token's hash; the token itself is never kept or
logged), with at most :data:`MAX_API_CALLS` requests to the apiserver at once.

The decisions are pure functions (:func:`bearer_token`, :func:`caller_of`,
:func:`check_pod`, :func:`pod_view`, ...), tested without I/O;
:class:`NoticeRelay` does the reads and writes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from spotguard.notice_relay import AUDIENCE, BASE_PATH, EVENT_PATH, POD_PATH, RELAYED_REASONS
from spotguard.operator.apierrors import api_reason, api_status
from spotguard.operator.podbuilder import ANNOTATION_INJECTED, LABEL_INJECT, LABEL_JOB
from spotguard.operator.probes import HttpAnswer

log = logging.getLogger("spotguard.operator")

EXTRA_POD_NAME = "authentication.kubernetes.io/pod-name"
EXTRA_POD_UID = "authentication.kubernetes.io/pod-uid"
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
#: A pod is read from the apiserver at most this often, however many ask.
POD_CACHE_SECONDS = 1.0
#: A token verified once is trusted this long (the pod's uid is still checked at every answer).
REVIEW_CACHE_SECONDS = 10.0
#: At most one relayed Event per pod and reason in this time.
EVENT_INTERVAL_SECONDS = 60.0
#: The largest Event request read; the message is cut to MAX_MESSAGE.
MAX_BODY = 4096
MAX_MESSAGE = 1024
#: Entries kept in each cache before expired ones are dropped.
MAX_ENTRIES = 4096
API_TIMEOUT_SECONDS = 5.0
#: Requests to the apiserver the relay makes at once, at most (a flood of callers never floods it).
MAX_API_CALLS = 8


class Refused(Exception):
    """A request the relay does not answer: the HTTP status and why (shown to the caller)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class Caller:
    """The pod a verified token is bound to."""

    namespace: str
    pod: str
    uid: str


# --- pure ---------------------------------------------------------------------------------


def bearer_token(authorization: str | None) -> str:
    """Pure: the token of an ``Authorization: Bearer <token>`` header; 401 without one."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Refused(
            401,
            f"no bearer token: send the pod's projected ServiceAccount token (audience {AUDIENCE})"
            " as 'Authorization: Bearer <token>'",
        )
    return token


def token_review(token: str, audience: str = AUDIENCE) -> dict[str, Any]:
    """Pure: the TokenReview that verifies ``token`` for ``audience`` only."""
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": token, "audiences": [audience]},
    }


def _one(extra: Mapping[str, Any], key: str) -> str | None:
    value = extra.get(key)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) and value[0]:
        return value[0]
    return None


def caller_of(status: Mapping[str, Any], audience: str = AUDIENCE) -> Caller:
    """Pure: the pod a TokenReview's ``status`` vouches for.

    401 unless the review authenticated the token for ``audience``; 403 for a
    token that is not a ServiceAccount's or not bound to a pod.
    """
    if status.get("authenticated") is not True:
        raise Refused(
            401,
            f"the token is not valid for audience {audience} (expired, or not a projected"
            f" ServiceAccount token with that audience)",
        )
    audiences = status.get("audiences")
    # An apiserver without audiences of its own would accept any token: the review must name ours.
    if not isinstance(audiences, list) or audience not in audiences:
        raise Refused(401, f"the token was not verified for audience {audience}")
    user = status.get("user")
    if not isinstance(user, Mapping):
        user = {}
    username = str(user.get("username") or "")
    parts = username[len(SERVICE_ACCOUNT_PREFIX) :].split(":") if username.startswith(SERVICE_ACCOUNT_PREFIX) else []
    if len(parts) != 2 or not all(parts):
        raise Refused(403, "the token is not a ServiceAccount's: use the pod's projected ServiceAccount token")
    extra = user.get("extra")
    if not isinstance(extra, Mapping):
        extra = {}
    name, uid = _one(extra, EXTRA_POD_NAME), _one(extra, EXTRA_POD_UID)
    if name is None or uid is None:
        raise Refused(403, "the token is not bound to a pod: use a projected serviceAccountToken volume of the pod")
    return Caller(namespace=parts[0], pod=name, uid=uid)


def check_served(caller: Caller, namespaces: Collection[str]) -> None:
    """Pure: 403 for a pod in a namespace this operator does not serve (``namespaces`` empty: all)."""
    if namespaces and caller.namespace not in namespaces:
        raise Refused(403, f"namespace {caller.namespace} is not served by this operator")


def is_spotguard_pod(pod: Mapping[str, Any]) -> bool:
    """Pure: a pod of a TrainingJob (``spotguard.dev/job``), or one the webhook injected the sidecar into."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    if labels.get(LABEL_JOB):
        return True
    return labels.get(LABEL_INJECT) == "true" and bool(annotations.get(ANNOTATION_INJECTED))


def check_pod(caller: Caller, pod: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """Pure: the caller's pod as read, if it is the very pod of the token and spotguard's; else why not."""
    where = f"{caller.namespace}/{caller.pod}"
    if pod is None:
        raise Refused(404, f"pod {where} no longer exists")
    if (pod.get("metadata") or {}).get("uid") != caller.uid:
        raise Refused(403, f"the token belongs to an earlier pod named {where}")
    if not is_spotguard_pod(pod):
        raise Refused(403, f"pod {where} is not spotguard's (no {LABEL_JOB} label, not injected)")
    return pod


def pod_view(pod: Mapping[str, Any]) -> dict[str, Any]:
    """Pure: the minimal view of a pod the sidecar needs (``disruption_notice`` reads it), nothing more."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    conditions = [dict(c) for c in status.get("conditions") or [] if isinstance(c, Mapping)]
    return {
        "metadata": {"uid": meta.get("uid"), "deletionTimestamp": meta.get("deletionTimestamp")},
        "spec": {
            "terminationGracePeriodSeconds": spec.get("terminationGracePeriodSeconds"),
            "nodeName": spec.get("nodeName"),
        },
        "status": {"conditions": conditions},
    }


def event_request(body: bytes) -> tuple[str, str]:
    """Pure: ``(reason, message)`` of an Event request; 400 (413 when too large) with what to send."""
    if len(body) > MAX_BODY:
        raise Refused(413, f"the request is larger than {MAX_BODY} bytes")
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise Refused(400, 'the body must be JSON: {"reason": ..., "message": ...}') from None
    reason, message = (doc.get("reason"), doc.get("message", "")) if isinstance(doc, dict) else (None, None)
    if not isinstance(reason, str) or reason not in RELAYED_REASONS:
        raise Refused(400, f"reason must be one of {', '.join(sorted(RELAYED_REASONS))}, not {reason!r}")
    if not isinstance(message, str):
        raise Refused(400, "message must be a string")
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    return reason, message


def relayed_event(
    caller: Caller, node: str | None, reason: str, message: str, now: datetime, instance: str
) -> dict[str, Any]:
    """Pure: the core/v1 Warning Event the relay posts on the caller's own pod, for its sidecar."""
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    source: dict[str, Any] = {"component": "spotguard-sidecar"}
    if node:
        source["host"] = node
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{caller.pod}.", "namespace": caller.namespace},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": caller.pod,
            "namespace": caller.namespace,
            "uid": caller.uid,
        },
        "reason": reason,
        "message": message,
        "type": "Warning",
        "source": source,
        "reportingComponent": "spotguard.dev/operator",
        "reportingInstance": instance[:128],
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def refusal(exc: Refused) -> HttpAnswer:
    """Pure: the HTTP answer to a refused request."""
    return exc.status, {"error": exc.message}


# --- I/O ----------------------------------------------------------------------------------


class _Expiring:
    """A small map whose entries expire; expired ones go when it grows (thread-safe)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[Any, tuple[float, Any]] = {}

    def get(self, key: Any) -> tuple[bool, Any]:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] <= self._clock():
                return False, None
            return True, entry[1]

    def put(self, key: Any, value: Any, seconds: float) -> None:
        with self._lock:
            self._put(key, value, seconds)

    def claim(self, key: Any, seconds: float) -> bool:
        """Take ``key`` for ``seconds`` unless it is taken; True when taken now."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] > self._clock():
                return False
            self._put(key, True, seconds)
            return True

    def _put(self, key: Any, value: Any, seconds: float) -> None:
        now = self._clock()
        if len(self._entries) >= MAX_ENTRIES:
            self._entries = {k: e for k, e in self._entries.items() if e[0] > now}
            if len(self._entries) >= MAX_ENTRIES:  # all alive: drop the oldest
                self._entries.pop(next(iter(self._entries)))
        self._entries[key] = (now + seconds, value)


class NoticeRelay:
    """The relay's I/O: TokenReviews, pod reads and Events through ``core`` (a CoreV1Api).

    ``namespaces``: those the operator serves (empty: all). ``instance``: this
    replica (the relayed Events' ``reportingInstance``).
    """

    max_body = MAX_BODY

    def __init__(
        self,
        core: Any,
        namespaces: Collection[str] = (),
        instance: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from kubernetes import client

        self.core = core
        self.auth = client.AuthenticationV1Api(core.api_client)
        self.namespaces = frozenset(namespaces)
        self.instance = instance
        self._reviews = _Expiring(clock)
        self._pods = _Expiring(clock)
        self._events = _Expiring(clock)
        self._api_calls = threading.BoundedSemaphore(MAX_API_CALLS)
        self._trouble = ""

    def serves(self, path: str) -> bool:
        """Whether ``path`` is the relay's (``/notices/v1`` and below)."""
        return path == BASE_PATH or path.startswith(f"{BASE_PATH}/")

    def handle(self, method: str, path: str, authorization: str | None, body: bytes = b"") -> HttpAnswer:
        """The answer to a request for one of the relay's paths (see :meth:`serves`)."""
        wanted = {POD_PATH: "GET", EVENT_PATH: "POST"}.get(path)
        if wanted is None:
            return 404, {"error": f"nothing at {path}: use GET {POD_PATH} or POST {EVENT_PATH}"}
        if method != wanted:
            return 405, {"error": f"{path} takes {wanted}"}
        try:
            caller = self.verify(authorization)
            pod = check_pod(caller, self.read_pod(caller))
            if path == POD_PATH:
                return 200, pod_view(pod)
            return self.post_event(caller, pod, body)
        except Refused as exc:
            log.debug("notice relay: %s %s refused (%d): %s", method, path, exc.status, exc.message)
            return refusal(exc)

    def verify(self, authorization: str | None) -> Caller:
        """The pod whose token came with the request (a TokenReview, cached by the token's hash)."""
        token = bearer_token(authorization)
        key = hashlib.sha256(token.encode()).hexdigest()
        known, caller = self._reviews.get(key)
        if not known:
            try:
                with self._api_call("TokenReview"):
                    resp = self.auth.create_token_review(
                        token_review(token), _preload_content=False, _request_timeout=API_TIMEOUT_SECONDS
                    )
                status = json.loads(resp.data).get("status") or {}
            except Refused:
                raise
            except Exception as exc:  # noqa: BLE001 - the review itself failed: a 503, not the caller's fault
                raise self._unavailable("TokenReview", exc) from None
            try:
                caller = caller_of(status)
            except Refused as exc:
                caller = exc  # the same token is refused again without asking the apiserver
            self._reviews.put(key, caller, REVIEW_CACHE_SECONDS)
        if isinstance(caller, Refused):
            raise Refused(caller.status, caller.message)
        assert isinstance(caller, Caller)
        check_served(caller, self.namespaces)
        return caller

    @contextlib.contextmanager
    def _api_call(self, what: str) -> Iterator[None]:
        """One of the :data:`MAX_API_CALLS` slots for a request to the apiserver; 503 when none frees in time."""
        if not self._api_calls.acquire(timeout=API_TIMEOUT_SECONDS):
            raise Refused(503, f"the operator is busy ({what}); the sidecar tries again")
        try:
            yield
        finally:
            self._api_calls.release()

    def read_pod(self, caller: Caller) -> dict[str, Any] | None:
        """The caller's pod (None when gone), read at most once per :data:`POD_CACHE_SECONDS`."""
        key = (caller.namespace, caller.pod)
        known, pod = self._pods.get(key)
        if known:
            return pod  # type: ignore[no-any-return]
        try:
            with self._api_call("reading the pod"):
                resp = self.core.read_namespaced_pod(
                    caller.pod, caller.namespace, _preload_content=False, _request_timeout=API_TIMEOUT_SECONDS
                )
            pod = json.loads(resp.data)
        except Refused:
            raise
        except Exception as exc:  # noqa: BLE001 - any client or API error but a 404 is a 503 for the caller
            if api_status(exc) != 404:
                raise self._unavailable(f"reading pod {caller.namespace}/{caller.pod}", exc) from None
            pod = None
        self._pods.put(key, pod, POD_CACHE_SECONDS)
        return pod  # type: ignore[no-any-return]

    def post_event(self, caller: Caller, pod: Mapping[str, Any], body: bytes) -> HttpAnswer:
        """Post one of the relayed reasons on the caller's own pod (at most one per reason and interval)."""
        reason, message = event_request(body)
        if not self._events.claim((caller.uid, reason), EVENT_INTERVAL_SECONDS):
            raise Refused(429, f"an Event {reason} was posted on this pod less than {EVENT_INTERVAL_SECONDS:g} s ago")
        node = (pod.get("spec") or {}).get("nodeName")
        event = relayed_event(caller, node, reason, message, datetime.now(UTC), self.instance)
        try:
            with self._api_call("posting an Event"):
                self.core.create_namespaced_event(caller.namespace, event, _request_timeout=API_TIMEOUT_SECONDS)
        except Refused:
            raise
        except Exception as exc:  # noqa: BLE001 - any client or API error is a 503 for the caller
            raise self._unavailable(f"posting an Event on pod {caller.namespace}/{caller.pod}", exc) from None
        log.info("notice relay: posted %s on pod %s/%s for its sidecar", reason, caller.namespace, caller.pod)
        return 202, {"posted": reason}

    def _unavailable(self, what: str, exc: BaseException) -> Refused:
        """503 for the caller; a warning in the operator's log when the trouble is new (never the token)."""
        reason = api_reason(exc)
        hint = ""
        if api_status(exc) == 403:
            hint = (
                " (the operator's RBAC needs create on tokenreviews.authentication.k8s.io, get on pods and"
                " create on events where its jobs run: install the chart's RBAC)"
            )
        text = f"{what}: {reason}{hint}"
        if text != self._trouble:
            self._trouble = text
            log.warning("notice relay: %s", text)
        return Refused(503, f"the operator cannot answer now: {what} failed ({reason}); the sidecar tries again")
