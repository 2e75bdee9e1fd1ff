"""Operator benchmark: reschedule latency and resource use while managing many TrainingJobs.

Against the real control plane (no kubelet: pods stay Pending on a nodeSelector
no node matches, and each preemption is the pod status kubelet's graceful node
shutdown leaves, patched through the apiserver), with every job's checkpoints in
a real SeaweedFS store that the operator polls for status. The preemptions are
measured twice: with the store healthy, and with its process stopped (SIGSTOP),
when every storage read hangs: pod-end handling must not wait for them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import PLOTS, MiB, Section, fmt, percentile

GROUP, VERSION, PLURAL = "spotguard.dev", "v1alpha1", "trainingjobs"
ROOT = Path(__file__).resolve().parent.parent
NO_NODE = {"spotguard.dev/bench-no-node": "true"}
SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."


def _job(name: str, storage: str, endpoint: str | None = None) -> dict[str, Any]:
    checkpoint: dict[str, Any] = {"storage": storage, "everySteps": 100}
    if endpoint:
        checkpoint.update({"endpoint": endpoint, "credentialsSecret": {"name": "bench-s3"}})
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "template": {
                "spec": {
                    "nodeSelector": NO_NODE,
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "trainer:1",
                            "command": ["python", "-m", "train"],
                            "resources": {"limits": {"nvidia.com/gpu": 1}},
                        }
                    ],
                }
            },
            "checkpoint": checkpoint,
            "preemption": {
                "maxPreemptions": 100,
                "backoffLimit": 3,
                "gracePeriodSeconds": 30,
                "backoff": {"initialSeconds": 0},
            },
        },
    }


def _terminated(name: str) -> dict[str, Any]:
    done = {
        "exitCode": 0,
        "reason": "Completed",
        "startedAt": "2030-01-01T00:00:00Z",
        "finishedAt": "2030-01-01T00:01:00Z",
    }
    return {"name": name, "ready": False, "restartCount": 0, "image": "x", "imageID": "", "state": {"terminated": done}}


def _shutdown_status() -> dict[str, Any]:
    return {
        "status": {
            "phase": "Failed",
            "reason": "Terminated",
            "message": SHUTDOWN_MESSAGE,
            "conditions": [
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "TerminationByKubelet",
                    "message": SHUTDOWN_MESSAGE,
                }
            ],
            "containerStatuses": [_terminated("trainer"), _terminated("spotguard-sidecar")],
        }
    }


class ProcSampler:
    """Samples a process's CPU time and resident memory in the background."""

    def __init__(self, pid: int, period: float = 0.5) -> None:
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, float, int]] = []  # (wall, cpu seconds, rss bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._page = os.sysconf("SC_PAGE_SIZE")

    def read(self) -> tuple[float, float, int]:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / self._ticks
        rss = int(Path(f"/proc/{self.pid}/statm").read_text().split()[1]) * self._page
        return time.monotonic(), cpu, rss

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.samples.append(self.read())
            except OSError:
                return

    def __enter__(self) -> ProcSampler:
        self.samples.append(self.read())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.read())

    def cpu_share(self) -> float:
        (w0, c0, _), (w1, c1, _) = self.samples[0], self.samples[-1]
        return (c1 - c0) / (w1 - w0)

    def max_rss(self) -> int:
        return max(s[2] for s in self.samples)


