"""Gang benchmark: one member of a TrainingJob of several nodes preempted -> every replacement pod created.

Against the real control plane with process nodes: every pod runs (restore
init container, a trainer that sleeps until SIGTERM, the sidecar), and each
preemption is a process node's graceful shutdown of the node under one member.
A gang's next attempt may start only when every pod of the ended one has
stopped, so its restart pays for stopping the other members; the baseline is
the same preemption of a job of one node (one pod, the operator's single-pod
path), measured in the same rounds.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from bench.common import Section, Spread, fmt, per_round, percentile
from testenv import kubetest
from testenv.kubetest import GROUP, PLURAL, VERSION, wait_for

if TYPE_CHECKING:
    from bench.common import Ctx

SIZES = (1, 2, 4)
GRACE = 5
TRAINER = "trap 'kill $! 2>/dev/null; exit 143' TERM; while true; do sleep 1 & wait $!; done"


def _job(name: str, nodes: int, storage: str) -> dict[str, Any]:
    # One GPU each, one per process node: every member on a node of its own.
    return kubetest.job_body(
        name,
        storage,
        kubetest.shell_trainer(TRAINER),
        nodes=nodes,
        sidecar={"metricsPort": 0},
        preemption=kubetest.fast_preemption(1000, 3, GRACE),
    )


def bench_gang(ctx: Ctx) -> Section:
    from testenv.processnode import ProcessNodes

    kube = ctx.kube
    assert kube is not None
    reps = ctx.rounds_for(8)
    kubetest.install_crd(kube)
    core, custom = kubetest.apis(kube)
    ns = kubetest.new_namespace(core, "bench-gang")
    store = ctx.work / "gang-store"
    ca = getattr(kube, "kubelet_client_ca", None)
    count = sum(SIZES)  # every job runs all the time: one node per pod
    nodes = ProcessNodes.start(
        kube.kubeconfig, ctx.work / "gang-nodes", count=count, extra_args=["--client-ca-file", str(ca)] if ca else None
    )
    op = kubetest.operator_process(
        kube, ns, ctx.work / "operator-gang.log", image="spotguard:bench", resync_seconds=None, poll_seconds=30
    )

    def pods(job: str, attempt: int) -> list[dict[str, Any]]:
        resp = core.list_namespaced_pod(
            ns, label_selector=f"spotguard.dev/job={job},spotguard.dev/attempt={attempt}", _preload_content=False
        )
        items: list[dict[str, Any]] = json.loads(resp.data)["items"]
        return items

    def attempt_of(job: str) -> int:
        st = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job).get("status") or {}
        return int(st.get("attempt") or 0)

    def wait_running(job: str, attempt: int, n: int) -> None:
        def running() -> bool:
            st = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job).get("status") or {}
            if st.get("phase") == "Failed":
                raise RuntimeError(f"{job} failed: {st}")
            live = [p for p in pods(job, attempt) if p["status"].get("phase") == "Running"]
            live = [p for p in live if not p["metadata"].get("deletionTimestamp")]
            return st.get("attempt") == attempt and st.get("phase") == "Running" and len(live) == n

        wait_for(running, f"{job} attempt {attempt} running", timeout=180, interval=0.2)

    def preempt(job: str, n: int) -> float:
        """Shut down the node of the highest rank's pod; seconds until every pod of the next attempt exists."""
        attempt = attempt_of(job)
        victim = f"{job}-a{attempt}" if n == 1 else f"{job}-a{attempt}-{n - 1}"
        t0 = time.monotonic()
        nodes.preempt(victim, ns, "shutdown", grace_seconds=GRACE, wait=False)
        wait_for(
            lambda: len(pods(job, attempt + 1)) == n,
            f"{job} attempt {attempt + 1}'s {n} pods",
            timeout=120,
            interval=0.02,
        )
        dt = time.monotonic() - t0
        wait_running(job, attempt + 1, n)
        return dt

    results: dict[int, list[float]] = {n: [] for n in SIZES}
    try:
        op.start()
        for n in SIZES:
            (store / ns / f"gang{n}").mkdir(parents=True, exist_ok=True)
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, _job(f"gang{n}", n, f"file://{store}"))
        for n in SIZES:
            wait_running(f"gang{n}", 1, n)
        for r in range(reps):
            order = SIZES[r % len(SIZES) :] + SIZES[: r % len(SIZES)]
            for n in order:
                results[n].append(preempt(f"gang{n}", n))
            print(f"   round {r + 1}: " + ", ".join(f"{n} node(s) {results[n][-1]:.2f}s" for n in SIZES), flush=True)
        counted = {
            n: (custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, f"gang{n}").get("status") or {}).get(
                "preemptions"
            )
            for n in SIZES
        }
    finally:
        op.stop()
        core.delete_namespace(ns)
        nodes.stop()
    for n in SIZES:
        if counted[n] != reps:
            raise RuntimeError(f"gang{n}: the operator counted {counted[n]} preemptions, not {reps}")

    base = results[1]

    def extra(n: int) -> float:
        return Spread.of([a - b for a, b in zip(results[n], base, strict=True)]).median

    s = Section(
        "Gang preemption: one member preempted -> every replacement pod created",
        "gang",
        ["nodes per job", "p50 (s)", "p95 (s)", "min-max (s)", "vs 1 node, per round [IQR]"],
    )
    for n in SIZES:
        xs = results[n]
        ratio = "1.00x (baseline)" if n == 1 else per_round(xs, base, higher_is_better=False).cell()
        s.rows.append(
            [str(n), fmt(percentile(xs, 0.5)), fmt(percentile(xs, 0.95)), f"{min(xs):.2f}-{max(xs):.2f}", ratio]
        )
        ctx.costs[f"gang_restart_p50_{n}"] = percentile(xs, 0.5)
    s.notes.append(
        f"{count} process nodes (one GPU each) and three TrainingJobs running side by side, of 1, 2 and 4 nodes; "
        f"every pod runs (restore init container, a shell trainer that exits at SIGTERM, the classic sidecar), "
        f"grace period {GRACE} s. In each of {reps} rounds (job order rotated) the node under the highest rank's "
        "pod of each job is shut down the process node's graceful way (its pods end Failed with a DisruptionTarget "
        "condition); the clock runs from the preemption request to the moment the last pod of the next attempt "
        "exists in the apiserver (a list every 20 ms), then waits untimed until all of them run. The baseline is "
        "the job of one node: its next pod is created as soon as its one pod has ended. A gang's next attempt "
        "waits for the operator to record why the attempt ended and to stop every other member (SIGTERM: the "
        f"trainer exits at once, the sidecar's emergency path runs); median per-round difference from the "
        f"baseline: {extra(2):+.2f} s for 2 nodes, {extra(4):+.2f} s for 4. The apiserver, the operator and every "
        "pod share this machine's cores, so the spreads are wide."
    )
    return s
