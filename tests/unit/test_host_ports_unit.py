"""Host ports of hostNetwork jobs: the pure picker, the taken set, and the claim protocol against a fake apiserver."""

from __future__ import annotations

import copy
import random
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from spotguard.operator import hostports as hp
from spotguard.operator import kubeapi as rc
from spotguard.operator.metrics import OperatorMetrics
from spotguard.operator.podbuilder import OperatorConfig, build_pods, build_service, host_ports
from spotguard.operator.spec import parse

NOW = datetime(2030, 1, 1, tzinfo=UTC)
NODEPORTS = range(30000, 32768)


def raw_spec(host_network: bool = True, **extra: Any) -> dict[str, Any]:
    tmpl: dict[str, Any] = {"containers": [{"name": "t", "image": "t"}]}
    if host_network:
        tmpl["hostNetwork"] = True
    return {"template": {"spec": tmpl}, "checkpoint": {"storage": "s3://bucket/x"}, **extra}


def job(name: str, status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": raw_spec(**spec),
        "status": status or {},
    }


# --- the pure part -----------------------------------------------------------------


def test_default_range_is_outside_the_nodeport_range() -> None:
    first, last = hp.DEFAULT_RANGE
    assert not set(range(first, last + 1)) & set(NODEPORTS)
    assert not hp.overlaps_nodeports(first, last)
    assert hp.overlaps_nodeports(29000, 30000) and hp.overlaps_nodeports(32767, 40000)
    # The per-uid preferred pair (used when no pair was allocated) is in the default range too.
    for i in range(200):
        master, metrics = host_ports(f"uid-{i}")
        assert first <= master < metrics <= last and metrics == master + 1


