"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection does it.

Several operator replicas may run; only the leader runs kopf's handlers, the
others stand by. kopf's peering cannot give that guarantee: a replica frozen
(SIGSTOP, a stalled VM, a long GC pause) and later continued keeps acting
until it next reads the peering object, and nothing stops it meanwhile.

The election (the same rules as client-go, so its timing is familiar):

* One Lease (``<fullname>-leader`` in the operator's namespace) names the
  holder (``holderIdentity``: the pod's name and a random suffix, fresh for
  every process, so a restarted replica never mistakes itself for the
  holder), ``leaseDurationSeconds``, ``acquireTime``/``renewTime`` and
  ``leaseTransitions``.
* A candidate reads the Lease every ``retry_period``. It judges expiry by its
  *own* monotonic clock only: a lease held by another expires
  ``leaseDurationSeconds`` after this replica last *saw the record change*.
  The times written in the Lease are never compared with a local clock, so
  skewed clocks between machines do no harm. A released lease (no holder)
  may be taken at once.
* Every write carries the ``resourceVersion`` that was read (optimistic
  concurrency): of two candidates that both find the lease expired, the
  apiserver lets exactly one write succeed; the other gets 409 Conflict and
  stays a candidate.
* The leader renews every ``retry_period``. If no renewal has succeeded for
  ``renew_deadline`` (measured from when the last successful renewal was
  *sent*, which is no later than when any other replica can have seen it),
  the process exits at once (``os._exit``): the Deployment restarts it as a
  standby with a new identity. ``renew_deadline < lease_duration``, so the
  leader gives up before any standby may take over.
* On SIGTERM the leader stops kopf, then releases the Lease (no holder,
  duration 1 s, as client-go's ReleaseOnCancel), so a standby takes over at
  its next look (``retry_period``) instead of after ``lease_duration``.

Fencing. A frozen leader that is continued must not act before it notices
that it lost the lease. Every write the operator makes for a job (creating
and deleting pods, its Service, ServiceAccount and RoleBinding, patching a
TrainingJob's status, posting an Event) first calls :meth:`LeaderElector.fence`:
if the last successful renewal is ``renew_deadline`` or more old on the
monotonic clock (which runs on while a process is stopped), the process
exits at once without writing. The same check runs again at the last
moment, as each request's bytes go to the socket (:func:`fence_requests`
for the kubernetes clients, the Lease's own renewals included; kopf's own
requests, its finalizer and Events, through the session
``spotguard.operator.handlers`` gives it), since a
request takes milliseconds of client work between the first check and the
wire, and a freeze lands there as easily as anywhere.

Residual window: a freeze *between* that last check and the send system
call (a few interpreter steps) lets one request reach the apiserver late,
at most one per thread. A freeze shorter than ``lease_duration -
renew_deadline`` (5 s by default) is harmless even then: no standby can
have taken over yet. Beyond it, each write's own guard holds: status writes
carry the job's ``resourceVersion`` (a stale leader's write fails with 409
once the new leader has written), pods have deterministic names (a second
create of an attempt's pod fails with 409 and is adopted, never
duplicated), and Events are reports only.

The decisions are pure functions of the observed record, when it was
observed, the time now and the identity (:func:`observe`, :func:`decide`,
:func:`fenced`), tested without any I/O; :class:`LeaderElector` does the I/O.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from spotguard.operator.apierrors import api_reason, api_status

log = logging.getLogger("spotguard.operator")

#: client-go's defaults (kube-controller-manager's ``--leader-elect-*`` flags).
LEASE_DURATION_SECONDS = 15
RENEW_DEADLINE_SECONDS = 10.0
RETRY_PERIOD_SECONDS = 2.0
#: client-go's JitterFactor: candidates retry within [1, 1.2] retry periods, and
#: the renew deadline must leave room for that.
JITTER_FACTOR = 1.2
#: The exit status of a replica that lost its lease (EX_TEMPFAIL: restart me).
LOST_EXIT_CODE = 75
#: Separates the pod's name from the per-process suffix in an identity (never in a pod name).
IDENTITY_SEPARATOR = "_"


# --- pure: timing, records, decisions ----------------------------------------------


@dataclass(frozen=True, slots=True)
class Timing:
    """How long a lease lasts, how long a leader keeps trying to renew it, how often anyone looks."""

    lease_duration: int = LEASE_DURATION_SECONDS
    renew_deadline: float = RENEW_DEADLINE_SECONDS
    retry_period: float = RETRY_PERIOD_SECONDS

    def problem(self) -> str | None:
        """Why these durations cannot work (client-go's checks), or None."""
        if self.lease_duration < 1 or self.renew_deadline <= 0 or self.retry_period <= 0:
            return "every duration must be positive (the lease duration at least 1 s)"
        if self.lease_duration <= self.renew_deadline:
            return (
                f"the lease duration ({self.lease_duration} s) must be longer than the renew deadline "
                f"({self.renew_deadline:g} s): a leader must give up before a standby may take over"
            )
        if self.renew_deadline <= JITTER_FACTOR * self.retry_period:
            return (
                f"the renew deadline ({self.renew_deadline:g} s) must be longer than {JITTER_FACTOR:g} x the "
                f"retry period ({self.retry_period:g} s): a leader must get more than one try to renew"
            )
        return None


@dataclass(frozen=True, slots=True)
class Record:
    """A Lease's spec: who holds it, for how long, since when, how often it changed hands."""

    holder: str = ""
    lease_duration: int = 0
    acquire_time: str | None = None
    renew_time: str | None = None
    transitions: int = 0

    @classmethod
    def from_lease(cls, lease: Mapping[str, Any]) -> Record:
        spec = lease.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            lease_duration=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=spec.get("acquireTime"),
            renew_time=spec.get("renewTime"),
            transitions=int(spec.get("leaseTransitions") or 0),
        )

    def spec(self) -> dict[str, Any]:
        """The Lease's ``spec`` for this record (a released lease has no holder)."""
        return {
            "holderIdentity": self.holder or None,
            "leaseDurationSeconds": self.lease_duration,
            "acquireTime": self.acquire_time,
            "renewTime": self.renew_time,
            "leaseTransitions": self.transitions,
        }


