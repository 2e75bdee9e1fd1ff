"""The end-to-end tests' shared world: the chart installed by Helm, the example jobs, and the checks.

Both end-to-end modules use it: ``tests/e2e/test_operator_e2e.py`` (training
pods on process nodes) and ``tests/e2e/test_realnode_e2e.py`` (on real nodes,
kubelet + containerd). What they check the same way lives here: how a job's
trainer logs its steps, the bitwise comparison of a job's final checkpoint with
an uninterrupted reference run on this machine, and who of the operator's
replicas acted (its Lease, the apiserver's audit log).
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from spotguard.operator.testing import wait_for
from testenv.cluster import repo_root
from testenv.kubetest import audit_writes, lease_holder

ROOT = repo_root()
CHART = ROOT / "charts" / "spotguard"
EXAMPLE = ROOT / "examples" / "trainingjob.yaml"
DDP_EXAMPLE = ROOT / "examples" / "trainingjob-ddp.yaml"
HF_EXAMPLE = ROOT / "examples" / "trainingjob-hf.yaml"
DEV_VALUES = ROOT / "examples" / "dev-values.yaml"
RELEASE, OPERATOR_NS = "spotguard", "spotguard-system"
GROUP, VERSION, PLURAL = "spotguard.dev", "v1alpha1", "trainingjobs"
#: The Secret examples/dev-setup.sh makes: the store's credentials and endpoint.
CREDENTIALS_SECRET = "spotguard-s3"


@dataclass
class Env:
    """A test namespace beside the chart installed by Helm: its clients, the store, the nodes."""

    kube: Any
    core: Any
    custom: Any
    ns: str
    metrics_port: int
    s3: Any
    nodes: Any
    log_dir: Path
    prom: Any = None

    def tool(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.kube.bin_dir / name), "--kubeconfig", str(self.kube.kubeconfig), *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=300,
        )

    def status(self, job: str) -> dict[str, Any]:
        body = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, job)
        return dict(body.get("status") or {})

    def wait_status(self, job: str, what: str, pred: Any, timeout: float = 240) -> dict[str, Any]:
        try:
            return wait_for(
                lambda: (lambda s: s if pred(s) else None)(self.status(job)),
                f"{job}: {what}",
                timeout=timeout,
                interval=0.5,
            )
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nstatus: {self.status(job)}\n{self.describe(job)}") from None

    def wait_pod_running(self, pod: str, timeout: float = 180) -> None:
        def running() -> bool:
            p = self.core.read_namespaced_pod(pod, self.ns)
            return bool(p.status.phase == "Running" and p.metadata.deletion_timestamp is None)

        try:
            wait_for(running, f"pod {pod} Running", timeout=timeout, interval=0.3)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.describe(pod.rsplit('-a', 1)[0])}") from None

    def trainer_log(self, pod: str) -> str:
        return self.container_log(self.ns, pod, "trainer")

    def container_log(self, namespace: str, pod: str, container: str) -> str:
        """A container's output so far, also once its pod is gone ("" before it starts): the process
        nodes keep it in a file (a world with other nodes overrides this)."""
        path = self.nodes.log_path(namespace, pod, container)
        return path.read_text(errors="replace") if path.exists() else ""

    def ends(self, job: str) -> str:
        """The job's Events and how each of its pods' containers ended, for an assertion message."""
        events = self.core.list_namespaced_event(self.ns, field_selector=f"involvedObject.name={job}").items
        lines = [f"event {e.reason}: {e.message}" for e in sorted(events, key=lambda e: str(e.last_timestamp))]
        for p in self.core.list_namespaced_pod(self.ns, label_selector=f"spotguard.dev/job={job}").items:
            for c in p.status.container_statuses or []:
                t = c.state.terminated if c.state else None
                if t is not None and t.exit_code:
                    lines.append(
                        f"pod {p.metadata.name} container {c.name} exited {t.exit_code} ({t.reason}): "
                        f"{(t.message or '').strip()[-500:]}"
                    )
        return "\n".join(lines)

    def describe(self, job: str) -> str:
        pods = self.tool("kubectl", "get", "pods", "-n", self.ns, "-o", "wide", check=False).stdout
        events = self.tool("kubectl", "get", "events", "-n", self.ns, "--sort-by=.lastTimestamp", check=False).stdout
        return f"pods:\n{pods}\nevents:\n{events[-3000:]}"


def adopt_crd(env: Env) -> None:
    crd = "crd/trainingjobs.spotguard.dev"
    if env.tool("kubectl", "get", crd, check=False).returncode == 0:
        env.tool("kubectl", "label", "--overwrite", crd, "app.kubernetes.io/managed-by=Helm")
        env.tool(
            "kubectl",
            "annotate",
            "--overwrite",
            crd,
            f"meta.helm.sh/release-name={RELEASE}",
            f"meta.helm.sh/release-namespace={OPERATOR_NS}",
        )


def example() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return doc


def create_bucket_and_secret(core: Any, s3_store: Any, ns: str, endpoint_url: str | None = None) -> None:
    """What examples/dev-setup.sh does on the dev cluster: the example's bucket, and the Secret with the
    store's credentials and endpoint (``endpoint_url``: where the pods reach the store, if not where
    this machine does)."""
    bucket = example()["spec"]["checkpoint"]["storage"].split("/")[2]
    s3 = s3_store.client()
    if bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket=bucket)
    core.create_namespaced_secret(
        ns,
        {
            "metadata": {"name": CREDENTIALS_SECRET},
            "stringData": {
                "AWS_ACCESS_KEY_ID": s3_store.access_key,
                "AWS_SECRET_ACCESS_KEY": s3_store.secret_key,
                "AWS_ENDPOINT_URL": endpoint_url or s3_store.endpoint_url,
            },
        },
    )


def helm_install(env: Env, *values: Path) -> None:
    """``helm upgrade --install`` of the chart into the operator's namespace, as a user installs it."""
    adopt_crd(env)
    files = [arg for v in values for arg in ("-f", str(v))]
    env.tool(
        "helm", "upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NS, "--create-namespace", *files
    )


