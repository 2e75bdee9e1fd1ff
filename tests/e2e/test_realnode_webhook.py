"""End to end on real nodes: the operator's webhook injects the sidecar into a plain ``batch/v1`` Job's pod.

The chart installed by ``helm install`` with its webhooks on (the chart's
default), its two operator replicas pulled from the registry onto a real node
(kubelet v1.20, containerd, runc, CNI); a user's own Job, not a TrainingJob,
whose pod template asks for spotguard by label and annotations
(``spotguard/operator/webhook.py``). The apiserver calls the webhook as on any
cluster, through the Service the chart's ``clientConfig.service`` names: the
control plane's cluster egress (``testenv/realnode/svcproxy.py``) routes the
Service's ClusterIP to a ready replica's pod IP, as kube-proxy would. Then
``kubectl drain`` of the Job's node: the injected sidecar takes the emergency
checkpoint, the Job controller's next pod restores it, and the Job completes
bitwise equal to an uninterrupted run.

Two of the session's real nodes (``testenv.pytest_realnodes``): one for both
replicas, one for the Job's pods.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from spotguard.operator.podbuilder import ANNOTATION_INJECTED
from spotguard.operator.spec import RESTORE_CONTAINER, SIDECAR_CONTAINER
from spotguard.operator.testing import free_ports, wait_for
from spotguard.operator.webhook import PREFIX
from testenv.e2e import (
    CREDENTIALS_SECRET,
    DEV_VALUES,
    OPERATOR_NS,
    RELEASE,
    LogFollower,
    RealNodeEnv,
    assert_final_bitwise,
    create_bucket_and_secret,
    example,
    helm_install,
    last_step,
    operator_pods,
    preempted_after,
    resumed_from,
    verified_step,
)
from testenv.processnode.api import Kube
from testenv.pytest_realnodes import real_node_namespace
from testenv.realnode import RealNodes

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

#: One node for the operator's two replicas, one for the Job's pods.
NODES = 2
#: Where the operator's replicas run (a label of this module's own: another module's label may stay on a node).
OPERATOR_ROLE, OPERATOR_ROLE_VALUE = "spotguard-test/webhook-role", "operator"
#: The chart's mutating webhook configuration (``<fullname>``) and the label it selects pods by.
WEBHOOK_CONFIG = RELEASE
INJECT_LABEL = f"{PREFIX}inject"
STEPS, EVERY, DELAY = 240, 20, 0.15


def chart_values(e: RealNodeEnv, registry: Any, liveness_port: int) -> Path:
    """The dev values with the webhooks on (the chart's default), the images from the registry and both
    replicas on the operator's node."""
    tag = registry.refs["spotguard"].rsplit(":", 1)[1]
    dev = yaml.safe_load(DEV_VALUES.read_text())
    dev.pop("webhook")  # the dev values turn it off; here the apiserver reaches its Service
    dev["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["namespaces"] = [e.ns]
    dev.update(
        {
            "image": {"registry": registry.address, "tag": tag},
            "replicaCount": 2,
            "nodeSelector": {OPERATOR_ROLE: OPERATOR_ROLE_VALUE},
            # Free ports: a pod's own 127.0.0.1 port that the host-services list names is the host's.
            "metrics": {"address": "0.0.0.0", "port": e.metrics_port},
            "liveness": {"address": "0.0.0.0", "port": liveness_port},
            "operator": {**dev["operator"], "watchNamespaces": [e.ns], "resyncSeconds": 2},
        }
    )
    path = e.log_dir / "values.yaml"
    path.write_text(yaml.safe_dump(dev))
    return path


@pytest.fixture(scope="module")
def env(
    kube: Any, s3_store: Any, image_registry: Any, real_nodes: RealNodes, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealNodeEnv]:
    """Two of the session's real nodes (they pull from the session's registry), a namespace with the store's
    Secret, and the chart installed by Helm with its webhooks, both replicas Ready."""
    from kubernetes import client

    for _ in range(NODES - len(real_nodes.node_names())):
        real_nodes.add_node(wait=True)
    operator_node = real_nodes.node_names()[0]
    log_dir = tmp_path_factory.mktemp("realnode-webhook")
    api = kube.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    namespaces = real_node_namespace(Kube(kube.kubeconfig), "rn-hook")
    ns = next(namespaces)
    follower = LogFollower(kube, core, [ns, OPERATOR_NS], log_dir / "logs")
    metrics_port, liveness_port = free_ports(2)
    e = RealNodeEnv(kube, core, custom, ns, metrics_port, s3_store, real_nodes, log_dir, follower=follower)
    e.images = dict(image_registry.refs)
    try:
        core.patch_node(operator_node, {"metadata": {"labels": {OPERATOR_ROLE: OPERATOR_ROLE_VALUE}}})
        create_bucket_and_secret(core, s3_store, ns)
        helm_install(e, chart_values(e, image_registry, liveness_port))
        wait_for(lambda: len(ready_replicas(e)) == 2, "both operator replicas Ready", timeout=420, interval=1)
        yield e
    finally:
        for p in core.list_namespaced_pod(OPERATOR_NS).items:
            log = e.container_log(OPERATOR_NS, p.metadata.name, "operator")
            print(f"--- operator log ({p.metadata.name}) ---\n" + "\n".join(log.splitlines()[-60:]))
        e.tool("helm", "uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait", check=False)
        # The nodes as this module found them: the label off, no pod of its own left.
        core.patch_node(operator_node, {"metadata": {"labels": {OPERATOR_ROLE: None}}})
        next(namespaces, None)
        follower.stop()


def ready_replicas(e: RealNodeEnv) -> list[str]:
    return [
        p.metadata.name
        for p in operator_pods(e)
        if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
    ]


def job_node(e: RealNodeEnv) -> str:
    return str(e.nodes.node_names()[1])


def plain_job(e: RealNodeEnv, name: str) -> dict[str, Any]:
    """A user's own ``batch/v1`` Job running the example's trainer, asking for spotguard by its pod's
    label and annotations; its pods go to the Job's node (off the replicas' node: a drain there must
    not take the webhook's replicas with it)."""
    trainer = example()["spec"]["template"]["spec"]["containers"][0]
    trainer = {
        **trainer,
        "image": e.images["spotguard-torch"],
        # The example's demo as it is: it returns 0 once preempted, and the injected sidecar's 143 fails the
        # pod (a Job replaces only a failed pod; one that succeeded would complete the Job half-trained).
        "command": ["python", "-m", "spotguard.demo.train"],
        "args": ["--steps", str(STEPS), "--step-delay", str(DELAY), "--log-every", "1"],
    }
    annotations = {
        f"{PREFIX}storage": example()["spec"]["checkpoint"]["storage"],
        f"{PREFIX}credentials-secret": CREDENTIALS_SECRET,
        f"{PREFIX}save-every-steps": str(EVERY),
    }
    on_node = {"key": "kubernetes.io/hostname", "operator": "In", "values": [job_node(e)]}
    pod_spec = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 30,
        "containers": [trainer],
        "tolerations": example()["spec"]["template"]["spec"]["tolerations"],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [on_node]}]
                }
            }
        },
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 2,
            "template": {"metadata": {"labels": {INJECT_LABEL: "true"}, "annotations": annotations}, "spec": pod_spec},
        },
    }


