"""End to end on the dev cluster: helm install, the example TrainingJob, three preemptions.

Everything is real except the machines: the control plane, the S3 store, the
Helm chart, the operator (a pod on a process node, talking to the apiserver
with its ServiceAccount), and the training pods (restore, trainer, sidecar as
local processes). Each spot death is one of the process node's three modes.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from spotguard.operator.leader import LOST_EXIT_CODE, pod_of
from spotguard.operator.podbuilder import ANNOTATION_OPERATOR_INSTANCE
from spotguard.operator.testing import free_ports, http_get, metric_value, wait_for
from testenv import trials
from testenv.e2e import (
    CHART,
    DDP_EXAMPLE,
    DEV_VALUES,
    GANG_STEPS,
    GROUP,
    HF_EXAMPLE,
    OPERATOR_NS,
    PLURAL,
    RELEASE,
    VERSION,
    Env,
    assert_final_bitwise,
    check_one_actor_at_a_time,
    create_bucket_and_secret,
    delete_jobs,
    example,
    final_digest,
    helm_install,
    last_step,
    leader,
    operator_pods,
    preempted_after,
    reference_args,
    reference_env,
    resumed_from,
    runs,
    set_steps,
    verified_step,
)

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

#: The shortest step the example's preemption test gives the trainer (--step-delay).
SLOW_STEP_SECONDS = 0.15


@pytest.fixture(scope="module")
def env(
    kube: Any, s3_store: Any, process_nodes: Any, prometheus_module: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Env]:
    from kubernetes import client

    # Process nodes run containers with their working directory at "/", and this
    # checkout is installed in editable mode: a directory /spotguard would shadow the
    # package for `python -m spotguard...` (see spotguard/operator/podbuilder.py).
    stray = Path("/spotguard")
    if stray.is_dir() and not any(stray.iterdir()):
        stray.rmdir()
    assert not stray.exists(), "a /spotguard directory on this machine shadows the spotguard package; remove it"
    api = kube.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    log_dir = tmp_path_factory.mktemp("e2e")
    ns = f"e2e-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    metrics_port, liveness_port = free_ports(2)
    e = Env(kube, core, custom, ns, metrics_port, s3_store, process_nodes, log_dir)

    # What examples/dev-setup.sh does on the dev cluster: the bucket and the Secret.
    create_bucket_and_secret(core, s3_store, ns)

    values = log_dir / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "metrics": {"address": "0.0.0.0", "port": metrics_port},
                "liveness": {"address": "0.0.0.0", "port": liveness_port},
                "operator": {"watchNamespaces": [ns], "resyncSeconds": 2, "checkpointPollSeconds": 1},
            }
        )
    )
    # The dev values keep the operator away from training pods in `default`; here they run in `ns`.
    dev = yaml.safe_load(DEV_VALUES.read_text())
    dev["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["namespaces"] = [ns]
    (log_dir / "dev-values.yaml").write_text(yaml.safe_dump(dev))
    try:
        helm_install(e, log_dir / "dev-values.yaml", values)
        # The operator runs as a pod on a process node, with its ServiceAccount and the chart's RBAC.
        # Pods of process nodes have their own network: the operator is reached at its pod IP.
        wait_for(
            lambda: http_get(f"http://{operator_ip(core)}:{liveness_port}/healthz"),
            "the operator pod to be live",
            timeout=180,
            interval=0.5,
        )
        # A real Prometheus scrapes the operator and the training pods' sidecars (found through
        # the apiserver at their pod IPs and declared ports, as PodMonitors do) and evaluates the alerts.
        e.prom = prometheus_module(
            {},
            pods={
                "spotguard-operator": (kube.kubeconfig, OPERATOR_NS, "metrics"),
                "spotguard-sidecar": (kube.kubeconfig, ns, "sg-metrics"),
            },
            rule_files=[CHART / "files" / "prometheus-rules.yaml"],
        )
        yield e
    finally:
        # TrainingJobs first, while the operator still runs: it owns their finalizer.
        delete_jobs(e)
        pods = core.list_namespaced_pod(OPERATOR_NS).items
        for p in pods:
            log = process_nodes.log_path(OPERATOR_NS, p.metadata.name, "operator")
            if log.exists():
                print(f"--- operator log ({p.metadata.name}) ---\n" + "\n".join(log.read_text().splitlines()[-60:]))
        e.tool("helm", "uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait", check=False)
        core.delete_namespace(ns)


def operator_ip(core: Any) -> str:
    """The running operator pod's IP (pods of process nodes have their own network)."""
    pods = [
        p
        for p in core.list_namespaced_pod(OPERATOR_NS).items
        if p.status.pod_ip and p.metadata.deletion_timestamp is None
    ]
    assert pods, "no operator pod with an IP yet"
    return str(pods[0].status.pod_ip)


