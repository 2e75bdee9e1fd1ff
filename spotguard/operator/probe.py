"""The operator's storage probe: each job's newest verified checkpoint, for its status.

Storage is the one thing the operator talks to that it does not control: a
store can be slow, paused or gone for minutes. So the probe

* runs in its own bounded thread pool, never in the threads that reconcile
  jobs: a hung store delays status reports, never the handling of a pod end;
* keeps one storage handle per job, reused while the job's storage and
  credentials stay the same, and one S3 connection client per distinct
  endpoint and credentials, shared by the jobs that use them (a boto3 client
  costs tens of megabytes and a tenth of a second of CPU to build: one per
  poll, or even one per job, starves an operator of 200 jobs);
* reads each job's checkpoints through a :class:`~spotguard.checkpoint.LatestWatch`:
  a poll that finds the ``latest`` pointer unchanged costs one conditional
  request (``If-None-Match``); the listing and manifests are read only when
  it changed, and every ``full_read_seconds`` regardless (0: at every poll);
  every request sent to a store is counted
  (``spotguard_operator_storage_requests_total``);
* reads the job from the reconcile's last look (no API call per poll), and
  its credentials Secret at most every ``SECRET_TTL_SECONDS`` or after an
  error (a rotated Secret is picked up);
* stops polling a job once it is finished and its final checkpoint is read
  (or after a few failed tries), and forgets a deleted job's client, error and
  cache entry;
* is not created at all when the operator may not read checkpoints
  (``--no-read-checkpoints``): then no Secret and no store is ever read;
* bounds what one job's store can cost: it connects only to endpoints the
  platform allows (:mod:`spotguard.operator.endpoints`), reads at most
  ``max_object_bytes`` of a ``latest`` pointer or manifest, and gives each
  read ``read_timeout`` seconds from its start. A read that overruns keeps
  its thread until the store's socket timeouts end it, and the pool gets a
  thread in its place: the job's next read waits for it, other jobs' reads
  do not. Each such problem becomes the job's CheckpointsReadable condition
  (``ctx.storage_problems``, reported by the reconcile).

Credentials come from the job's own Secret and never appear in a log line.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from spotguard.checkpoint.store.latest import FULL_READ_SECONDS
from spotguard.operator import endpoints
from spotguard.operator.jobstatus import (
    R_ENDPOINT_NOT_ALLOWED,
    R_OBJECT_TOO_LARGE,
    R_STORAGE_UNREADABLE,
    R_STORE_TOO_SLOW,
    TERMINAL_PHASES,
)
from spotguard.operator.spec import TrainingJobSpec, parse
from spotguard.operator.specfields import SpecError
from spotguard.operator.times import format_time, parse_time
from spotguard.storage.base import ObjectTooLargeError

log = logging.getLogger("spotguard.operator")

#: What one probe of one job found.
#: ``changed``: a newer verified checkpoint; ``unchanged``: nothing new;
#: ``error``: storage or the Secret could not be read; ``settled``: the job is
#: finished and its checkpoint read, no need to look again; ``gone``: the job no longer exists.
Outcome = Literal["changed", "unchanged", "error", "settled", "gone"]

#: Failed reads of a finished job before the probe gives up on it.
FINISHED_JOB_TRIES = 5
#: Attempts per storage request: the next poll is the retry.
STORAGE_ATTEMPTS = 2
#: How long credentials read from a Secret are reused before it is read again.
SECRET_TTL_SECONDS = 300.0
#: How long one read of a job's checkpoints may take, from its start (``--checkpoint-read-timeout-seconds``).
READ_TIMEOUT_SECONDS = 60.0
#: The largest ``latest`` pointer or manifest read (``--checkpoint-max-object-bytes``): a manifest of a
#: checkpoint of hundreds of GB in 1 MiB chunks is a few MB.
MAX_OBJECT_BYTES = 16 << 20
#: How long to wait for a store's TCP connection.
CONNECT_TIMEOUT_SECONDS = 5.0


class ProbeError(Exception):
    """Storage could not be read; the message has no credentials in it. ``reason``: the condition's."""

    def __init__(self, message: str, reason: str = R_STORAGE_UNREADABLE) -> None:
        super().__init__(message)
        self.reason = reason