def delete_jobs(env: Env, timeout: float = 60) -> None:
    """Delete the namespace's TrainingJobs and wait until they are gone (while the operator runs: it owns
    their finalizer)."""
    env.custom.delete_collection_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL)
    try:
        wait_for(
            lambda: not env.custom.list_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL)["items"],
            "the TrainingJobs to be deleted",
            timeout=timeout,
        )
    except TimeoutError as exc:
        print(exc)


def verified_step(e: Env, uri: str) -> int:
    from spotguard.checkpoint import latest_verified
    from spotguard.storage import open_storage

    storage = open_storage(
        uri, endpoint_url=e.s3.endpoint_url, access_key=e.s3.access_key, secret_key=e.s3.secret_key, region=e.s3.region
    )
    info, _ = latest_verified(storage, checksums=False)
    return info.step if info is not None else -1


def last_step(log: str) -> int:
    steps = [int(m) for m in re.findall(r"^step (\d+) loss", log, re.M)]
    return max(steps) if steps else -1


def resumed_from(log: str) -> int | None:
    m = re.search(r"^resumed from step (\d+)", log, re.M)
    return int(m.group(1)) if m else None


def preempted_after(log: str) -> int | None:
    m = re.search(r"^preempted after step (\d+)", log, re.M)
    return int(m.group(1)) if m else None


def assert_final_bitwise(
    env: Env, uri: str, args: list[str], every: int, steps: int, tmp_path: Path, storage: Any = None
) -> None:
    """The job's final checkpoint in storage (the S3 store unless given) equals an uninterrupted run here, bitwise."""
    from safetensors.torch import load_file

    from spotguard.checkpoint import list_local_committed, restore_latest
    from spotguard.storage import open_storage

    if storage is None:
        storage = open_storage(
            uri,
            endpoint_url=env.s3.endpoint_url,
            access_key=env.s3.access_key,
            secret_key=env.s3.secret_key,
            region=env.s3.region,
        )
    final = restore_latest(storage, tmp_path / "final")
    assert final is not None and final.step == steps - 1
    ref_args = reference_args(args)
    subprocess.run(
        [sys.executable, "-m", "spotguard.demo.train", *ref_args],
        env=reference_env(tmp_path, SPOTGUARD_SAVE_EVERY_STEPS=str(every)),
        check=True,
        capture_output=True,
        timeout=600,
    )
    ref = list_local_committed(tmp_path / "ref")[-1]
    got = tmp_path / "final" / ref.name
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert (got / name).read_bytes() == (ref / name).read_bytes(), f"{name} differs"
    # The demo draws only from torch's generator (dropout); numpy's and Python's
    # global generators start from OS entropy in each fresh process, so only
    # torch's state is comparable with a separate reference run.
    assert load_file(str(got / "rng.safetensors"))["torch"].equal(load_file(str(ref / "rng.safetensors"))["torch"])


#: The DDP example's steps in the end-to-end tests (it trains 300): 8 checkpoints at its ``everySteps``
#: (20), room for a preemption at every fraction the tests use; 4 processes of a step on a loaded 2-core
#: machine take up to ~0.75 s, so the 140 left out are minutes of a run.
GANG_STEPS = 160


def set_steps(doc: dict[str, Any], steps: int) -> list[str]:
    """The trainer of TrainingJob ``doc`` trains ``steps`` steps (its ``--steps`` argument); returns its args."""
    trainer = doc["spec"]["template"]["spec"]["containers"][0]
    args = list(trainer["args"])
    args[args.index("--steps") + 1] = str(steps)
    trainer["args"] = args
    return args