@pytest.mark.trials
@pytest.mark.timeout(1200)
def test_example_survives_drain_shutdown_and_loss_bitwise(env: Env, tmp_path: Path) -> None:
    """The README's example job: drained, its node shut down, its node lost; Succeeded, nothing lost in the
    graceful ways, at most what came after the newest verified checkpoint in the abrupt one, bitwise equal to
    an uninterrupted run, and counted in the operator's metrics as Prometheus scraped them.

    ``make test`` runs the shutdown alone (``make soak`` runs all three): the Hugging Face and the fallback
    end-to-end jobs are drained, the fallback's node is lost, and on real nodes the same example is drained
    and loses its node (``tests/e2e/test_realnode_e2e.py``)."""
    doc = example()
    job = doc["metadata"]["name"]
    spec = doc["spec"]
    every = int(spec["checkpoint"]["everySteps"])
    args = list(spec["template"]["spec"]["containers"][0]["args"])
    steps = int(args[args.index("--steps") + 1])
    uri = f"{spec['checkpoint']['storage'].rstrip('/')}/{env.ns}/{job}"

    # The example as it is, but for a slower step: every upload here is several requests through
    # the pod network, and an attempt must still be training when its node goes.
    delay = args.index("--step-delay") + 1
    args[delay] = str(max(float(args[delay]), SLOW_STEP_SECONDS))
    spec["template"]["spec"]["containers"][0]["args"] = args
    applied = tmp_path / "trainingjob.yaml"
    applied.write_text(yaml.safe_dump(doc))
    env.tool("kubectl", "apply", "-n", env.ns, "-f", str(applied))

    verified_at_kill = -1
    modes = trials.variants(full=[("drain", 0.2), ("shutdown", 0.45), ("kill", 0.7)], quick=[("shutdown", 0.45)])
    abrupt = modes[-1][0] == "kill"  # the abrupt loss comes last, when it comes
    last = len(modes) + 1  # the attempt that runs to the end
    for attempt, (mode, fraction) in enumerate(modes, start=1):
        pod = f"{job}-a{attempt}"
        env.wait_pod_running(pod)
        # Preempt by the trainer's own progress (verification may lag behind training on a
        # loaded machine), once something is verified.
        target = int(steps * fraction)
        wait_for(
            lambda t=target, p=pod: last_step(env.trainer_log(p)) >= t,
            f"{pod} at step {target}",
            timeout=240,
            interval=0.2,
        )
        wait_for(lambda: verified_step(env, uri) >= 0, "a verified checkpoint", timeout=240, interval=0.5)
        if mode == "kill":
            # Die right after a fresh checkpoint: what is lost is what came after it.
            base = verified_step(env, uri)
            wait_for(
                lambda b=base: verified_step(env, uri) > b, "the next verified checkpoint", timeout=120, interval=0.05
            )
            verified_at_kill = verified_step(env, uri)
        result = env.nodes.preempt(pod, env.ns, mode)
        print(f"preempted {pod} by {mode}: {result}")
        env.wait_status(job, f"attempt {attempt + 1}", lambda s, a=attempt: (s.get("attempt") or 0) > a)

    st = env.wait_status(job, "Succeeded", lambda s: s.get("phase") in ("Succeeded", "Failed"), timeout=480)
    assert st["phase"] == "Succeeded", st
    assert st["preemptions"] == len(modes) and st["failures"] == 0 and st["attempt"] == last
    events = env.core.list_namespaced_event(env.ns, field_selector=f"involvedObject.name={job}").items
    preempted = [e.message for e in events if e.reason == "Preempted"]
    assert len(preempted) == len(modes), preempted
    print("preempted events:", preempted, "last pod end:", st.get("lastPodEnd"))
    assert any("(NodeLost)" in m for m in preempted) == abrupt, preempted

    # Steps lost: none for the graceful ways, at most one save interval for the abrupt one.
    logs = {a: env.trainer_log(f"{job}-a{a}") for a in range(1, last + 1)}
    for a in range(1, last - 1 if abrupt else last):
        stopped, resumed = preempted_after(logs[a]), resumed_from(logs[a + 1])
        assert stopped is not None and resumed == stopped, (a, stopped, resumed)
    if abrupt:
        # What came after the newest verified checkpoint is lost, never more (how many steps that is
        # depends on how long the upload and the kill took, not on the product).
        resumed = resumed_from(logs[last])
        lost = last_step(logs[last - 1]) - (resumed if resumed is not None else -1)
        graceful = ", ".join(f"{m} 0" for m, _ in modes[:-1])
        print(f"steps lost: {graceful}, kill {lost} (every {every}, verified at the kill {verified_at_kill})")
        assert resumed is not None and resumed >= verified_at_kill and lost >= 0, (resumed, verified_at_kill, lost)
    assert f"finished {steps} steps" in logs[last]

    # Bitwise: the final checkpoint in storage against an uninterrupted run here.
    assert_final_bitwise(env, uri, args, every, steps, tmp_path)

    # The operator (on another node) lived through all of it, and its metrics count the preemptions.
    operators = env.core.list_namespaced_pod(OPERATOR_NS).items
    assert len(operators) == 1 and operators[0].status.phase == "Running", [p.metadata.name for p in operators]
    text = http_get(f"http://{operators[0].status.pod_ip}:{env.metrics_port}/metrics")
    labels = {"namespace": env.ns, "trainingjob": job}
    assert metric_value(text, "spotguard_job_preemptions_total", labels) == len(modes)
    assert metric_value(text, "spotguard_job_restarts_total", labels) == len(modes)
    assert (metric_value(text, "spotguard_reschedule_latency_seconds_count") or 0) >= len(modes)

    # The same, as Prometheus scraped it, with the sidecars' series beside the operator's.
    sel = f'namespace="{env.ns}",trainingjob="{job}"'

    def prom_value(expr: str) -> float | None:
        result = env.prom.query(expr)
        return float(result[0]["value"][1]) if result else None

    wait_for(
        lambda: prom_value(f"spotguard_job_preemptions_total{{{sel}}}") == len(modes),
        f"Prometheus to see {len(modes)} preemptions",
        timeout=30,
        interval=0.5,
    )
    assert prom_value('spotguard_jobs{phase="Succeeded"}') == 1.0
    assert prom_value('count(spotguard_build_info{component="operator"})') == 1.0
    # A sidecar may exit between two scrapes, so the newest step seen can trail the last one.
    seen = prom_value(f"max_over_time(spotguard_checkpoint_last_verified_step{{{sel}}}[30m])")
    assert seen is not None and every <= seen <= steps - 1, seen
    assert (prom_value(f'max_over_time(spotguard_checkpoint_uploads_total{{{sel},result="verified"}}[30m])') or 0) >= 1
    rules = [r for g in env.prom.rules() for r in g["rules"]]
    assert rules and all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]