def test_the_operator_flag_defaults_to_the_default_range(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from spotguard.operator import cli

    def parse_args(*args: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        cli.register(parser.add_subparsers())
        return parser.parse_args(["operator", *args])

    monkeypatch.delenv("SPOTGUARD_HOST_PORT_RANGE", raising=False)
    assert hp.parse_range(parse_args().host_port_range) == hp.DEFAULT_RANGE
    assert parse_args("--host-port-range", "40000-40999").host_port_range == "40000-40999"
    monkeypatch.setenv("SPOTGUARD_HOST_PORT_RANGE", "41000-41999")
    assert parse_args().host_port_range == "41000-41999"


def test_parse_range() -> None:
    assert hp.parse_range("20000-29999") == (20000, 29999)
    assert hp.parse_range(" 1024 - 1025 ") == (1024, 1025)
    for bad in ("", "20000", "a-b", "29999-20000", "0-10", "60000-70000", "5-5", "1-2-3"):
        with pytest.raises(ValueError):
            hp.parse_range(bad)
    assert hp.format_range((20000, 29999)) == "20000-29999"


def test_pick_pair_is_the_first_free_aligned_pair_from_the_start() -> None:
    assert hp.pick_pair(set(), 20000, 20009) == (20000, 20001)
    assert hp.pick_pair({20000}, 20000, 20009) == (20002, 20003)
    assert hp.pick_pair({20003}, 20000, 20009) == (20000, 20001)
    assert hp.pick_pair({20000, 20003}, 20000, 20009) == (20004, 20005)
    # From a start index, wrapping around.
    assert hp.pick_pair(set(), 20000, 20009, start=3) == (20006, 20007)
    assert hp.pick_pair({20006, 20009}, 20000, 20009, start=3) == (20000, 20001)
    assert hp.pick_pair(set(), 20000, 20009, start=13) == (20006, 20007)
    # An odd-sized range leaves its last port unused.
    assert hp.pair_count(20000, 20004) == 2
    assert hp.pick_pair({20000, 20002}, 20000, 20004) is None
    # Full: None.
    assert hp.pick_pair(set(range(20000, 20010)), 20000, 20009) is None


def test_pick_pair_never_returns_a_taken_port() -> None:
    rng = random.Random(7)
    for _ in range(300):
        first = rng.randrange(1024, 60000)
        last = first + rng.randrange(1, 40)
        taken = {p for p in range(first, last + 1) if rng.random() < 0.4}
        got = hp.pick_pair(taken, first, last, start=rng.randrange(100))
        free_pairs = [(p, p + 1) for p in range(first, last, 2) if p + 1 <= last and not {p, p + 1} & taken]
        if got is None:
            assert free_pairs == []
        else:
            assert got in free_pairs


def test_twenty_jobs_get_twenty_distinct_pairs() -> None:
    # The hashed layout gave two of 20 jobs one pair about 17% of the time; allocation never does.
    jobs: list[dict[str, Any]] = []
    for i in range(20):
        uid = str(uuid.uuid4())
        taken = hp.taken_ports(jobs, uid)
        pair = hp.pick_pair(taken, *hp.DEFAULT_RANGE, start=hp.preferred_index(uid, hp.pair_count(*hp.DEFAULT_RANGE)))
        assert pair is not None
        j = job(f"j{i}", {"hostPorts": {"master": pair[0], "metrics": pair[1], "confirmed": True}})
        j["metadata"]["uid"] = uid
        jobs.append(j)
    ports = [p for j in jobs for p in (j["status"]["hostPorts"]["master"], j["status"]["hostPorts"]["metrics"])]
    assert len(set(ports)) == 40 and not set(ports) & set(NODEPORTS)


def test_taken_ports() -> None:
    held = {"master": 20000, "metrics": 20001, "confirmed": True}
    claimed = {"master": 20002, "metrics": 20003}
    jobs = [
        job("a", {"hostPorts": held, "phase": "Running"}),
        job("b", {"hostPorts": claimed}),  # a claim not confirmed yet counts
        # The operator removes a finished job's pair as it finishes it; until then it counts.
        job("finishing", {"hostPorts": {"master": 20004, "metrics": 20005}, "phase": "Succeeded"}),
        job("own", masterPort=20010, sidecar={"metricsPort": 20011}),  # ports written in the spec
        job("own-done", {"phase": "Failed"}, masterPort=20014, sidecar={"metricsPort": 20015}),
        job("podnet", host_network=False, masterPort=20012),  # its pods have their own network
        job("me", {"hostPorts": {"master": 20020, "metrics": 20021}}),
    ]
    gone = job("gone", {"hostPorts": {"master": 20008, "metrics": 20009}})
    gone["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    jobs.append(gone)
    assert hp.taken_ports(jobs, "uid-me") == {20000, 20001, 20002, 20003, 20004, 20005, 20010, 20011} | hp.RESERVED
    assert hp.holders(jobs, "uid-me", (20001, 20011)) == ["ns/a", "ns/own"]
    assert hp.holders(jobs, "uid-a", (20000, 20001)) == []
    # The reserved port is never handed out.
    assert 29500 in hp.RESERVED
    assert hp.pick_pair(hp.taken_ports([], "x"), 29500, 29503) == (29502, 29503)


def test_recorded_and_needs() -> None:
    assert hp.recorded({}) is None
    assert hp.recorded({"hostPorts": {"master": 20000}}) is None
    assert hp.recorded({"hostPorts": {"master": 20000, "metrics": 20001}}) == hp.HostPorts(20000, 20001, False)
    assert hp.recorded({"hostPorts": {"master": 1, "metrics": 2, "confirmed": True}}) == hp.HostPorts(1, 2, True)
    assert hp.needs_host_ports(parse(raw_spec()))
    assert hp.needs_host_ports(parse(raw_spec(masterPort=29501)))
    assert not hp.needs_host_ports(parse(raw_spec(masterPort=29501, sidecar={"metricsPort": 9555})))
    assert not hp.needs_host_ports(parse(raw_spec(host_network=False)))


def test_the_allocated_pair_reaches_the_pods_and_service() -> None:
    s = parse(raw_spec(nodes=2))
    pods = build_pods("j", "ns", "uid-j", s, 1, OperatorConfig(), allocated=(24000, 24001))
    trainer = pods[0]["spec"]["containers"][0]
    assert {"name": "sg-c10d", "containerPort": 24000, "protocol": "TCP"} in trainer["ports"]
    assert {e["name"]: e.get("value") for e in trainer["env"]}["MASTER_PORT"] == "24000"
    for pod in pods:
        sidecar = next(c for c in pod["spec"]["containers"] if c["name"] == "spotguard-sidecar")
        assert sidecar["ports"][0]["containerPort"] == 24001
    svc = build_service("j", "ns", "uid-j", s, allocated=(24000, 24001))
    assert svc is not None and svc["spec"]["ports"][0]["port"] == 24000
    # A port written in the spec wins over the allocated one.
    own = parse(raw_spec(nodes=2, masterPort=29501))
    pods = build_pods("j", "ns", "uid-j", own, 1, OperatorConfig(), allocated=(24000, 24001))
    assert {e["name"]: e.get("value") for e in pods[0]["spec"]["containers"][0]["env"]}["MASTER_PORT"] == "29501"


def test_exhausted_job_waits_with_a_condition_and_one_event() -> None:
    message = hp.exhausted_message(20000, 20003)
    assert "20000-20003" in message and "operator.hostPortRange" in message
    d = hp.wait_for_ports({}, message, NOW, 1)
    assert d.create_attempt is None and d.requeue_after
    assert d.status["phase"] == "Pending"
    (c,) = [c for c in d.status["conditions"] if c["type"] == hp.COND_HOST_PORTS]
    assert (c["status"], c["reason"], c["message"]) == ("False", hp.R_EXHAUSTED, message)
    assert [(e.type, e.reason) for e in d.events] == [("Warning", hp.R_EXHAUSTED)]
    again = hp.wait_for_ports(d.status, message, NOW, 1)
    assert again.events == () and again.status == d.status  # no Event at every look
    restarting = hp.wait_for_ports({"phase": "Restarting", "attempt": 2}, message, NOW, 1)
    assert restarting.status["phase"] == "Restarting"
    # Once a pair is free: the condition turns True, with an Event.
    st, events = hp.note_allocated(d.status, hp.HostPorts(20000, 20001, True), NOW, 1)
    (c,) = [c for c in st["conditions"] if c["type"] == hp.COND_HOST_PORTS]
    assert (c["status"], c["reason"]) == ("True", hp.R_ALLOCATED) and "20000" in c["message"]
    assert [(e.type, e.reason) for e in events] == [("Normal", hp.R_ALLOCATED)]
    # A job that never waited gets no condition.
    assert hp.note_allocated({"phase": "Pending"}, hp.HostPorts(20000, 20001, True), NOW, 1) == (
        {"phase": "Pending"},
        (),
    )


# --- the claim protocol, against a fake apiserver -----------------------------------


class Conflict(Exception):
    status = 409


class FakeCustom:
    """TrainingJobs in memory: linearizable reads and writes, merge patches of status with a resourceVersion check.

    ``jitter`` sleeps a random while before and after every call, so threads interleave every way.
    """

    def __init__(self, jitter: float = 0.0, seed: int = 0) -> None:
        self.objs: dict[tuple[str, str], dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.rv = 0
        self.jitter = jitter
        self.rng = random.Random(seed)

    def _pause(self) -> None:
        if self.jitter:
            with self.lock:
                t = self.rng.uniform(0, self.jitter)
            time.sleep(t)

    def add(self, body: dict[str, Any]) -> None:
        with self.lock:
            self.rv += 1
            body = copy.deepcopy(body)
            body["metadata"]["resourceVersion"] = str(self.rv)
            self.objs[(body["metadata"]["namespace"], body["metadata"]["name"])] = body

    def get_namespaced_custom_object(self, group: str, version: str, ns: str, plural: str, name: str) -> Any:
        self._pause()
        with self.lock:
            return copy.deepcopy(self.objs[(ns, name)])

    def list_cluster_custom_object(self, group: str, version: str, plural: str) -> Any:
        self._pause()
        with self.lock:
            return {"items": copy.deepcopy(list(self.objs.values()))}

    def list_namespaced_custom_object(self, group: str, version: str, ns: str, plural: str) -> Any:
        self._pause()
        with self.lock:
            return {"items": copy.deepcopy([o for (n, _), o in self.objs.items() if n == ns])}

    def patch_namespaced_custom_object_status(
        self, group: str, version: str, ns: str, plural: str, name: str, body: dict[str, Any], **_: Any
    ) -> Any:
        self._pause()
        with self.lock:
            obj = self.objs[(ns, name)]
            want = (body.get("metadata") or {}).get("resourceVersion")
            if want is not None and want != obj["metadata"]["resourceVersion"]:
                raise Conflict()
            st = obj.setdefault("status", {})
            for k, v in (body.get("status") or {}).items():
                if v is None:
                    st.pop(k, None)
                else:
                    st[k] = v
            self.rv += 1
            obj["metadata"]["resourceVersion"] = str(self.rv)
            result = copy.deepcopy(obj)
        self._pause()
        return result


def ctx_on(custom: FakeCustom, first: int, last: int) -> rc.Context:
    return rc.Context(
        core=None, custom=custom, config=OperatorConfig(), metrics=OperatorMetrics(), host_port_range=(first, last)
    )


def test_allocation_is_stable_and_freed() -> None:
    custom = FakeCustom()
    ctx = ctx_on(custom, 20000, 20003)
    for name in ("a", "b", "c"):
        custom.add(job(name))
    spec = parse(raw_spec())
    a = rc.ensure_host_ports(ctx, custom.objs[("ns", "a")], spec)
    assert a.ports is not None and a.job["status"]["hostPorts"]["confirmed"] is True
    assert rc.ensure_host_ports(ctx, a.job, spec).ports == a.ports  # stable
    b = rc.ensure_host_ports(ctx, custom.objs[("ns", "b")], spec)
    assert b.ports is not None and not set(b.ports) & set(a.ports)
    c = rc.ensure_host_ports(ctx, custom.objs[("ns", "c")], spec)
    assert c.ports is None and c.exhausted is not None and "20000-20003" in c.exhausted
    # a finishes (the operator removes its pair as it does): the pair is free for c.
    custom.objs[("ns", "a")]["status"] = {"phase": "Succeeded"}
    c = rc.ensure_host_ports(ctx, custom.objs[("ns", "c")], spec)
    assert c.ports == a.ports


def test_a_claim_left_by_a_stopped_operator_is_finished_by_the_next() -> None:
    custom = FakeCustom()
    custom.add(job("a", {"hostPorts": {"master": 20002, "metrics": 20003}}))
    custom.add(job("b", {"hostPorts": {"master": 20002, "metrics": 20003}}))  # two claims on one pair
    ctx = ctx_on(custom, 20000, 20005)
    spec = parse(raw_spec())
    a = rc.ensure_host_ports(ctx, custom.objs[("ns", "a")], spec)
    b = rc.ensure_host_ports(ctx, custom.objs[("ns", "b")], spec)
    assert a.ports and b.ports and not set(a.ports) & set(b.ports)


@pytest.mark.parametrize("seed", range(8))
def test_operators_allocating_at_once_never_share_a_port(seed: int) -> None:
    # Three operator processes (each with its own lock) over one apiserver, every call interleaved at random:
    # each job's claim is checked against every other claim after it is written, so two cannot both win.
    n = 12
    custom = FakeCustom(jitter=0.002, seed=seed)
    first, last = 20000, 20000 + 2 * n - 1  # exactly one pair per job: the tightest case
    for i in range(n):
        custom.add(job(f"j{i:02d}"))
    ctxs = [ctx_on(custom, first, last) for _ in range(3)]
    spec = parse(raw_spec())
    errors: list[BaseException] = []

    def serve(ctx: rc.Context, order: list[int]) -> None:
        try:
            for _ in range(60):
                pending = False
                for i in order:
                    body = custom.get_namespaced_custom_object("", "", "ns", "", f"j{i:02d}")
                    if rc.ensure_host_ports(ctx, body, spec).ports is None:
                        pending = True
                if not pending:
                    return
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    rng = random.Random(seed)
    orders = [rng.sample(range(n), n) for _ in ctxs]
    threads = [threading.Thread(target=serve, args=(c, o)) for c, o in zip(ctxs, orders, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    got = {name: o["status"].get("hostPorts") for (_, name), o in custom.objs.items()}
    assert all(p and p.get("confirmed") for p in got.values()), got
    ports = [p for v in got.values() for p in (v["master"], v["metrics"])]
    assert len(set(ports)) == 2 * n, got


# --- the chart ---------------------------------------------------------------------


def test_the_chart_passes_the_range_to_the_operator() -> None:
    from testenv.chart import CHART, helm, operator_command, render

    assert "--host-port-range=20000-29999" in operator_command(render())
    assert "--host-port-range=40000-40999" in operator_command(render("operator.hostPortRange=40000-40999"))
    bad = helm("template", "rel", str(CHART), "--set", "operator.hostPortRange=lots", check=False)
    assert bad.returncode != 0 and "hostPortRange" in bad.stderr