def reference_args(args: list[str]) -> list[str]:
    """A job's trainer arguments for an uninterrupted run on this machine: without ``--step-delay``."""
    return [a for i, a in enumerate(args) if a != "--step-delay" and (i == 0 or args[i - 1] != "--step-delay")]


def reference_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of an uninterrupted reference run on this machine: nothing inherited but this
    interpreter's directory, its checkpoints and temporary files (torchrun leaves a directory of its own
    there) below ``tmp_path``."""
    return {
        "PATH": str(Path(sys.executable).parent),
        "TMPDIR": str(tmp_path),
        "SPOTGUARD_CHECKPOINT_DIR": str(tmp_path / "ref"),
        **extra,
    }


def final_digest(log: str) -> str | None:
    m = re.search(r"^final digest ([0-9a-f]{64})", log, re.M)
    return m.group(1) if m else None


def reference_ddp_digest(args: list[str], every: int, world_size: int, tmp_path: Path) -> str:
    """The final digest of an uninterrupted run of the DDP example's trainer with ``args`` on this machine:
    ``world_size`` processes of one torchrun (a gang's digest does not depend on how its ranks are spread
    over nodes), checkpointing every ``every`` steps as the job does."""
    ref = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size)]
        + ["--module", "spotguard.demo.train_ddp", *reference_args(args)],
        env=reference_env(tmp_path, SPOTGUARD_SAVE_EVERY_STEPS=str(every), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    digest = final_digest(ref.stdout)
    assert digest is not None, ref.stdout[-2000:]
    return digest


#: The Lease the chart's replicas elect their leader with (``<fullname>-leader``).
LEASE = f"{RELEASE}-leader"
#: What the operator writes for a job (its own client's requests and kopf's carry its identity).
JOB_WRITES = {"pods", "events", "services", "serviceaccounts", "rolebindings", "trainingjobs", "trainingjobs/status"}


def leader(e: Env) -> str | None:
    """The identity that holds the Lease (``<pod>_<suffix>``), None when none does."""
    return lease_holder(e.core.api_client, OPERATOR_NS, LEASE)


def operator_pods(e: Env) -> list[Any]:
    return [
        p
        for p in e.core.list_namespaced_pod(OPERATOR_NS).items
        if p.status.phase == "Running" and p.metadata.deletion_timestamp is None
    ]


def runs(seq: list[str]) -> list[str]:
    """``seq`` with repeats in a row collapsed: who acted, in turn."""
    return [x for i, x in enumerate(seq) if i == 0 or seq[i - 1] != x]


def check_one_actor_at_a_time(e: Env, job: str, frozen: str, successor: str, attempts: int) -> None:
    """From the apiserver's audit log, in the order it received the writes: the job's writes (pods, status,
    Events...) each came from the replica that held the Lease then, the replicas took turns, the frozen one
    wrote nothing (not even a refused renewal) once the standby had taken the Lease, and each pod was created
    exactly once, both pods of an attempt by one replica."""
    writes = audit_writes(e.kube, [e.ns, OPERATOR_NS])
    if writes is None:
        print("no audit log (a cluster the tests did not start): checked from the objects only")
        return
    start = next(w.at for w in writes if w.resource == "trainingjobs" and w.verb == "create" and w.name == job)
    mine = [w for w in writes if w.at >= start]
    leases = [w for w in writes if w.namespace == OPERATOR_NS and w.resource == "leases" and w.name == LEASE and w.ok]
    takeover = next(w.at for w in leases if w.identity == successor and w.at >= start)
    late = [w for w in mine if w.identity == frozen and w.at > takeover]
    assert not late, f"the frozen replica wrote after the takeover at {takeover}: {late}"
    acts = [w for w in mine if w.namespace == e.ns and w.resource in JOB_WRITES and w.identity]
    # Each write for the job came from the Lease's holder as the apiserver had it then.
    for w in acts:
        held = [x for x in leases if x.at < w.at]
        assert held and held[-1].identity == w.identity, (w, held[-1:] or "no Lease yet")
    turns = runs([str(w.identity) for w in acts])
    assert turns[-1] == successor and len(turns) == len(set(turns)), turns
    assert frozen in turns, turns
    creates = [w for w in acts if w.resource == "pods" and w.verb == "create" and w.ok]
    names = [w.name for w in creates]
    assert len(names) == len(set(names)) == 2 * attempts, names  # 2 pods an attempt, each created once
    by_attempt: dict[str, set[str]] = {}
    for w in creates:
        by_attempt.setdefault(w.name.rsplit("-", 1)[0], set()).add(str(w.identity))
    assert all(len(ids) == 1 for ids in by_attempt.values()), by_attempt
    print(
        f"audit: {len(acts)} writes for the job by {turns} in turn; the Lease changed hands at {takeover};"
        f" nothing from {frozen} after it"
    )


# --- real nodes (kubelet + containerd): what the process nodes give the tests for free ---


class LogFollower:
    """Every container's output in some namespaces, kept once its pod is gone: a real node's kubelet
    removes a deleted pod's logs, and a drained or lost attempt's last lines are what the checks read.

    A thread lists the pods every half second and runs ``kubectl logs -f`` for each container instance
    (pod uid, container, restart count) as soon as it has started; each instance's output goes to a
    file of its own, and :meth:`log` gives a container's instances in order."""

    def __init__(self, kube: Any, core: Any, namespaces: list[str], log_dir: Path) -> None:
        self.kube, self.core, self.namespaces, self.dir = kube, core, namespaces, log_dir
        self.procs: dict[tuple[str, str, int], subprocess.Popen[bytes]] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="log-follower", daemon=True)
        self.thread.start()

    def path(self, namespace: str, pod: str, container: str, restarts: int) -> Path:
        return self.dir / namespace / pod / f"{container}.{restarts}.log"

    def log(self, namespace: str, pod: str, container: str) -> str:
        """Everything ``container`` of ``pod`` wrote so far, its instances (restarts) in order."""
        where = self.dir / namespace / pod
        files = sorted(where.glob(f"{container}.*.log"), key=lambda p: int(p.name.rsplit(".", 2)[1]))
        return "".join(p.read_text(errors="replace") for p in files)

    def _run(self) -> None:
        while not self.stopping.wait(0.5):
            for ns in self.namespaces:
                try:
                    pods = self.core.list_namespaced_pod(ns).items
                except Exception as exc:  # noqa: BLE001 - an apiserver hiccup must not end the following
                    print(f"log follower: listing pods in {ns}: {exc}")
                    continue
                for p in pods:
                    for cs in [*(p.status.init_container_statuses or []), *(p.status.container_statuses or [])]:
                        started = cs.state and (cs.state.running or cs.state.terminated)
                        if started:
                            self._follow(ns, p.metadata.name, p.metadata.uid, cs.name, cs.restart_count or 0)

    def _follow(self, ns: str, pod: str, uid: str, container: str, restarts: int) -> None:
        key = (uid, container, restarts)
        proc = self.procs.get(key)
        if proc is not None and (proc.poll() is None or proc.returncode == 0):
            return  # following, or followed to the end
        path = self.path(ns, pod, container, restarts)
        path.parent.mkdir(parents=True, exist_ok=True)
        argv = [str(self.kube.bin_dir / "kubectl"), "--kubeconfig", str(self.kube.kubeconfig)]
        argv += ["logs", "-f", "-n", ns, pod, "-c", container]
        with path.open("wb") as out:  # a retry (the first one failed) reads the log from its start again
            self.procs[key] = subprocess.Popen(argv, stdout=out, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(10)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)


