"""A fleet of TrainingJobs on few nodes, with random spot deaths of every mode.

20 jobs (``make soak``; 6 in ``make test``, see ``testenv.trials``) start at once in one namespace:
mostly single-node jobs training the packaged demo
(``python -m spotguard.demo.train``), and one in five a gang of two nodes
(``torchrun --module spotguard.demo.train_ddp``). No job asks for a GPU, so all
of them run at once, several pods to a process node. While they train, nodes
die at random (6 in ``make soak``, 3 in ``make test``, cycling drain,
graceful shutdown and abrupt loss, a few seconds apart, each on the node of a
random running pod of a job whose trainer steps, else of one whose trainer is
still starting; ``SPOTGUARD_TEST_SEED`` fixes the choices). A node takes
every pod on it, and a node that was killed comes back empty, so the pods
that restart crowd onto it.

Then every job must have Succeeded without a failure, no pod name may have
been created twice, each attempt's pods must have appeared only after every
pod of the attempt before had stopped (in the apiserver's event order), and
every job must end bit-for-bit where an uninterrupted run ends: a single-node
job's final checkpoint (model, optimizer, torch RNG) equals that of one
uninterrupted run on this machine, a gang's ``final digest`` equals that of an
uninterrupted two-process ``torchrun``.

The same again with ``hostNetwork: true`` (20 jobs in ``make soak``, 4 in
``make test``, at least two of them gangs): the pods of a node share its ports,
so the operator picks a master port and a metrics port per job and declares
them, and the scheduler never puts two pods with one port on one node. (Process
nodes all share this machine's network, so two pods with one port on
*different* nodes do collide here, the two ranks of a gang for one: the
sidecar of the second one cannot serve metrics and goes on shipping. The test
checks that every such sidecar shared its port with a pod on another node.)

Everything competes for a CI machine's few cores, which is the point: many
pods to a node, slow starts, deaths while pods start and stop.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from reference_runs import Pending, ReferenceRuns
from sidecar_helpers import Proc

from testenv import kubetest, trials
from testenv.kubetest import (
    GROUP,
    IMAGE,
    PLURAL,
    VERSION,
    Env,
    PodLife,
    PodWatch,
    delete_jobs,
    fast_preemption,
    operator_namespace,
    trainer_log,
)

pytestmark = pytest.mark.integration

#: Scale (``testenv.trials``): ``make soak`` runs the full fleets, one without hostNetwork and
#: one with it; ``make test`` one small fleet that holds every kind at once (single-node and gang
#: jobs, every death mode, pod network and hostNetwork side by side on the same nodes).
FLEET_JOBS = trials.count(full=20, quick=6)
HOSTNET_JOBS = trials.count(full=20, quick=4)
PREEMPTIONS = trials.count(full=6, quick=3)
MODES = ("drain", "shutdown", "kill")
#: Long enough that the deaths land mid-training with every job running at once on two cores.
STEPS, STEP_DELAY, EVERY = 60, 0.15, 10
TRAIN_ARGS = ["--steps", str(STEPS), "--step-delay", str(STEP_DELAY), "--log-every", "1"]
REF_ARGS = ["--steps", str(STEPS), "--log-every", "10"]
SOLO_COMMAND = ["python", "-m", "spotguard.demo.train"]
GANG_COMMAND = ["torchrun", "--module", "spotguard.demo.train_ddp"]
GRACE = 30


# --- fixtures -------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(
    kube: Any, apis: tuple[Any, Any], crd: None, process_nodes: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Env]:
    with operator_namespace(kube, apis, process_nodes, "fleet", tmp_path_factory.mktemp("fleet"), poll_seconds=5) as e:
        yield e


@pytest.fixture
def env(fleet: Env, apis: tuple[Any, Any]) -> Iterator[Env]:
    """The module's namespace and operator; the test's jobs and pods are gone after it."""
    try:
        yield fleet
    finally:
        delete_jobs(apis, fleet.ns)


@dataclass
class References:
    """What uninterrupted runs of the fleet's two trainers end with."""

    solo_dir: Path  # the single-node demo's final checkpoint directory
    gang_digest: str


