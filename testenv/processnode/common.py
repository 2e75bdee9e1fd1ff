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
HEARTBEAT_SECONDS = 5.0
LEASE_SECONDS = 40
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
