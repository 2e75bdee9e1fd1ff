"""Fake cloud metadata servers that answer as each provider documents (no tests here).

Small HTTP servers on 127.0.0.1, shared by ``test_notices.py``,
``test_notices_run.py`` and ``test_notices_providers.py``:
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
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


class FakeProvider:
    """Request log and a lock; subclasses answer requests."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        self.url = ""

    def handle(
        self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str], body: bytes
    ) -> tuple[int, bytes]:
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

    def handle(
        self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str], body: bytes
    ) -> tuple[int, bytes]:
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

    def handle(
        self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str], body: bytes
    ) -> tuple[int, bytes]:
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

    def handle(
        self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str], body: bytes
    ) -> tuple[int, bytes]:
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


# --- what makes each fake give its notice ------------------------------------------


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
    fake.add_event(
        {
            "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
            "EventType": "Preempt",
            "ResourceType": "VirtualMachine",
            "Resources": ["spot-vm-1"],
            "EventStatus": "Scheduled",
            "NotBefore": (datetime.now(UTC) + timedelta(seconds=30)).strftime("%a, %d %b %Y %H:%M:%S GMT"),
            "Description": "",
            "EventSource": "Platform",
            "DurationInSeconds": -1,
        }
    )


PROVIDERS: dict[str, tuple[Callable[[], FakeProvider], str, str, Callable[[Any], None], str]] = {
    # name: (fake, --notices value, endpoint flag, trigger, metric source)
    "aws": (FakeAws, "aws", "--aws-imds-endpoint", _aws_action, "aws"),
    "aws_late": (FakeAws, "aws", "--aws-imds-endpoint", _aws_late, "aws"),
    "aws_rebalance": (FakeAws, "aws", "--aws-imds-endpoint", _aws_rebalance, "aws_rebalance"),
    "gce": (FakeGce, "gce", "--gce-metadata-endpoint", _gce, "gce"),
    "azure": (FakeAzure, "azure", "--azure-metadata-endpoint", _azure, "azure"),
}