def final_digest(log: str) -> str | None:
    m = re.search(r"^final digest ([0-9a-f]{64})", log, re.M)
    return m.group(1) if m else None


def start_reference(argv: list[str]) -> Callable[[Path], Pending[tuple[Path, str]]]:
    """A reference run of ``argv`` (no storage, no step delay), checkpointing into its directory's ``ckpt``;
    its result: that directory and the run's output."""

    def begin(d: Path) -> Pending[tuple[Path, str]]:
        env = {
            "PATH": str(Path(sys.executable).parent),
            "TMPDIR": str(d),  # torchrun leaves a directory of its own in the temporary directory
            "SPOTGUARD_CHECKPOINT_DIR": str(d / "ckpt"),
            "SPOTGUARD_SAVE_EVERY_STEPS": str(EVERY),
            "OMP_NUM_THREADS": "1",
        }
        proc = Proc(argv, env, d / "train.log")

        def finish() -> tuple[Path, str]:
            assert proc.wait(300) == 0, proc.tail(60)
            return d / "ckpt", proc.text()

        return Pending(finish, proc.kill)

    return begin


@pytest.fixture(scope="module")
def references(reference_runs: ReferenceRuns) -> References:
    """One uninterrupted run of each trainer on this machine, side by side (once per session)."""
    from spotguard.checkpoint import list_local_committed

    py = sys.executable
    started = time.monotonic()
    solo = reference_runs.start(
        ("fleet-demo", STEPS, EVERY), start_reference([py, "-m", "spotguard.demo.train", *REF_ARGS])
    )
    gang = reference_runs.start(
        ("fleet-demo-ddp", 2, STEPS, EVERY),
        start_reference(
            [
                py,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "--module",
                "spotguard.demo.train_ddp",
                *REF_ARGS,
            ]
        ),
    )
    solo_ckpt, _ = solo.result()
    _, gang_out = gang.result()
    digest = final_digest(gang_out)
    assert digest, gang_out[-3000:]
    solo_dir = list_local_committed(solo_ckpt)[-1]
    assert solo_dir.name.endswith(f"{STEPS - 1:012d}"), solo_dir
    print(f"reference runs: {time.monotonic() - started:.1f}s; gang digest {digest}")
    return References(solo_dir, digest)


# --- the watch over every pod of the fleet -----------------------------------------


@dataclass
class PodFacts:
    job: str
    nodes: set[str] = field(default_factory=set)
    host_ports: set[int] = field(default_factory=set)
    metrics_port: int | None = None


class FleetWatch(PodWatch):
    """A :class:`PodWatch` over every spotguard pod of the namespace, which also notes nodes and ports."""

    def __init__(self, core: Any, ns: str) -> None:
        super().__init__(core, ns, "fleet")
        self.selector = "spotguard.dev/job"
        self.facts: dict[str, PodFacts] = {}

    def _record(self, kind: str, pod: Any) -> None:
        super()._record(kind, pod)
        with self.lock:
            facts = self.facts.setdefault(pod.metadata.name, PodFacts(pod.metadata.labels["spotguard.dev/job"]))
            if pod.spec.node_name:
                facts.nodes.add(pod.spec.node_name)
            host_network = bool(pod.spec.host_network)
            for c in [*(pod.spec.init_containers or []), *pod.spec.containers]:
                for p in c.ports or []:
                    port = p.host_port or (p.container_port if host_network else None)
                    if port:
                        facts.host_ports.add(port)
                    if p.name == "sg-metrics":
                        facts.metrics_port = p.container_port


def overlapping(a: PodLife, b: PodLife) -> bool:
    """Whether two pods existed at the same time (positions in the watch's event order)."""
    inf = 1 << 62
    a0, a1, b0, b1 = a.added or 0, a.stopped or inf, b.added or 0, b.stopped or inf
    return a0 < b1 and b0 < a1


