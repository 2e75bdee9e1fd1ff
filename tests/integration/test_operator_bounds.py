"""What one job's store may cost the operator, against the real apiserver and real stores.

A store the job's author chooses can hang, flood the answer, or be a host
that should never see the job's credentials: each costs that job a
CheckpointsReadable condition and an Event, never the operator's memory,
its threads for other jobs, or a connection to an endpoint the platform did
not allow.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ckpt_helpers import s3_options

from spotguard.operator.jobstatus import (
    COND_CHECKPOINTS_READABLE,
    R_ENDPOINT_NOT_ALLOWED,
    R_OBJECT_TOO_LARGE,
    R_STORE_TOO_SLOW,
)
from spotguard.operator.testing import wait_for
from testenv.faultproxy import FaultProxy, flood, latency
from testenv.kubetest import (
    cond,
    create_job,
    delete_jobs,
    new_namespace,
    no_node_job,
    start_operator,
    wait_event,
    wait_status,
)

NS_PREFIX = "bounds"


def upload_verified(tmp_path: Path, storage: Any, step: int) -> None:
    from spotguard.checkpoint import snapshot_state, upload_checkpoint, write_checkpoint

    local = write_checkpoint(tmp_path / f"local-{step}", step, snapshot_state({"step": step}))
    upload_checkpoint(local, storage)


def s3_job(name: str, storage: str, endpoint: str | None, secret: str = "s3") -> dict[str, Any]:
    checkpoint: dict[str, Any] = {"storage": storage, "credentialsSecret": {"name": secret}}
    if endpoint is not None:
        checkpoint["endpoint"] = endpoint
    return no_node_job(name, storage, checkpoint=checkpoint)


def store_secret(core: Any, ns: str, name: str, s3_store: Any, endpoint: str | None = None) -> None:
    data = {"AWS_ACCESS_KEY_ID": s3_store.access_key, "AWS_SECRET_ACCESS_KEY": s3_store.secret_key}
    if endpoint is not None:
        data["AWS_ENDPOINT_URL"] = endpoint
    core.create_namespaced_secret(ns, {"metadata": {"name": name}, "stringData": data})


def unreadable(reason: str) -> Any:
    return lambda st: cond(st, COND_CHECKPOINTS_READABLE).get("reason") == reason


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_hung_store_and_a_flooding_one_cost_their_jobs_a_condition_not_the_operator(
    apis: tuple[Any, Any], kube: Any, crd: None, s3_store: Any, tmp_path: Path
) -> None:
    from spotguard.storage import open_storage

    core, _ = apis
    ns = new_namespace(core, "bounds")
    storage = f"s3://{s3_store.bucket}/bounds-{ns}"
    store_secret(core, ns, "s3", s3_store)
    good = open_storage(f"{storage}/{ns}/good", **s3_options(s3_store))
    upload_verified(tmp_path, good, 10)
    with FaultProxy(s3_store.endpoint_url) as hung, FaultProxy(s3_store.endpoint_url) as flooding:
        hung.add(latency(3600))  # every request: accepted, never answered
        # A `latest` pointer of 1 GiB, sent without saying its size.
        flooding.add(flood(1 << 30, announce=False), method="GET", path=r"/latest$")
        op = start_operator(
            kube,
            ns,
            tmp_path / "operator.log",
            extra_args=["--probe-workers", "1", "--checkpoint-read-timeout-seconds", "4"],
        )
        try:
            assert op.proc is not None
            create_job(apis, ns, s3_job("hung", storage, hung.url))
            create_job(apis, ns, s3_job("flooded", storage, flooding.url))
            wait_for(lambda: hung.requests("GET"), "the probe to reach the hung store", timeout=60)
            create_job(apis, ns, s3_job("good", storage, s3_store.endpoint_url))

            st = wait_status(apis, ns, "hung", "told its store is too slow", unreadable(R_STORE_TOO_SLOW), timeout=90)
            message = cond(st, COND_CHECKPOINTS_READABLE)["message"]
            assert cond(st, COND_CHECKPOINTS_READABLE)["status"] == "False"
            assert "took more than 4s" in message and urlsplit(hung.url).netloc in message, message
            wait_event(apis, ns, "hung", "StoreTooSlow", lambda t, r, _m: t == "Warning" and r == R_STORE_TOO_SLOW)

            st = wait_status(apis, ns, "flooded", "told its pointer is too large", unreadable(R_OBJECT_TOO_LARGE))
            assert "/flooded/latest holds more than 16777216 bytes" in cond(st, COND_CHECKPOINTS_READABLE)["message"]
            wait_event(apis, ns, "flooded", "too large", lambda t, r, _m: t == "Warning" and r == R_OBJECT_TOO_LARGE)

            # The other job is read and reported all along, with one probe thread held by the hung store.
            wait_status(
                apis, ns, "good", "its checkpoint", lambda s: (s.get("lastVerifiedCheckpoint") or {}).get("step") == 10
            )
            upload_verified(tmp_path, good, 20)
            st = wait_status(
                apis,
                ns,
                "good",
                "its newer checkpoint",
                lambda s: (s.get("lastVerifiedCheckpoint") or {}).get("step") == 20,
            )
            assert cond(st, COND_CHECKPOINTS_READABLE) == {}  # its reads never failed
            # The flood stopped at the limit: nowhere near 1 GiB in the operator's memory.
            assert peak_rss_bytes(op.proc.pid) < 512 << 20
            delete_jobs(apis, ns, pods=False)
        finally:
            op.stop()
            print(f"--- operator log ---\n{op.log_tail(40)}")
    core.delete_namespace(ns)


class CountingListener:
    """A TCP endpoint that counts the connections made to it and answers none."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def test_an_endpoint_the_platform_does_not_allow_is_never_connected_to(
    apis: tuple[Any, Any], kube: Any, crd: None, s3_store: Any, tmp_path: Path
) -> None:
    from spotguard.storage import open_storage

    core, _ = apis
    ns = new_namespace(core, "endpoints")
    storage = f"s3://{s3_store.bucket}/endpoints-{ns}"
    elsewhere = CountingListener()
    store_secret(core, ns, "s3", s3_store)
    store_secret(core, ns, "s3-elsewhere", s3_store, endpoint=elsewhere.url)
    upload_verified(tmp_path, open_storage(f"{storage}/{ns}/allowed", **s3_options(s3_store)), 30)
    store_port = urlsplit(s3_store.endpoint_url).port
    op = start_operator(
        kube, ns, tmp_path / "operator.log", extra_args=["--allowed-endpoints", f"127.0.0.1:{store_port}"]
    )
    try:
        create_job(apis, ns, s3_job("by-spec", storage, elsewhere.url))
        create_job(apis, ns, s3_job("by-secret", storage, None, secret="s3-elsewhere"))
        create_job(apis, ns, s3_job("allowed", storage, s3_store.endpoint_url))
        for name, source in (("by-spec", "spec.checkpoint.endpoint"), ("by-secret", "of Secret s3-elsewhere")):
            st = wait_status(apis, ns, name, "its endpoint refused", unreadable(R_ENDPOINT_NOT_ALLOWED))
            message = cond(st, COND_CHECKPOINTS_READABLE)["message"]
            assert urlsplit(elsewhere.url).netloc in message and source in message, message
            assert s3_store.secret_key not in message
            wait_event(
                apis, ns, name, "EndpointNotAllowed", lambda t, r, _m: t == "Warning" and r == R_ENDPOINT_NOT_ALLOWED
            )
        wait_status(
            apis, ns, "allowed", "its checkpoint", lambda s: (s.get("lastVerifiedCheckpoint") or {}).get("step") == 30
        )
        time.sleep(3)  # three more polls of every job
        assert elsewhere.connections == 0
        delete_jobs(apis, ns, pods=False)
    finally:
        op.stop()
        elsewhere.close()
        print(f"--- operator log ---\n{op.log_tail(40)}")
    core.delete_namespace(ns)