def scrub(text: str, options: Mapping[str, Any]) -> str:
    """First line of an error text, with any credential value in it masked."""
    info = options.get("credentials_info")
    values = [options.get("access_key"), options.get("secret_key")]
    if isinstance(info, Mapping):
        values += [info.get("private_key"), info.get("private_key_id")]
    for value in values:
        if isinstance(value, str) and value:
            text = text.replace(value, "***")
    return text.splitlines()[0][:300] if text else text


def _api_status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def probe_problem(exc: BaseException) -> str:
    """One line about why storage could not be read (never credentials)."""
    status = _api_status(exc)
    if status == 404:
        return "the credentials Secret was not found"
    if status == 403:
        return "the operator may not read the credentials Secret (RBAC)"
    if isinstance(exc, ProbeError):
        return str(exc)
    return type(exc).__name__


class DaemonPool(Executor):
    """A fixed pool of daemon threads.

    Unlike ``ThreadPoolExecutor``, whose threads the interpreter joins at exit,
    a read hung on a dead store cannot hold up the operator's shutdown; and a
    thread held by a call that overran can be stood in for (:meth:`stand_in`).
    """

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._closed = False
        self._name = name
        self._lock = threading.Lock()
        self._started = 0
        self._live = 0
        #: Threads in a call now, and those of them to end after it (stood in for).
        self._busy: set[int] = set()
        self._retiring: set[int] = set()
        for _ in range(max(1, workers)):
            self._start_thread()

    def _start_thread(self) -> None:
        self._started += 1
        self._live += 1
        threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True).start()

    def stand_in(self, thread: int) -> None:
        """A new thread in place of ``thread`` (an ident), held by a call that overran; ``thread``
        ends when that call does. Nothing when its call already ended."""
        with self._lock:
            if not self._closed and thread in self._busy and thread not in self._retiring:
                self._retiring.add(thread)
                self._start_thread()

    def threads(self) -> int:
        """Threads started and not yet ended (the pool's size plus those stood in for)."""
        with self._lock:
            return self._live

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Queue ``fn(*args)``; raises ``RuntimeError`` after shutdown."""
        if self._closed:
            raise RuntimeError("the probe pool is shut down")
        future: Future[Any] = Future()
        call = functools.partial(fn, **kwargs) if kwargs else fn
        self._queue.put((future, call, args))
        return future

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            item = self._queue.get()
            if item is None:
                with self._lock:
                    self._live -= 1
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._busy.add(me)
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - whatever the call raised goes to whoever awaits the future
                future.set_exception(exc)
            with self._lock:
                self._busy.discard(me)
                if me in self._retiring:
                    self._retiring.discard(me)
                    self._live -= 1
                    return

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; the threads end after their current read (never joined)."""
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        with self._lock:
            for _ in range(self._live):
                self._queue.put(None)


@dataclass
class _Client:
    fingerprint: str
    storage: Any
    #: Digest of the connection settings (endpoint, region, credentials) of an S3 client, else "".
    connection: str = ""
    #: The job's :class:`~spotguard.checkpoint.LatestWatch` on ``storage``.
    watch: Any = None


def _digest(value: Any) -> str:
    # A digest, so no cache holds a second copy of the credentials.
    return hashlib.sha256(repr(value).encode()).hexdigest()


