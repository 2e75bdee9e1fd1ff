"""Gangs: an attempt of several nodes lives and dies together, decided without a cluster."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from spotguard.operator.accounting import on_create_error
from spotguard.operator.classify import PodEnd
from spotguard.operator.decide import decide
from spotguard.operator.gang import gang_trigger
from spotguard.operator.jobstatus import Decision, Member, Observation, condition
from spotguard.operator.podbuilder import OperatorConfig, build_pods, build_service, host_ports
from spotguard.operator.spec import TrainingJobSpec, check_name, parse
from spotguard.operator.specfields import SpecError

T0 = datetime(2030, 1, 1, tzinfo=UTC)
RUN = PodEnd("running", "Running")
PENDING = PodEnd("running", "Pending")
TERMINATING = PodEnd("running", "Terminating", "the pod is shutting down")
UNSCHED = PodEnd(
    "running",
    "Unschedulable",
    "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
    start_problem="unschedulable",
    since="2030-01-01T00:00:00Z",
)
DONE = PodEnd("succeeded", "Completed", "training finished", step=100, ended_at="2030-01-01T00:05:00Z")
CRASH = PodEnd("failed", "Error", "container trainer exited with code 1", step=40, ended_at="2030-01-01T00:01:00Z")
PEER_CRASH = PodEnd("failed", "Error", "container trainer exited with code 1", ended_at="2030-01-01T00:01:01Z")
SHUTDOWN = PodEnd(
    "preempted",
    "NodeShutdown",
    "Pod was terminated in response to imminent node shutdown.",
    step=40,
    lost_steps=0,
    ended_at="2030-01-01T00:01:05Z",
)
LOST = PodEnd("preempted", "NodeLost", "node spot-3 is gone", stop_pod="force")
SIGTERMED = PodEnd(
    "preempted", "sigterm", "the trainer stopped early after a checkpoint", step=40, ended_at="2030-01-01T00:01:02Z"
)
DELETED = PodEnd("preempted", "PodDeleted", "the pod was deleted before it finished")


def spec(nodes: int = 2, **extra: Any) -> TrainingJobSpec:
    raw: dict[str, Any] = {
        "nodes": nodes,
        "template": {
            "spec": {"containers": [{"name": "trainer", "image": "t", "resources": {"limits": {"nvidia.com/gpu": 2}}}]}
        },
        "checkpoint": {"storage": "s3://bkt/p"},
        "preemption": {"maxPreemptions": 3, "backoffLimit": 1, "backoff": {"initialSeconds": 0}},
        **extra,
    }
    return parse(raw)


def m(rank: int, end: PodEnd, attempt: int = 1, **kw: Any) -> Member:
    settled = kw.pop("settled", end.kind in ("succeeded", "failed", "preempted") and end.stop_pod is None)
    return Member(rank, f"job-a{attempt}-{rank}", end, node=kw.pop("node", f"spot-{rank}"), settled=settled, **kw)


def step(
    status: dict[str, Any] | None,
    members: tuple[Member, ...] = (),
    sp: TrainingJobSpec | None = None,
    now: datetime = T0,
) -> Decision:
    return decide("job", status, sp or spec(), Observation(members=members), now, 1)


def cond(d: Decision, type_: str) -> tuple[str | None, str | None, str | None]:
    c = condition(d.status, type_) or {}
    return c.get("status"), c.get("reason"), c.get("message")


def running(attempt: int = 1) -> dict[str, Any]:
    d = step(None)
    for _ in range(attempt - 1):
        d = step(d.status, (m(0, SHUTDOWN, d.status["attempt"]), m(1, SIGTERMED, d.status["attempt"])))
        d = step(d.status, (m(0, SHUTDOWN, d.status["attempt"]), m(1, SIGTERMED, d.status["attempt"])))
    d = step(d.status, (m(0, RUN, attempt), m(1, RUN, attempt)))
    assert d.status["phase"] == "Running"
    return d.status


def test_a_new_gang_creates_every_pod_of_attempt_one() -> None:
    d = step(None)
    assert d.create_attempt == 1 and d.status["nodes"] == 2
    assert d.status["currentPod"] == "job-a1-0"
    assert "job-a1-0, job-a1-1" in d.events[0].message


def test_running_only_when_every_pod_runs() -> None:
    d = step(None)
    d = step(d.status, (m(0, RUN), m(1, PENDING)))
    assert d.status["phase"] == "Pending"
    assert cond(d, "Running")[:2] == ("False", "GangStarting")
    d = step(d.status, (m(0, RUN), m(1, RUN)))
    assert d.status["phase"] == "Running" and cond(d, "Running")[:2] == ("True", "PodRunning")
    assert [e.reason for e in d.events] == ["PodRunning"]


def test_a_missing_node_is_named_with_the_schedulers_message() -> None:
    d = step(None)
    d = step(d.status, (m(0, RUN), m(1, UNSCHED, node=None)), now=T0 + timedelta(seconds=5))
    status, reason, message = cond(d, "Running")
    assert (status, reason) == ("False", "NodesMissing")
    assert message is not None and "1 of 2 nodes missing" in message and "job-a1-1" in message
    assert "Insufficient nvidia.com/gpu" in message
    assert d.requeue_after is not None and d.requeue_after > 0  # the Warning comes after a while
    assert cond(d, "PodBlocked")[0] is None
    later = step(d.status, (m(0, RUN), m(1, UNSCHED, node=None)), now=T0 + timedelta(seconds=301))
    assert cond(later, "PodBlocked")[:2] == ("True", "Unschedulable")
    assert [e.type for e in later.events] == ["Warning"]
    ok = step(later.status, (m(0, RUN), m(1, RUN)), now=T0 + timedelta(seconds=330))
    assert ok.status["phase"] == "Running" and cond(ok, "PodBlocked")[0] == "False"


def test_a_preempted_member_stops_the_gang_then_one_preemption_is_counted() -> None:
    st = running()
    # 1. the end is recorded before anything is deleted (a restarted operator reads it)
    d = step(st, (m(0, SHUTDOWN), m(1, RUN)))
    assert d.delete_pods == () and d.create_attempt is None
    assert d.status["teardown"]["pod"] == "job-a1-0" and d.status["teardown"]["node"] == "spot-0"
    assert d.status["phase"] == "Restarting" and d.status["preemptions"] == 0
    assert d.events[0].reason == "StoppingGang" and "job-a1-0 on node spot-0" in d.events[0].message
    assert "job-a1-1" in d.events[0].message
    assert d.requeue_after is not None and d.requeue_after < 1
    # 2. the others are deleted gracefully (they get their emergency checkpoint)
    d = step(d.status, (m(0, SHUTDOWN), m(1, RUN)))
    assert d.delete_pods == (("job-a1-1", False),) and d.create_attempt is None
    # 3. while one still terminates: nothing new, no second delete of a pod already going
    d = step(d.status, (m(0, SHUTDOWN), m(1, TERMINATING, deleting=True)))
    assert d.delete_pods == () and d.create_attempt is None and d.status["preemptions"] == 0
    # 4. all gone: counted once, next attempt
    d = step(d.status, (m(0, SHUTDOWN), m(1, SIGTERMED, deleting=True)))
    assert d.create_attempt == 2 and d.status["preemptions"] == 1 and d.status["failures"] == 0
    assert d.accounted is not None and d.accounted.kind == "preempted"
    end = d.status["lastPodEnd"]
    assert end["pod"] == "job-a1-0" and end["node"] == "spot-0" and end["reason"] == "NodeShutdown"
    assert end["step"] == 40
    assert "teardown" not in d.status
    assert any(e.reason == "Preempted" and "job-a1-0 on node spot-0" in e.message for e in d.events)


def test_a_rank_that_exits_1_is_one_failure_of_the_whole_gang() -> None:
    st = running()
    d = step(st, (m(0, RUN), m(1, CRASH)))
    assert d.status["teardown"]["kind"] == "failed"
    d = step(d.status, (m(0, RUN), m(1, CRASH)))
    assert d.delete_pods == (("job-a1-0", False),)
    # the other rank fails too because its peer went: still one failure
    d = step(d.status, (m(0, PEER_CRASH), m(1, CRASH)))
    assert d.status["failures"] == 1 and d.status["preemptions"] == 0 and d.create_attempt == 2
    assert d.status["lastPodEnd"]["pod"] == "job-a1-1"


def test_backoff_limit_exhausted_fails_with_the_pod_named() -> None:
    st = running()
    for attempt in (1, 2):
        d = step(st, (m(0, RUN, attempt), m(1, CRASH, attempt)))
        d = step(d.status, (m(0, PEER_CRASH, attempt), m(1, CRASH, attempt)))
        st = d.status
        if attempt == 1:
            d = step(st, (m(0, RUN, 2), m(1, RUN, 2)))
            st = d.status
    assert d.status["phase"] == "Failed" and d.create_attempt is None
    status, reason, message = cond(d, "Failed")
    assert reason == "BackoffLimitExceeded" and message is not None
    assert any("job-a2-1 on node spot-1" in e.message for e in d.events)


def test_failures_caused_by_a_lost_node_count_as_a_preemption() -> None:
    st = running()
    # the peers fail first (their node is still there), then the machine turns out gone
    d = step(st, (m(0, LOST, settled=False), m(1, PEER_CRASH)))
    assert d.status["teardown"]["kind"] == "preempted" and d.status["teardown"]["reason"] == "NodeLost"
    d = step(st, (m(0, RUN), m(1, PEER_CRASH)))
    assert d.status["teardown"]["kind"] == "failed"
    d = step(d.status, (m(0, LOST, settled=False), m(1, PEER_CRASH)))
    assert d.delete_pods == (("job-a1-0", True),)  # its node is gone: at once
    assert d.status["teardown"]["kind"] == "preempted"
    d = step(d.status, (m(0, DELETED, present=False, settled=True), m(1, PEER_CRASH)))
    assert d.status["preemptions"] == 1 and d.status["failures"] == 0 and d.create_attempt == 2


def test_a_peer_failing_while_a_members_node_shuts_down_counts_as_a_preemption() -> None:
    """Rank 0's node starts a graceful shutdown while the gang is in rendezvous; rank 1 loses the store and
    exits 1 before rank 0's pod shows its end (the teardown then deletes it, so its end is never seen)."""
    st = running()
    d = step(st, (m(0, RUN, node_shutting_down=True), m(1, PEER_CRASH)))
    assert d.status["teardown"]["kind"] == "preempted" and d.status["teardown"]["reason"] == "NodeShutdown"
    assert d.status["teardown"]["rank"] == 0
    # the shutdown begins after the teardown for the failure did: the cause is upgraded
    d = step(st, (m(0, RUN), m(1, PEER_CRASH)))
    assert d.status["teardown"]["kind"] == "failed"
    d = step(d.status, (m(0, RUN, node_shutting_down=True), m(1, PEER_CRASH)))
    assert d.status["teardown"]["kind"] == "preempted"
    d = step(d.status, (m(0, DELETED, present=False, settled=True), m(1, PEER_CRASH)))
    assert d.status["preemptions"] == 1 and d.status["failures"] == 0 and d.create_attempt == 2
    # a node that shuts down is the machine going: it beats a peer's crash in the trigger order
    t = gang_trigger((m(0, CRASH), m(1, RUN, node_shutting_down=True)))
    assert t is not None and t.rank == 1 and t.end.reason == "NodeShutdown"