@pytest.mark.timeout(900)
def test_a_job_on_gcs_moves_to_on_demand_after_a_drain_and_a_node_kill_and_back_bitwise(
    env: Env, gcs_store: Any, tmp_path: Path
) -> None:
    """spec.fallback and gs:// end to end, on process nodes: two spot nodes and one on-demand node told apart by a
    label; checkpoints in a GCS JSON API server (the restore, the sidecar and the operator's probe all use it)."""
    from spotguard.checkpoint import latest_verified
    from spotguard.storage import open_storage

    operator_nodes = {p.spec.node_name for p in env.core.list_namespaced_pod(OPERATOR_NS).items}
    free = [n for n in env.nodes.node_names() if n not in operator_nodes]
    assert len(free) >= 3, (free, operator_nodes)
    tag = uuid.uuid4().hex[:6]
    spot_nodes, od_node = free[:2], free[2]
    pools = {**{n: f"spot-{tag}" for n in spot_nodes}, od_node: f"od-{tag}"}
    for node, pool in pools.items():
        env.core.patch_node(node, {"metadata": {"labels": {"test-pool": pool}}})
    try:
        doc = example()
        job = doc["metadata"]["name"] = "fallback"
        spec = doc["spec"]
        steps, every = 260, 20
        args = ["--steps", str(steps), "--step-delay", "0.08", "--log-every", "1"]
        spec["template"]["spec"]["containers"][0]["args"] = args
        spec["template"]["spec"]["nodeSelector"] = {"test-pool": f"spot-{tag}"}
        # The test server takes no credentials (on GKE: Workload Identity, or a Secret with a service account key).
        spec["checkpoint"] = {
            "storage": f"gs://{gcs_store.bucket}/e2e-{tag}",
            "endpoint": gcs_store.endpoint_url,
            "everySteps": every,
        }
        spec["preemption"].update({"preemptionBackoff": {"initialSeconds": 0}})
        spec["fallback"] = {
            "nodeSelector": {"test-pool": f"od-{tag}"},
            "afterPreemptions": 2,
            "preemptionWindowSeconds": 600,
            "afterUnschedulableSeconds": 0,
            "cooldownSeconds": 12,
        }
        applied = tmp_path / "trainingjob.yaml"
        applied.write_text(yaml.safe_dump(doc))
        env.tool("kubectl", "apply", "-n", env.ns, "-f", str(applied))
        uri = f"{spec['checkpoint']['storage']}/{env.ns}/{job}"
        storage = open_storage(uri, endpoint_url=gcs_store.endpoint_url)

        def verified() -> int:
            info, _ = latest_verified(storage, checksums=False)
            return info.step if info is not None else -1

        def node_of(pod: str) -> str:
            return str(env.core.read_namespaced_pod(pod, env.ns).spec.node_name)

        # A drain, then the abrupt loss of a node right after a verified checkpoint (its replacement comes up
        # without the pool label: the other spot node stays for the return).
        for attempt, target, mode in ((1, 30, "drain"), (2, 60, "kill")):
            pod = f"{job}-a{attempt}"
            env.wait_pod_running(pod)
            assert node_of(pod) in spot_nodes, (pod, node_of(pod), pools)
            wait_for(
                lambda t=target, p=pod: last_step(env.trainer_log(p)) >= t,
                f"{pod} at step {target}",
                timeout=240,
                interval=0.2,
            )
            if mode == "kill":
                base = verified()
                wait_for(
                    lambda b=base: verified() > b, "the next verified checkpoint in gs://", timeout=120, interval=0.05
                )
                spot_nodes.remove(node_of(pod))
            print(f"{mode} {pod}: {env.nodes.preempt(pod, env.ns, mode)}")
        env.wait_pod_running(f"{job}-a3")
        assert node_of(f"{job}-a3") == od_node, "two preemptions within the window move the job to on-demand"
        st = env.status(job)
        assert st["placement"]["pool"] == "fallback" and st["preemptions"] == 2, st
        # The cool-down is over: the operator stops attempt 3 after a checkpoint; attempt 4 runs on spot.
        env.wait_pod_running(f"{job}-a4", timeout=240)
        assert node_of(f"{job}-a4") in spot_nodes
        st = env.wait_status(job, "Succeeded", lambda s: s.get("phase") in ("Succeeded", "Failed"), timeout=480)
        assert st["phase"] == "Succeeded", (st, env.ends(job))
        assert st["preemptions"] == 2 and st["failures"] == 0 and st["attempt"] == 4, (st, env.ends(job))
        assert st["placement"]["pool"] == "primary", st
        reasons = [
            e.reason for e in env.core.list_namespaced_event(env.ns, field_selector=f"involvedObject.name={job}").items
        ]
        assert {"FallbackPlacement", "ReturningToPrimary", "PrimaryPlacement"} <= set(reasons), reasons
        a3, a4 = env.trainer_log(f"{job}-a3"), env.trainer_log(f"{job}-a4")
        # The node loss lost at most what came after the newest verified checkpoint.
        assert (resumed_from(a3) or -1) >= 2 * every - 1, a3[:300]
        # No step was lost on the way back: attempt 4 resumed where attempt 3 stopped.
        assert preempted_after(a3) is not None and resumed_from(a4) == preempted_after(a3), (a3[-300:], a4[:300])
        # The operator read the job's gs:// checkpoints (its probe, with the spec's endpoint).
        env.wait_status(
            job,
            "the final checkpoint recorded",
            lambda s: (s.get("lastVerifiedCheckpoint") or {}).get("step") == steps - 1,
            timeout=60,
        )
        assert_final_bitwise(env, uri, args, every, steps, tmp_path, storage=storage)
    finally:
        for node in pools:
            with contextlib.suppress(Exception):  # a killed node is gone
                env.core.patch_node(node, {"metadata": {"labels": {"test-pool": None}}})


