"""A metrics port that cannot be bound is a warning, never the end of checkpointing.

With ``hostNetwork: true`` two pods on one node share the node's ports: the
second sidecar cannot bind its metrics port. It must still ship every
checkpoint (routine and emergency), say so in its termination report and in
an Event on its pod, and ``spotguard run`` must still run.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sidecar_helpers import Proc, base_env, reaping, s3_storage, spotguard_argv, train_argv

from spotguard.checkpoint import latest_verified
from spotguard.sidecar.events import REASON_METRICS_PORT_UNAVAILABLE, pod_event, post_pod_event
from spotguard.sidecar.metrics import (
    RUN_PORT_HINT,
    SIDECAR_PORT_HINT,
    SidecarMetrics,
    metrics_unavailable_message,
)

STEPS = 40
SAVE_EVERY = 10


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port some other process is listening on (as another pod's sidecar would)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


@pytest.fixture
def own_pod(kube: Any) -> Iterator[tuple[Any, Any]]:
    """(CoreV1Api, a pod that stays Pending): only its identity matters, the sidecar posts Events on it."""
    from kubernetes import client

    core = client.CoreV1Api(kube.api_client())
    pod = core.create_namespaced_pod(
        "default",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"port-{uuid.uuid4().hex[:8]}"},
            "spec": {
                "nodeSelector": {"spotguard.dev/no-such-node": "true"},
                "containers": [{"name": "trainer", "image": "trainer:latest", "command": ["true"]}],
            },
        },
    )
    try:
        yield core, pod
    finally:
        core.delete_namespaced_pod(pod.metadata.name, "default", grace_period_seconds=0)


def _events(core: Any, pod: str) -> list[Any]:
    """The sidecar's MetricsPortUnavailable Events on ``pod`` (not the scheduler's)."""
    items = core.list_namespaced_event("default", field_selector=f"involvedObject.name={pod}").items
    return [e for e in items if e.reason == REASON_METRICS_PORT_UNAVAILABLE]


def _warning_line(proc: Proc, port: int) -> str:
    return proc.wait_for_line(lambda ln: "WARNING" in ln and f"cannot serve metrics on 127.0.0.1:{port}" in ln, 30)


@pytest.mark.integration
def test_classic_sidecar_without_its_metrics_port_still_ships_and_reports(
    s3_store: Any, s3_uri: str, kube: Any, own_pod: tuple[Any, Any], tmp_path: Path
) -> None:
    core, pod = own_pod
    env = base_env(
        {
            **s3_store.env(),
            **kube.env(),
            "SPOTGUARD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
            "SPOTGUARD_STORAGE_URI": s3_uri,
            "POD_NAME": pod.metadata.name,
            "POD_NAMESPACE": "default",
        }
    )
    with taken_port() as port, reaping() as procs:
        sidecar = Proc(
            spotguard_argv(
                "sidecar",
                "--mode",
                "classic",
                "--metrics-port",
                str(port),
                "--metrics-addr",
                "127.0.0.1",
                "--termination-log",
                str(tmp_path / "termination-log"),
            ),
            env,
            tmp_path / "sidecar.log",
        )
        procs.append(sidecar)
        line = _warning_line(sidecar, port)
        trainer = Proc(train_argv(STEPS, None, 0.0, save_every=SAVE_EVERY), env, tmp_path / "trainer.log")
        procs.append(trainer)
        assert trainer.wait() == 0, trainer.tail()
        assert sidecar.wait() == 0, sidecar.tail()
    assert "Address already in use" in line and "spec.sidecar.metricsPort" in line and "0 to turn metrics off" in line
    info, _ = latest_verified(s3_storage(s3_store, s3_uri))
    assert info is not None and info.step == STEPS - 1
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report["preempted"] is False and report["reason"] == "finished" and report["step"] == STEPS - 1
    assert f"127.0.0.1:{port}" in report["metricsError"] and "Address already in use" in report["metricsError"]
    # And a Warning Event on its pod says the same.
    events = _events(core, pod.metadata.name)
    assert [(e.type, e.message, e.involved_object.uid) for e in events] == [
        ("Warning", report["metricsError"], pod.metadata.uid)
    ]


@pytest.mark.integration
def test_native_sidecar_without_its_metrics_port_still_gets_the_emergency_checkpoint(
    s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    env = base_env(
        {**s3_store.env(), "SPOTGUARD_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "SPOTGUARD_STORAGE_URI": s3_uri}
    )
    with taken_port() as port, reaping() as procs:
        sidecar = Proc(
            spotguard_argv(
                "sidecar",
                "--mode",
                "native",
                "--metrics-port",
                str(port),
                "--metrics-addr",
                "127.0.0.1",
                "--grace-seconds",
                "30",
                "--termination-log",
                str(tmp_path / "termination-log"),
            ),
            env,
            tmp_path / "sidecar.log",
        )
        procs.append(sidecar)
        _warning_line(sidecar, port)
        trainer = Proc(train_argv(10_000, None, 0.01, save_every=1000), env, tmp_path / "trainer.log")
        procs.append(trainer)
        trainer.wait_for_step(20)
        for p in (trainer, sidecar):  # as kubelet does on a preemption
            p.signal(signal.SIGTERM)
        assert sidecar.wait() == 0, sidecar.tail()
        assert trainer.wait() == 0, trainer.tail()
        stopped = trainer.wait_for_stopped_step()
    info, _ = latest_verified(s3_storage(s3_store, s3_uri))
    assert info is not None and info.step >= stopped >= 20
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report["preempted"] is True and report["reason"] == "sigterm" and report["step"] == info.step
    assert "Address already in use" in report["metricsError"]


@pytest.mark.integration
def test_run_without_its_metrics_port_completes_and_uploads(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    with taken_port() as port, reaping() as procs:
        argv = spotguard_argv(
            "run",
            "--workdir",
            str(tmp_path / "work"),
            "--storage",
            s3_uri,
            "--metrics-port",
            str(port),
            "--",
            *train_argv(STEPS, tmp_path / "final.safetensors", 0.0, SAVE_EVERY),
        )
        run = Proc(argv, base_env(s3_store.env()), tmp_path / "run.log")
        procs.append(run)
        assert run.wait() == 0, run.tail()
    line = _warning_line(run, port)
    assert "Address already in use" in line and "--metrics-port" in line
    assert (tmp_path / "final.safetensors").is_file()
    info, _ = latest_verified(s3_storage(s3_store, s3_uri))
    assert info is not None and info.step == STEPS - 1


# -- the pieces ----------------------------------------------------------------


def test_serve_or_warn_returns_the_message_instead_of_raising() -> None:
    with taken_port() as port:
        bound, error = SidecarMetrics().serve_or_warn(port, "127.0.0.1", SIDECAR_PORT_HINT)
    assert bound is None and error is not None
    assert error.startswith(f"cannot serve metrics on 127.0.0.1:{port}: [Errno 98] Address already in use")
    assert error.endswith(SIDECAR_PORT_HINT)
    bound, error = SidecarMetrics().serve_or_warn(0, "127.0.0.1", SIDECAR_PORT_HINT)
    assert error is None and bound


@pytest.mark.parametrize(("port", "addr"), [(70000, "127.0.0.1"), (0, "no-such-address.invalid")])
def test_other_bind_errors_are_warnings_too(port: int, addr: str) -> None:
    bound, error = SidecarMetrics().serve_or_warn(port, addr, RUN_PORT_HINT)
    assert bound is None and error is not None and f"{addr}:{port}" in error and error.endswith(RUN_PORT_HINT)


def test_message_names_port_address_error_and_what_to_do() -> None:
    msg = metrics_unavailable_message(9400, "0.0.0.0", OSError(98, "Address already in use"), SIDECAR_PORT_HINT)
    assert msg == (
        "cannot serve metrics on 0.0.0.0:9400: [Errno 98] Address already in use; checkpoints are "
        "still shipped, only metrics are off; set spec.sidecar.metricsPort (--metrics-port, "
        "SPOTGUARD_METRICS_PORT) to a free port, or to 0 to turn metrics off"
    )


def test_pod_event_shape() -> None:
    now = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    ev = pod_event("job-a1", "team", "MetricsPortUnavailable", "x" * 5000, uid="u-1", now=now)
    assert ev["metadata"] == {"generateName": "job-a1.", "namespace": "team"}
    assert ev["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "job-a1",
        "namespace": "team",
        "uid": "u-1",
    }
    assert (ev["type"], ev["reason"], ev["count"]) == ("Warning", "MetricsPortUnavailable", 1)
    assert ev["firstTimestamp"] == ev["lastTimestamp"] == "2030-01-02T03:04:05Z"
    assert ev["source"] == {"component": "spotguard-sidecar"}
    assert len(ev["message"]) == 1024 and ev["message"].endswith("...")
    assert "uid" not in pod_event("p", "n", "R", "m")["involvedObject"]


def test_no_pod_identity_or_no_cluster_posts_nothing(tmp_path: Path) -> None:
    assert post_pod_event("R", "m", {}) is False
    assert post_pod_event("R", "m", {"POD_NAME": "p", "POD_NAMESPACE": "n"}) is False
    # An apiserver that does not answer: a failure, within the timeout, not an exception.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{dead}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    t0 = time.monotonic()
    assert post_pod_event("R", "m", {"POD_NAME": "p", "POD_NAMESPACE": "n", "KUBECONFIG": str(cfg)}, timeout=2) is False
    assert time.monotonic() - t0 < 10


@pytest.mark.integration
def test_event_is_posted_on_the_own_pod(kube: Any, own_pod: tuple[Any, Any]) -> None:
    core, created = own_pod
    name = created.metadata.name
    message = metrics_unavailable_message(9400, "0.0.0.0", "[Errno 98] Address already in use", SIDECAR_PORT_HINT)
    env = {"POD_NAME": name, "POD_NAMESPACE": "default", **kube.env()}
    assert post_pod_event(REASON_METRICS_PORT_UNAVAILABLE, message, env) is True
    events = _events(core, name)
    assert len(events) == 1
    ev = events[0]
    assert (ev.type, ev.reason, ev.message) == ("Warning", "MetricsPortUnavailable", message)
    # Tied to this very pod (what `kubectl describe pod` matches on).
    assert ev.involved_object.uid == created.metadata.uid and ev.involved_object.kind == "Pod"


def test_a_sidecar_that_cannot_start_leaves_its_error_for_the_pods_failure(tmp_path: Path) -> None:
    """Its error goes to the termination message, and the pod's failure names spotguard's container with it."""
    from spotguard.operator.classify import classify_pod_end

    log = tmp_path / "termination-log"
    with reaping() as procs:
        sidecar = Proc(
            spotguard_argv("sidecar", "--storage", "bogus://x", "--metrics-port", "0", "--termination-log", str(log)),
            base_env(),
            tmp_path / "sidecar.log",
        )
        procs.append(sidecar)
        code = sidecar.wait()
    assert code == 2
    message = log.read_text()
    assert message.startswith("spotguard: error: unsupported storage URI scheme 'bogus'")
    finished = {"exitCode": code, "reason": "Error", "message": message, "finishedAt": "2030-01-01T00:00:01Z"}
    done = {"exitCode": 0, "reason": "Completed", "finishedAt": "2030-01-01T00:09:00Z"}
    pod = {
        "metadata": {"name": "j-a1", "namespace": "ns"},
        "spec": {"nodeName": "n1"},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {"name": "trainer", "state": {"terminated": done}},
                {"name": "spotguard-sidecar", "state": {"terminated": finished}},
            ],
        },
    }
    end = classify_pod_end(pod)
    assert (end.kind, end.reason) == ("failed", "SidecarFailed")
    assert (
        end.message == f"spotguard's container spotguard-sidecar exited with code 2 (not the training code): {message}"
    )