def test_the_operators_own_deletes_never_turn_a_failure_into_a_preemption() -> None:
    st = running()
    d = step(st, (m(0, RUN), m(1, CRASH)))
    d = step(d.status, (m(0, RUN), m(1, CRASH)))
    d = step(d.status, (m(0, SIGTERMED, deleting=True), m(1, CRASH)))
    assert d.status["failures"] == 1 and d.status["preemptions"] == 0


def test_trigger_order() -> None:
    assert gang_trigger((m(0, RUN), m(1, RUN))) is None
    assert gang_trigger((m(0, DONE), m(1, RUN))) is None
    t = gang_trigger((m(0, CRASH), m(1, SHUTDOWN)))
    assert t is not None and t.rank == 1  # the machine went: the crash is its consequence
    t = gang_trigger((m(0, PEER_CRASH), m(1, CRASH)))
    assert t is not None and t.rank == 1  # the first to end
    t = gang_trigger((m(0, CRASH), m(1, DELETED, present=False)))
    assert t is not None and t.rank == 1  # a pod that is gone went first


def test_success_only_when_every_pod_succeeded() -> None:
    st = running()
    d = step(st, (m(0, DONE), m(1, RUN)))
    assert d.status["phase"] == "Running" and d.delete_pods == ()
    d = step(d.status, (m(0, DONE), m(1, DONE)))
    assert d.status["phase"] == "Succeeded" and d.status["lastPodEnd"]["step"] == 100
    assert cond(d, "Succeeded")[0] == "True"


