"""TrainingJobs of several nodes ("gangs") against the real kube-apiserver and process nodes.

Every pod really runs (restore init container, trainer, sidecar as local
processes on a process node), but the trainer is a shell loop, never torch, so
that each test takes seconds. Preemptions are the process nodes' own: drain
(cordon + eviction API), graceful node shutdown, and a node that is killed and
replaced. A watch on the job's pods records, in the apiserver's order, when
each pod appeared and when it stopped running (terminal phase or gone): the
next attempt's first pod must appear only after every pod of the previous one
has stopped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testenv.kubetest import (
    Env,
    cond,
    delete_jobs,
    fast_preemption,
    job_body,
    operator_namespace,
    shell_trainer,
    trainer_log,
    wait_for,
)

pytestmark = pytest.mark.integration

#: The trainer: says who it is, then sleeps until SIGTERM (exit 143 at once), or,
#: on rank $FAIL_RANK, exits 1 after $FAIL_AFTER seconds. $IGNORE_TERM keeps it
#: alive through SIGTERM, so that its pod takes the whole grace period to end.
TRAINER = r"""
echo "rank=$NODE_RANK pet_rank=$PET_NODE_RANK nnodes=$PET_NNODES master=$MASTER_ADDR:$MASTER_PORT world=$WORLD_SIZE"
if [ -n "$IGNORE_TERM" ]; then trap '' TERM; else trap 'kill $! 2>/dev/null; exit 143' TERM; fi
if [ "$NODE_RANK" = "${FAIL_RANK:-none}" ]; then sleep "${FAIL_AFTER:-1}"; echo "rank $NODE_RANK fails"; exit 1; fi
while true; do sleep 1 & wait $!; done
"""


# --- fixtures -------------------------------------------------------------------


@pytest.fixture(scope="module")
def env_module(
    kube: Any, apis: tuple[Any, Any], crd: None, process_nodes: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Env]:
    with operator_namespace(kube, apis, process_nodes, "gang", tmp_path_factory.mktemp("gang"), poll_seconds=5) as e:
        yield e


@pytest.fixture
def env(env_module: Env) -> Iterator[Env]:
    """The module's namespace and operator; each test's jobs and pods are gone after it."""
    try:
        yield env_module
    finally:
        for w in env_module.watches:
            w.stop()
        env_module.watches.clear()
        if env_module.operator is None:
            env_module.start_operator(env_module.log_dir / "operator-3.log")
        delete_jobs(env_module.apis, env_module.ns)


# --- helpers --------------------------------------------------------------------


def gang_job(
    name: str,
    storage: str,
    nodes: int = 2,
    *,
    env: dict[str, str] | None = None,
    node_selector: dict[str, str] | None = None,
    grace: int = 5,
    **preemption: Any,
) -> dict[str, Any]:
    """A gang of ``nodes`` pods running :data:`TRAINER`, which restarts at once (no backoff)."""
    return job_body(
        name,
        storage,
        shell_trainer(TRAINER, env or {}),
        nodes=nodes,
        node_selector=node_selector,
        # Pods of process nodes may share the host's network: no metrics port to collide on.
        sidecar={"metricsPort": 0},
        preemption=fast_preemption(5, 2, grace, **preemption),
    )


def store(tmp_path: Path, e: Env, job: str) -> str:
    """A file store for ``job`` (its directory must exist: the restore reads it)."""
    (tmp_path / "store" / e.ns / job).mkdir(parents=True, exist_ok=True)
    return f"file://{tmp_path}/store"


def all_running(e: Env, job: str, attempt: int, nodes: int) -> bool:
    pods = e.core.list_namespaced_pod(e.ns, label_selector=f"spotguard.dev/job={job},spotguard.dev/attempt={attempt}")
    live = [p for p in pods.items if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
    return len(live) == nodes


def wait_running(e: Env, job: str, attempt: int, nodes: int = 2, timeout: float = 120) -> dict[str, Any]:
    """The job says Running for ``attempt``, and all its pods run."""
    return e.wait_status(
        job,
        f"attempt {attempt} Running",
        lambda s: s.get("attempt") == attempt and s.get("phase") == "Running" and all_running(e, job, attempt, nodes),
        timeout=timeout,
    )


def wait_trainer_log(e: Env, pod: str) -> str:
    return wait_for(lambda: trainer_log(e, pod), f"{pod}'s trainer log")


# --- tests ----------------------------------------------------------------------


def test_two_node_job_pods_service_env_and_running(env: Env, tmp_path: Path) -> None:
    e = env
    job = e.create_job(gang_job("duo", store(tmp_path, e, "duo")))
    uid = job["metadata"]["uid"]
    st = wait_running(e, "duo", 1)
    assert cond(st, "Running")["status"] == "True" and st["preemptions"] == 0 and st["failures"] == 0

    pods = {p.metadata.name: p for p in e.core.list_namespaced_pod(e.ns, label_selector="spotguard.dev/job=duo").items}
    assert sorted(pods) == ["duo-a1-0", "duo-a1-1"]
    assert len({p.spec.node_name for p in pods.values()}) == 2, "one pod per node"
    for rank in (0, 1):
        pod = pods[f"duo-a1-{rank}"]
        labels = pod.metadata.labels
        assert (labels["spotguard.dev/job"], labels["spotguard.dev/attempt"], labels["spotguard.dev/node-rank"]) == (
            "duo",
            "1",
            str(rank),
        )
        assert pod.spec.hostname == f"duo-{rank}" and pod.spec.subdomain == "duo"
        assert [r.uid for r in pod.metadata.owner_references] == [uid]
        for c in pod.spec.containers:
            cenv = {v.name: v.value for v in c.env or []}
            assert cenv["PET_NNODES"] == "2" and cenv["PET_NODE_RANK"] == str(rank), (c.name, cenv)
            assert cenv["PET_NPROC_PER_NODE"] == "1" and cenv["NODE_RANK"] == str(rank)
            assert cenv["PET_MASTER_ADDR"] == cenv["MASTER_ADDR"] == f"duo-0.duo.{e.ns}.svc.cluster.local"
            assert cenv["PET_MASTER_PORT"] == cenv["MASTER_PORT"] and cenv["WORLD_SIZE"] == "2"
            port = int(cenv["MASTER_PORT"])
        # What the trainer process really got.
        log = wait_trainer_log(e, pod.metadata.name)
        assert f"rank={rank} pet_rank={rank} nnodes=2 master=duo-0.duo.{e.ns}.svc.cluster.local:" in log, log

    svc = e.core.read_namespaced_service("duo", e.ns)
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses is True
    assert svc.spec.selector == {"spotguard.dev/job": "duo"}
    assert [(p.name, p.port) for p in svc.spec.ports] == [("c10d", port)]
    ref = svc.metadata.owner_references[0]
    assert (ref.kind, ref.name, ref.uid, ref.controller) == ("TrainingJob", "duo", uid, True)
    e.wait_event("duo", "all pods running", lambda _t, r, m: r == "PodRunning" and "all 2 pods are running" in m)


@pytest.mark.parametrize(("mode", "rank"), [("drain", 1), ("shutdown", 0), ("kill", 1)])
def test_preempting_one_member_restarts_the_whole_gang_once(env: Env, tmp_path: Path, mode: str, rank: int) -> None:
    e = env
    name = f"pre-{mode}"
    watch = e.watch(name)
    e.create_job(gang_job(name, store(tmp_path, e, name)))
    wait_running(e, name, 1)
    victim = f"{name}-a1-{rank}"
    node = e.core.read_namespaced_pod(victim, e.ns).spec.node_name

    result = e.nodes.preempt(victim, e.ns, mode, grace_seconds=5)
    print(f"preempted {victim} by {mode}: {result}")
    assert result["node"] == node
    st = wait_running(e, name, 2)
    for p in watch.attempt_pods(1):
        print(f"{p.name}: {' -> '.join(p.states)}")
    assert st["preemptions"] == 1 and st["failures"] == 0, st
    end = st["lastPodEnd"]
    print(f"lastPodEnd: {end}")
    assert end["attempt"] == 1 and end["kind"] == "preempted", end
    assert cond(st, "Preempted")["status"] == "False"  # resumed
    assert "teardown" not in st
    assert len([r for _t, r, _m in e.events(name) if r == "Preempted"]) <= 1, e.events(name)
    watch.assert_no_overlap(2, 2)
    # Which pod ended the attempt, and on which node: in the status and in an Event.
    assert end["pod"] == victim and end.get("node") == node, end
    e.wait_event(name, f"naming {victim} on {node}", lambda _t, r, m: r == "Preempted" and victim in m and node in m)
    assert len([r for _t, r, _m in e.events(name) if r == "Preempted"]) == 1, e.events(name)


def test_failing_rank_restarts_the_gang_then_exhausts_the_backoff_limit(env: Env, tmp_path: Path) -> None:
    e = env
    watch = e.watch("crash")
    e.create_job(
        gang_job("crash", store(tmp_path, e, "crash"), env={"FAIL_RANK": "1", "FAIL_AFTER": "4"}, backoffLimit=1)
    )
    st = e.wait_status("crash", "attempt 2", lambda s: (s.get("attempt") or 0) >= 2, timeout=120)
    assert st["attempt"] == 2 and st["failures"] == 1 and st["preemptions"] == 0, st
    end = st["lastPodEnd"]
    assert (end["attempt"], end["kind"], end["pod"]) == (1, "failed", "crash-a1-1"), end

    st = e.wait_status("crash", "Failed", lambda s: s.get("phase") in ("Failed", "Succeeded"), timeout=120)
    assert st["phase"] == "Failed" and st["failures"] == 2 and st["preemptions"] == 0 and st["attempt"] == 2, st
    failed = cond(st, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "BackoffLimitExceeded", failed
    assert "exited with code 1" in failed["message"], failed
    e.wait_event(
        "crash",
        "naming the failed pod crash-a2-1",
        lambda t, r, m: t == "Warning" and "crash-a2-1" in m and r in ("PodFailed", "BackoffLimitExceeded"),
    )
    e.wait_event("crash", "BackoffLimitExceeded", lambda _t, r, _m: r == "BackoffLimitExceeded")
    # Every pod of the failed job has stopped; no third attempt.
    wait_for(lambda: all(p.stopped is not None for p in watch.attempt_pods(2)), "attempt 2's pods to stop", timeout=60)
    watch.assert_no_overlap(2, 2)
    assert not watch.attempt_pods(3)


def test_one_node_short_says_nodes_missing_then_runs(env: Env, tmp_path: Path) -> None:
    e = env
    key = f"spotguard.dev/gang-{uuid.uuid4().hex[:6]}"
    first, second = e.nodes.node_names()[:2]
    labelled: list[str] = []

    def label(node: str, value: str | None) -> None:
        e.core.patch_node(node, {"metadata": {"labels": {key: value}}})

    try:
        label(first, "yes")
        labelled.append(first)
        e.create_job(gang_job("short", store(tmp_path, e, "short"), node_selector={key: "yes"}))
        st = e.wait_status("short", "NodesMissing", lambda s: cond(s, "Running").get("reason") == "NodesMissing")
        running = cond(st, "Running")
        assert running["status"] == "False" and st["phase"] == "Pending", st
        assert "1 of 2 nodes missing" in running["message"], running

        # The scheduler's own message, as it is on the pod that waits.
        def scheduler_message() -> str | None:
            for p in e.core.list_namespaced_pod(e.ns, label_selector="spotguard.dev/job=short").items:
                for c in p.status.conditions or []:
                    if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                        return f"{p.metadata.name}|{c.message}"
            return None

        pod, message = wait_for(scheduler_message, "an unschedulable pod").split("|", 1)
        st = e.wait_status(
            "short", "the scheduler's message", lambda s: message in cond(s, "Running").get("message", "")
        )
        assert pod in cond(st, "Running")["message"]
        assert st["failures"] == 0 and st["preemptions"] == 0 and st["attempt"] == 1

        label(second, "yes")
        labelled.append(second)
        st = wait_running(e, "short", 1)
        assert cond(st, "Running")["reason"] == "PodRunning"
    finally:
        for node in labelled:
            try:
                label(node, None)
            except Exception as exc:  # a node a kill replaced is gone with its label
                print(f"unlabel {node}: {exc}")


def test_operator_restarted_mid_teardown_finishes_it_once(env: Env, apis: tuple[Any, Any], tmp_path: Path) -> None:
    e = env
    old = e.operator
    assert old is not None
    watch = e.watch("restart")
    # The other rank ignores SIGTERM: it ends only at the end of its grace period, so the
    # teardown lasts that long.
    e.create_job(gang_job("restart", store(tmp_path, e, "restart"), env={"IGNORE_TERM": "1"}, grace=12))
    wait_running(e, "restart", 1)
    victim = "restart-a1-1"
    e.nodes.preempt(victim, e.ns, "shutdown", grace_seconds=1, wait=False)
    st = e.wait_status("restart", "a teardown", lambda s: (s.get("teardown") or {}).get("attempt") == 1, interval=0.05)
    assert st["teardown"]["pod"] == victim, st["teardown"]
    old.kill()  # a crash, in the middle of the teardown
    e.operator = None
    survivors = [p for p in watch.attempt_pods(1) if p.stopped is None]
    print(f"operator killed; teardown {st['teardown']}; still running: {[p.name for p in survivors]}")
    assert survivors, "the teardown was over before the operator could be stopped"

    e.start_operator(tmp_path / "operator-2.log")
    try:
        st = wait_running(e, "restart", 2)
    finally:
        print(f"--- restarted operator log ---\n{e.operator.log_tail(40)}")
    assert st["preemptions"] == 1 and st["failures"] == 0, st
    assert st["lastPodEnd"]["pod"] == victim and st["lastPodEnd"]["attempt"] == 1, st["lastPodEnd"]
    assert "teardown" not in st
    watch.assert_no_overlap(2, 2)
    time.sleep(3)  # a late duplicate would show up within a resync
    watch.assert_no_overlap(2, 2)
    assert not watch.attempt_pods(3)
    assert len([r for _t, r, _m in e.events("restart") if r == "Preempted"]) == 1, e.events("restart")