def attempt_problems(job: str, nodes: int, attempts: int, lives: dict[str, PodLife]) -> list[str]:
    """What is wrong with a job's pods: a name created twice, a pod too many or missing, attempts that overlap."""
    mine = [p for p in lives.values() if p.name.startswith(f"{job}-a")]
    problems = [f"pod {p.name} was created {len(p.uids)} times" for p in mine if len(p.uids) != 1]
    for a in range(1, attempts + 1):
        names = sorted(p.name for p in mine if p.attempt == a)
        want = [f"{job}-a{a}"] if nodes == 1 else [f"{job}-a{a}-{r}" for r in range(nodes)]
        if names != want:
            problems.append(f"attempt {a}: pods {names}, expected {want}")
    if extra := sorted(p.name for p in mine if p.attempt > attempts):
        problems.append(f"pods of attempts after the last one ({attempts}): {extra}")
    for a in range(1, attempts):
        old = [p for p in mine if p.attempt == a]
        new = [p for p in mine if p.attempt == a + 1]
        if not old or not new:
            continue
        if running := [p.name for p in old if p.stopped is None]:
            problems.append(f"attempt {a}'s pods {running} never stopped, yet attempt {a + 1} exists")
            continue
        last_stop = max(old, key=lambda p: p.stopped or 0)
        first_new = min(new, key=lambda p: p.added or 0)
        if (first_new.added or 0) <= (last_stop.stopped or 0):
            problems.append(
                f"attempt {a + 1}'s pod {first_new.name} appeared (event {first_new.added}) before attempt {a}'s "
                f"pod {last_stop.name} stopped (event {last_stop.stopped})"
            )
    return problems


# --- the fleet --------------------------------------------------------------------


@dataclass
class Job:
    name: str
    nodes: int
    host_network: bool = False
    #: Seconds from its creation to its end, as its status says.
    wall: float | None = None
    status: dict[str, Any] = field(default_factory=dict)

    def lead_pod(self, attempt: int) -> str:
        """The pod whose trainer prints the steps (rank 0)."""
        return f"{self.name}-a{attempt}" if self.nodes == 1 else f"{self.name}-a{attempt}-0"


def job_body(job: Job, storage: str) -> dict[str, Any]:
    command = SOLO_COMMAND if job.nodes == 1 else GANG_COMMAND
    trainer = {
        "name": "trainer",
        "image": IMAGE,
        "command": command,
        "args": TRAIN_ARGS,
        # torch's threads: one each, as many processes share two cores.
        "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
    }
    gang: dict[str, Any] = {"nodes": job.nodes, "nprocPerNode": 1} if job.nodes > 1 else {}
    return kubetest.job_body(
        job.name,
        storage,
        trainer,
        pod_spec={"hostNetwork": True} if job.host_network else None,
        every_steps=EVERY,
        preemption=fast_preemption(20, 2, GRACE),
        **gang,
    )


def jobs_now(e: Env) -> dict[str, dict[str, Any]]:
    items = e.custom.list_namespaced_custom_object(GROUP, VERSION, e.ns, PLURAL)["items"]
    return {i["metadata"]["name"]: i for i in items}


def training(log: str) -> bool:
    """The trainer has stepped and is not done."""
    return re.search(r"^step \d+ ", log, re.M) is not None and not re.search(r"^(finished|preempted after)", log, re.M)


def raw(call: Any, *args: Any, **kwargs: Any) -> Any:
    """An API call's JSON as plain dicts (the client's models cost CPU the fleet needs)."""
    return json.loads(call(*args, _preload_content=False, **kwargs).data)


def ready_nodes(e: Env) -> set[str]:
    ready = set()
    for n in raw(e.core.list_node)["items"]:
        ok = any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions") or [])
        if ok and not n["spec"].get("unschedulable"):
            ready.add(n["metadata"]["name"])
    return ready


@dataclass(frozen=True)
class Victim:
    pod: str
    node: str
    training: bool  # its job's trainer has stepped (not still starting)
    on_node: tuple[str, ...]  # every pod that runs there