def test_operator_restart_mid_teardown_creates_nothing_until_all_are_gone() -> None:
    st = running()
    d = step(st, (m(0, SHUTDOWN), m(1, RUN)))
    saved = d.status  # what the apiserver holds when the operator dies here
    for _ in range(3):  # any number of fresh operators look again
        again = step(saved, (m(0, SHUTDOWN), m(1, TERMINATING, deleting=True)))
        assert again.create_attempt is None and again.status["preemptions"] == 0
        assert again.status["teardown"]["pod"] == "job-a1-0"
    done = step(saved, (m(0, SHUTDOWN), m(1, DELETED, present=False, settled=True)))
    assert done.create_attempt == 2 and done.status["preemptions"] == 1
    # after the next attempt was recorded, the old attempt is never looked at again
    nxt = step(done.status, (m(0, RUN, 2), m(1, RUN, 2)))
    assert nxt.create_attempt is None and nxt.status["attempt"] == 2


def test_suspend_stops_the_gang_without_counting() -> None:
    st = running()
    sp = spec(suspend=True)
    d = step(st, (m(0, RUN), m(1, RUN)), sp=sp)
    assert d.status["teardown"]["kind"] == "suspended"
    d = step(d.status, (m(0, RUN), m(1, RUN)), sp=sp)
    assert sorted(d.delete_pods) == [("job-a1-0", False), ("job-a1-1", False)]
    d = step(d.status, (m(0, SIGTERMED, deleting=True), m(1, SIGTERMED, deleting=True)), sp=sp)
    assert d.status["phase"] == "Suspended" and d.status["preemptions"] == 0 and d.status["failures"] == 0
    d = step(d.status, (), sp=spec())
    assert d.create_attempt == 2


