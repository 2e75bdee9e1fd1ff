"""Host ports of jobs whose pods share their node's network (pure).

With ``hostNetwork: true`` a job's pods listen on their node's ports: torchrun's
master port (rank 0's rendezvous store) and the sidecar's metrics port. Unless
the spec sets both, the operator gives each such job a pair of ports that no
other live job holds, from a range outside Kubernetes' NodePort range, and
records it in ``status.hostPorts``: every attempt of the job uses the same
pair, a restarted operator (or a standby replica) reads the taken pairs from
the jobs themselves, and a job that finishes or is deleted frees its pair.

This module holds the rules; ``kubeapi.ensure_host_ports`` does the I/O.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from spotguard.operator.jobstatus import (
    PENDING,
    TERMINAL_PHASES,
    Decision,
    Event,
    condition,
    set_condition,
)
from spotguard.operator.spec import DEFAULT_MASTER_PORT, TrainingJobSpec

#: Default range of host ports: below Kubernetes' default NodePort range and
#: below Linux's default ephemeral range (32768-60999).
DEFAULT_RANGE = (20000, 29999)
#: Kubernetes' default ``--service-node-port-range``.
NODEPORT_RANGE = (30000, 32767)
#: Never handed out: torchrun's default master port, which other software on a
#: GPU node often uses with the node's network.
RESERVED = frozenset({DEFAULT_MASTER_PORT})

STATUS_FIELD = "hostPorts"
COND_HOST_PORTS = "HostPortsAllocated"
R_EXHAUSTED = "HostPortRangeExhausted"
R_ALLOCATED = "HostPortsAllocated"
#: Seconds between looks while a job waits for a free pair.
WAIT_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class HostPorts:
    """A job's pair as recorded in its status; ``confirmed`` once no other claim on it can win."""

    master: int
    metrics: int
    confirmed: bool = False

    @property
    def pair(self) -> tuple[int, int]:
        """(master port, metrics port)."""
        return self.master, self.metrics

    def as_status(self) -> dict[str, Any]:
        """The ``status.hostPorts`` object."""
        out: dict[str, Any] = {"master": self.master, "metrics": self.metrics}
        if self.confirmed:
            out["confirmed"] = True
        return out