def webhook_answers(e: RealNodeEnv, job: dict[str, Any]) -> bool:
    """Whether a pod of ``job``'s template, created as a dry run, comes back injected: the apiserver reached
    the webhook through its Service (the operator puts its CA into the configuration at start)."""
    from kubernetes import client

    config = client.AdmissionregistrationV1Api(e.core.api_client).read_mutating_webhook_configuration(WEBHOOK_CONFIG)
    if not config.webhooks[0].client_config.ca_bundle:
        return False
    template = job["spec"]["template"]
    labels = {**template["metadata"]["labels"], "job-name": job["metadata"]["name"]}
    pod = {"metadata": {"generateName": "probe-", "labels": labels, "annotations": template["metadata"]["annotations"]}}
    made = e.core.create_namespaced_pod(e.ns, {**pod, "spec": template["spec"]}, dry_run="All")
    return bool((made.metadata.annotations or {}).get(ANNOTATION_INJECTED))


def job_pods(e: RealNodeEnv, name: str) -> list[Any]:
    pods = e.core.list_namespaced_pod(e.ns, label_selector=f"job-name={name}").items
    return sorted(pods, key=lambda p: p.metadata.creation_timestamp)


def injected(pod: Any) -> list[str]:
    """The containers of ``pod`` that the webhook added."""
    names = [c.name for c in [*(pod.spec.init_containers or []), *pod.spec.containers]]
    return [n for n in names if n in (RESTORE_CONTAINER, SIDECAR_CONTAINER)]


