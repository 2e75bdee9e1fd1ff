"""A process node's heartbeats write what a kubelet 1.20 with node leases writes: the Lease at every beat,
the node's status when it changes and otherwise only now and then (each status write wakes every
watcher of Nodes: the scheduler, the controller-manager, every operator)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from testenv.processnode import node as node_module
from testenv.processnode.node import ProcessNode


class RecordingKube:
    """The apiserver client of a fake agent: records each PATCH by path."""

    def __init__(self) -> None:
        self.patches: list[str] = []
        self.lock = threading.Lock()

    def patch(self, path: str, body: Any) -> dict[str, Any]:
        with self.lock:
            self.patches.append(path)
        return {}

    def count(self, suffix: str) -> int:
        with self.lock:
            return sum(1 for p in self.patches if p.endswith(suffix))


class FakeAgent:
    def __init__(self) -> None:
        self.kube = RecordingKube()


def beats(monkeypatch: pytest.MonkeyPatch, until: Any, every: float = 0.01) -> RecordingKube:
    """Run one node's heartbeat loop, a beat every ``every`` seconds, until ``until(kube)`` holds."""
    monkeypatch.setattr(node_module, "HEARTBEAT_SECONDS", every)
    agent = FakeAgent()
    node = ProcessNode(agent, "pn-0")  # type: ignore[arg-type]
    node.heartbeat()  # what register() does
    loop = threading.Thread(target=node._beat_loop, daemon=True)  # noqa: SLF001 - the loop under test
    loop.start()
    deadline = time.monotonic() + 60
    while not until(agent.kube) and time.monotonic() < deadline:
        time.sleep(0.01)
    node._stop.set()  # noqa: SLF001
    loop.join(5)
    return agent.kube


def leases(kube: RecordingKube) -> int:
    return kube.count("/leases/pn-0")


def statuses(kube: RecordingKube) -> int:
    return kube.count("/nodes/pn-0/status")


def test_the_lease_is_renewed_at_every_beat_and_the_status_posted_once_in_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kube = beats(monkeypatch, lambda k: leases(k) >= 20)
    assert leases(kube) >= 20, kube.patches
    assert statuses(kube) == 1, f"{statuses(kube)} status writes in {leases(kube)} beats"  # register()'s only


def test_the_status_is_posted_again_once_the_report_interval_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_module, "STATUS_REPORT_SECONDS", 0.2)
    started = time.monotonic()
    kube = beats(monkeypatch, lambda k: statuses(k) >= 3)
    assert statuses(kube) >= 3, kube.patches
    # Once per 0.2 s at most, however many beats came between.
    assert statuses(kube) <= 2 + (time.monotonic() - started) / 0.2
    assert leases(kube) > statuses(kube)


def test_a_readiness_change_is_posted_at_once() -> None:
    agent = FakeAgent()
    node = ProcessNode(agent, "pn-0")  # type: ignore[arg-type]
    node.heartbeat()
    node.set_ready(False, "KubeletNotReady", "shutting down")
    assert agent.kube.count("/nodes/pn-0/status") == 2