@contextlib.contextmanager
def _paused(pid: int) -> Iterator[None]:
    """The store stopped (SIGSTOP to its own process group): the kernel accepts connections, nobody answers."""
    os.killpg(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(pid, signal.SIGCONT)


def bench_operator(ctx: Any) -> Section:
    from kubernetes import client

    from spotguard.operator.testing import OperatorProcess, metric_value, wait_for
    from testenv import cluster

    kube = ctx.kube
    assert kube is not None
    n_jobs = int(os.environ.get("BENCH_OPERATOR_JOBS", "200"))
    n_preempt = min(int(os.environ.get("BENCH_OPERATOR_PREEMPTIONS", "40")), n_jobs // 2)
    # The chart's default storage poll.
    poll = os.environ.get("BENCH_OPERATOR_POLL_SECONDS", "30")
    kubectl = str(kube.bin_dir / "kubectl")
    subprocess.run(
        [kubectl, "apply", "-f", str(ROOT / "crds" / "trainingjob.yaml")],
        env={**os.environ, **kube.env()},
        check=True,
        capture_output=True,
    )
    api = kube.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    wait_for(lambda: core.read_namespaced_service_account("default", ns), "default ServiceAccount", timeout=60)
    # A store of this benchmark's own: it is paused below, and no other user may be.
    sup = cluster.Supervisor(ctx.work / "operator-store")
    store = cluster.start_seaweedfs(sup, bucket="operator-bench")
    weed_pid = sup.services[-1].popen.pid
    core.create_namespaced_secret(
        ns,
        {
            "metadata": {"name": "bench-s3"},
            "stringData": {"AWS_ACCESS_KEY_ID": store.access_key, "AWS_SECRET_ACCESS_KEY": store.secret_key},
        },
    )
    storage = f"s3://{store.bucket}/jobs"

    def pods() -> dict[str, Any]:
        items = core.list_namespaced_pod(ns, label_selector="spotguard.dev/job").items
        return {p.metadata.name: p for p in items}

    def exists(pod: str) -> bool:
        # One small GET by name, raw: listing (and decoding) every pod of n_jobs jobs at each
        # poll would take longer than what is measured.
        try:
            core.read_namespaced_pod(pod, ns, _preload_content=False)
            return True
        except client.exceptions.ApiException as exc:
            if exc.status == 404:
                return False
            raise

    def preempt(jobs: list[str]) -> list[float]:
        """Pod end -> replacement pod exists, one job at a time."""
        out = []
        for job in jobs:
            core.patch_namespaced_pod_status(f"{job}-a1", ns, _shutdown_status())
            t1 = time.monotonic()
            wait_for(lambda job=job: exists(f"{job}-a2"), f"replacement of {job}", timeout=300, interval=0.02)
            out.append(time.monotonic() - t1)
        return out

    op = OperatorProcess(
        [
            *("-n", ns, "--image", "spotguard:bench", "--native-sidecar", "off", "--checkpoint-poll-seconds", poll),
            *("--allowed-endpoints", "127.0.0.1"),  # the store of the test world
        ],
        env=kube.env(),
        log_path=ctx.work / "operator-bench.log",
    ).start()
    try:
        assert op.proc is not None
        pid = op.proc.pid
        # 1. Bring up n_jobs TrainingJobs: time until every first pod exists.
        t0 = time.monotonic()
        with ProcSampler(pid) as create_sample:
            for i in range(n_jobs):
                custom.create_namespaced_custom_object(
                    GROUP, VERSION, ns, PLURAL, _job(f"job-{i:03d}", storage, store.endpoint_url)
                )
            wait_for(lambda: len(pods()) >= n_jobs, f"{n_jobs} pods", timeout=600, interval=0.5)
        create_seconds = time.monotonic() - t0
        # 2. Steady state: the operator just watches n_jobs jobs (and reads their storage).
        with ProcSampler(pid) as idle_sample:
            time.sleep(float(os.environ.get("BENCH_OPERATOR_IDLE_SECONDS", "45")))
        text = op.metrics()
        clients = metric_value(text, "spotguard_operator_storage_clients") or 0
        connections = metric_value(text, "spotguard_operator_storage_connections") or 0
        reads = metric_value(text, "spotguard_operator_storage_reads_total", {"result": "ok"}) or 0
        # 3. Preempt pods one at a time, the store healthy.
        with ProcSampler(pid) as preempt_sample:
            latencies = preempt([f"job-{i:03d}" for i in range(n_preempt)])
        # 4. The same with the store paused, once the probe's workers hang on it (n_jobs reads
        #    spread over one poll interval fill its few workers within a second or two).
        with _paused(weed_pid):
            time.sleep(5)
            paused = preempt([f"job-{i:03d}" for i in range(n_preempt, 2 * n_preempt)])
        errors = metric_value(op.metrics(), "spotguard_operator_storage_reads_total", {"result": "error"}) or 0
    finally:
        op.stop()
        core.delete_namespace(ns)
        sup.stop()
    peak_rss = max(x.max_rss() for x in (create_sample, idle_sample, preempt_sample))
    p95, p95_paused = percentile(latencies, 0.95), percentile(paused, 0.95)
    s = Section(f"Operator: reschedule latency and cost with {n_jobs} TrainingJobs", "operator", ["measure", "value"])
    s.rows += [
        ["pod end -> replacement pod created, p50", fmt(percentile(latencies, 0.5), 3) + " s"],
        ["pod end -> replacement pod created, p95", fmt(p95, 3) + " s"],
        ["pod end -> replacement pod created, p99", fmt(percentile(latencies, 0.99), 3) + " s"],
        ["same, store paused (SIGSTOP), p50", fmt(percentile(paused, 0.5), 3) + " s"],
        ["same, store paused (SIGSTOP), p95", fmt(p95_paused, 3) + " s"],
        ["p95 store paused / p95 store healthy", f"{p95_paused / p95:.2f}x" if p95 else "n/a"],
        [f"{n_jobs} jobs created -> {n_jobs} pods exist", fmt(create_seconds, 1) + " s"],
        ["operator CPU while creating (share of one core)", f"{create_sample.cpu_share():.0%}"],
        [f"operator CPU while idle with {n_jobs} jobs", f"{idle_sample.cpu_share():.1%}"],
        ["operator CPU while rescheduling", f"{preempt_sample.cpu_share():.0%}"],
        ["operator peak resident memory", f"{peak_rss / MiB:.0f} MiB"],
        [f"storage handles / S3 clients held after {reads:.0f} reads", f"{clients:.0f} / {connections:.0f}"],
    ]
    s.notes.append(
        f"{len(latencies)} + {len(paused)} preemptions, one at a time, each the pod status kubelet's graceful node "
        "shutdown leaves (Failed, reason Terminated, DisruptionTarget), patched through the apiserver; latency is "
        "measured by the client from the patch to the replacement pod existing (a GET by name every 20 ms), so it "
        "includes the watch delivery to the operator and the apiserver round trips. Every job's checkpoints are "
        f"in a SeaweedFS store the operator reads every {poll} s per job for status; for the second set the "
        f"store's process is stopped (SIGSTOP), so those reads hang ({errors:.0f} failed by the end) on the "
        "probe's own bounded pool while pod ends are handled. The apiserver, etcd, the store and the operator "
        "share this machine's cores."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.hist([latencies, paused], bins=20, color=["#2b7bba", "#d95f02"], label=["store healthy", "store paused"])
    ax.set_xlabel("pod end -> replacement pod created (s)")
    ax.set_ylabel("preemptions")
    ax.legend()
    fig.tight_layout()
    fig.savefig(getattr(ctx, "plots", PLOTS) / "operator.png", dpi=110)
    plt.close(fig)
    s.plot = "bench/operator.png"
    return s