@pytest.mark.timeout(1200)
def test_webhook_injects_a_plain_job_whose_pod_survives_a_drain(env: RealNodeEnv, tmp_path: Path) -> None:
    """The Job's pod is created with the restore init container and the sidecar (the apiserver called the
    operator's webhook through its Service); ``kubectl drain`` of its node ends it with an emergency
    checkpoint, which the Job controller's next pod resumes from; the Job completes, its final checkpoint
    bitwise equal to an uninterrupted run's."""
    from kubernetes import client

    name = "plain-job"
    job = plain_job(env, name)
    wait_for(lambda: webhook_answers(env, job), "the webhook to answer through its Service", timeout=120, interval=1)
    batch = client.BatchV1Api(env.core.api_client)
    batch.create_namespaced_job(env.ns, job)
    first = wait_for(lambda: job_pods(env, name), "the Job's pod", timeout=120, interval=0.5)[0]
    assert injected(first) == [RESTORE_CONTAINER, SIDECAR_CONTAINER], first.spec
    uri = first.metadata.annotations[ANNOTATION_INJECTED]
    assert uri == f"{example()['spec']['checkpoint']['storage']}/{env.ns}/{name}", uri

    pod = first.metadata.name
    env.wait_pod_running(pod, timeout=420)  # the node pulls the torch image first
    wait_for(lambda: last_step(env.trainer_log(pod)) >= STEPS // 3, f"{pod} at step {STEPS // 3}", timeout=300)
    wait_for(lambda: verified_step(env, uri) >= 0, "a verified checkpoint", timeout=240, interval=0.5)
    node = job_node(env)
    drain = ("drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--force", "--timeout=180s")
    print(env.tool("kubectl", *drain).stdout)
    env.tool("kubectl", "uncordon", node)

    def complete() -> bool:
        st = batch.read_namespaced_job_status(name, env.ns).status
        failed = [c for c in st.conditions or [] if c.type == "Failed" and c.status == "True"]
        assert not failed, f"{st}\n{env.describe(name)}"
        return bool(st.succeeded)

    wait_for(complete, "the Job to complete", timeout=600, interval=1)
    # The drained pod is gone (evicted); the Job's one other pod finished it.
    pods = job_pods(env, name)
    assert [p.metadata.name for p in pods if p.metadata.name != pod] == [pods[-1].metadata.name], pods
    second = pods[-1]
    assert second.status.phase == "Succeeded" and injected(second) == [RESTORE_CONTAINER, SIDECAR_CONTAINER], second
    stopped, last = preempted_after(env.trainer_log(pod)), env.trainer_log(second.metadata.name)
    assert stopped is not None and resumed_from(last) == stopped, (stopped, env.trainer_log(pod)[-1500:], last[:500])
    assert f"finished {STEPS} steps" in last, last[-1500:]
    args = ["--steps", str(STEPS), "--step-delay", str(DELAY), "--log-every", "1"]
    assert_final_bitwise(env, uri, args, EVERY, STEPS, tmp_path)
    batch.delete_namespaced_job(name, env.ns, propagation_policy="Background")
