"""A classic sidecar that dies while its trainer trains, on a real apiserver and process nodes.

The sidecar's process is killed on its process node (as an OOM kill would);
kubelet then reports that one container terminated while the pod runs on.
The operator must notice within seconds: condition, Event and metric, the
pod stopped, and a new attempt whose sidecar runs.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotguard.operator.testing import metric_value
from testenv.kubetest import (
    GROUP,
    PLURAL,
    VERSION,
    Env,
    cond,
    fast_preemption,
    job_body,
    operator_namespace,
    shell_trainer,
    wait_for,
)

pytestmark = pytest.mark.integration

SIDECAR = "spotguard-sidecar"
#: Trains "forever"; exits at once on SIGTERM.
TRAINER = r"""
trap 'kill $! 2>/dev/null; exit 143' TERM
echo "training"
while true; do sleep 1 & wait $!; done
"""


@pytest.fixture
def env(kube: Any, apis: tuple[Any, Any], crd: None, process_nodes: Any, tmp_path: Path) -> Iterator[Env]:
    (tmp_path / "logs").mkdir()
    with operator_namespace(kube, apis, process_nodes, "sdown", tmp_path / "logs", poll_seconds=5) as e:
        yield e


class Watched:
    """A watch on one object by name, keeping ``summary(object)`` of each update as it came: a
    state that lasts less than a poll's interval is seen too."""

    def __init__(self, list_fn: Any, args: tuple[Any, ...], name: str, summary: Any) -> None:
        self.list_fn, self.args, self.name, self.summary = list_fn, args, name, summary
        self.seen: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kubernetes import watch

        rv: str | None = None  # resumed from here: no update is missed between streams
        while not self._stop.is_set():
            try:
                for ev in watch.Watch().stream(
                    self.list_fn,
                    *self.args,
                    resource_version=rv,
                    field_selector=f"metadata.name={self.name}",
                    timeout_seconds=2,
                ):
                    obj = ev["object"]
                    meta = obj["metadata"] if isinstance(obj, dict) else obj.metadata
                    rv = meta["resourceVersion"] if isinstance(meta, dict) else meta.resource_version
                    self.seen.append(self.summary(obj))
            except Exception:  # a dropped or expired watch: start again
                rv = None
                time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def pod_states(e: Env, pod: str) -> Watched:
    """(phase, deleting, {container: state}) of ``pod`` at each update."""

    def summary(p: Any) -> tuple[str | None, bool, dict[str, str]]:
        states = {
            c.name: next(k for k in ("running", "terminated", "waiting") if getattr(c.state, k) is not None)
            for c in (p.status.container_statuses or [])
        }
        return p.status.phase, bool(p.metadata.deletion_timestamp), states

    return Watched(e.core.list_namespaced_pod, (e.ns,), pod, summary)


def job_conditions(e: Env, job: str) -> Watched:
    """``job``'s SidecarHealthy condition, and its failures and preemptions, at each update."""

    def summary(obj: dict[str, Any]) -> dict[str, Any]:
        st = obj.get("status") or {}
        return {**cond(st, "SidecarHealthy"), "failures": st.get("failures"), "preemptions": st.get("preemptions")}

    return Watched(e.custom.list_namespaced_custom_object, (GROUP, VERSION, e.ns, PLURAL), job, summary)


def pod_status(e: Env, pod: str) -> dict[str, Any]:
    p = e.core.read_namespaced_pod(pod, e.ns)
    return {
        "phase": p.status.phase,
        "states": {c.name: c.state for c in p.status.container_statuses or []},
    }


def sidecar_runs(e: Env, pod: str) -> bool:
    try:
        st = pod_status(e, pod)
    except Exception:
        return False
    state = st["states"].get(SIDECAR)
    return st["phase"] == "Running" and state is not None and state.running is not None


def kill_container(e: Env, pod: str, container: str) -> None:
    """SIGKILL a container's processes on its process node (what the kernel's OOM killer does)."""
    e.nodes.signal_container(e.ns, pod, container, signal.SIGKILL)


def test_a_dead_sidecar_stops_the_attempt_and_the_next_one_runs(env: Env, tmp_path: Path) -> None:
    e = env
    (tmp_path / "store" / e.ns / "lone").mkdir(parents=True)
    body = job_body(
        "lone",
        f"file://{tmp_path}/store",
        shell_trainer(TRAINER),
        sidecar={"metricsPort": 0},
        preemption=fast_preemption(3, 2, 5),
    )
    e.create_job(body)
    e.wait_status("lone", "attempt 1 running", lambda s: s.get("attempt") == 1 and s.get("phase") == "Running")
    wait_for(lambda: sidecar_runs(e, "lone-a1"), "lone-a1's sidecar to run", timeout=60)
    assert not cond(e.status("lone"), "SidecarHealthy")

    states = pod_states(e, "lone-a1")
    # Watched, not polled: attempt 2's sidecar can run (the condition True again) within a second.
    conditions = job_conditions(e, "lone")
    try:
        time.sleep(0.5)  # the watches are open
        kill_container(e, "lone-a1", SIDECAR)
        t0 = time.monotonic()

        def went_false() -> dict[str, Any] | None:
            return next((c for c in conditions.seen if c.get("status") == "False"), None)

        c = wait_for(went_false, "SidecarHealthy False", timeout=20)
        noticed = time.monotonic() - t0
        assert c["reason"] == "SidecarExited"
        assert "lone-a1" in c["message"] and "code 137" in c["message"] and "attempt 2" in c["message"], c
        assert c["failures"] == 1 and c["preemptions"] == 0
        assert e.status("lone")["lastPodEnd"]["reason"] == "SidecarExited"
        ev = e.wait_event("lone", "SidecarExited", lambda t, r, m: r == "SidecarExited", timeout=20)
        assert ev == ("Warning", "SidecarExited", c["message"])
        # The pod of attempt 1 is stopped.
        wait_for(
            lambda: not e.core.list_namespaced_pod(e.ns, field_selector="metadata.name=lone-a1").items,
            "lone-a1 to be gone",
            timeout=30,
        )
    finally:
        states.stop()
        conditions.stop()
    print(f"noticed after {noticed:.1f}s; lone-a1 went through {states.seen}")
    # As kubelet: the sidecar's termination was reported while the trainer ran on, the pod still Running.
    assert ("Running", False, {"trainer": "running", SIDECAR: "terminated"}) in states.seen, states.seen

    # Attempt 2 runs, with a sidecar that runs: the condition is True again.
    st = e.wait_status(
        "lone",
        "attempt 2 with a healthy sidecar",
        lambda s: s.get("attempt") == 2 and cond(s, "SidecarHealthy").get("status") == "True",
        timeout=60,
    )
    assert st["phase"] == "Running" and cond(st, "SidecarHealthy")["reason"] == "SidecarRunning"
    assert sidecar_runs(e, "lone-a2")
    assert e.operator is not None
    labels = {"namespace": e.ns, "trainingjob": "lone"}
    assert metric_value(e.operator.metrics(), "spotguard_job_sidecar_failures_total", labels) == 1.0
