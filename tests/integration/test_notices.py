"""Early notices end to end: each provider's notice gets a checkpoint verified before SIGTERM.

Also home of the fake providers that ``test_notices_providers.py`` shares.

The fakes are small HTTP servers on 127.0.0.1 that answer as each provider
documents:
- AWS IMDSv2: ``PUT /latest/api/token`` (TTL header required), then GETs with
  ``X-aws-ec2-metadata-token`` (401 without a valid token);
  ``spot/instance-action`` and ``events/recommendations/rebalance`` are 404
  until set.
- GCE: ``/computeMetadata/v1/instance/preempted`` needs ``Metadata-Flavor:
  Google`` (403 without) and answers ``TRUE``/``FALSE``.
- Azure: ``/metadata/scheduledevents?api-version=...`` needs ``Metadata:
  true`` (400 without); a ``POST`` of ``StartRequests`` approves events.
"""

from __future__ import annotations

import json
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from test_sidecar_helpers import (
    Proc,
    base_env,
    free_port,
    metric,
    reaping,
    s3_storage,
    scrape,
    spotguard_argv,
    train_argv,
    wait_until,
)

from spotguard.checkpoint import latest_verified


class FakeProvider:
    """Request log and a lock; subclasses answer requests."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        self.url = ""

    def handle(self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str],
               body: bytes) -> tuple[int, bytes]:
        raise NotImplementedError

    def count(self, method: str, path: str) -> int:
        with self.lock:
            return sum(1 for m, p in self.requests if m == method and p == path)


class FakeAws(FakeProvider):
    def __init__(self) -> None:
        super().__init__()
        self.tokens: set[str] = set()
        self.issued = 0
        self.instance_action: dict[str, Any] | None = None
        self.rebalance: dict[str, Any] | None = None

    def revoke_tokens(self) -> None:
        with self.lock:
            self.tokens.clear()

    def handle(self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str],
               body: bytes) -> tuple[int, bytes]:
        with self.lock:
            if path == "/latest/api/token":
                if method != "PUT":
                    return 405, b""
                ttl = headers.get("x-aws-ec2-metadata-token-ttl-seconds", "")
                if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                    return 400, b""
                self.issued += 1
                token = f"token-{self.issued}"
                self.tokens.add(token)
                return 200, token.encode()
            if method != "GET":
                return 405, b""
            if headers.get("x-aws-ec2-metadata-token") not in self.tokens:
                return 401, b""
            if path == "/latest/meta-data/spot/instance-action" and self.instance_action is not None:
                return 200, json.dumps(self.instance_action).encode()
            if path == "/latest/meta-data/events/recommendations/rebalance" and self.rebalance is not None:
                return 200, json.dumps(self.rebalance).encode()
            return 404, b"Not Found"


class FakeGce(FakeProvider):
    def __init__(self) -> None:
        super().__init__()
        self.preempted = False

    def handle(self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str],
               body: bytes) -> tuple[int, bytes]:
        if headers.get("metadata-flavor") != "Google":
            return 403, b"Missing Metadata-Flavor:Google header."
        if method == "GET" and path == "/computeMetadata/v1/instance/preempted":
            with self.lock:
                return 200, (b"TRUE" if self.preempted else b"FALSE")
        return 404, b""


class FakeAzure(FakeProvider):
    def __init__(self) -> None:
        super().__init__()
        self.incarnation = 1
        self.events: list[dict[str, Any]] = []
        self.approved: list[str] = []

    def add_event(self, event: dict[str, Any]) -> None:
        with self.lock:
            self.events.append(event)
            self.incarnation += 1

    def handle(self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str],
               body: bytes) -> tuple[int, bytes]:
        if headers.get("metadata") != "true":
            return 400, b'{"error": "Bad request. Required metadata header not specified"}'
        if path != "/metadata/scheduledevents":
            return 404, b""
        if not query.get("api-version"):
            return 400, b'{"error": "Bad request. api-version was not specified"}'
        with self.lock:
            if method == "GET":
                return 200, json.dumps({"DocumentIncarnation": self.incarnation, "Events": self.events}).encode()
            if method == "POST":
                try:
                    ids = [str(r["EventId"]) for r in json.loads(body)["StartRequests"]]
                except (ValueError, KeyError, TypeError):
                    return 400, b""
                self.approved.extend(ids)
                for event in self.events:
                    if event["EventId"] in ids:
                        event["EventStatus"] = "Started"
                self.incarnation += 1
                return 200, b""
        return 405, b""


@contextmanager
def serve(provider: FakeProvider) -> Iterator[Any]:
    """Serve ``provider`` on 127.0.0.1 (a free port) for the duration of the block."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            parts = urlsplit(self.path)
            with provider.lock:
                provider.requests.append((self.command, parts.path))
            headers = {k.lower(): v for k, v in self.headers.items()}
            status, payload = provider.handle(self.command, parts.path, parse_qs(parts.query), headers, body)
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_PUT = do_POST = _answer  # noqa: N815 - http.server's naming

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    provider.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield provider
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# --- A notice from each provider gets a checkpoint verified before any SIGTERM ---------------