@pytest.mark.timeout(600)
def test_failing_script_consumes_backoff_limit(env: Env) -> None:
    doc = example()
    doc["metadata"]["name"] = "exit-one"
    trainer = doc["spec"]["template"]["spec"]["containers"][0]
    trainer["command"] = ["python", "-c", "import sys; print('failing on purpose'); sys.exit(1)"]
    trainer.pop("args")
    doc["spec"]["preemption"] = {"backoffLimit": 1, "backoff": {"initialSeconds": 1}, "gracePeriodSeconds": 10}
    path = env.log_dir / "exit-one.yaml"
    path.write_text(yaml.safe_dump(doc))
    env.tool("kubectl", "apply", "-n", env.ns, "-f", str(path))
    st = env.wait_status("exit-one", "Failed", lambda s: s.get("phase") in ("Failed", "Succeeded"), timeout=300)
    assert st["phase"] == "Failed" and st["failures"] == 2 and st["preemptions"] == 0
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "BackoffLimitExceeded"
    assert "exited with code 1" in failed["message"]
    assert "failing on purpose" in env.trainer_log("exit-one-a1")


def test_invalid_spec_is_refused_with_the_field(env: Env) -> None:
    doc = example()
    doc["metadata"]["name"] = "bad-storage"
    doc["spec"]["checkpoint"]["storage"] = "az://not-supported/x"
    path = env.log_dir / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = env.tool("kubectl", "apply", "-n", env.ns, "-f", str(path), check=False)
    assert result.returncode != 0
    assert "spec.checkpoint.storage" in result.stderr