def victims(e: Env, jobs: dict[str, Job]) -> list[Victim]:
    """Running pods (on a live node) of jobs whose current attempt runs and is not being torn down."""
    st = {name: item.get("status") or {} for name, item in jobs_now(e).items()}
    nodes = ready_nodes(e)
    pods = raw(e.core.list_namespaced_pod, e.ns, label_selector="spotguard.dev/job")["items"]
    on_node: dict[str, list[str]] = {}
    for p in pods:
        if p["status"].get("phase") in ("Pending", "Running") and p["spec"].get("nodeName"):
            on_node.setdefault(p["spec"]["nodeName"], []).append(p["metadata"]["name"])
    out = []
    for p in pods:
        meta, node = p["metadata"], p["spec"].get("nodeName")
        job = jobs.get(meta["labels"]["spotguard.dev/job"])
        s = st.get(job.name, {}) if job else {}
        attempt = int(meta["labels"].get("spotguard.dev/attempt", "0"))
        if (
            job is None
            or p["status"].get("phase") != "Running"
            or meta.get("deletionTimestamp")
            or node not in nodes
            or s.get("phase") != "Running"
            or s.get("attempt") != attempt
            or s.get("teardown")
        ):
            continue
        stepping = training(trainer_log(e, job.lead_pod(attempt)))
        out.append(Victim(meta["name"], node, stepping, tuple(sorted(on_node[node]))))
    return sorted(out, key=lambda v: v.pod)


def describe_job(e: Env, job: Job) -> str:
    pods = e.core.list_namespaced_pod(e.ns, label_selector=f"spotguard.dev/job={job.name}").items
    lines = [
        f"{p.metadata.name} {p.status.phase} node={p.spec.node_name} deleting={bool(p.metadata.deletion_timestamp)}"
        for p in pods
    ]
    evs = e.core.list_namespaced_event(e.ns, field_selector=f"involvedObject.name={job.name}").items
    lines += [f"event {ev.type} {ev.reason}: {ev.message}" for ev in evs]
    last = job.lead_pod(int(job.status.get("attempt") or 1))
    lines.append(f"{last} trainer log tail:\n{trainer_log(e, last)[-1500:]}")
    return f"--- {job.name}: {job.status}\n  " + "\n  ".join(lines)


def own_name_on_host_network() -> bool:
    """Whether a process node's hostNetwork pod resolves its own headless-Service name, as with cluster DNS.

    A gang's rank 0 connects to its own MASTER_ADDR; without that name its rendezvous never completes.
    """
    from testenv.processnode.hosts import ClusterHosts, HostsFile

    hosts = HostsFile(Path("/nonexistent"), "ns", "127.0.0.1", "j-0", "j", True)
    return "j-0.j.ns.svc.cluster.local" in ClusterHosts().render("uid", hosts)