@dataclass(frozen=True, slots=True)
class Observation:
    """The record as last read (None: no Lease) and when, on the local monotonic clock, it was first seen so."""

    record: Record | None
    at: float


Action = Literal["create", "acquire", "renew", "wait", "lost"]


@dataclass(frozen=True, slots=True)
class Step:
    """What to do after a look at the Lease: write ``record`` (create, acquire, renew), wait, or stop (lost)."""

    action: Action
    record: Record | None = None
    #: For ``wait``: seconds until the holder's lease expires as judged here (0: never seen it change yet).
    expires_in: float = 0.0


def observe(previous: Observation | None, record: Record | None, now: float) -> Observation:
    """The new observation: the old one while the record is unchanged, else this record seen ``now``.

    A renewal changes ``renewTime``, so a live holder's record keeps changing;
    a dead holder's stops, and its lease runs out ``leaseDurationSeconds``
    after the last change *this* replica saw.
    """
    if previous is not None and previous.record == record:
        return previous
    return Observation(record, now)


def micro_time(when: datetime) -> str:
    """A Kubernetes MicroTime (RFC 3339, microseconds, UTC)."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def decide(
    observed: Observation, me: str, now: float, wall: datetime, timing: Timing, *, leading: bool = False
) -> Step:
    """What this replica does with the Lease now (client-go's tryAcquireOrRenew, without the I/O).

    ``now`` is the monotonic clock (expiry); ``wall`` is only written into the
    record, for people reading it. A ``leading`` replica that finds the Lease
    gone or anyone else's (even released) has lost it: it never takes it
    back, since it may have acted while it did not hold it.
    """
    stamp = micro_time(wall)
    record = observed.record
    if record is not None and record.holder == me:
        return Step("renew", Record(me, timing.lease_duration, record.acquire_time or stamp, stamp, record.transitions))
    if leading:
        return Step("lost")
    if record is None:
        return Step("create", Record(me, timing.lease_duration, stamp, stamp, 0))
    left = observed.at + record.lease_duration - now
    if record.holder and left > 0:
        return Step("wait", expires_in=left)
    return Step("acquire", Record(me, timing.lease_duration, stamp, stamp, record.transitions + 1))


def released(record: Record, wall: datetime) -> Record:
    """The record a leader leaves when it steps down: no holder, so a standby takes it at once."""
    stamp = micro_time(wall)
    return Record("", 1, stamp, stamp, record.transitions)


def fenced(last_renewal: float | None, now: float, renew_deadline: float) -> bool:
    """Whether a leader must stop acting: no successful renewal within ``renew_deadline`` (or none ever)."""
    return last_renewal is None or now - last_renewal >= renew_deadline


def new_identity(pod_name: str | None = None, suffix: str | None = None) -> str:
    """``<pod>_<random>``: the pod's name (``POD_NAME``, else the hostname) and a per-process suffix."""
    pod = pod_name or os.environ.get("POD_NAME") or socket.gethostname()
    return f"{pod}{IDENTITY_SEPARATOR}{suffix or secrets.token_hex(4)}"


def pod_of(identity: str) -> str:
    """The pod's name in an identity made by :func:`new_identity`."""
    return identity.rsplit(IDENTITY_SEPARATOR, 1)[0]


def jittered(period: float, rng: Callable[[], float] = random.random) -> float:
    """``period`` stretched by up to :data:`JITTER_FACTOR` (candidates do not retry in lockstep)."""
    return period * (1 + (JITTER_FACTOR - 1) * rng())


# --- I/O ----------------------------------------------------------------------------


class LostLease(Exception):
    """This replica is no longer (or never was) the leader; raised by the ``on_lost`` used in tests."""


def exit_lost(reason: str) -> None:
    """Stop the process at once: nothing of it may act any more (the default ``on_lost``)."""
    log.critical("lost the lease: %s; exiting at once (a restarted replica stands by)", reason)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(LOST_EXIT_CODE)


class LeaderElector:
    """One replica's part in the election: acquire, keep renewing, fence, release.

    ``api`` is a ``kubernetes.client.CoordinationV1Api``. ``clock`` (monotonic)
    and ``wall`` are injectable for tests, as is ``on_lost`` (default: exit).
    """

    def __init__(
        self,
        api: Any,
        namespace: str,
        name: str,
        identity: str,
        timing: Timing | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
        on_lost: Callable[[str], None] = exit_lost,
    ) -> None:
        self.timing = timing or Timing()
        problem = self.timing.problem()
        if problem:
            raise ValueError(problem)
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.clock = clock
        self.wall = wall
        self.on_lost = on_lost
        self.observed: Observation | None = None
        #: Monotonic time the last successful write of this replica's record was sent (None: not leading).
        self.renewed_at: float | None = None
        #: Monotonic time the standby's loop last ran (its liveness).
        self.ticked_at: float = clock()
        #: Whether the standby's last look at the Lease worked (None: no look yet); its readiness.
        self.reached: bool | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def where(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def holder(self) -> str:
        """The holder as last read ('' when none, or not read yet)."""
        return self.observed.record.holder if self.observed and self.observed.record else ""

    def _read(self, timeout: float) -> tuple[Record | None, str | None]:
        try:
            resp = self.api.read_namespaced_lease(
                self.name, self.namespace, _preload_content=False, _request_timeout=timeout
            )
        except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
            if api_status(exc) == 404:
                return None, None
            raise
        lease = json.loads(resp.data)
        return Record.from_lease(lease), (lease.get("metadata") or {}).get("resourceVersion")

    def _write(self, action: Action, record: Record, version: str | None, timeout: float) -> bool:
        """Create or replace the Lease; False when another writer got there first (409, or 404 on replace)."""
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if version is not None:
            metadata["resourceVersion"] = version
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": record.spec()}
        try:
            if action == "create":
                self.api.create_namespaced_lease(self.namespace, body, _preload_content=False, _request_timeout=timeout)
            else:
                self.api.replace_namespaced_lease(
                    self.name, self.namespace, body, _preload_content=False, _request_timeout=timeout
                )
        except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
            if api_status(exc) in (404, 409):
                return False
            raise
        return True

    @property
    def leading(self) -> bool:
        """Whether this replica holds the Lease (as far as it knows: see :meth:`fence`)."""
        return self.renewed_at is not None

    def try_acquire_or_renew(self, timeout: float | None = None) -> Step:
        """One look at the Lease and, when this replica may hold it, a write (client-go's tryAcquireOrRenew).

        Returns what was decided; a write that succeeded moved ``renewed_at``
        (a 409 means another writer was first: the next look sees what it wrote).
        """
        timeout = timeout if timeout is not None else self.timing.renew_deadline
        sent = self.clock()
        record, version = self._read(timeout)
        now = self.clock()
        self.observed = observe(self.observed, record, now)
        step = decide(self.observed, self.identity, now, self.wall(), self.timing, leading=self.leading)
        if self.leading and self._check_deadline():  # frozen since the read: not even a renewal goes out
            return Step("lost")
        if step.record is not None and self._write(step.action, step.record, version, timeout):
            self.observed = Observation(step.record, self.clock())
            self.renewed_at = sent
        return step

    def acquire(self, stop: threading.Event) -> bool:
        """Stand by until this replica holds the Lease (True), or until ``stop`` is set (False)."""
        log.info("standing by as %s for the Lease %s", self.identity, self.where)
        reported = ""
        while not stop.is_set():
            self.ticked_at = self.clock()
            try:
                self.try_acquire_or_renew()
                self.reached = True
            except Exception as exc:  # noqa: BLE001 - the apiserver may be briefly away; a candidate just tries again
                self.reached = False
                log.warning("could not read or write the Lease %s: %s", self.where, api_reason(exc))
            if self.leading:
                log.info("became the leader as %s (Lease %s)", self.identity, self.where)
                return True
            if self.holder and self.holder != reported:
                reported = self.holder
                log.info("the leader is %s; standing by", self.holder)
            stop.wait(jittered(self.timing.retry_period))
        return False

    def start_renewing(self) -> None:
        """Keep the Lease from a daemon thread; exits the process (``on_lost``) when that fails."""
        if self.renewed_at is None:
            raise RuntimeError("start_renewing before this replica holds the Lease")
        self._thread = threading.Thread(target=self._renew_loop, name="lease-renewal", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.timing.retry_period):
            last = self.renewed_at
            if last is None or self._check_deadline():
                return
            left = self.timing.renew_deadline - (self.clock() - last)
            try:
                step = self.try_acquire_or_renew(timeout=max(0.5, left))
            except Exception as exc:  # noqa: BLE001 - any client or API error is retried until the renew deadline
                log.warning("could not renew the Lease %s: %s", self.where, api_reason(exc))
                continue
            if self._stop.is_set():
                return
            if step.action == "lost":
                held = f"held by {self.holder}" if self.holder else "released or deleted"
                self.on_lost(f"the Lease {self.where} is {held}")
                return

    def _check_deadline(self) -> bool:
        """Call ``on_lost`` (and return True) when the last renewal is too old to act on."""
        if not fenced(self.renewed_at, self.clock(), self.timing.renew_deadline):
            return False
        since = "never" if self.renewed_at is None else f"{self.clock() - self.renewed_at:.1f} s ago"
        self.on_lost(
            f"the Lease {self.where} was last renewed {since} (renew deadline {self.timing.renew_deadline:g} s)"
        )
        return True

    def fence(self) -> None:
        """Call before every write for a job: exits (``on_lost``) unless the lease is surely still held."""
        self._check_deadline()

    def fence_renewal(self) -> None:
        """:meth:`fence` while leading, nothing while standing by: for the requests of the Lease itself."""
        if self.renewed_at is not None:
            self._check_deadline()

    def release(self) -> None:
        """Stop renewing and give the Lease up if this replica still holds it (best effort)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timing.renew_deadline + 1)
        if self.renewed_at is None:
            return
        self.renewed_at = None
        try:
            record, version = self._read(self.timing.retry_period)
            if record is None or record.holder != self.identity:
                return
            if self._write("renew", released(record, self.wall()), version, self.timing.retry_period):
                log.info("released the Lease %s", self.where)
        except Exception as exc:  # noqa: BLE001 - best effort: the standby takes over after the lease duration
            log.warning("could not release the Lease %s: %s", self.where, api_reason(exc))


def fence_requests(api_client: Any, fence: Callable[[], None]) -> None:
    """Call ``fence`` as each request of ``api_client`` (a kubernetes ApiClient) goes out, for every
    write *and* read: a stale leader exits at its next request, before any byte of it is sent."""
    import urllib3
    from urllib3.connection import HTTPConnection, HTTPSConnection

    class FencedHTTP(HTTPConnection):
        def send(self, data: Any) -> None:
            fence()
            super().send(data)

    class FencedHTTPS(HTTPSConnection):
        def send(self, data: Any) -> None:
            fence()
            super().send(data)

    class FencedHTTPPool(urllib3.HTTPConnectionPool):
        ConnectionCls = FencedHTTP

    class FencedHTTPSPool(urllib3.HTTPSConnectionPool):
        ConnectionCls = FencedHTTPS

    manager = api_client.rest_client.pool_manager
    manager.pool_classes_by_scheme = {"http": FencedHTTPPool, "https": FencedHTTPSPool}
    manager.clear()  # pools made before use the plain connections


class StandbyLiveness:
    """What a standby's probes answer (the process's probe server, ``spotguard.operator.probes``, asks).

    Alive while the election loop runs (it looked at the Lease within a few
    retry periods), so a probe restarts a standby whose loop hangs, and never
    one that merely waits. Ready when, besides, its last look reached the
    apiserver: a standby that cannot read the Lease could not take over.
    """

    def __init__(self, elector: LeaderElector) -> None:
        self.elector = elector

    def healthy(self) -> bool:
        timing = self.elector.timing
        return self.elector.clock() - self.elector.ticked_at < timing.renew_deadline + 3 * timing.retry_period

    @property
    def reached(self) -> bool:
        """Whether the election loop's last look at the Lease reached the apiserver."""
        return bool(self.elector.reached)

    def body(self) -> dict[str, Any]:
        """What the liveness endpoint says: a standby, and the leader as last read."""
        return {"standby": True, "leader": self.elector.holder or None}