@pytest.mark.timeout(600)
def test_k8s_notice_yields_a_verified_checkpoint_before_sigterm(env: Env) -> None:
    """spec.preemption.notices [k8s]: a DisruptionTarget on the pod -> a verified checkpoint, pod still running.

    The pod keeps its own (default) account, with no rights: its sidecar asks the operator (a pod, with
    the chart's RBAC) through the chart's Service, showing the pod's projected token, as on a real node.
    """
    from datetime import UTC, datetime

    doc = example()
    job = doc["metadata"]["name"] = "notice-k8s"
    spec = doc["spec"]
    # No routine checkpoints: only the notice can cause one.
    spec["checkpoint"]["everySteps"] = 1_000_000
    trainer = spec["template"]["spec"]["containers"][0]
    trainer["args"] = ["--steps", "100000", "--step-delay", "0.05", "--log-every", "1"]
    spec["preemption"]["notices"] = ["k8s"]
    path = env.log_dir / "notice.yaml"
    path.write_text(yaml.safe_dump(doc))
    uri = f"{spec['checkpoint']['storage'].rstrip('/')}/{env.ns}/{job}"
    env.tool("kubectl", "apply", "-n", env.ns, "-f", str(path))
    pod = f"{job}-a1"
    env.wait_pod_running(pod)
    spec_of = env.core.read_namespaced_pod(pod, env.ns).spec
    assert spec_of.service_account_name == "default"
    sidecar = next(c for c in spec_of.containers if c.name == "spotguard-sidecar")
    url = {e.name: e.value for e in sidecar.env}["SPOTGUARD_NOTICE_URL"]
    assert url.startswith(f"http://{RELEASE}.{OPERATOR_NS}.svc:") and url.endswith("/notices/v1/pod"), url
    try:
        wait_for(lambda: last_step(env.trainer_log(pod)) >= 3, "the trainer to step", timeout=180, interval=0.5)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{env.trainer_log(pod)[-3000:]}\n{env.describe(job)}") from None
    assert verified_step(env, uri) == -1
    noticed_at = last_step(env.trainer_log(pod))
    # What Kubernetes 1.26+ writes before it evicts or shuts down (1.20 never does: write it as it would).
    env.core.patch_namespaced_pod_status(
        pod,
        env.ns,
        {
            "status": {
                "conditions": [
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "reason": "TerminationByKubelet",
                        "message": "Pod was terminated in response to imminent node shutdown.",
                        "lastTransitionTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    }
                ]
            }
        },
    )
    wait_for(
        lambda: verified_step(env, uri) >= noticed_at,
        "a checkpoint verified after the notice",
        timeout=180,
        interval=0.5,
    )
    # Before any SIGTERM: the pod was never deleted and still runs.
    p = env.core.read_namespaced_pod(pod, env.ns)
    assert p.metadata.deletion_timestamp is None and p.status.phase == "Running"
    assert env.status(job)["attempt"] == 1
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, job)


@pytest.mark.timeout(600)
def test_missing_credentials_secret_is_reported_then_recovers(env: Env) -> None:
    """A job whose credentials Secret does not exist says so (as kubelet reports it), then starts once it does."""
    doc = example()
    job = doc["metadata"]["name"] = "no-secret"
    doc["spec"]["checkpoint"]["credentialsSecret"] = {"name": "created-later"}
    path = env.log_dir / "no-secret.yaml"
    path.write_text(yaml.safe_dump(doc))
    env.tool("kubectl", "apply", "-n", env.ns, "-f", str(path))
    st = env.wait_status(
        job,
        "PodBlocked",
        lambda s: any(c["type"] == "PodBlocked" and c["status"] == "True" for c in s.get("conditions") or []),
        timeout=180,
    )
    blocked = next(c for c in st["conditions"] if c["type"] == "PodBlocked")
    assert blocked["reason"] == "CreateContainerConfigError", blocked
    assert 'secret "created-later" not found' in blocked["message"], blocked
    assert st["phase"] == "Pending" and st["failures"] == 0 and st["preemptions"] == 0
    # The status is patched first, then the Event is posted: wait for it.
    wait_for(
        lambda: any(
            e.reason == "CreateContainerConfigError" and e.type == "Warning"
            for e in env.core.list_namespaced_event(env.ns, field_selector=f"involvedObject.name={job}").items
        ),
        "the CreateContainerConfigError Event",
        timeout=30,
        interval=0.5,
    )
    # Create the Secret: kubelet retries, the pod starts, the condition clears.
    secret = env.core.read_namespaced_secret("spotguard-s3", env.ns)
    env.core.create_namespaced_secret(env.ns, {"metadata": {"name": "created-later"}, "data": secret.data})
    env.wait_pod_running(f"{job}-a1")
    st = env.wait_status(
        job,
        "unblocked",
        lambda s: any(c["type"] == "PodBlocked" and c["status"] == "False" for c in s.get("conditions") or []),
    )
    assert st["attempt"] == 1
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, job)