@pytest.mark.trials
@pytest.mark.timeout(900)
@pytest.mark.parametrize("network", trials.variants(full=["podnet", "hostnet", "mixed"], quick=["mixed"]))
def test_fleet_survives_random_preemptions_bitwise(
    env: Env, references: References, tmp_path: Path, network: str
) -> None:
    from safetensors.torch import load_file

    from spotguard.checkpoint import restore_latest
    from spotguard.storage import open_storage

    if network != "podnet":
        # A gang's rank 0 connects to its own MASTER_ADDR; without that name its rendezvous never completes.
        assert own_name_on_host_network(), "process nodes give hostNetwork pods no hosts entry for their own name"
    e = env
    started = time.monotonic()
    seed = trials.seed()
    rng = trials.rng(f"fleet-{network}")
    n_jobs = HOSTNET_JOBS if network == "hostnet" else FLEET_JOBS
    gangs = max(1 if network == "podnet" else 2, n_jobs // 5)
    gang_at = set(rng.sample(range(n_jobs), gangs))
    # mixed: one gang and one single-node job on the host's network, the rest on the pod network.
    host_at = (
        set(range(n_jobs))
        if network == "hostnet"
        else set()
        if network == "podnet"
        else {min(gang_at), min(set(range(n_jobs)) - gang_at)}
    )
    jobs = {
        j.name: j
        for j in (
            Job(
                f"{'h' if i in host_at else 'p'}{'gang' if i in gang_at else 'solo'}-{i:02d}",
                2 if i in gang_at else 1,
                i in host_at,
            )
            for i in range(n_jobs)
        )
    }
    print(
        f"\nfleet: {n_jobs} jobs ({gangs} gangs of 2, {len(host_at)} on the host's network), {PREEMPTIONS} "
        f"node deaths, seed {seed} ({trials.SEED_ENV}={seed} repeats the choices)"
    )
    storage = f"file://{tmp_path}/store"
    watch = FleetWatch(e.core, e.ns)
    watch.start()
    try:
        for job in jobs.values():
            (tmp_path / "store" / e.ns / job.name).mkdir(parents=True)
            e.custom.create_namespaced_custom_object(GROUP, VERSION, e.ns, PLURAL, job_body(job, storage))

        # Nodes die while the jobs train: each death in a thread of its own (a drain or a shutdown
        # waits for the node's pods to stop), a few seconds apart, never two at once on one node.
        deadline = time.monotonic() + 300
        while len({v.pod.split("-a")[0] for v in victims(e, jobs) if v.training}) < len(jobs) // 4:
            assert time.monotonic() < deadline, "a quarter of the jobs never trained at once"
            time.sleep(2)
        print(f"{time.monotonic() - started:.0f}s: a quarter of the jobs are training")
        deaths: list[dict[str, Any]] = []
        dying: dict[str, threading.Thread] = {}
        modes: dict[str, str] = {}
        misses = 0

        def die(mode: str, pod: str, node: str, at: float) -> None:
            try:
                result = e.nodes.preempt(pod, e.ns, mode)
            except Exception as exc:  # the pod ended or its node went meanwhile: another one dies instead
                print(f"{at:.0f}s: {mode} of {node} (for {pod}) did not happen: {exc}")
                return
            deaths.append(result)
            print(f"{at:.0f}s: {mode} {node} (chosen for {pod}) took {time.monotonic() - started - at:.0f}s")

        while True:
            busy = {n for n, t in dying.items() if t.is_alive()}
            if len(deaths) + len(busy) >= PREEMPTIONS:
                if not busy:
                    break
                time.sleep(0.5)
                continue
            candidates = [v for v in victims(e, jobs) if v.node not in busy]
            if not candidates:
                misses += 1
                assert misses < 60, f"nothing left to preempt after {len(deaths)} node deaths: train longer"
                time.sleep(1)
                continue
            # A pod of a job that trains if there is one, else one that is starting (a restore done).
            victim = rng.choice([v for v in candidates if v.training] or candidates)
            pod, node = victim.pod, victim.node
            # drain, shutdown, kill, drain, ...: the mode that happened least so far (a death that did not
            # happen is done again).
            had = [d["mode"] for d in deaths] + [modes[n] for n in busy]
            mode = min(MODES, key=lambda m: (had.count(m), MODES.index(m)))
            modes[node] = mode
            at = time.monotonic() - started
            print(
                f"{at:.0f}s: {mode} {node} (chosen for {pod}, {'training' if victim.training else 'starting'}), "
                f"running there: {', '.join(victim.on_node)}"
            )
            dying[node] = threading.Thread(target=die, args=(mode, pod, node, at), daemon=True)
            dying[node].start()
            time.sleep(rng.uniform(2, 4))

        # Every job ends.
        deadline = time.monotonic() + 480
        while True:
            for name, item in jobs_now(e).items():
                job = jobs[name]
                job.status = dict(item.get("status") or {})
                if job.wall is None and job.status.get("phase") in ("Succeeded", "Failed"):
                    done = datetime.fromisoformat(job.status.get("completionTime", "").replace("Z", "+00:00"))
                    born = datetime.fromisoformat(item["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
                    job.wall = (done - born).total_seconds()
            if all(j.wall is not None for j in jobs.values()):
                break
            if time.monotonic() > deadline:
                left = [j for j in jobs.values() if j.wall is None]
                raise AssertionError(f"{len(left)} jobs never ended:\n" + "\n".join(describe_job(e, j) for j in left))
            time.sleep(2)
        time.sleep(3)  # a late duplicate pod would show up within a resync
    finally:
        watch.stop()
    print(f"{time.monotonic() - started:.0f}s: every job ended")

    problems: list[str] = []
    lives = watch.lives()
    if expired := [x for x in watch.errors if "410" in x]:
        problems.append(f"the watch missed events: {expired}")
    preemptions = 0
    for job in jobs.values():
        s = job.status
        attempts = int(s.get("attempt") or 0)
        preemptions += int(s.get("preemptions") or 0)
        print(
            f"{job.name}: {s.get('phase')} attempts {attempts} preemptions {s.get('preemptions')} "
            f"failures {s.get('failures')} wall {job.wall:.0f}s"
        )
        bad = [] if s.get("phase") == "Succeeded" and s.get("failures") == 0 else [f"ended {s}"]
        bad += attempt_problems(job.name, job.nodes, attempts, lives)
        if job.nodes == 1:
            uri = f"{storage}/{e.ns}/{job.name}"
            final = restore_latest(open_storage(uri), tmp_path / "final" / job.name)
            if final is None or final.step != STEPS - 1:
                bad.append(f"final checkpoint in {uri}: {final}")
            else:
                got = tmp_path / "final" / job.name / references.solo_dir.name
                for f in ("model.safetensors", "optimizer.safetensors"):
                    if (got / f).read_bytes() != (references.solo_dir / f).read_bytes():
                        bad.append(f"{f} differs from the uninterrupted run's")
                rng_got = load_file(str(got / "rng.safetensors"))["torch"]
                if not rng_got.equal(load_file(str(references.solo_dir / "rng.safetensors"))["torch"]):
                    bad.append("the torch RNG differs from the uninterrupted run's")
        else:
            digest = final_digest(trainer_log(e, job.lead_pod(attempts)))
            if digest != references.gang_digest:
                bad.append(f"final digest {digest}, uninterrupted {references.gang_digest}")
        if bad:
            problems.append(describe_job(e, job) + "\n  PROBLEMS: " + "; ".join(bad))

    # Host ports: never two pods with one port on one node at the same time.
    facts = dict(watch.facts)
    names = sorted(facts)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            fa, fb = facts[a], facts[b]
            shared = fa.host_ports & fb.host_ports
            if shared and fa.nodes & fb.nodes and overlapping(lives[a], lives[b]):
                problems.append(f"{a} and {b} on node {fa.nodes & fb.nodes} at once, both with host ports {shared}")
    # Host ports are declared by the pods of hostNetwork jobs, and only by them.
    wrong = [n for n, f in facts.items() if bool(f.host_ports) != jobs[f.job].host_network]
    assert not wrong, f"pods whose host ports do not match their job's hostNetwork: {wrong}"
    # A sidecar that could not bind its metrics port: only where a pod on another node held it
    # (process nodes share one machine's network), never one on its own node.
    collisions = 0
    for pod, mine in facts.items():
        path = e.nodes.log_path(e.ns, pod, "spotguard-sidecar")
        log = path.read_text(errors="replace") if path.exists() else ""
        if "cannot serve metrics" not in log:
            continue
        collisions += 1
        holders = [
            n
            for n, f in facts.items()
            if n != pod and f.metrics_port == mine.metrics_port and overlapping(lives[n], lives[pod])
        ]
        if not jobs[mine.job].host_network or not holders or any(facts[h].nodes & mine.nodes for h in holders):
            line = next(x for x in log.splitlines() if "cannot serve metrics" in x)
            problems.append(
                f"{pod} on {mine.nodes}: {line}; port {mine.metrics_port} also held by "
                f"{[(h, facts[h].nodes) for h in holders]}"
            )
    print(f"metrics ports taken by a pod on another node of this machine: {collisions}")

    took = time.monotonic() - started
    print(
        f"fleet ({network}): {len(deaths)} node deaths, {preemptions} job preemptions, {len(lives)} pods, {took:.0f}s"
    )
    assert not problems, "\n".join(problems)
    assert preemptions >= len(deaths), (preemptions, deaths)
    assert {d["mode"] for d in deaths} == set(MODES[: len(deaths)]), deaths
