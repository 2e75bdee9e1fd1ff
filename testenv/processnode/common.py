"""Names, constants and clocks shared by the process node's modules."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

log = logging.getLogger("processnode")

JSON = dict[str, Any]

MODES = ("drain", "shutdown", "kill")
LOOPBACK = "127.0.0.1"
RUN_MARKER = "SPOTGUARD_TESTENV_RUN"
NODE_LEASE_NAMESPACE = "kube-node-lease"
#: As kubelet 1.20 does with node leases: the Lease renewed every 10 s (a quarter of its 40 s), the
#: node's status posted when it changes and otherwise only now and then (kubelet: every 5 min; here
#: every minute). Every status write wakes each watcher of Nodes (the scheduler, the controller-manager,
#: kopf in every operator): posting both every 5 s cost the test world about 1% of a core all along.
HEARTBEAT_SECONDS = 10.0
LEASE_SECONDS = 40
STATUS_REPORT_SECONDS = 60.0
DEFAULT_POD_GRACE = 30
SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
SHUTDOWN_REJECT_MESSAGE = "Pod was rejected as the node is shutting down."


def utc_now() -> str:
    """Kubernetes ``Time``: RFC 3339, seconds."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_now_micro() -> str:
    """Kubernetes ``MicroTime`` (Lease renewTime)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class PreemptError(Exception):
    """A preemption request that cannot be carried out (one line for the caller)."""


#: In a pod's directory: when it was made (ns since the epoch), which orders the pods of one name.
CREATED_FILE = "_created"


def pod_dir_name(namespace: str, name: str, uid: str) -> str:
    """The directory of one pod (of one UID) under the agent's ``pods/`` (names and UIDs hold no ``_``)."""
    return f"{namespace}_{name}_{uid}"
