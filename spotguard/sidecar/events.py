"""Kubernetes Events the sidecar posts on its own pod (best effort).

Today one: ``MetricsPortUnavailable``, when the sidecar cannot bind its
metrics port (two ``hostNetwork`` pods on one node), once at its start.

How, in this order:

* in a pod of the operator's with the ``k8s`` notice source
  (``SPOTGUARD_NOTICE_URL`` and the pod's projected token): the operator's
  notice relay posts it on the caller's own pod (``POST /notices/v1/event``,
  reasons of :data:`spotguard.notice_relay.RELAYED_REASONS` only). The pod's
  own account needs no rights; spotguard grants it none;
* else with ``KUBECONFIG`` (outside a cluster), or the in-cluster
  ServiceAccount where the pod has one mounted: directly, which needs
  ``create`` on events for that account (spotguard does not grant it: without
  it, or anywhere else, the warning stays in the sidecar's log and its
  termination report's ``metricsError``, which the operator quotes).

Only where the sidecar can tell which pod it is (``POD_NAME`` and
``POD_NAMESPACE``). Posting happens in a daemon thread with a short timeout: a
missing permission, an unreachable apiserver or relay, or a slow one is logged
and forgotten; it never delays or stops shipping checkpoints.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from spotguard import notice_relay
from spotguard.contract import env as envvars
from spotguard.contract.env import from_env
from spotguard.sidecar.notices import http_request, read_token, relay_error

log = logging.getLogger(__name__)

COMPONENT = "spotguard-sidecar"
# Reasons the sidecar posts (CamelCase, like kubelet's); the notice relay posts these on its behalf.
REASON_METRICS_PORT_UNAVAILABLE = notice_relay.REASON_METRICS_PORT_UNAVAILABLE
REQUEST_TIMEOUT_SECONDS = 5.0
MAX_MESSAGE = 1024
_SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def pod_event(
    pod: str,
    namespace: str,
    reason: str,
    message: str,
    *,
    uid: str | None = None,
    event_type: str = "Warning",
    now: dt.datetime | None = None,
    host: str | None = None,
) -> dict[str, Any]:
    """Pure: a core/v1 Event about pod ``namespace/pod`` from the sidecar.

    ``uid`` lets ``kubectl describe pod`` show it (it matches events by the
    pod's uid); without it the event is still listed by ``kubectl get events``.
    """
    when = (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC)
    stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    involved: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "name": pod, "namespace": namespace}
    if uid:
        involved["uid"] = uid
    source: dict[str, Any] = {"component": COMPONENT}
    if host:
        source["host"] = host
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{pod}.", "namespace": namespace},
        "involvedObject": involved,
        "reason": reason,
        "message": message,
        "type": event_type,
        "source": source,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def _core_api(env: Mapping[str, str]) -> Any | None:
    """A CoreV1Api on its own configuration, or None when there is no apiserver to talk to."""
    from kubernetes import client, config  # heavy: only when there is something to post

    cfg = client.Configuration()
    if env.get("KUBECONFIG"):
        config.load_kube_config(config_file=env["KUBECONFIG"], client_configuration=cfg)
    elif env.get("KUBERNETES_SERVICE_HOST") and os.path.exists(_SERVICE_ACCOUNT_TOKEN):
        config.load_incluster_config(client_configuration=cfg)
    else:
        return None
    return client.CoreV1Api(client.ApiClient(cfg))


def post_pod_event(
    reason: str, message: str, env: Mapping[str, str] | None = None, timeout: float = REQUEST_TIMEOUT_SECONDS
) -> bool:
    """Post a Warning Event on this container's pod; True when the apiserver (or the notice relay) took it.

    Never raises: any failure (no pod identity, no configuration, no
    permission, a timeout) is logged at INFO or DEBUG and returns False.
    """
    env = os.environ if env is None else env
    relay_url = from_env(envvars.NOTICE_URL, env)
    if relay_url:
        return _post_through_relay(
            relay_url, from_env(envvars.NOTICE_TOKEN_FILE, env) or notice_relay.TOKEN_FILE, reason, message, timeout
        )
    pod, namespace = env.get("POD_NAME"), env.get("POD_NAMESPACE")
    if not pod or not namespace:
        log.debug("no POD_NAME/POD_NAMESPACE: event %s not posted", reason)
        return False
    try:
        api = _core_api(env)
        if api is None:
            log.debug("not in a cluster and no KUBECONFIG: event %s not posted", reason)
            return False
        uid = env.get("POD_UID") or _pod_uid(api, pod, namespace, timeout)
        body = pod_event(pod, namespace, reason, message, uid=uid, host=env.get("NODE_NAME") or None)
        api.create_namespaced_event(namespace, body, _request_timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - an event is a courtesy, never a failure
        log.info("could not post event %s on pod %s/%s: %s", reason, namespace, pod, _short(exc))
        return False
    log.debug("posted event %s on pod %s/%s", reason, namespace, pod)
    return True


def _post_through_relay(url: str, token_file: str, reason: str, message: str, timeout: float) -> bool:
    """Ask the operator's notice relay to post the Event on this pod (it takes the pod from the token)."""
    target = notice_relay.event_url(url)
    body = json.dumps({"reason": reason, "message": message[:MAX_MESSAGE]}).encode()
    try:
        token = read_token(token_file)
        resp = http_request(
            target,
            method="POST",
            data=body,
            timeout=timeout,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
    except (OSError, ValueError) as exc:
        log.info("could not post event %s through the notice relay %s: %s", reason, target, exc)
        return False
    if resp.status not in (200, 201, 202):
        log.info(
            "the notice relay %s did not post event %s: HTTP %d: %s",
            target,
            reason,
            resp.status,
            relay_error(resp.body),
        )
        return False
    log.debug("the notice relay posted event %s", reason)
    return True


def post_pod_event_async(reason: str, message: str, env: Mapping[str, str] | None = None) -> threading.Thread:
    """:func:`post_pod_event` in a daemon thread (returned, for tests to join)."""
    snapshot = dict(os.environ if env is None else env)
    thread = threading.Thread(
        target=post_pod_event, args=(reason, message, snapshot), name="spotguard-event", daemon=True
    )
    thread.start()
    return thread


def _pod_uid(api: Any, pod: str, namespace: str, timeout: float) -> str | None:
    # The pod's uid ties the event to this very pod; reading it needs "get" on
    # pods, which the job's ServiceAccount may not have: then go without.
    try:
        obj = api.read_namespaced_pod(pod, namespace, _request_timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - the uid is optional: the event goes out without it
        log.debug("could not read pod %s/%s for its uid: %s", namespace, pod, _short(exc))
        return None
    uid = getattr(getattr(obj, "metadata", None), "uid", None)
    return str(uid) if uid else None


def _short(exc: BaseException) -> str:
    # ApiException's text spans lines (headers, body): status and reason say enough.
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status:
        return f"HTTP {status} {getattr(exc, 'reason', '') or ''}".strip()
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
