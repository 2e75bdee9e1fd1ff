"""Prometheus metrics of the sidecar and of ``spotguard run``.

Every series carries the constant labels ``namespace`` and ``trainingjob``
(from ``POD_NAMESPACE`` and ``SPOTGUARD_JOB``; never ``job``, the label
Prometheus gives every target); the only other labels are bounded
enumerations (``stage``, ``source``, ``result``, ``reason``). Each
:class:`SidecarMetrics` owns its registry, so several can live in one
process (tests, ``spotguard demo``) without clashing. ``docs/sidecar.md``
lists every series.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from spotguard.buildinfo import build_info
from spotguard.contract.env import METRICS_PORT

if TYPE_CHECKING:
    from spotguard.sidecar.deadline import DeadlineAssessment

# Checkpoints range from megabytes to hundreds of gigabytes: cover 50 ms to 30 min.
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

# Bounded label values, listed so callers cannot invent new ones by accident.
STAGES = ("save", "upload", "verify", "retention", "emergency", "restore", "notice")
NOTICE_SOURCES = ("aws", "aws_rebalance", "gce", "azure", "k8s", "sigterm", "sigint")
SAVE_REASONS = ("interval", "sigterm", "notice", "proactive", "other")

log = logging.getLogger(__name__)

# What to do when the metrics port cannot be bound, for the sidecar (set by the
# operator from the TrainingJob) and for ``spotguard run``.
SIDECAR_PORT_HINT = (
    f"set spec.sidecar.metricsPort (--metrics-port, {METRICS_PORT.name}) to a free port, or to 0 to turn metrics off"
)
RUN_PORT_HINT = "pass --metrics-port with a free port, or 0 to turn metrics off"


def metrics_unavailable_message(port: int, addr: str, error: BaseException | str, hint: str) -> str:
    """Pure: the one line that says metrics could not be served, and what to do.

    ``error`` is the exception (or its text), e.g. ``[Errno 98] Address already in use``.
    """
    return (
        f"cannot serve metrics on {addr}:{port}: {error}; checkpoints are still shipped, only metrics are off; {hint}"
    )


class SidecarMetrics:
    """The sidecar's series in their own registry."""

    def __init__(
        self, namespace: str = "", job: str = "", registry: CollectorRegistry | None = None, component: str = "sidecar"
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.labels = {"namespace": namespace, "trainingjob": job}
        base = ["namespace", "trainingjob"]
        r = self.registry
        build_info(r, component)
        self.save_duration = Histogram(
            "spotguard_checkpoint_save_duration_seconds",
            "Time the trainer took to save a checkpoint locally (snapshot + write), by reason.",
            base + ["reason"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "spotguard_checkpoint_request_latency_seconds",
            "From a checkpoint request to the trainer's acknowledgement (step boundary + write).",
            base,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.upload_duration = Histogram(
            "spotguard_checkpoint_upload_duration_seconds",
            "Time to upload one checkpoint (data, manifest, pointer).",
            base,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.verify_duration = Histogram(
            "spotguard_checkpoint_verify_duration_seconds",
            "Time to verify one uploaded checkpoint against its manifest.",
            base,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.emergency_duration = Histogram(
            "spotguard_checkpoint_emergency_duration_seconds",
            "From a preemption signal or notice to the emergency checkpoint verified in storage.",
            base + ["source"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.uploaded_bytes = Counter(
            "spotguard_checkpoint_uploaded_bytes_total", "Bytes of checkpoint files uploaded.", base, registry=r
        )
        self.reused_bytes = Counter(
            "spotguard_checkpoint_reused_bytes_total",
            "Bytes of checkpoint files already in storage that an incremental upload did not send again.",
            base,
            registry=r,
        )
        self.uploads = Counter(
            "spotguard_checkpoint_uploads_total",
            "Checkpoint uploads by result (verified or failed).",
            base + ["result"],
            registry=r,
        )
        self.last_verified_step = Gauge(
            "spotguard_checkpoint_last_verified_step",
            "Step of the newest checkpoint verified in storage.",
            base,
            registry=r,
        )
        self.last_verified_timestamp = Gauge(
            "spotguard_checkpoint_last_verified_timestamp_seconds",
            "Unix time the newest checkpoint was verified in storage.",
            base,
            registry=r,
        )
        self.failures = Counter(
            "spotguard_checkpoint_failures_total",
            "Failures by stage (save, upload, verify, retention, emergency, restore, notice).",
            base + ["stage"],
            registry=r,
        )
        self.notices = Counter(
            "spotguard_preemption_notices_total",
            "Preemption notices and signals received, by source.",
            base + ["source"],
            registry=r,
        )
        self.deadline_at_risk = Gauge(
            "spotguard_checkpoint_deadline_at_risk",
            "1 when the expected emergency save + upload does not fit the grace period.",
            base,
            registry=r,
        )
        self.expected_emergency = Gauge(
            "spotguard_checkpoint_expected_emergency_seconds",
            "Expected duration of an emergency save + upload from recent throughput.",
            base,
            registry=r,
        )
        self.grace = Gauge(
            "spotguard_checkpoint_grace_seconds",
            "The grace period the sidecar plans emergency checkpoints against.",
            base,
            registry=r,
        )
        self.start_time = Gauge(
            "spotguard_sidecar_start_timestamp_seconds",
            "Unix time the sidecar (or spotguard run) started.",
            base,
            registry=r,
        )
        self.checkpoint_interval = Gauge(
            "spotguard_checkpoint_interval_seconds",
            "Seconds between routine checkpoints: SPOTGUARD_SAVE_EVERY_SECONDS, else as observed (0 while unknown).",
            base,
            registry=r,
        )
        self.restarts = Counter(
            "spotguard_run_restarts_total",
            "Restarts of the training command by spotguard run, by reason.",
            base + ["reason"],
            registry=r,
        )
        self.deleted_local = Counter(
            "spotguard_checkpoint_local_pruned_total",
            "Local checkpoints removed after a newer one was verified in storage.",
            base,
            registry=r,
        )
        # Make the labelled families visible (with zeros) before the first event,
        # so dashboards and alerts see a series from the start.
        for stage in STAGES:
            self.failures.labels(**self.labels, stage=stage)
        for result in ("verified", "failed"):
            self.uploads.labels(**self.labels, result=result)
        self.uploaded_bytes.labels(**self.labels)
        self.deadline_at_risk.labels(**self.labels).set(0)
        self._last_step = -1
        self.start_time.labels(**self.labels).set(time.time())
        self.checkpoint_interval.labels(**self.labels).set(0)
        self.last_verified_step.labels(**self.labels).set(-1)
        self.last_verified_timestamp.labels(**self.labels).set(0)

    # Recording helpers keep label handling in one place.

    def observe_save(self, seconds: float, reason: str) -> None:
        """A local save of known duration (``reason``: one of ``SAVE_REASONS``)."""
        self.save_duration.labels(**self.labels, reason=reason).observe(seconds)

    def observe_upload(self, seconds: float, nbytes: int, reused_bytes: int = 0) -> None:
        """An upload finished (before verification); ``reused_bytes``: chunks it did not send again."""
        self.upload_duration.labels(**self.labels).observe(seconds)
        self.uploaded_bytes.labels(**self.labels).inc(nbytes)
        if reused_bytes:
            self.reused_bytes.labels(**self.labels).inc(reused_bytes)

    def observe_verified(self, seconds: float, step: int, when: float) -> None:
        """A checkpoint verified in storage."""
        self.verify_duration.labels(**self.labels).observe(seconds)
        self.uploads.labels(**self.labels, result="verified").inc()
        # A re-verified older checkpoint must not move the gauge backwards.
        if step >= self._last_step:
            self._last_step = step
            self.last_verified_step.labels(**self.labels).set(step)
            self.last_verified_timestamp.labels(**self.labels).set(when)

    def observe_upload_failed(self, stage: str) -> None:
        """An upload or verification failed."""
        self.uploads.labels(**self.labels, result="failed").inc()
        self.failure(stage)

    def failure(self, stage: str) -> None:
        """Count one failure of ``stage``."""
        self.failures.labels(**self.labels, stage=stage).inc()

    def notice(self, source: str) -> None:
        """Count one notice or signal."""
        self.notices.labels(**self.labels, source=source).inc()

    def observe_emergency(self, seconds: float, source: str) -> None:
        """An emergency checkpoint verified ``seconds`` after the trigger."""
        self.emergency_duration.labels(**self.labels, source=source).observe(seconds)

    def set_deadline(self, assessment: DeadlineAssessment, grace_seconds: float) -> None:
        """Export the latest deadline assessment."""
        self.grace.labels(**self.labels).set(grace_seconds)
        self.deadline_at_risk.labels(**self.labels).set(1 if assessment.at_risk else 0)
        if assessment.expected_seconds is not None:
            self.expected_emergency.labels(**self.labels).set(assessment.expected_seconds)

    def set_interval(self, seconds: float) -> None:
        """The routine checkpoint interval in seconds (configured or observed)."""
        self.checkpoint_interval.labels(**self.labels).set(seconds)

    def restart(self, reason: str) -> None:
        """Count one restart of the supervised command."""
        self.restarts.labels(**self.labels, reason=reason).inc()

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``addr:port`` in a daemon thread; returns the bound port.

        Port 0 picks a free port (tests).
        """
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_address[1])

    def serve_or_warn(self, port: int, addr: str, hint: str) -> tuple[int | None, str | None]:
        """Like :meth:`serve`, but a port that cannot be bound is a WARNING, not an error.

        Metrics are secondary: a busy port (two pods with ``hostNetwork`` on one
        node), a privileged port or an unknown address must not stop checkpoints
        from being shipped. Returns ``(bound port, None)`` or ``(None, message)``.
        """
        try:
            bound = self.serve(port, addr)
        except (OSError, OverflowError, ValueError) as exc:
            message = metrics_unavailable_message(port, addr, exc, hint)
            log.warning("%s", message)
            return None, message
        log.info("metrics on %s:%d/metrics", addr, bound)
        return bound, None