@pytest.mark.trials
@pytest.mark.soak
@pytest.mark.timeout(1500)
def test_ddp_gang_survives_every_preemption_mode_and_an_operator_failover_bitwise(env: Env, tmp_path: Path) -> None:
    """2 nodes x 2 processes: drain (rank 1), shutdown (rank 0, with the leading operator replica frozen mid-way
    and continued once the standby took over), abrupt loss (rank 1); Succeeded with a preemption each and the
    digest of an uninterrupted 4-process run; one replica acted at a time, as the apiserver saw it.

    ``make soak`` runs it (named on the command line, it runs the shutdown with the failover alone). In
    ``make test`` its kinds run on real nodes: the same gang loses rank 0's node and ends with the digest
    of an uninterrupted 4-process run (``test_ddp_gang_survives_losing_rank0_node_bitwise``), a frozen
    leader's standby acts and no pod is made twice (``test_frozen_leader_the_standby_acts_no_duplicate_pods``,
    both in ``tests/e2e/test_realnode_e2e.py``), and a gang member's preemption recreates the whole gang
    (``tests/integration/test_gang.py``: drain, shutdown and node loss of either rank)."""
    doc = yaml.safe_load(DDP_EXAMPLE.read_text())
    job = doc["metadata"]["name"]
    spec = doc["spec"]
    every = int(spec["checkpoint"]["everySteps"])
    args, steps = set_steps(doc, GANG_STEPS), GANG_STEPS
    applied = tmp_path / "trainingjob-ddp.yaml"
    applied.write_text(yaml.safe_dump(doc))
    uri = f"{spec['checkpoint']['storage'].rstrip('/')}/{env.ns}/{job}"

    # Jobs an earlier test left behind (it failed before deleting them) would hold nodes the gang needs.
    for left in env.custom.list_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL)["items"]:
        env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, left["metadata"]["name"])
    # Two operator replicas: the one that holds the Lease acts, the other stands by.
    env.tool(
        "helm", "upgrade", RELEASE, str(CHART), "--namespace", OPERATOR_NS, "--reuse-values", "--set", "replicaCount=2"
    )

    def two_replicas_one_leader() -> str | None:
        # The single replica of before (it elects nothing) must be gone, not just terminating.
        if len(env.core.list_namespaced_pod(OPERATOR_NS).items) != 2:
            return None
        pods = {p.metadata.name for p in operator_pods(env)}
        holder = leader(env)
        standby = [p for p in pods if holder and p != pod_of(holder)]
        return (
            holder
            if len(pods) == 2
            and holder
            and pod_of(holder) in pods
            and any(
                "standing by" in env.nodes.log_path(OPERATOR_NS, p, "operator").read_text(errors="replace")
                for p in standby
                if env.nodes.log_path(OPERATOR_NS, p, "operator").exists()
            )
            else None
        )

    wait_for(two_replicas_one_leader, "two operator replicas, one leading, one standing by", timeout=180, interval=1)
    env.tool("kubectl", "apply", "-n", env.ns, "-f", str(applied))

    wait_for(
        lambda: env.core.list_namespaced_service(env.ns, field_selector=f"metadata.name={job}").items,
        "the headless Service",
        timeout=120,
        interval=0.5,
    )
    svc = env.core.read_namespaced_service(job, env.ns)
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses

    seen: dict[str, str] = {}  # pod -> uid: each pod name is created once
    verified_at_kill = -1
    frozen = successor = ""  # the leader frozen in the failover, and the standby that took over
    makers: dict[int, set[str]] = {}  # attempt -> the replicas that created its pods (their annotation)
    made_at: dict[int, Any] = {}  # attempt -> when its first pod was created (the apiserver's clock)

    def note_makers(attempt: int) -> None:
        for p in env.core.list_namespaced_pod(
            env.ns, label_selector=f"spotguard.dev/job={job},spotguard.dev/attempt={attempt}"
        ).items:
            makers.setdefault(attempt, set()).add(p.metadata.annotations[ANNOTATION_OPERATOR_INSTANCE])
            made_at[attempt] = min(made_at.get(attempt, p.metadata.creation_timestamp), p.metadata.creation_timestamp)

    modes = trials.variants(
        full=[("drain", 1, 0.2), ("shutdown", 0, 0.45), ("kill", 1, 0.7)],
        quick=[("shutdown", 0, 0.45)],
    )
    abrupt = modes[-1][0] == "kill"  # the abrupt loss comes last, when it comes
    last = len(modes) + 1  # the attempt that runs to the end
    shutdown_attempt = next(a for a, (m, _, _) in enumerate(modes, start=1) if m == "shutdown")
    for attempt, (mode, rank, fraction) in enumerate(modes, start=1):
        pods = [f"{job}-a{attempt}-{r}" for r in (0, 1)]
        for pod in pods:
            env.wait_pod_running(pod)
        note_makers(attempt)  # before a drain or a lost node takes the pods away
        # Preempt by the trainer's own progress (rank 0 logs every step): verification
        # can lag far behind training on a loaded machine, and an attempt must still be
        # training when its node goes.
        rank0 = pods[0]
        wait_for(
            lambda p=rank0: (
                resumed_from(env.trainer_log(p)) is not None or "starting from scratch" in env.trainer_log(p)
            ),
            f"{rank0} to start",
            timeout=300,
            interval=0.2,
        )
        start = resumed_from(env.trainer_log(rank0)) or 0
        target = max(int(steps * fraction), start + every)
        wait_for(
            lambda t=target, p=rank0: last_step(env.trainer_log(p)) >= t,
            f"rank 0 training past step {target}",
            timeout=300,
            interval=0.2,
        )
        if mode == "kill":
            base = verified_step(env, uri)
            wait_for(
                lambda b=base: verified_step(env, uri) > b, "the next verified checkpoint", timeout=120, interval=0.05
            )
            verified_at_kill = verified_step(env, uri)
        result = env.nodes.preempt(pods[rank], env.ns, mode)
        print(f"preempted {pods[rank]} by {mode}: {result}")
        if mode == "shutdown":
            # Freeze the leader (SIGSTOP: not deleted, it may wake up) in the middle of the gang's teardown.
            env.wait_status(job, "the teardown", lambda s: bool(s.get("teardown")), timeout=120)
            frozen = leader(env)
            assert frozen, "no operator holds the Lease"
            frozen_pod = pod_of(frozen)
            env.nodes.signal_container(OPERATOR_NS, frozen_pod, "operator", signal.SIGSTOP)
            t0 = time.monotonic()
            print(f"froze the leader {frozen}")
            successor = wait_for(
                lambda f=frozen: (lambda h: h if h and h != f else None)(leader(env)),
                "the standby to take the Lease",
                timeout=120,
                interval=0.1,
            )
            takeover_s = time.monotonic() - t0
            # Continue the frozen one at once, while the new leader goes on with the teardown.
            env.nodes.signal_container(OPERATOR_NS, frozen_pod, "operator", signal.SIGCONT)
            following = f"spotguard.dev/job={job},spotguard.dev/attempt={attempt + 1}"
            wait_for(
                lambda sel=following: env.core.list_namespaced_pod(env.ns, label_selector=sel).items,
                "the next attempt's pods",
                timeout=300,
                interval=0.1,
            )
            next_step_s = time.monotonic() - t0
            print(
                f"failover: the standby {successor} held the Lease {takeover_s:.1f} s after the SIGSTOP of the"
                f" leader; the next attempt's pods were created {next_step_s:.1f} s after it (lease 15 s,"
                " renew deadline 10 s, retry 2 s; the gang's old pods stop meanwhile)"
            )
            assert pod_of(successor) != frozen_pod

            def exited_lost(pod: str = frozen_pod) -> bool:
                p = env.core.read_namespaced_pod(pod, OPERATOR_NS)
                last = (p.status.container_statuses or [None])[0]
                term = last.last_state.terminated if last and last.last_state else None
                return bool(term and term.exit_code == LOST_EXIT_CODE)

            # It exits by itself (the Deployment's pod restarts it as a standby with a new identity).
            wait_for(exited_lost, f"the continued replica {frozen_pod} to exit", timeout=60, interval=0.2)
            log = env.nodes.log_path(OPERATOR_NS, frozen_pod, "operator").read_text(errors="replace")
            assert "lost the lease" in log, log[-3000:]
        env.wait_status(job, f"attempt {attempt + 1}", lambda s, a=attempt: (s.get("attempt") or 0) > a, timeout=300)
        for p in env.core.list_namespaced_pod(env.ns, label_selector=f"spotguard.dev/job={job}").items:
            assert seen.setdefault(p.metadata.name, p.metadata.uid) == p.metadata.uid, f"{p.metadata.name} twice"
        # The next attempt started only once every pod of this one had stopped.
        new = [
            p
            for p in env.core.list_namespaced_pod(env.ns, label_selector=f"spotguard.dev/job={job}").items
            if p.metadata.labels.get("spotguard.dev/attempt") == str(attempt + 1)
        ]
        old = [
            p
            for p in env.core.list_namespaced_pod(env.ns, label_selector=f"spotguard.dev/job={job}").items
            if p.metadata.labels.get("spotguard.dev/attempt") == str(attempt)
        ]
        for p in old:
            assert p.status.phase in ("Succeeded", "Failed"), (p.metadata.name, p.status.phase)
        assert len(new) <= 2

    st = env.wait_status(job, "Succeeded", lambda s: s.get("phase") in ("Succeeded", "Failed"), timeout=600)
    assert st["phase"] == "Succeeded", f"{st}\n{env.ends(job)}"
    assert st["preemptions"] == len(modes) and st["failures"] == 0 and st["attempt"] == last, f"{st}\n{env.ends(job)}"
    events = env.core.list_namespaced_event(env.ns, field_selector=f"involvedObject.name={job}").items
    # One event per preemption; the operator that takes over in a failover may report a pod
    # end its predecessor already reported (the same message again: the status counts it once).
    preempted = sorted({e.message for e in events if e.reason == "Preempted"})
    print("preempted events:", preempted)
    assert len(preempted) == len(modes), preempted
    assert any("(NodeLost)" in m for m in preempted) == abrupt, preempted
    assert any(f"{job}-a{shutdown_attempt}-0 on node" in m for m in preempted), preempted  # rank 0's node

    logs = {a: env.trainer_log(f"{job}-a{a}-0") for a in range(1, last + 1)}
    for a in range(1, last - 1 if abrupt else last):  # the graceful modes lose nothing: every rank saved one step
        stopped, resumed = preempted_after(logs[a]), resumed_from(logs[a + 1])
        assert stopped is not None and resumed == stopped, (a, stopped, resumed, logs[a][-1500:])
    if abrupt:
        # What came after the newest globally verified checkpoint is lost, never more.
        resumed = resumed_from(logs[last])
        lost = last_step(logs[last - 1]) - (resumed if resumed is not None else -1)
        graceful = ", ".join(f"{m} 0" for m, _, _ in modes[:-1])
        print(f"steps lost: {graceful}, kill {lost} (every {every}, verified at the kill {verified_at_kill})")
        assert resumed is not None and resumed >= verified_at_kill and lost >= 0, (resumed, verified_at_kill, lost)
    got = final_digest(logs[last])
    assert got is not None, logs[last][-2000:]

    # An uninterrupted run of the same 4 ranks on this machine.
    ref_args = reference_args(args)
    ref = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "--module",
            "spotguard.demo.train_ddp",
            *ref_args,
        ],
        env=reference_env(tmp_path, SPOTGUARD_SAVE_EVERY_STEPS=str(every), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert final_digest(ref.stdout) == got, (final_digest(ref.stdout), got)

    # Who acted, from the objects: both pods of each attempt made by one replica (their annotation), the
    # replicas in turn by creation time, the frozen one's Events all posted before the takeover.
    note_makers(last)
    assert sorted(makers) == list(range(1, last + 1)) and all(len(m) == 1 for m in makers.values()), makers
    order = runs([next(iter(makers[a])) for a in sorted(makers, key=lambda a: made_at[a])])
    assert order[-1] == successor and len(order) == len(set(order)), order
    taken_over = range(shutdown_attempt + 1, last + 1)  # the attempts made after the takeover
    assert all(makers[a] == {successor} for a in taken_over), makers
    for ev in events:
        assert ev.reporting_instance != frozen or ev.metadata.creation_timestamp <= made_at[shutdown_attempt + 1], ev
    check_one_actor_at_a_time(env, job, frozen, successor, last)
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, job)