def test_max_preemptions_counts_attempts_not_pods() -> None:
    st = running()
    for attempt in range(1, 5):
        d = step(st, (m(0, SHUTDOWN, attempt), m(1, SHUTDOWN, attempt)))
        d = step(d.status, (m(0, SHUTDOWN, attempt), m(1, SHUTDOWN, attempt)))
        assert d.status["preemptions"] == attempt
        st = d.status
        if d.status["phase"] == "Failed":
            break
        st = step(st, (m(0, RUN, attempt + 1), m(1, RUN, attempt + 1))).status
    assert d.status["phase"] == "Failed" and d.status["preemptions"] == 4  # maxPreemptions 3


def test_create_error_of_a_gang_fails_the_job() -> None:
    d = on_create_error("job", {"attempt": 1, "nodes": 2}, 1, 422, "bad", T0)
    assert d.status["phase"] == "Failed"


# --- spec and names --------------------------------------------------------------------------


def test_spec_defaults_and_gpu_nproc() -> None:
    s = spec(nodes=1)
    assert (s.nodes, s.nproc_per_node, s.master_port) == (1, 2, 29500)  # nprocPerNode: the GPU limit
    plain = parse(
        {"template": {"spec": {"containers": [{"name": "t", "image": "t"}]}}, "checkpoint": {"storage": "s3://bkt/p"}}
    )
    assert (plain.nodes, plain.nproc_per_node, plain.distributed) == (1, 1, False)


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        ("nodes", 0, "spec.nodes"),
        ("nodes", 5000, "spec.nodes"),
        ("nodes", "two", "spec.nodes"),
        ("nprocPerNode", 0, "spec.nprocPerNode"),
        ("masterPort", 0, "spec.masterPort"),
        ("masterPort", 70000, "spec.masterPort"),
        ("masterPort", 9400, "spec.masterPort"),  # the sidecar's metrics port
    ],
)
def test_spec_refuses_nonsense_naming_the_field(field: str, value: Any, where: str) -> None:
    with pytest.raises(SpecError) as err:
        spec(**{field: value})
    assert err.value.field == where


def test_names_that_cannot_make_pods_are_refused_with_the_limit() -> None:
    check_name("a" * 63, spec(nodes=1))
    with pytest.raises(SpecError, match="at most 63") as err:
        check_name("a" * 70, spec(nodes=1))
    assert err.value.field == "metadata.name"
    check_name("a" * 61, spec(nodes=2))
    with pytest.raises(SpecError, match="at most 61"):
        check_name("a" * 62, spec(nodes=2))
    with pytest.raises(SpecError, match="at most 60"):
        check_name("a" * 61, spec(nodes=11))
    with pytest.raises(SpecError, match="headless Service"):
        check_name("1job", spec(nodes=2))
    with pytest.raises(SpecError, match="headless Service"):
        check_name("my.job", spec(nodes=2))
    check_name("my.job", spec(nodes=1))  # a subdomain name is fine for one pod


