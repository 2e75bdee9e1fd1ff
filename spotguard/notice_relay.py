"""The notice relay's contract: what the operator serves and what the sidecar asks it.

A pod of a job with the ``k8s`` notice source learns of its own disruption
(a ``DisruptionTarget`` condition, a ``deletionTimestamp``) through the
operator instead of reading the API with rights of its own: the operator would
otherwise have to create a RoleBinding per job, and an account that may create
RoleBindings can bind any role whose rules it holds, its own included. Server:
:mod:`spotguard.operator.notices`; client: the sidecar's
``KubernetesDisruptionNotices`` and its Events (:mod:`spotguard.sidecar.events`).

Wire protocol (HTTP, JSON answers, ``Authorization: Bearer <token>``):

=========================  ==========================================================================
``GET  <base>/pod``        the caller's own pod, a minimal view: ``{"metadata": {"uid",
                           "deletionTimestamp"}, "spec": {"terminationGracePeriodSeconds",
                           "nodeName"}, "status": {"conditions"}}``
``POST <base>/event``      body ``{"reason", "message"}``: a Warning Event on the caller's own pod,
                           for the reasons in :data:`RELAYED_REASONS` only (202)
=========================  ==========================================================================

The token is a projected ServiceAccount token of the pod (audience
:data:`AUDIENCE`, bound to the pod), mounted into the sidecar container only.
Refusals: 401 (no or an invalid token), 403 (a token not bound to a pod, a
namespace the operator does not serve, a pod that is not spotguard's), 404
(the token's pod is gone); each with ``{"error": "..."}`` saying why.
"""

from __future__ import annotations

from urllib.parse import urljoin

#: The audience of the pods' projected tokens: useless against the apiserver, which accepts only its own.
AUDIENCE = "spotguard.dev/notices"
#: Paths served by every operator replica (on its probes port).
BASE_PATH = "/notices/v1"
POD_PATH = f"{BASE_PATH}/pod"
EVENT_PATH = f"{BASE_PATH}/event"

#: Where the operator mounts the projected token into the sidecar container (kubelet rewrites it before it
#: expires); the sidecar finds it, and the relay's pod URL, in its environment (``spotguard.contract.env``:
#: ``NOTICE_TOKEN_FILE``, ``NOTICE_URL``).
TOKEN_DIR = "/var/run/secrets/spotguard.dev/notices"
TOKEN_NAME = "token"
TOKEN_FILE = f"{TOKEN_DIR}/{TOKEN_NAME}"
#: The token's lifetime (the API's minimum); kubelet renews it at 80 %.
TOKEN_EXPIRATION_SECONDS = 600

#: The only Event reasons the relay posts for a sidecar.
REASON_METRICS_PORT_UNAVAILABLE = "MetricsPortUnavailable"
RELAYED_REASONS = frozenset({REASON_METRICS_PORT_UNAVAILABLE})


def event_url(notice_url: str) -> str:
    """Pure: the relay's Event URL next to its pod URL (``.../notices/v1/pod`` -> ``.../notices/v1/event``)."""
    return urljoin(notice_url, EVENT_PATH.rsplit("/", 1)[-1])
