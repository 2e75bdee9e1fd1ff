"""``spotguard jobs ...`` as a user runs it: a subprocess against the real apiserver, operator and S3 store.

As in ``test_operator.py``, no kubelet runs: the pods stay Pending (a
nodeSelector no node matches), and a pod "runs" when its status is patched as
kubelet would. The operator watching the module's namespace is real, so a
preemption driven by ``spotguard jobs preempt`` is counted and answered by it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from spotguard.operator.testing import OperatorProcess
from testenv.kubetest import (
    create_job,
    job_body,
    kubectl,
    status,
    wait_for,
    wait_status,
)

pytestmark = pytest.mark.integration

#: The namespace of this module (the ``ns`` fixture).
NS_PREFIX = "jobs"

REPO = Path(__file__).resolve().parent.parent.parent
NO_NODE = {"spotguard.dev/test-no-node": "true"}
TRAINER = {
    "name": "trainer",
    "image": "trainer:1",
    "command": ["python", "-m", "train"],
    "resources": {"limits": {"nvidia.com/gpu": 1}},
}


def cli_env(kube: Any, **extra: str) -> dict[str, str]:
    """This interpreter's environment without any AWS settings, the test cluster's kubeconfig, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["KUBECONFIG"] = str(kube.kubeconfig)
    env.update(extra)
    return env