def _soon() -> str:
    # AWS's two-minute warning, taken when the notice fires: a time taken at
    # import would have passed by the time a long test session gets here.
    return (datetime.now(UTC) + timedelta(minutes=2)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _aws_action(fake: Any) -> None:
    with fake.lock:
        fake.instance_action = {"action": "terminate", "time": _soon()}


def _aws_late(fake: Any) -> None:
    # Read after its announced time (a sidecar that restarted, clock skew):
    # the machine is still up, so the checkpoint is still worth a try.
    past = (datetime.now(UTC) - timedelta(seconds=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
    with fake.lock:
        fake.instance_action = {"action": "terminate", "time": past}


def _aws_rebalance(fake: Any) -> None:
    with fake.lock:
        fake.rebalance = {"noticeTime": _soon()}


def _gce(fake: Any) -> None:
    with fake.lock:
        fake.preempted = True


def _azure(fake: Any) -> None:
    fake.add_event({"EventId": "602d9444-d2cd-49c7-8624-8643e7171297", "EventType": "Preempt",
                    "ResourceType": "VirtualMachine", "Resources": ["spot-vm-1"], "EventStatus": "Scheduled",
                    "NotBefore": (datetime.now(UTC) + timedelta(seconds=30)).strftime("%a, %d %b %Y %H:%M:%S GMT"),
                    "Description": "", "EventSource": "Platform", "DurationInSeconds": -1})


PROVIDERS: dict[str, tuple[Callable[[], FakeProvider], str, str, Callable[[Any], None], str]] = {
    # name: (fake, --notices value, endpoint flag, trigger, metric source)
    "aws": (FakeAws, "aws", "--aws-imds-endpoint", _aws_action, "aws"),
    "aws_late": (FakeAws, "aws", "--aws-imds-endpoint", _aws_late, "aws"),
    "aws_rebalance": (FakeAws, "aws", "--aws-imds-endpoint", _aws_rebalance, "aws_rebalance"),
    "gce": (FakeGce, "gce", "--gce-metadata-endpoint", _gce, "gce"),
    "azure": (FakeAzure, "azure", "--azure-metadata-endpoint", _azure, "azure"),
}


def _notice_run(tmp_path: Path, s3_store: Any, s3_uri: str, sidecar_args: list[str], extra_env: dict[str, str],
                trigger: Callable[[], None], source: str, settled: Callable[[], bool] = lambda: True) -> None:
    """Trainer + sidecar; fire the notice; a checkpoint must verify while both still run."""
    port = free_port()
    storage = s3_storage(s3_store, s3_uri)
    env = base_env({**s3_store.env(), **extra_env, "SPOTGUARD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
                    "SPOTGUARD_STORAGE_URI": s3_uri})
    with reaping() as procs:
        # No routine checkpoints: only the notice can cause one.
        trainer = Proc(train_argv(100_000, None, 0.02, save_every=1_000_000), env, tmp_path / "trainer.log")
        sidecar = Proc(spotguard_argv("sidecar", "--metrics-port", str(port), "--metrics-addr", "127.0.0.1",
                                      "--notice-interval", "0.2", *sidecar_args), env, tmp_path / "sidecar.log")
        procs += [trainer, sidecar]
        trainer.wait_for_step(3)
        wait_until(lambda: scrape(port), 60, "the metrics endpoint")
        assert latest_verified(storage)[0] is None
        noticed_at = trainer.last_step
        assert noticed_at is not None
        trigger()
        info = wait_until(lambda: latest_verified(storage)[0], 120, "a checkpoint verified after the notice")
        assert info.step >= noticed_at
        wait_until(lambda: metric(scrape(port), "spotguard_checkpoint_emergency_duration_seconds_count",
                                  source=source) == 1, 60, "the notice's checkpoint in the metrics")
        wait_until(settled, 30, "the provider to be acknowledged")
        samples = scrape(port)
        assert metric(samples, "spotguard_preemption_notices_total", source=source) == 1
        assert metric(samples, "spotguard_checkpoint_last_verified_step") == info.step
        # Before any SIGTERM: the trainer keeps training, the sidecar keeps running.
        assert trainer.popen.poll() is None and sidecar.popen.poll() is None
        assert f"notice source={source}" in sidecar.text()
        # Then the preemption itself, as kubelet delivers it.
        trainer.signal(signal.SIGTERM)
        sidecar.signal(signal.SIGTERM)
        assert sidecar.wait() == 0, sidecar.tail()
        assert trainer.wait() == 0, trainer.tail()
    final, _ = latest_verified(storage)
    assert final is not None and final.step > info.step


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(PROVIDERS))
def test_cloud_notice_checkpoints_before_sigterm(name: str, s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    make, notices, flag, trigger, source = PROVIDERS[name]
    with serve(make()) as fake:
        settled: Callable[[], bool] = lambda: True  # noqa: E731
        if name == "azure":
            settled = lambda: fake.approved == ["602d9444-d2cd-49c7-8624-8643e7171297"]  # noqa: E731
        _notice_run(tmp_path, s3_store, s3_uri, ["--notices", notices, flag, fake.url], {},
                    lambda: trigger(fake), source, settled)
        if name == "azure":
            # Approved only after the checkpoint was verified: exactly once.
            assert fake.count("POST", "/metadata/scheduledevents") == 1


@pytest.mark.integration
def test_kubernetes_disruption_target_checkpoints_before_sigterm(kube: Any, s3_store: Any, s3_uri: str,
                                                                 tmp_path: Path) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube.api_client())
    name = f"notice-{uuid.uuid4().hex[:8]}"
    core.create_namespaced_pod("default", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"terminationGracePeriodSeconds": 60,
                 # Never scheduled: only its status matters here.
                 "nodeSelector": {"spotguard.dev/no-such-node": "true"},
                 "containers": [{"name": "trainer", "image": "trainer:latest", "command": ["true"]}]},
    })

    def disrupt() -> None:
        core.patch_namespaced_pod_status(name, "default", {"status": {"conditions": [{
            "type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
            "message": "Pod was terminated in response to imminent node shutdown.",
            "lastTransitionTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}]}})

    try:
        _notice_run(tmp_path, s3_store, s3_uri, ["--notices", "k8s"],
                    {"POD_NAME": name, "POD_NAMESPACE": "default", **kube.env()}, disrupt, "k8s")
    finally:
        core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