def parse_range(text: str) -> tuple[int, int]:
    """``"20000-29999"`` -> (20000, 29999); ValueError with a reason for anything else."""
    parts = [p.strip() for p in str(text).split("-")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{text!r} is not FIRST-LAST (e.g. 20000-29999)")
    first, last = int(parts[0]), int(parts[1])
    if not 1 <= first <= 65535 or not 1 <= last <= 65535:
        raise ValueError(f"{text!r}: ports are 1-65535")
    if last <= first:
        raise ValueError(f"{text!r}: FIRST must be below LAST (a range holds at least one pair of ports)")
    return first, last


def format_range(rng: tuple[int, int]) -> str:
    """(20000, 29999) -> ``"20000-29999"``."""
    return f"{rng[0]}-{rng[1]}"


def overlaps_nodeports(first: int, last: int) -> bool:
    """Whether the range shares a port with Kubernetes' default NodePort range."""
    return first <= NODEPORT_RANGE[1] and last >= NODEPORT_RANGE[0]


def pair_count(first: int, last: int) -> int:
    """How many pairs ``(first + 2k, first + 2k + 1)`` the range holds."""
    return max(0, (last - first + 1) // 2)


def preferred_index(uid: str, count: int) -> int:
    """Where a job starts looking for a free pair: spread by its uid, so that claims rarely meet."""
    if count <= 0:
        return 0
    return int(hashlib.sha256(uid.encode()).hexdigest()[:8], 16) % count


def pick_pair(taken: Collection[int], first: int, last: int, start: int = 0) -> tuple[int, int] | None:
    """The first pair of the range, from pair index ``start`` on (wrapping), with neither port taken; None if full."""
    count = pair_count(first, last)
    for i in range(count):
        k = (start + i) % count
        pair = (first + 2 * k, first + 2 * k + 1)
        if pair[0] not in taken and pair[1] not in taken:
            return pair
    return None


def needs_host_ports(spec: TrainingJobSpec) -> bool:
    """Whether the operator allocates ports for this job (node's network, a port not set in the spec)."""
    return spec.host_network and not (spec.master_port_set and spec.metrics_port_set)


def recorded(status: Mapping[str, Any] | None) -> HostPorts | None:
    """The pair recorded in a status, if any."""
    raw = (status or {}).get(STATUS_FIELD)
    if not isinstance(raw, Mapping):
        return None
    master, metrics = raw.get("master"), raw.get("metrics")
    if not isinstance(master, int) or not isinstance(metrics, int):
        return None
    return HostPorts(master, metrics, raw.get("confirmed") is True)


def deleting(job: Mapping[str, Any]) -> bool:
    """Whether the job is being deleted."""
    return bool((job.get("metadata") or {}).get("deletionTimestamp"))


def held_ports(job: Mapping[str, Any]) -> set[int]:
    """Ports a job holds.

    Its recorded pair (claimed or confirmed) until the job is deleted; the
    operator removes the pair in the same status write that finishes the job.
    With hostNetwork, also the ports its spec sets, until it finishes.
    """
    if deleting(job):
        return set()
    out: set[int] = set()
    mine = recorded(job.get("status"))
    if mine is not None:
        out.update(mine.pair)
    if (job.get("status") or {}).get("phase") in TERMINAL_PHASES:
        return out
    spec = job.get("spec") or {}
    pod_spec = ((spec.get("template") or {}) if isinstance(spec, Mapping) else {}).get("spec") or {}
    if isinstance(pod_spec, Mapping) and pod_spec.get("hostNetwork") is True:
        sidecar = spec.get("sidecar") or {}
        for port in (spec.get("masterPort"), sidecar.get("metricsPort") if isinstance(sidecar, Mapping) else None):
            if isinstance(port, int) and not isinstance(port, bool) and port > 0:
                out.add(port)
    return out


def _uid(job: Mapping[str, Any]) -> str:
    return str((job.get("metadata") or {}).get("uid") or "")


def taken_ports(jobs: Iterable[Mapping[str, Any]], uid: str) -> set[int]:
    """Every port held by a job other than ``uid``, plus the reserved ones."""
    out = set(RESERVED)
    for job in jobs:
        if _uid(job) != uid:
            out |= held_ports(job)
    return out


def holders(jobs: Iterable[Mapping[str, Any]], uid: str, ports: Collection[int]) -> list[str]:
    """``namespace/name`` of each job other than ``uid`` that holds one of ``ports``."""
    out = []
    for job in jobs:
        if _uid(job) != uid and held_ports(job) & set(ports):
            meta = job.get("metadata") or {}
            out.append(f"{meta.get('namespace')}/{meta.get('name')}")
    return sorted(out)


def exhausted_message(first: int, last: int) -> str:
    """What the job says while every pair of the range is held."""
    return (
        f"no free pair of host ports in {first}-{last}: every pair is held by another hostNetwork TrainingJob."
        " The job starts when one of them finishes or is deleted; to run more at once, widen the range"
        " (chart value operator.hostPortRange, operator flag --host-port-range) or set spec.masterPort and"
        " spec.sidecar.metricsPort"
    )


def wait_for_ports(status: Mapping[str, Any], message: str, now: datetime, generation: int | None) -> Decision:
    """The job waits for a free pair: no pod, the condition False, a Warning Event when it turns so."""
    st = copy.deepcopy(dict(status))
    st.setdefault("phase", PENDING)
    conds = st.setdefault("conditions", [])
    before = condition(st, COND_HOST_PORTS) or {}
    set_condition(conds, COND_HOST_PORTS, False, R_EXHAUSTED, message, now, generation)
    events: tuple[Event, ...] = ()
    if before.get("status") != "False" or before.get("message") != message:
        events = (Event("Warning", R_EXHAUSTED, message),)
    if generation is not None:
        st["observedGeneration"] = generation
    return Decision(status=st, events=events, requeue_after=WAIT_SECONDS)


def note_allocated(
    status: Mapping[str, Any], ports: HostPorts, now: datetime, generation: int | None
) -> tuple[dict[str, Any], tuple[Event, ...]]:
    """Turn the condition True once a job that waited has its pair (a job that never waited gets none)."""
    st = dict(status)
    before = condition(st, COND_HOST_PORTS)
    if before is None or before.get("status") == "True":
        return st, ()
    st = copy.deepcopy(st)
    message = f"host ports {ports.master} (master) and {ports.metrics} (metrics)"
    set_condition(st["conditions"], COND_HOST_PORTS, True, R_ALLOCATED, message, now, generation)
    return st, (Event("Normal", R_ALLOCATED, message),)