@dataclass
class RealNodeEnv(Env):
    """:class:`Env` on real nodes: logs through the kubelet (kept by a :class:`LogFollower`)."""

    follower: Any = None
    #: Target -> the image's reference in the registry the nodes pull from.
    images: dict[str, str] = field(default_factory=dict)

    def container_log(self, namespace: str, pod: str, container: str) -> str:
        return str(self.follower.log(namespace, pod, container))


def container_cgroup(nodes: Any, pod: Any, container: str, hierarchy: str = "freezer") -> Path:
    """The cgroup (in one v1 ``hierarchy``) of a running container of ``pod`` (a V1Pod) on a real node:
    below its node's cgroupRoot, the directory named by the container's id."""
    statuses = {cs.name: cs for cs in pod.status.container_statuses or []}
    cid = str(statuses[container].container_id or "").split("://")[-1]
    assert cid, f"{pod.metadata.name}/{container} has no container id yet"
    root = Path("/sys/fs/cgroup", hierarchy, nodes.node(pod.spec.node_name).cgroup_root.lstrip("/"))
    found = [p for p in root.rglob(cid) if p.is_dir()]
    assert len(found) == 1, f"cgroup of {pod.metadata.name}/{container} ({cid}) below {root}: {found}"
    return found[0]


def freeze(cgroup: Path, state: str = "FROZEN") -> None:
    """Freeze (``FROZEN``) or thaw (``THAWED``) every process of a container at once, through its freezer
    cgroup: what a SIGSTOP of each does, without a window in which some of them still run."""
    (cgroup / "freezer.state").write_text(state)
    deadline = time.monotonic() + 10
    while (cgroup / "freezer.state").read_text().strip() != state:
        assert time.monotonic() < deadline, f"{cgroup} not {state}"
        time.sleep(0.05)


def process_status(pid: int) -> dict[str, str]:
    """``/proc/<pid>/status`` as a dict (Uid, Gid, CapEff, NoNewPrivs, Seccomp, ...)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