@pytest.mark.timeout(1200)
def test_hf_trainer_job_survives_drain_and_shutdown_bitwise(env: Env, tmp_path: Path) -> None:
    """The Hugging Face Trainer example as a TrainingJob: drained, then its node shut down; Succeeded with
    2 preemptions, no step lost, and the digest of an uninterrupted run (weights, optimizer, scheduler, RNG)."""
    doc = yaml.safe_load(HF_EXAMPLE.read_text())
    job = doc["metadata"]["name"]
    args = list(doc["spec"]["template"]["spec"]["containers"][0]["args"])
    steps, every = int(args[args.index("--steps") + 1]), int(args[args.index("--save-every") + 1])
    for left in env.custom.list_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL)["items"]:
        env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, left["metadata"]["name"])
    env.tool("kubectl", "apply", "-n", env.ns, "-f", str(HF_EXAMPLE))

    for attempt, (mode, fraction) in enumerate([("drain", 0.3), ("shutdown", 0.6)], start=1):
        pod = f"{job}-a{attempt}"
        env.wait_pod_running(pod)
        wait_for(
            lambda p=pod: resumed_from(env.trainer_log(p)) is not None or "starting from scratch" in env.trainer_log(p),
            f"{pod} to start",
            timeout=300,
            interval=0.2,
        )
        start = resumed_from(env.trainer_log(pod)) or 0
        # Aim between two of the Trainer's own saves: the preemption's checkpoint is mostly an extra one.
        target = max(int(steps * fraction), start + every) + every // 2
        wait_for(
            lambda t=target, p=pod: last_step(env.trainer_log(p)) >= t,
            f"{pod} training past step {target}",
            timeout=300,
            interval=0.2,
        )
        result = env.nodes.preempt(pod, env.ns, mode)
        print(f"preempted {pod} by {mode}: {result}")
        env.wait_status(job, f"attempt {attempt + 1}", lambda s, a=attempt: (s.get("attempt") or 0) > a, timeout=300)

    st = env.wait_status(job, "Succeeded", lambda s: s.get("phase") in ("Succeeded", "Failed"), timeout=600)
    assert st["phase"] == "Succeeded", st
    assert st["preemptions"] == 2 and st["failures"] == 0 and st["attempt"] == 3, st
    logs = {a: env.trainer_log(f"{job}-a{a}") for a in (1, 2, 3)}
    for a in (1, 2):  # graceful modes: the step the Trainer stopped at is the step the next pod resumed from
        stopped, resumed = preempted_after(logs[a]), resumed_from(logs[a + 1])
        assert stopped is not None and resumed == stopped, (a, stopped, resumed, logs[a][-1500:])
    assert f"finished {steps} steps" in logs[3]
    got = final_digest(logs[3])
    assert got is not None, logs[3][-2000:]

    ref_args = reference_args(args)
    ref_args[ref_args.index("--output-dir") + 1] = str(tmp_path / "hf-output")
    ref = subprocess.run(
        [sys.executable, "-m", "spotguard.demo.train_hf", *ref_args],
        env=reference_env(tmp_path, HOME=str(tmp_path), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert final_digest(ref.stdout) == got, (final_digest(ref.stdout), got)
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, job)