def jobs(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotguard.cli", "jobs", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spotguard: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], proc.stderr
    return lines[0]


def no_node_job(name: str, storage: str, **spec: Any) -> dict[str, Any]:
    preemption = {"maxPreemptions": 3, "backoffLimit": 1, "gracePeriodSeconds": 5, "backoff": {"initialSeconds": 0}}
    return job_body(name, storage, TRAINER, node_selector=NO_NODE, **{"preemption": preemption, **spec})


def start_job(apis: tuple[Any, Any], ns: str, body: dict[str, Any]) -> None:
    """Create the job and wait until its first pod exists."""
    core, _ = apis
    name = body["metadata"]["name"]
    create_job(apis, ns, body)
    wait_status(apis, ns, name, "attempt 1", lambda s: s.get("attempt") == 1)
    wait_for(lambda: core.read_namespaced_pod(f"{name}-a1", ns), f"pod {name}-a1")


def run_pod(apis: tuple[Any, Any], ns: str, pod: str) -> None:
    core, _ = apis
    core.patch_namespaced_pod_status(pod, ns, {"status": {"phase": "Running"}})


def cells(line: str) -> list[str]:
    return [c for c in line.split("   ") if c.strip()] if line else []


# --- tests ------------------------------------------------------------------------------


def test_ls_table_json_and_not_found(
    kube: Any, apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    start_job(apis, ns, no_node_job("listed", f"file://{tmp_path}/store"))
    env = cli_env(kube)

    table = jobs(env, "ls", "-n", ns)
    assert table.returncode == 0, table.stderr
    head, *rows = table.stdout.strip().splitlines()
    assert [c.strip() for c in cells(head)] == [
        "NAME",
        "PHASE",
        "ATTEMPT",
        "PREEMPTIONS",
        "FAILURES",
        "VERIFIED STEP",
        "PLACEMENT",
        "AGE",
    ]
    row = next(r.split() for r in rows if r.split()[0] == "listed")
    assert row[:7] == ["listed", "Pending", "1", "0", "0", "-", "-"]

    listed = jobs(env, "ls", "-n", ns, "-o", "json")
    assert listed.returncode == 0, listed.stderr
    doc = json.loads(listed.stdout)
    item = next(i for i in doc["items"] if i["metadata"]["name"] == "listed")
    assert doc["kind"] == "List" and item["kind"] == "TrainingJob" and item["metadata"]["namespace"] == ns
    assert item["status"]["attempt"] == 1 and item["status"]["currentPod"] == "listed-a1"
    assert "managedFields" not in item["metadata"]

    # Without -n: the namespace of the kubeconfig's current context, as kubectl.
    cfg = yaml.safe_load(Path(kube.kubeconfig).read_text())
    context = next(c for c in cfg["contexts"] if c["name"] == cfg["current-context"])
    context["context"]["namespace"] = ns
    (tmp_path / "kubeconfig").write_text(json.dumps(cfg))
    in_context = jobs(env, "ls", "--kubeconfig", str(tmp_path / "kubeconfig"))
    assert ["listed", "Pending", "1"] in [line.split()[:3] for line in in_context.stdout.splitlines()], in_context

    everywhere = jobs(env, "ls", "-A")
    assert everywhere.returncode == 0, everywhere.stderr
    assert [ns, "listed", "Pending"] in [line.split()[:3] for line in everywhere.stdout.splitlines()]

    one_line_error(jobs(env, "describe", "nope", "-n", ns), f"trainingjob nope not found in namespace {ns}")
    one_line_error(jobs(env, "preempt", "nope", "-n", ns), f"trainingjob nope not found in namespace {ns}")
    usage = jobs(env, "ls", "-o", "xml")
    assert usage.returncode == 2 and "invalid choice: 'xml'" in usage.stderr


def test_preempt_evicts_the_pod_and_the_operator_starts_attempt_2(
    kube: Any, apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    start_job(apis, ns, no_node_job("drill", f"file://{tmp_path}/store"))
    env = cli_env(kube)
    proc = subprocess.Popen(
        [sys.executable, "-m", "spotguard.cli", "jobs", "preempt", "drill", "-n", ns, "--progress", "--timeout", "60"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The next attempt's pod appears; make it run as kubelet would report it.
        st = wait_status(apis, ns, "drill", "attempt 2", lambda s: s.get("attempt") == 2)
        run_pod(apis, ns, "drill-a2")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out + err
    lines = out.strip().splitlines()
    assert lines[0] == "evicted pod drill-a1 (attempt 1 of trainingjob drill)", out + err
    assert lines[-1].startswith("trainingjob drill: attempt 2 is running (pod drill-a2); preemptions 1"), out
    assert "no Eviction API" not in err  # the Eviction API itself, not the delete fallback
    progress = [line.split("] ", 1)[1] for line in err.strip().splitlines()]
    ended = next(i for i, p in enumerate(progress) if p.startswith("attempt 1 ended: preempted (PodDeleted)"))
    created = progress.index("attempt 2 created (pod drill-a2)")
    assert ended < created < progress.index("attempt 2 running"), err
    assert "preemptions 1, failures 0" in progress[ended]

    st = status(apis, ns, "drill")
    assert st["preemptions"] == 1 and st["failures"] == 0 and st["attempt"] == 2 and st["phase"] == "Running"
    assert st["lastPodEnd"]["attempt"] == 1 and st["lastPodEnd"]["kind"] == "preempted"

    # describe tells the story: attempt 1 preempted, why, attempt 2 running, its pod.
    wait_for(lambda: "Preempted" in jobs(env, "describe", "drill", "-n", ns).stdout, "the Preempted Event")
    text = jobs(env, "describe", "drill", "-n", ns)
    assert text.returncode == 0, text.stderr
    described = text.stdout.splitlines()
    assert "Phase:        Running" in described and "Preemptions:  1 (maxPreemptions 3)" in described
    first = next(line for line in described if line.startswith("  #1: "))
    assert "preempted (PodDeleted)" in first, text.stdout
    cause = described[described.index(first) + 1]
    assert cause == f"      cause: {st['lastPodEnd']['message']}", text.stdout
    assert any(line.startswith("  #2 (current): created ") for line in described), text.stdout
    pods = described[described.index("Pods (attempt 2):") + 2]
    assert pods.split()[:3] == ["drill-a2", "Running", "<none>"], text.stdout
    assert any("Preempted" in line and "pod drill-a1 preempted (PodDeleted)" in line for line in described)

    as_json = json.loads(jobs(env, "describe", "drill", "-n", ns, "-o", "json").stdout)
    first_attempt = as_json["attempts"][0]
    assert first_attempt["attempt"] == 1 and first_attempt["end"]["kind"] == "preempted"
    assert first_attempt["end"]["reason"] == "PodDeleted" and as_json["preemptions"]["count"] == 1


def create_pdb(kube: Any, ns: str, job: str, tmp_path: Path) -> None:
    """A PodDisruptionBudget that allows no disruption of the job's pods (policy/v1, else v1beta1 before 1.21)."""
    for version in ("policy/v1", "policy/v1beta1"):
        manifest = tmp_path / "pdb.json"
        manifest.write_text(
            json.dumps(
                {
                    "apiVersion": version,
                    "kind": "PodDisruptionBudget",
                    "metadata": {"name": f"{job}-pdb", "namespace": ns},
                    "spec": {"minAvailable": 1, "selector": {"matchLabels": {"spotguard.dev/job": job}}},
                }
            )
        )
        if kubectl(kube, "apply", "-f", str(manifest), check=False).returncode == 0:
            return
    raise AssertionError("could not create a PodDisruptionBudget")


def test_a_disruption_budget_refuses_the_eviction_and_a_timeout_is_an_error(
    kube: Any, apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    core, _ = apis
    start_job(apis, ns, no_node_job("guarded", f"file://{tmp_path}/store"))
    run_pod(apis, ns, "guarded-a1")
    wait_status(apis, ns, "guarded", "Running", lambda s: s.get("phase") == "Running")
    create_pdb(kube, ns, "guarded", tmp_path)
    env = cli_env(kube)

    refused = jobs(env, "preempt", "guarded", "-n", ns)
    one_line_error(
        refused, "the eviction of pod guarded-a1 was refused", "PodDisruptionBudget", f"kubectl get pdb -n {ns}"
    )
    pod = core.read_namespaced_pod("guarded-a1", ns)
    assert pod.metadata.deletion_timestamp is None
    assert status(apis, ns, "guarded")["preemptions"] == 0

    kubectl(kube, "delete", "pdb", "guarded-pdb", "-n", ns)
    # Attempt 2's pod never gets a node here: the wait gives up with what it saw.
    late = jobs(env, "preempt", "guarded", "-n", ns, "--timeout", "2", "--no-progress")
    assert late.stdout.startswith("evicted pod guarded-a1 (attempt 1 of trainingjob guarded)"), late.stdout
    one_line_error(late, "timed out after 2s waiting for trainingjob guarded to run its next attempt")
    wait_status(apis, ns, "guarded", "attempt 2", lambda s: s.get("attempt") == 2 and s.get("preemptions") == 1)


def test_checkpoints_in_s3_with_the_users_credentials(
    kube: Any, apis: tuple[Any, Any], ns: str, operator: OperatorProcess, s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    from spotguard.checkpoint import read_manifest, snapshot_state, upload_checkpoint, write_checkpoint
    from spotguard.storage import open_storage

    # The spec names the store's endpoint; the user's environment has only the keys.
    create_job(
        apis,
        ns,
        no_node_job(
            "stored",
            s3_uri,
            checkpoint={
                "storage": s3_uri,
                "endpoint": s3_store.endpoint_url,
                "credentialsSecret": {"name": "stored-s3"},
            },
        ),
    )
    storage = open_storage(
        f"{s3_uri}/{ns}/stored",
        endpoint_url=s3_store.endpoint_url,
        access_key=s3_store.access_key,
        secret_key=s3_store.secret_key,
    )
    for step in (10, 20, 30):
        upload_checkpoint(write_checkpoint(tmp_path / f"local-{step}", step, snapshot_state({"step": step})), storage)
    damaged = f"ckpt-000000000020/{read_manifest(storage, 'ckpt-000000000020').files[0].path}"
    data = storage.read_bytes(damaged)
    storage.write_bytes(damaged, data[:-1] + bytes([data[-1] ^ 0xFF]))

    keys = {
        "AWS_ACCESS_KEY_ID": s3_store.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_store.secret_key,
        "AWS_DEFAULT_REGION": s3_store.region,
    }
    env = cli_env(kube, **keys)
    table = jobs(env, "checkpoints", "stored", "-n", ns)
    assert table.returncode == 0, table.stderr
    rows = [line.split() for line in table.stdout.strip().splitlines()]
    assert rows[0] == ["STEP", "CREATED", "SIZE", "VERIFIED"]
    assert [r[0] for r in rows[1:4]] == ["10", "20", "30*"]
    assert rows[1][-1] == "yes" and rows[3][-1] == "yes" and "no:" in rows[2], rows

    listed = json.loads(jobs(env, "checkpoints", "stored", "-n", ns, "-o", "json").stdout)
    assert listed["uri"] == f"{s3_uri}/{ns}/stored"
    assert [(c["step"], c["verified"], c["latest"]) for c in listed["checkpoints"]] == [
        (10, True, False),
        (20, False, False),
        (30, True, True),
    ]
    assert listed["checkpoints"][1]["problems"]

    # Without credentials: what to do, in one line.
    bare = cli_env(
        kube,
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    one_line_error(
        jobs(bare, "checkpoints", "stored", "-n", ns),
        "no AWS credentials found",
        "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        f"reading {s3_uri}/{ns}/stored",
        f"Secret stored-s3 of namespace {ns}",
    )
    # --endpoint-url overrides the spec's endpoint (here: one where nothing listens).
    wrong = jobs(
        cli_env(kube, AWS_MAX_ATTEMPTS="1", **keys),
        "checkpoints",
        "stored",
        "-n",
        ns,
        "--endpoint-url",
        "http://127.0.0.1:9",
    )
    one_line_error(wrong, "cannot reach the S3 endpoint (http://127.0.0.1:9")