def test_gang_pods_service_and_torchrun_env() -> None:
    s = spec(nodes=2, masterPort=29600)
    pods = build_pods("job", "ns", "uid-1", s, 3, OperatorConfig())
    assert [p["metadata"]["name"] for p in pods] == ["job-a3-0", "job-a3-1"]
    for rank, pod in enumerate(pods):
        ps = pod["spec"]
        assert ps["hostname"] == f"job-{rank}" and ps["subdomain"] == "job"
        assert pod["metadata"]["labels"]["spotguard.dev/node-rank"] == str(rank)
        for c in [*ps["containers"], *ps["initContainers"]]:
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["PET_NNODES"] == "2" and env["PET_NPROC_PER_NODE"] == "2"
            assert env["PET_NODE_RANK"] == env["NODE_RANK"] == str(rank)
            assert env["PET_MASTER_ADDR"] == env["MASTER_ADDR"] == "job-0.job.ns.svc.cluster.local"
            assert env["PET_MASTER_PORT"] == env["MASTER_PORT"] == "29600"
            assert env["WORLD_SIZE"] == "4"
            assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "60"  # the grace period
    svc = build_service("job", "ns", "uid-1", s)
    assert svc is not None
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"spotguard.dev/job": "job"}
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert build_service("job", "ns", "uid-1", spec(nodes=1)) is None


def test_one_node_pods_stay_as_before() -> None:
    pods = build_pods(
        "job",
        "ns",
        "uid",
        spec(nodes=1, template={"spec": {"containers": [{"name": "t", "image": "t"}]}}),
        2,
        OperatorConfig(),
    )
    assert [p["metadata"]["name"] for p in pods] == ["job-a2"]
    ps = pods[0]["spec"]
    assert "hostname" not in ps and "subdomain" not in ps
    assert not any(e["name"].startswith("PET_") for e in ps["containers"][0]["env"])


def test_host_network_ports_are_per_job_and_declared() -> None:
    tmpl = {"spec": {"hostNetwork": True, "containers": [{"name": "t", "image": "t"}]}}
    a = build_pods("a", "ns", "uid-a", spec(nodes=2, template=tmpl), 1, OperatorConfig())
    b = build_pods("b", "ns", "uid-b", spec(nodes=2, template=tmpl), 1, OperatorConfig())
    ports_a, ports_b = host_ports("uid-a"), host_ports("uid-b")
    assert ports_a != ports_b
    for pods, (master, metrics) in ((a, ports_a), (b, ports_b)):
        trainer = pods[0]["spec"]["containers"][0]
        assert {"name": "sg-c10d", "containerPort": master, "protocol": "TCP"} in trainer["ports"]
        sidecar = [c for c in pods[0]["spec"]["containers"] if c["name"] == "spotguard-sidecar"][0]
        assert sidecar["ports"][0]["containerPort"] == metrics
        assert {e["name"]: e.get("value") for e in trainer["env"]}["PET_MASTER_PORT"] == str(master)
        assert "ports" not in pods[1]["spec"]["containers"][0]  # only rank 0 serves the rendezvous
        assert all(p["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet" for p in pods)
    # ports written in the spec win
    own = build_pods(
        "c",
        "ns",
        "uid-c",
        spec(nodes=2, template=tmpl, masterPort=29501, sidecar={"metricsPort": 9555}),
        1,
        OperatorConfig(),
    )
    assert {e["name"]: e.get("value") for e in own[0]["spec"]["containers"][0]["env"]}["MASTER_PORT"] == "29501"


def _stored(value: Any) -> Any:
    """What the apiserver keeps of a merge-patched status: no null values."""
    if isinstance(value, dict):
        return {k: _stored(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_stored(v) for v in value]
    return value


def test_a_look_at_an_unchanged_gang_patches_nothing() -> None:
    from spotguard.operator.jobstatus import status_patch

    st = running()
    for members in ((m(0, SHUTDOWN), m(1, RUN)), (m(0, LOST, settled=False), m(1, TERMINATING, deleting=True))):
        d = step(st, members)
        stored = _stored(d.status)
        stored = _stored(step(stored, members).status)  # recorded, then stopping: now steady
        again = step(stored, members)
        assert status_patch(stored, again.status) == {}, status_patch(stored, again.status)
        st = stored


def test_a_member_being_deleted_by_someone_else_ends_the_attempt_at_once_with_its_node() -> None:
    st = running()
    d = step(st, (m(0, RUN), m(1, TERMINATING, deleting=True)))  # a drain: evicted, still in its grace period
    assert d.status["teardown"]["pod"] == "job-a1-1" and d.status["teardown"]["node"] == "spot-1"
    assert d.status["teardown"]["reason"] == "PodDeleted"
    d = step(d.status, (m(0, RUN), m(1, TERMINATING, deleting=True)))
    assert d.delete_pods == (("job-a1-0", False),)  # the other rank is told to stop now
    d = step(d.status, (m(0, SIGTERMED, deleting=True), m(1, DELETED, present=False, settled=True, node=None)))
    assert d.status["preemptions"] == 1 and d.status["lastPodEnd"]["node"] == "spot-1"