class CheckpointProbe:
    """Reads jobs' newest verified checkpoints on a bounded pool of its own.

    ``ctx`` is the reconcile's :class:`~spotguard.operator.kubeapi.Context`
    (API clients, the verified cache the reconcile reads). ``full_read_seconds``:
    how often a job's checkpoints are read in full although its ``latest``
    pointer did not change (0: at every poll). ``allowed_endpoints``: the
    patterns of the endpoints a job may name (:mod:`~spotguard.operator.endpoints`;
    empty: the cloud's own only); ``read_timeout`` and ``max_object_bytes``
    bound one read of a job's checkpoints. ``open_storage`` and ``clock``
    (monotonic seconds, for the full reads) are injectable for tests.
    """

    def __init__(
        self,
        ctx: Any,
        *,
        workers: int = 4,
        full_read_seconds: float = FULL_READ_SECONDS,
        allowed_endpoints: Sequence[str] = (),
        read_timeout: float = READ_TIMEOUT_SECONDS,
        max_object_bytes: int = MAX_OBJECT_BYTES,
        open_storage: Callable[..., Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ctx = ctx
        self.pool = DaemonPool(workers, "spotguard-probe")
        self.full_read_seconds = full_read_seconds
        self.allowed_endpoints = tuple(allowed_endpoints)
        self.read_timeout = read_timeout
        self.max_object_bytes = max_object_bytes
        #: When each job's read in progress began (monotonic), for its time bound, and its thread.
        self._reading: dict[tuple[str, str], tuple[float, int]] = {}
        #: Jobs whose read in progress overran: its problem stands until a read succeeds.
        self._overran: set[tuple[str, str]] = set()
        self._clock = clock
        self._open = open_storage
        self._lock = threading.Lock()
        #: Held while a job's storage is opened (see :meth:`_storage`).
        self._opening = threading.Lock()
        self._clients: dict[tuple[str, str], _Client] = {}
        #: S3 clients shared by the jobs with the same endpoint and credentials.
        self._connections: dict[str, Any] = {}
        self._secrets: dict[tuple[str, str], tuple[float, dict[str, str]]] = {}
        #: The last problem reported per job (said once, not at every poll).
        self.errors: dict[tuple[str, str], str] = {}
        self._finished_failures: dict[tuple[str, str], int] = {}

    # -- blocking part (runs in the pool) -------------------------------------------

    def _secret_values(self, namespace: str, spec: TrainingJobSpec) -> dict[str, str]:
        sec = spec.checkpoint.credentials_secret
        if sec is None:
            return {}
        values = self._cached_secret(namespace, sec.name)
        out: dict[str, str] = {}
        for opt, name in (
            ("access_key", sec.access_key_id_key),
            ("secret_key", sec.secret_access_key_key),
            ("endpoint_url", sec.endpoint_key),
        ):
            if values.get(name):
                out[opt] = values[name]
        return out

    def _cached_secret(self, namespace: str, name: str) -> dict[str, str]:
        """A Secret's values, read at most every ``SECRET_TTL_SECONDS``."""
        key = (namespace, name)
        with self._lock:
            cached = self._secrets.get(key)
        if cached is not None and time.monotonic() - cached[0] < SECRET_TTL_SECONDS:
            return cached[1]
        values = self._read_secret(namespace, name)
        now = time.monotonic()
        with self._lock:
            # Expired entries go (Secrets of deleted jobs and namespaces included).
            for old in [k for k, (at, _v) in self._secrets.items() if now - at >= SECRET_TTL_SECONDS]:
                del self._secrets[old]
            self._secrets[key] = (now, values)
        return values

    def _gcs_options(self, namespace: str, spec: TrainingJobSpec) -> dict[str, Any]:
        """gs://: the emulator endpoint, and the service account key from the job's Secret (if it names one)."""
        options: dict[str, Any] = {}
        if spec.checkpoint.endpoint:
            options["endpoint_url"] = spec.checkpoint.endpoint
        sec = spec.checkpoint.credentials_secret
        if sec is not None:
            raw = self._cached_secret(namespace, sec.name).get(sec.key_file_key)
            if not raw:
                raise ProbeError(
                    f"the credentials Secret {sec.name} has no key {sec.key_file_key!r}"
                    " (a service account's JSON key: spec.checkpoint.credentialsSecret.keyFileKey)"
                )
            try:
                options["credentials_info"] = json.loads(raw)
            except ValueError:
                raise ProbeError(f"key {sec.key_file_key!r} of Secret {sec.name} is not a JSON key") from None
        return options

    def _read_secret(self, namespace: str, name: str) -> dict[str, str]:
        secret = self.ctx.core.read_namespaced_secret(name, namespace)
        data = getattr(secret, "data", None) or {}
        return {str(k): base64.b64decode(v).decode().strip() for k, v in data.items() if v}

    def _storage(self, key: tuple[str, str], uri: str, options: dict[str, Any]) -> _Client:
        """The job's storage and watch: reused while its URI and credentials stay the same."""
        fingerprint = _digest((uri, sorted(options.items())))
        with self._lock:
            cached = self._clients.get(key)
        if cached is not None and cached.fingerprint == fingerprint:
            return cached
        # One job at a time opens storage: the first reads of many jobs (an operator starting) run at once,
        # and each would otherwise build its own S3 client for the same endpoint and credentials.
        with self._opening:
            connection = ""
            if self._open is not None:
                storage = self._open(uri, **options)
            else:
                from spotguard.storage import open_storage

                bounds = self._bounds(uri)
                if uri.startswith("s3://"):
                    connection = _digest(sorted(options.items()))
                    with self._lock:
                        shared = self._connections.get(connection)
                    if shared is not None:
                        storage = open_storage(uri, client=shared, max_read_bytes=self.max_object_bytes)
                    else:
                        storage = open_storage(uri, **options, **bounds, max_attempts=STORAGE_ATTEMPTS)
                else:
                    storage = open_storage(uri, **options, **bounds)
            self._count_requests(storage)
            from spotguard.checkpoint import LatestWatch

            # Sizes and manifests only: the sidecar verified every checksum when it uploaded,
            # and re-reading whole checkpoints at every full read would double the egress.
            watch = LatestWatch(
                storage, full_read_seconds=self.full_read_seconds, checksums=False, quiet=True, clock=self._clock
            )
            handle = _Client(fingerprint, storage, connection, watch)
            with self._lock:
                if connection:
                    self._connections.setdefault(connection, getattr(storage, "client"))  # noqa: B009 - S3 only
                self._clients[key] = handle
                self._drop_unused_connections()
        self._count_clients()
        return handle

    def _bounds(self, uri: str) -> dict[str, Any]:
        """What bounds one job's store: the object size, and for a remote store each request's waits."""
        bounds: dict[str, Any] = {"max_read_bytes": self.max_object_bytes}
        if uri.startswith(("s3://", "gs://")):
            # A wait for bytes well inside the read's own bound, so a silent store fails the read in time.
            bounds["connect_timeout"] = min(CONNECT_TIMEOUT_SECONDS, self.read_timeout)
            bounds["read_timeout"] = max(1.0, self.read_timeout / 3)
        if uri.startswith("gs://"):
            bounds["retry_deadline"] = self.read_timeout
        return bounds

    def _count_requests(self, storage: Any) -> None:
        """Count every request the storage's S3 client sends (retries included), once per client."""
        events = getattr(getattr(getattr(storage, "client", None), "meta", None), "events", None)
        if events is None:
            return  # file:// storage: no requests
        counter = self.ctx.metrics.storage_requests

        def count(**_: Any) -> None:
            counter.inc()

        # The same id for every job sharing the client: registered once, counted once.
        events.register("before-send.s3", count, unique_id=f"spotguard-operator-requests-{id(counter)}")

    def _drop_unused_connections(self) -> None:
        # Called with the lock held.
        used = {c.connection for c in self._clients.values()}
        for connection in [c for c in self._connections if c not in used]:
            del self._connections[connection]

    def connections(self) -> int:
        """How many S3 connection clients are held (one per endpoint and credentials in use)."""
        with self._lock:
            return len(self._connections)

    def clients(self) -> int:
        """How many jobs have a storage handle (one each at most)."""
        with self._lock:
            return len(self._clients)

    def _count_clients(self) -> None:
        self.ctx.metrics.storage_clients.set(self.clients())
        self.ctx.metrics.storage_connections.set(self.connections())

    def read(self, namespace: str, name: str) -> tuple[dict[str, Any] | None, bool] | None:
        """Read the newest verified checkpoint: ``(entry or None, job finished)``; None when the job is gone.

        Raises on any storage or Secret error (the message carries no credentials).
        """
        from spotguard.operator.kubeapi import get_job

        # The reconcile's last look at the job (it is woken by every change of it);
        # the apiserver only when there was none yet.
        job = self.ctx.jobs.get((namespace, name)) or get_job(self.ctx, namespace, name)
        if job is None:
            return None
        finished = (job.get("status") or {}).get("phase") in TERMINAL_PHASES
        try:
            spec = parse(job.get("spec"))
        except SpecError:
            return None, finished
        options: dict[str, Any] = {}
        if spec.checkpoint.storage.startswith("gs://"):
            options = self._gcs_options(namespace, spec)
        elif spec.checkpoint.storage.startswith("s3://"):
            options = self._secret_values(namespace, spec)
            if spec.checkpoint.endpoint:
                options["endpoint_url"] = spec.checkpoint.endpoint
            if spec.checkpoint.region:
                options["region"] = spec.checkpoint.region
        self._check_endpoint(spec, options.get("endpoint_url"))
        uri = spec.checkpoint.job_uri(namespace, name)
        try:
            handle = self._storage((namespace, name), uri, options)
            # A finished job's last look reads everything (a pointer that lags is not trusted there).
            info, _skipped = handle.watch.poll(full=finished)
        except ObjectTooLargeError as exc:
            raise ProbeError(str(exc), R_OBJECT_TOO_LARGE) from None
        except Exception as exc:  # noqa: BLE001 - any storage error becomes a ProbeError, credentials scrubbed
            raise ProbeError(scrub(f"{type(exc).__name__}: {exc}", options)) from None
        if info is None:
            return None, finished
        created = parse_time(info.created)
        stamp = format_time(created or datetime.now(UTC))
        # bytes: what a staging volume the spec gives no size is sized from (podbuilder.staging_size).
        return {"step": int(info.step), "uri": info.uri, "time": stamp, "bytes": int(info.size)}, finished

    def _check_endpoint(self, spec: TrainingJobSpec, endpoint: Any) -> None:
        """Raise unless the platform allows the job's endpoint: nothing is sent to one it does not."""
        if not isinstance(endpoint, str) or not endpoint:
            return
        source = "spec.checkpoint.endpoint"
        sec = spec.checkpoint.credentials_secret
        if not spec.checkpoint.endpoint and sec is not None:
            source = f"key {sec.endpoint_key} of Secret {sec.name}"
        refused = endpoints.refusal(spec.checkpoint.storage, endpoint, self.allowed_endpoints, source)
        if refused:
            raise ProbeError(refused, R_ENDPOINT_NOT_ALLOWED)

    def probe_once(self, namespace: str, name: str) -> Outcome:
        """Read one job's storage and refresh the cache (blocking)."""
        key = (namespace, name)
        started = time.monotonic()
        self._reading[key] = (started, threading.get_ident())
        try:
            result = self.read(namespace, name)
        except Exception as exc:  # noqa: BLE001 - any failed read is counted and reported; probing goes on
            self.ctx.metrics.storage_reads.labels("error").inc()
            self._forget_credentials(namespace, name)
            problem = probe_problem(exc)
            if key not in self._overran:  # an overrun said more than how it ended
                reason = exc.reason if isinstance(exc, ProbeError) else R_STORAGE_UNREADABLE
                self.ctx.storage_problems[key] = (reason, f"the operator cannot read this job's checkpoints: {problem}")
            if self.errors.get(key) != problem:
                self.errors[key] = problem
                log.warning("%s/%s: cannot read its checkpoints: %s", namespace, name, problem)
            if self.ctx.phases.get(key) in TERMINAL_PHASES:
                self._finished_failures[key] = self._finished_failures.get(key, 0) + 1
                if self._finished_failures[key] >= FINISHED_JOB_TRIES:
                    log.warning("%s/%s: finished; no longer reading its checkpoints", namespace, name)
                    return "settled"
            return "error"
        finally:
            self._reading.pop(key, None)
        if result is None:
            self.forget(namespace, name)
            return "gone"
        self.ctx.metrics.storage_reads.labels("ok").inc()
        self.ctx.storage_problems.pop(key, None)
        if self.errors.pop(key, None) is not None:
            log.info("%s/%s: its checkpoints can be read again", namespace, name)
        entry, finished = result
        changed = False
        if entry is not None:
            changed = self.ctx.verified.put(namespace, name, entry)
            log.log(
                logging.INFO if changed else logging.DEBUG,
                "%s/%s: newest verified checkpoint: step %s (%.2fs)",
                namespace,
                name,
                entry["step"],
                time.monotonic() - started,
            )
        if finished:
            # Nothing will change any more: drop the client, keep the cached entry for the status.
            with self._lock:
                self._clients.pop(key, None)
                self._drop_unused_connections()
            self._count_clients()
            return "changed" if changed else "settled"
        return "changed" if changed else "unchanged"

    def _forget_credentials(self, namespace: str, name: str) -> None:
        """Read the job's Secret again next time (it may have been created, fixed or rotated)."""
        job = self.ctx.jobs.get((namespace, name)) or {}
        ref = ((job.get("spec") or {}).get("checkpoint") or {}).get("credentialsSecret")
        secret = ref.get("name") if isinstance(ref, Mapping) else ref
        if isinstance(secret, str):
            with self._lock:
                self._secrets.pop((namespace, secret), None)

    def forget(self, namespace: str, name: str) -> None:
        """Drop everything kept for a job (it was deleted)."""
        key = (namespace, name)
        self._forget_credentials(namespace, name)
        with self._lock:
            self._clients.pop(key, None)
            self._drop_unused_connections()
        self._count_clients()
        self.errors.pop(key, None)
        self._finished_failures.pop(key, None)
        self.ctx.storage_problems.pop(key, None)
        self.ctx.verified.forget(namespace, name)

    # -- async part (the job's daemon) -------------------------------------------------

    async def run(self, namespace: str, name: str, wake_job: Callable[[], None], poke: asyncio.Event) -> Outcome:
        """Poll one job until it is finished (and read) or gone; ``poke`` asks for a read now."""
        loop = asyncio.get_running_loop()
        key = (namespace, name)
        while True:
            poke.clear()
            before = self.ctx.storage_problems.get(key)
            read = loop.run_in_executor(self.pool, self.probe_once, namespace, name)
            outcome = await self._bounded(key, read, wake_job)
            if self.ctx.storage_problems.get(key) != before:
                wake_job()  # the reconcile reports it (CheckpointsReadable)
            if outcome == "changed":
                wake_job()
                # A finished job's final checkpoint: read once more to settle.
                if self.ctx.phases.get((namespace, name)) in TERMINAL_PHASES:
                    continue
            if outcome in ("settled", "gone"):
                return outcome
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(poke.wait(), timeout=self.ctx.checkpoint_poll_seconds)

    async def _bounded(
        self, key: tuple[str, str], read: asyncio.Future[Outcome], wake_job: Callable[[], None]
    ) -> Outcome:
        """The read's outcome; one that runs past ``read_timeout`` (from its start, not from its wait
        in the queue) is reported at once and given a thread in its place, then waited for: the job
        never has two reads in flight, the other jobs keep their threads."""
        deadline: float | None = None
        while not read.done():
            if deadline is None and key in self._reading:
                deadline = self._reading[key][0] + self.read_timeout
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self._overrun(key)
                wake_job()
                try:
                    await read
                finally:
                    self._overran.discard(key)
                break
            await asyncio.wait({read}, timeout=self.read_timeout if deadline is None else deadline - now)
        return read.result()

    def _overrun(self, key: tuple[str, str]) -> None:
        """Report a read that overran its time, and give the pool a thread in place of the one it holds."""
        self._overran.add(key)
        reading = self._reading.get(key)
        if reading is not None:
            self.pool.stand_in(reading[1])
        self.ctx.metrics.storage_reads.labels("timeout").inc()
        spec = (self.ctx.jobs.get(key) or {}).get("spec") or {}
        checkpoint = spec.get("checkpoint")
        checkpoint = checkpoint if isinstance(checkpoint, Mapping) else {}
        where = str(checkpoint.get("storage") or "its storage")
        endpoint = checkpoint.get("endpoint")
        if isinstance(endpoint, str):
            where += f" at {endpoints.endpoint_name(endpoint)}"
        message = (
            f"the operator cannot read this job's checkpoints: reading {where} took more than {self.read_timeout:g}s"
            " (the store answers too slowly or not at all); it tries again, other jobs are not held up"
        )
        self.ctx.storage_problems[key] = (R_STORE_TOO_SLOW, message)
        log.warning("%s/%s: %s", key[0], key[1], message)

    def shutdown(self) -> None:
        """Stop the pool without waiting for reads hung on a dead store."""
        self.pool.shutdown(wait=False, cancel_futures=True)
