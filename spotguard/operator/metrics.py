"""Operator metrics (prometheus-client, own registry; bounded labels only).

A job's series carry ``namespace`` and ``trainingjob``: never ``job``, which
Prometheus sets on every target itself (a scrape that does not honor the
target's labels would rename it and break every alert).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from spotguard.buildinfo import build_info

PHASES = ("Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended")


class OperatorMetrics:
    """The operator's series; one instance per process, injected through kopf's memo."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        job = ["namespace", "trainingjob"]
        build_info(self.registry, "operator")
        self.preemptions = Counter(
            "spotguard_job_preemptions_total",
            "Attempts of a job that ended by preemption.",
            job,
            registry=self.registry,
        )
        self.restarts = Counter(
            "spotguard_job_restarts_total",
            "Replacement pods created for a job after an attempt ended.",
            job,
            registry=self.registry,
        )
        self.failures = Counter(
            "spotguard_job_failures_total",
            "Attempts of a job that failed (the user's code or config).",
            job,
            registry=self.registry,
        )
        self.sidecar_failures = Counter(
            "spotguard_job_sidecar_failures_total",
            "Attempts of a job stopped because spotguard's sidecar stopped while the trainer ran.",
            job,
            registry=self.registry,
        )
        self.lost_steps = Counter(
            "spotguard_job_lost_steps_total",
            "Training steps done after the last verified checkpoint and lost at a preemption"
            " (only when the sidecar could tell).",
            job,
            registry=self.registry,
        )
        self.attempt = Gauge("spotguard_job_attempt", "Current attempt number of a job.", job, registry=self.registry)
        self.last_verified_step = Gauge(
            "spotguard_job_last_verified_step",
            "Newest verified checkpoint step of a job.",
            job,
            registry=self.registry,
        )
        self.reschedule_latency = Histogram(
            "spotguard_reschedule_latency_seconds",
            "Time from noticing that an attempt ended to creating its replacement pod.",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        self.on_fallback = Gauge(
            "spotguard_job_on_fallback",
            "1 while a job's pods go to its fallback placement (spec.fallback), else 0.",
            job,
            registry=self.registry,
        )
        self.placement_moves = Counter(
            "spotguard_job_placement_moves_total",
            "Moves of a job between its placements, by where to (fallback, primary).",
            [*job, "to"],
            registry=self.registry,
        )
        self.ignored_failures = Counter(
            "spotguard_job_ignored_failures_total",
            "Failed attempts a spec.failurePolicy rule restarted without counting against backoffLimit.",
            job,
            registry=self.registry,
        )
        self.jobs = Gauge("spotguard_jobs", "TrainingJobs by phase.", ["phase"], registry=self.registry)
        self.storage_reads = Counter(
            "spotguard_operator_storage_reads_total",
            "Reads of a job's storage for its newest verified checkpoint, by result (ok, error, timeout).",
            ["result"],
            registry=self.registry,
        )
        self.storage_requests = Counter(
            "spotguard_operator_storage_requests_total",
            "Requests the operator sent to S3 stores while reading jobs' checkpoints (retries included).",
            registry=self.registry,
        )
        self.storage_clients = Gauge(
            "spotguard_operator_storage_clients",
            "Storage handles the operator holds (at most one per job it still reads).",
            registry=self.registry,
        )
        self.storage_connections = Gauge(
            "spotguard_operator_storage_connections",
            "S3 clients the operator holds (one per endpoint and credentials in use, shared by jobs).",
            registry=self.registry,
        )
        self._phases: dict[tuple[str, str], str] = {}
        for phase in PHASES:
            self.jobs.labels(phase=phase).set(0)

    def preempted(self, namespace: str, job: str, lost_steps: int | None) -> None:
        """Count a preemption (and the steps it lost, when known)."""
        self.preemptions.labels(namespace, job).inc()
        self.lost_steps.labels(namespace, job).inc(max(0, lost_steps or 0))

    def failed(self, namespace: str, job: str) -> None:
        """Count a failed attempt."""
        self.failures.labels(namespace, job).inc()

    def sidecar_failed(self, namespace: str, job: str) -> None:
        """Count an attempt stopped because its sidecar stopped."""
        self.sidecar_failures.labels(namespace, job).inc()

    def moved(self, namespace: str, job: str, to: str) -> None:
        """Count a move of a job to its ``fallback`` or back to its ``primary`` placement."""
        self.placement_moves.labels(namespace, job, to).inc()

    def ignored(self, namespace: str, job: str) -> None:
        """Count a failure a rule restarted without counting."""
        self.ignored_failures.labels(namespace, job).inc()

    def restarted(self, namespace: str, job: str, latency_seconds: float | None) -> None:
        """Count a replacement pod and how long the job waited for it."""
        self.restarts.labels(namespace, job).inc()
        if latency_seconds is not None:
            self.reschedule_latency.observe(max(0.0, latency_seconds))

    def observe_job(self, namespace: str, job: str, status: Mapping[str, object]) -> None:
        """Mirror a job's status into the gauges."""
        phase = status.get("phase")
        if isinstance(phase, str):
            self._phases[(namespace, job)] = phase
        attempt = status.get("attempt")
        if isinstance(attempt, int):
            self.attempt.labels(namespace, job).set(attempt)
        lv = status.get("lastVerifiedCheckpoint")
        if isinstance(lv, Mapping) and isinstance(lv.get("step"), int):
            self.last_verified_step.labels(namespace, job).set(lv["step"])
        placement = status.get("placement")
        if isinstance(placement, Mapping):
            self.on_fallback.labels(namespace, job).set(1 if placement.get("pool") == "fallback" else 0)
        self._refresh_phases()

    def forget(self, namespace: str, job: str) -> None:
        """Remove every series of a deleted job."""
        for metric in (
            self.preemptions,
            self.restarts,
            self.failures,
            self.sidecar_failures,
            self.lost_steps,
            self.attempt,
            self.last_verified_step,
            self.on_fallback,
            self.ignored_failures,
        ):
            with contextlib.suppress(KeyError):
                metric.remove(namespace, job)
        for to in ("fallback", "primary"):
            with contextlib.suppress(KeyError):
                self.placement_moves.remove(namespace, job, to)
        self._phases.pop((namespace, job), None)
        self._refresh_phases()

    def _refresh_phases(self) -> None:
        counts = dict.fromkeys(PHASES, 0)
        for phase in self._phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, n in counts.items():
            self.jobs.labels(phase=phase).set(n)
