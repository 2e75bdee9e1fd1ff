"""The process node: pods bound by the real scheduler run as local processes, and spot deaths.

Pods here are plain ``sh -c`` / ``python -c`` commands. Mount paths live under
the test's tmp dir: a file written through an emptyDir mount must not appear in
the host directory under the mount point, which proves the bind mount.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from testenv.processnode import SHUTDOWN_MESSAGE, ProcessNodes, log_tail
from testenv.processnode.pod import IMAGE_PATHS
from testenv.processnode.podnet import available as pod_networks

pytestmark = pytest.mark.integration

WAIT = 90.0  # generous deadlines for a shared, noisy machine: never a speed check


def wait_for(check: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def core(kube: Any) -> Any:
    from kubernetes import client

    return client.CoreV1Api(kube.api_client())


@pytest.fixture
def ns(core: Any) -> Iterator[str]:
    """A fresh namespace, deleted afterwards (the agent then stops its pods gracefully)."""
    name = f"pn-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


def create_pod(core: Any, namespace: str, pod: dict[str, Any]) -> None:
    """Create a pod, retrying while the namespace's ServiceAccount (token) is not made yet."""
    from kubernetes.client.exceptions import ApiException

    deadline = time.monotonic() + WAIT
    while True:
        try:
            core.create_namespaced_pod(namespace, pod)
            return
        except ApiException as exc:
            if "service account" not in str(exc.body).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def pod_manifest(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "processnode-test"}},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2, "containers": containers, **spec},
    }


def container(name: str, command: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": "busybox:test", "command": command, **extra}


def wait_phase(core: Any, namespace: str, name: str, phases: tuple[str, ...]) -> Any:
    def done() -> Any:
        pod = core.read_namespaced_pod(name, namespace)
        return pod if pod.status.phase in phases else None

    return wait_for(done, f"pod {namespace}/{name} in {phases}")


def terminated(pod: Any, container_name: str, init: bool = False) -> Any:
    statuses = pod.status.init_container_statuses if init else pod.status.container_statuses
    (status,) = [s for s in statuses if s.name == container_name]
    assert status.state.terminated is not None, f"{container_name}: {status.state}"
    return status.state.terminated


def pod_gone(core: Any, namespace: str, name: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        core.read_namespaced_pod(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def host_pid(marker: str) -> int | None:
    """The host pid of the container process whose environment has ``PROBE=marker``.

    A container's own pid is that of its PID namespace (1 for its command), so
    the test finds the process from the host; the container's shim, which
    carries the same environment, runs the process node's launcher.
    """
    needle = f"PROBE={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in environ and b"container_init" not in cmdline:
            return int(entry.name)
    return None


def process_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# --- running pods --------------------------------------------------------------------------


def test_gpu_pod_is_scheduled_and_its_containers_share_an_emptydir(
    core: Any, ns: str, process_nodes: ProcessNodes, tmp_path: Path
) -> None:
    shared = tmp_path / "mnt" / "shared"  # the mountPath; the host directory must stay empty
    mount = [{"name": "shared", "mountPath": str(shared)}]
    env = [{"name": "DIR", "value": str(shared)}]
    reader = 'i=0; until [ -f "$DIR/from-writer" ]; do i=$((i+1)); [ $i -lt 600 ] || exit 7; sleep 0.1; done; '
    reader += 'cat "$DIR/from-init" "$DIR/from-writer"'
    pod = pod_manifest(
        "gpu",
        [
            container(
                "writer",
                ["python", "-c", "import os, sys; open(os.environ['DIR'] + '/from-writer', 'w').write('hello\\n')"],
                env=env,
                volumeMounts=mount,
                resources={"limits": {"nvidia.com/gpu": "1"}},
            ),
            container("reader", ["sh", "-c", reader], env=env, volumeMounts=mount),
        ],
        initContainers=[container("init", ["sh", "-c", 'echo ready > "$DIR/from-init"'], env=env, volumeMounts=mount)],
        volumes=[{"name": "shared", "emptyDir": {}}],
    )
    create_pod(core, ns, pod)

    done = wait_phase(core, ns, "gpu", ("Succeeded", "Failed"))

    assert done.spec.node_name in process_nodes.node_names()
    assert core.read_node(done.spec.node_name).status.allocatable["nvidia.com/gpu"] == "1"
    assert done.status.phase == "Succeeded", process_nodes.log_path(ns, "gpu", "reader").read_text()
    assert terminated(done, "init", init=True).exit_code == 0
    for name in ("writer", "reader"):
        term = terminated(done, name)
        assert (term.exit_code, term.reason) == (0, "Completed")
    assert process_nodes.log_path(ns, "gpu", "reader").read_text() == "ready\nhello\n"
    assert shared.is_dir() and not any(shared.iterdir()), "files landed in the host dir, not in the emptyDir"
    assert done.status.pod_ip.startswith("127.64." if pod_networks() else "127.0.0.1")  # its own network
    ready = {c.type: c.status for c in done.status.conditions}
    assert ready["PodScheduled"] == "True" and ready["Initialized"] == "True"


def test_failing_command_fails_the_pod_with_its_exit_code(core: Any, ns: str, process_nodes: ProcessNodes) -> None:
    create_pod(core, ns, pod_manifest("fails", [container("main", ["sh", "-c", "echo boom >&2; exit 3"])]))

    done = wait_phase(core, ns, "fails", ("Succeeded", "Failed"))

    assert done.status.phase == "Failed"
    term = terminated(done, "main")
    assert (term.exit_code, term.reason) == (3, "Error")
    assert process_nodes.log_path(ns, "fails", "main").read_text() == "boom\n"


def test_failing_init_container_fails_the_pod_before_containers_start(core: Any, ns: str) -> None:
    pod = pod_manifest(
        "init-fails",
        [container("main", ["sh", "-c", "exit 0"])],
        initContainers=[container("setup", ["sh", "-c", "exit 5"])],
    )
    create_pod(core, ns, pod)

    done = wait_phase(core, ns, "init-fails", ("Succeeded", "Failed"))

    assert done.status.phase == "Failed"
    assert terminated(done, "setup", init=True).exit_code == 5
    (main,) = done.status.container_statuses
    assert main.state.terminated is None and main.state.running is None


def test_secrets_configmaps_and_downward_api_reach_the_process(
    core: Any, ns: str, process_nodes: ProcessNodes, tmp_path: Path
) -> None:
    secret = {"metadata": {"name": "creds"}, "stringData": {"password": "s3cr3t", "file.txt": "from-secret"}}
    core.create_namespaced_secret(ns, secret)
    core.create_namespaced_config_map(ns, {"metadata": {"name": "settings"}, "data": {"MODE": "fast"}})
    creds = tmp_path / "creds"
    script = textwrap.dedent(
        """
        import json, os, ssl, sys, urllib.request
        sa = "/var/run/secrets/kubernetes.io/serviceaccount"
        creds = sys.argv[1]
        ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")  # verifies the apiserver's cert
        url = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}/api"
        token = open(f"{sa}/token").read()
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": "Bearer " + token}),
                                    context=ctx, timeout=30) as resp:
            api_status = resp.status
        names = ("PASSWORD", "MODE", "POD_NAME", "POD_NAMESPACE", "POD_UID", "NODE_NAME", "POD_IP", "APP", "GREETING")
        print(json.dumps({
            "env": {n: os.environ.get(n) for n in names},
            "files": sorted(os.listdir(creds)),
            "renamed": open(f"{creds}/renamed.txt").read(),
            "sa_namespace": open(f"{sa}/namespace").read(),
            "api_status": api_status,
        }))
        """
    )

    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env = [
        {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
        {"name": "POD_NAME", **field("metadata.name")},
        {"name": "POD_NAMESPACE", **field("metadata.namespace")},
        {"name": "POD_UID", **field("metadata.uid")},
        {"name": "NODE_NAME", **field("spec.nodeName")},
        {"name": "POD_IP", **field("status.podIP")},
        {"name": "APP", **field("metadata.labels['app']")},
        {"name": "GREETING", "value": "hi-$(POD_NAME)"},
    ]
    pod = pod_manifest(
        "config",
        [
            container(
                "main",
                ["python", "-c", script],
                args=[str(creds)],
                env=env,
                envFrom=[{"configMapRef": {"name": "settings"}}],
                volumeMounts=[{"name": "creds", "mountPath": str(creds)}],
            )
        ],
        volumes=[
            {"name": "creds", "secret": {"secretName": "creds", "items": [{"key": "file.txt", "path": "renamed.txt"}]}}
        ],
    )
    create_pod(core, ns, pod)

    done = wait_phase(core, ns, "config", ("Succeeded", "Failed"))

    log = process_nodes.log_path(ns, "config", "main").read_text()
    assert done.status.phase == "Succeeded", log
    seen = json.loads(log)
    assert seen["env"] == {
        "PASSWORD": "s3cr3t",
        "MODE": "fast",
        "POD_NAME": "config",
        "POD_NAMESPACE": ns,
        "POD_UID": done.metadata.uid,
        "NODE_NAME": done.spec.node_name,
        "POD_IP": done.status.pod_ip,
        "APP": "processnode-test",
        "GREETING": "hi-config",
    }
    assert seen["files"] == ["renamed.txt"]  # items honoured: only the listed key, under its path
    assert seen["renamed"] == "from-secret"
    assert seen["sa_namespace"] == ns
    assert seen["api_status"] == 200  # the ServiceAccount token authenticates against the real apiserver


def waiting_reason(core: Any, namespace: str, name: str) -> tuple[str, str] | None:
    """(reason, message) of the pod's first container while it is waiting."""
    statuses = core.read_namespaced_pod(name, namespace).status.container_statuses or []
    if statuses and statuses[0].state.waiting is not None:
        return statuses[0].state.waiting.reason, statuses[0].state.waiting.message or ""
    return None


def pod_events(core: Any, namespace: str, name: str, reason: str) -> list[Any]:
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    return [e for e in events if e.reason == reason]


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        (
            {"env": [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "late", "key": "PASSWORD"}}}]},
            'secret "late" not found',
        ),
        ({"envFrom": [{"secretRef": {"name": "late"}}]}, 'secret "late" not found'),
        ({"envFrom": [{"configMapRef": {"name": "late"}}]}, 'configmap "late" not found'),
    ],
    ids=["secretKeyRef", "envFrom-secret", "envFrom-configmap"],
)
def test_missing_secret_or_configmap_for_env_is_a_config_error_until_created(
    core: Any, ns: str, kube: Any, process_nodes: ProcessNodes, ref: dict[str, Any], message: str
) -> None:
    """As kubelet: waiting with CreateContainerConfigError and its message; starts once the object exists."""
    optional = [  # optional refs to objects that never exist: no error, the variable is just unset
        {"name": "MAYBE", "valueFrom": {"secretKeyRef": {"name": "never", "key": "k", "optional": True}}},
        {"name": "MAYBE_TOO", "valueFrom": {"configMapKeyRef": {"name": "never", "key": "k", "optional": True}}},
    ]
    spec = {**ref, "env": [*ref.get("env", []), *optional]}
    spec.setdefault("envFrom", []).append({"secretRef": {"name": "never-either", "optional": True}})
    create_pod(core, ns, pod_manifest("waits", [container("main", ["sh", "-c", 'echo "$PASSWORD"'], **spec)]))

    def config_error() -> tuple[str, str] | None:
        waiting = waiting_reason(core, ns, "waits")
        return waiting if waiting is not None and waiting[0] == "CreateContainerConfigError" else None

    assert wait_for(config_error, "CreateContainerConfigError")[1] == message
    no_logs = kubectl(kube, "logs", "-n", ns, "waits")  # an error, as from kubelet: nothing ran yet
    assert no_logs.returncode != 0
    assert 'container "main" in pod "waits" is waiting to start: CreateContainerConfigError' in no_logs.stderr
    assert wait_for(lambda: pod_events(core, ns, "waits", "Failed"), "kubelet's Failed event")[0].message == (
        f"Error: {message}"
    )
    data = {"PASSWORD": "s3cr3t"}
    if "configmap" in message:
        core.create_namespaced_config_map(ns, {"metadata": {"name": "late"}, "data": data})
    else:
        core.create_namespaced_secret(ns, {"metadata": {"name": "late"}, "stringData": data})
    done = wait_phase(core, ns, "waits", ("Succeeded", "Failed"))
    assert done.status.phase == "Succeeded"
    assert process_nodes.log_path(ns, "waits", "main").read_text() == "s3cr3t\n"


def test_missing_secret_volume_is_a_failed_mount_until_created(
    core: Any, ns: str, process_nodes: ProcessNodes, tmp_path: Path
) -> None:
    """As kubelet: the pod stays ContainerCreating, a FailedMount Event says why; mounts once the Secret exists."""
    creds = str(tmp_path / "creds")
    pod = pod_manifest(
        "mounts",
        [container("main", ["cat", f"{creds}/password"], volumeMounts=[{"name": "creds", "mountPath": creds}])],
        volumes=[
            {"name": "creds", "secret": {"secretName": "late-creds"}},
            {"name": "maybe", "secret": {"secretName": "never", "optional": True}},
        ],
    )
    create_pod(core, ns, pod)

    (event,) = wait_for(lambda: pod_events(core, ns, "mounts", "FailedMount"), "kubelet's FailedMount event")
    assert event.message == 'MountVolume.SetUp failed for volume "creds" : secret "late-creds" not found'
    assert (event.type, event.source.component) == ("Warning", "kubelet")
    pending = core.read_namespaced_pod("mounts", ns)
    assert pending.status.phase == "Pending"
    assert pending.status.container_statuses[0].state.waiting.reason == "ContainerCreating"
    core.create_namespaced_secret(ns, {"metadata": {"name": "late-creds"}, "stringData": {"password": "s3cr3t"}})
    done = wait_phase(core, ns, "mounts", ("Succeeded", "Failed"))
    assert done.status.phase == "Succeeded"
    assert process_nodes.log_path(ns, "mounts", "main").read_text() == "s3cr3t"


def test_on_failure_restarts_the_container_and_keeps_its_emptydir(core: Any, ns: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    # Fails on its first run, succeeds on the second: the run count lives in the emptyDir.
    count = 'n=$(cat "$DIR/runs" 2>/dev/null || echo 0); echo $((n+1)) > "$DIR/runs"; [ "$n" -ge 1 ]'
    pod = pod_manifest(
        "flaky",
        [
            container(
                "main",
                ["sh", "-c", count],
                env=[{"name": "DIR", "value": str(work)}],
                volumeMounts=[{"name": "work", "mountPath": str(work)}],
            )
        ],
        restartPolicy="OnFailure",
        volumes=[{"name": "work", "emptyDir": {}}],
    )
    create_pod(core, ns, pod)

    done = wait_phase(core, ns, "flaky", ("Succeeded", "Failed"))

    assert done.status.phase == "Succeeded"
    (status,) = done.status.container_statuses
    assert status.restart_count == 1
    assert status.last_state.terminated.exit_code == 1
    assert status.state.terminated.exit_code == 0


def test_agent_killed_outright_takes_its_pod_processes_along(core: Any, ns: str, kube: Any, tmp_path: Path) -> None:
    """No orphans even when the agent gets SIGKILL and cannot clean up."""
    agent = ProcessNodes.start(
        kube.kubeconfig, tmp_path / "agent", count=1, extra_args=["--taint", "--name-prefix", "lone"]
    )
    try:
        (node,) = agent.node_names()
        marker = f"{ns}-sleeper"
        sleeper = container("main", ["sleep", "600"], env=[{"name": "PROBE", "value": marker}])
        create_pod(core, ns, pod_manifest("sleeper", [sleeper], nodeName=node))
        pid = int(wait_for(lambda: host_pid(marker), "the sleeper's process"))
        assert process_alive(pid)
        assert agent.proc is not None
        agent.proc.kill()
        agent.proc.wait()
        wait_for(lambda: not process_alive(pid), "the pod's process to die with its agent")
    finally:
        agent.stop()
    assert node_gone(core, node)  # stop() removed the Node the dead agent left behind


# --- PID namespaces ------------------------------------------------------------------------------

# Waits until the other container is up, then prints what this one sees of the pod's processes.
PROCESS_VIEW = textwrap.dedent(
    """
    import json, os, sys, time
    for _ in range(600):
        if os.path.exists(sys.argv[1]):
            break
        time.sleep(0.1)
    seen = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                seen[entry] = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
            except OSError:
                pass
    print(json.dumps({"pid": os.getpid(), "processes": seen}))
    """
)


def process_view(core: Any, ns: str, process_nodes: ProcessNodes, tmp_path: Path, share: bool) -> dict[str, Any]:
    """Run a pod whose "viewer" lists /proc while its "other" container sleeps; what the viewer saw."""
    shared = str(tmp_path / "in-pod")
    mount = [{"name": "shared", "mountPath": shared}]
    other = 'touch "$DIR/other-up"; exec python -c "import time; time.sleep(600)" other-container-marker'
    env = [{"name": "DIR", "value": shared}]
    spec: dict[str, Any] = {"volumes": [{"name": "shared", "emptyDir": {}}]}
    if share:
        spec["shareProcessNamespace"] = True
    pod = pod_manifest(
        "pids",
        [
            container("viewer", ["python", "-c", PROCESS_VIEW, f"{shared}/other-up"], env=env, volumeMounts=mount),
            container("other", ["sh", "-c", other], env=env, volumeMounts=mount),
        ],
        **spec,
    )
    create_pod(core, ns, pod)
    wait_for(lambda: terminated_or_none(core, ns, "pids", "viewer"), "the viewer to finish")
    assert terminated(core.read_namespaced_pod("pids", ns), "viewer").exit_code == 0
    view: dict[str, Any] = json.loads(process_nodes.log_path(ns, "pids", "viewer").read_text().splitlines()[-1])
    return view


def terminated_or_none(core: Any, namespace: str, name: str, container_name: str) -> Any:
    pod = core.read_namespaced_pod(name, namespace)
    for status in pod.status.container_statuses or []:
        if status.name == container_name and status.state.terminated is not None:
            return status.state.terminated
    return None


def test_containers_of_a_pod_see_only_their_own_processes(
    core: Any, ns: str, process_nodes: ProcessNodes, tmp_path: Path
) -> None:
    """Without shareProcessNamespace each container has its own PID namespace, its command PID 1."""
    view = process_view(core, ns, process_nodes, tmp_path, share=False)
    assert view["pid"] == 1
    commands = list(view["processes"].values())
    assert not any("other-container-marker" in c for c in commands), commands
    assert set(view["processes"]) == {"1"}, commands  # nothing but itself: no host process, no shim


def test_shared_process_namespace_shows_the_other_containers(
    core: Any, ns: str, process_nodes: ProcessNodes, tmp_path: Path
) -> None:
    """With shareProcessNamespace the pod's containers see each other; PID 1 is the pod's sandbox."""
    view = process_view(core, ns, process_nodes, tmp_path, share=True)
    assert view["pid"] != 1
    commands = list(view["processes"].values())
    assert any("other-container-marker" in c for c in commands), commands
    assert "1" in view["processes"] and "other-container-marker" not in view["processes"]["1"]
    assert not any("container_init" in c for c in commands), "the shims stay outside the pod's namespace"


# --- kubectl logs --------------------------------------------------------------------------------

TALKER = """
for i in 1 2 3 4 5; do echo "line $i"; done
echo "to stderr" >&2
until [ -f "$GO" ]; do sleep 0.1; done
echo "after go"
"""
# Fails on its first run and stays up on its second: two runs for --previous.
RESTARTER = """
n=$(cat "$DIR/runs" 2>/dev/null || echo 0); n=$((n+1)); echo "$n" > "$DIR/runs"
echo "run $n"
[ "$n" -ge 2 ] && exec sleep 600
exit 1
"""


def test_a_pod_made_again_under_its_name_has_logs_of_its_own(
    core: Any, ns: str, kube: Any, process_nodes: ProcessNodes
) -> None:
    """As kubelet keeps logs per pod UID (``/var/log/pods/<ns>_<name>_<uid>``): the second pod of a name
    (a job made again) does not show the first one's output, neither in its file nor by kubectl logs."""
    for word in ("first", "second"):
        create_pod(core, ns, pod_manifest("again", [container("main", ["sh", "-c", f"echo {word}"])]))
        assert wait_phase(core, ns, "again", ("Succeeded", "Failed")).status.phase == "Succeeded"
        assert process_nodes.log_path(ns, "again", "main").read_text() == f"{word}\n"
        out = kubectl(kube, "logs", "-n", ns, "again", "-c", "main")
        assert (out.returncode, out.stdout) == (0, f"{word}\n"), out.stderr
        core.delete_namespaced_pod("again", ns, grace_period_seconds=0)
        wait_for(lambda: pod_gone(core, ns, "again"), "the pod gone")


def kubectl(kube: Any, *args: str, timeout: float = WAIT) -> subprocess.CompletedProcess[str]:
    argv = [str(kube.bin_dir / "kubectl"), "--kubeconfig", str(kube.kubeconfig), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def test_kubectl_logs_through_the_apiserver(
    core: Any, ns: str, kube: Any, process_nodes: ProcessNodes, tmp_path: Path
) -> None:
    """kubectl logs (tail, limit, previous, follow) reaches the node's log endpoint through the apiserver."""
    go = tmp_path / "go"  # a hostPath file the test creates: the talker's cue to finish
    pod = pod_manifest(
        "talker",
        [
            container("main", ["sh", "-c", TALKER], env=[{"name": "GO", "value": str(go)}]),
            container(
                "restarter",
                ["sh", "-c", RESTARTER],
                env=[{"name": "DIR", "value": "/state"}],
                volumeMounts=[{"name": "state", "mountPath": "/state"}],
            ),
        ],
        restartPolicy="OnFailure",
        volumes=[{"name": "state", "emptyDir": {}}],
    )
    create_pod(core, ns, pod)

    def logs(*args: str) -> str:
        out = kubectl(kube, "logs", "-n", ns, "talker", *args)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def logs_once_started(*args: str) -> str:  # "waiting to start" is kubelet's answer until then
        out = kubectl(kube, "logs", "-n", ns, "talker", *args)
        return out.stdout if out.returncode == 0 else ""

    wait_for(lambda: "to stderr" in logs_once_started("-c", "main"), "the talker's output in kubectl logs")
    assert logs("-c", "main") == "".join(f"line {i}\n" for i in range(1, 6)) + "to stderr\n"
    assert logs("-c", "main", "--tail=2") == "line 5\nto stderr\n"
    assert logs("-c", "main", "--limit-bytes=6") == "line 1"
    wait_for(lambda: logs_once_started("-c", "restarter") == "run 2\n", "the restarter's second run")
    assert logs("-c", "restarter", "--previous") == "run 1\n"

    follow = subprocess.Popen(
        [
            str(kube.bin_dir / "kubectl"),
            "--kubeconfig",
            str(kube.kubeconfig),
            "logs",
            "-f",
            "-n",
            ns,
            "talker",
            "-c",
            "main",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert follow.stdout is not None
        assert follow.stdout.readline() == "line 1\n"  # streaming while the container runs
        go.touch()
        rest = follow.stdout.read()  # to the end of the stream: it ends with the container
        assert follow.wait(timeout=WAIT) == 0
    finally:
        follow.kill()
        follow.wait()
    assert rest == "".join(f"line {i}\n" for i in range(2, 6)) + "to stderr\nafter go\n"


def test_kubelet_endpoint_serves_only_the_apiserver(core: Any, kube: Any, process_nodes: ProcessNodes) -> None:
    """The node's log endpoint is on 127.0.0.1 and wants the apiserver's client certificate."""
    import socket
    import ssl

    if getattr(kube, "kubelet_client_ca", None) is None:
        pytest.skip("a cluster the tests did not start: its apiserver's kubelet client CA is unknown")
    node = core.read_node(process_nodes.node_names()[0])
    assert [a.address for a in node.status.addresses if a.type == "InternalIP"] == ["127.0.0.1"]
    port = node.status.daemon_endpoints.kubelet_endpoint.port
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE

    def answer() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as raw, ctx.wrap_socket(raw) as tls:
            tls.sendall(b"GET /containerLogs/default/any/any HTTP/1.0\r\n\r\n")
            return tls.recv(64)

    try:
        got = answer()
    except (ssl.SSLError, ConnectionError):
        got = b""  # refused in the handshake (TLS 1.2) or right after it (TLS 1.3)
    assert not got.startswith(b"HTTP"), got


# --- termination messages and mounts ------------------------------------------------------------

# The runtime's /dev, and what the process node may add to it (GPUs on a GPU machine).
DEV_ALLOWED = {
    "null",
    "zero",
    "full",
    "random",
    "urandom",
    "tty",
    "ptmx",
    "pts",
    "mqueue",
    "shm",
    "fd",
    "stdin",
    "stdout",
    "stderr",
    "termination-log",
}

# Waits until "other" (same pod) has written its own termination log, then checks that
# this container's log is still empty (private to it) and that /dev is private and works.
DEV_PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    shared = sys.argv[1]
    for _ in range(600):
        if os.path.exists(f"{shared}/other-wrote"):
            break
        time.sleep(0.1)
    with open("/dev/shm/probe", "wb") as f:
        f.write(b"shm")
    with open("/dev/null", "wb") as f:
        f.write(b"discarded")
    checks = {
        "private_log": open("/dev/termination-log").read() == "",
        "zero": open("/dev/zero", "rb").read(4) == bytes(4),
        "urandom": len(open("/dev/urandom", "rb").read(8)) == 8,
        "shm": open("/dev/shm/probe", "rb").read() == b"shm",
        "fd": os.readlink("/dev/fd") == "/proc/self/fd" and os.path.exists("/dev/stdout"),
        "pts": os.path.isdir("/dev/pts"),
    }
    print(json.dumps({"checks": checks, "dev": sorted(os.listdir("/dev"))}))
    with open("/dev/termination-log", "r+") as f:  # never creates it: no stray file in the host's /dev
        f.write(json.dumps({"preempted": True, "step": 7}))
    """
)


def mount_points(pid: int) -> set[str]:
    """Mount points of a process's mount namespace (field 5 of mountinfo)."""
    return {line.split()[4] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()}


def test_termination_messages_like_kubelet(core: Any, ns: str, process_nodes: ProcessNodes, tmp_path: Path) -> None:
    host_log = Path("/dev/termination-log")
    host_log_existed = host_log.exists()
    assert process_nodes.proc is not None
    mounts_before = mount_points(process_nodes.proc.pid)
    shared = tmp_path / "shared"
    custom = tmp_path / "elsewhere" / "message"  # a path not under /dev
    mount = [{"name": "shared", "mountPath": str(shared)}]
    fallback = {"terminationMessagePolicy": "FallbackToLogsOnError"}
    tlog = "/dev/termination-log"
    guard = f"[ -f {tlog} ] &&"  # the writers never create it (as spotguard's sidecar): no stray host file
    hundred_lines = "i=1; while [ $i -le 100 ]; do echo line $i; i=$((i+1)); done"
    pod = pod_manifest(
        "messages",
        [
            container("report", ["python", "-c", DEV_PROBE, str(shared)], volumeMounts=mount),
            container(
                "other",
                ["sh", "-c", f'{guard} printf other > {tlog} && touch "$0/other-wrote"', str(shared)],
                volumeMounts=mount,
            ),
            container("custom", ["sh", "-c", f"printf 'custom path' > {custom}"], terminationMessagePath=str(custom)),
            container("big", ["python", "-c", "open('/dev/termination-log', 'r+').write('a' * 100 + 'b' * 4096)"]),
            container("fallback", ["sh", "-c", f"{hundred_lines}; exit 3"], **fallback),
            container("fallback-ok", ["sh", "-c", "echo fine"], **fallback),
            container(
                "file-wins", ["sh", "-c", f"echo noise; {guard} printf 'from file' > {tlog}; exit 4"], **fallback
            ),
            container("plain-error", ["sh", "-c", "echo not a message; exit 5"]),
        ],
        volumes=[{"name": "shared", "emptyDir": {}}],
    )
    create_pod(core, ns, pod)

    done = wait_phase(core, ns, "messages", ("Succeeded", "Failed"))

    probe = process_nodes.log_path(ns, "messages", "report").read_text()
    seen = json.loads(probe)
    assert all(seen["checks"].values()), seen
    assert {d for d in seen["dev"] if not d.startswith("nvidia")} <= DEV_ALLOWED, seen["dev"]
    messages = {s.name: s.state.terminated.message for s in done.status.container_statuses}
    assert json.loads(messages["report"]) == {"preempted": True, "step": 7}
    assert messages["other"] == "other"
    assert messages["custom"] == "custom path"
    assert not custom.exists() or custom.read_text() == "", "written to the host file, not to the bound one"
    assert messages["big"] == "b" * 4096  # the last 4096 bytes
    assert messages["fallback"] == "".join(f"line {i}\n" for i in range(21, 101))  # the last 80 lines
    assert messages["fallback-ok"] is None  # exit 0: no fallback to the logs
    assert messages["file-wins"] == "from file"
    assert messages["plain-error"] is None  # policy File: the log is not used
    assert terminated(done, "fallback").exit_code == 3
    # Nothing of it on the host: no /dev/termination-log, no mounts, no message files left over.
    assert host_log.exists() == host_log_existed
    leaked = {
        m
        for m in mount_points(process_nodes.proc.pid) - mounts_before
        if m.startswith(("/dev", "/tmp", "/run", str(process_nodes.state_dir)))
    }
    assert not leaked
    assert not list(process_nodes.log_path(ns, "messages", "report").parent.glob("*termination*"))


def test_termination_message_of_each_run_on_restarts(core: Any, ns: str, tmp_path: Path) -> None:
    """Every run gets a fresh message file, and the log fallback sees only that run's output."""
    work = tmp_path / "work"
    script = textwrap.dedent(
        """
        n=$(cat "$DIR/runs" 2>/dev/null || echo 0); n=$((n+1)); echo $n > "$DIR/runs"
        case $n in
          1) echo "run 1 output"; [ -f /dev/termination-log ] && printf first > /dev/termination-log; exit 1;;
          2) echo "run 2 output"; exit 2;;
          *) [ -f /dev/termination-log ] && printf third > /dev/termination-log;;
        esac
        """
    )
    pod = pod_manifest(
        "reruns",
        [
            container(
                "main",
                ["sh", "-c", script],
                env=[{"name": "DIR", "value": str(work)}],
                volumeMounts=[{"name": "work", "mountPath": str(work)}],
                terminationMessagePolicy="FallbackToLogsOnError",
            )
        ],
        restartPolicy="OnFailure",
        volumes=[{"name": "work", "emptyDir": {}}],
    )
    create_pod(core, ns, pod)

    done = wait_phase(core, ns, "reruns", ("Succeeded", "Failed"))

    (status,) = done.status.container_statuses
    assert status.restart_count == 2
    assert (status.state.terminated.exit_code, status.state.terminated.message) == (0, "third")
    assert (status.last_state.terminated.exit_code, status.last_state.terminated.message) == (2, "run 2 output\n")


def test_emptydir_at_tmp_hides_no_other_volume_source(core: Any, ns: str, process_nodes: ProcessNodes) -> None:
    """Volume sources live under the state dir in /tmp: an emptyDir at /tmp must not hide them."""
    core.create_namespaced_secret(ns, {"metadata": {"name": "creds"}, "stringData": {"password": "s3cr3t"}})
    marker = f"written-{uuid.uuid4().hex[:8]}"
    script = textwrap.dedent(
        """
        import json, os, ssl, sys, urllib.request
        sa = "/var/run/secrets/kubernetes.io/serviceaccount"
        ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
        url = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}/api"
        token = open(f"{sa}/token").read()
        request = urllib.request.Request(url, headers={"Authorization": "Bearer " + token})
        with urllib.request.urlopen(request, context=ctx, timeout=30) as resp:
            api_status = resp.status
        open(f"/tmp/{sys.argv[1]}", "w").write("into the emptyDir")
        print(json.dumps({"password": open("/tmp/creds/password").read(), "api_status": api_status,
                          "tmp": sorted(os.listdir("/tmp"))}))
        """
    )
    pod = pod_manifest(
        "hidden",
        [
            container(
                "main",
                ["python", "-c", script, marker],
                volumeMounts=[{"name": "scratch", "mountPath": "/tmp"}, {"name": "creds", "mountPath": "/tmp/creds"}],
            )
        ],
        volumes=[{"name": "scratch", "emptyDir": {}}, {"name": "creds", "secret": {"secretName": "creds"}}],
    )
    create_pod(core, ns, pod)

    done = wait_phase(core, ns, "hidden", ("Succeeded", "Failed"))

    log = process_nodes.log_path(ns, "hidden", "main").read_text()
    assert done.status.phase == "Succeeded", f"{log}\n{done.status.container_statuses[0].state}"
    seen = json.loads(log)
    assert seen["password"] == "s3cr3t"
    assert seen["api_status"] == 200  # the ServiceAccount token (a volume source under /tmp) authenticates
    # /tmp is the emptyDir, with the secret inside it (and the mount point of the process node's image, the
    # checkout and its environment, where they lie under /tmp: testenv.processnode.pod.shadowed_image_paths).
    image = {Path(p).relative_to("/tmp").parts[0] for p in IMAGE_PATHS if Path(p).is_relative_to("/tmp")}
    assert seen["tmp"] == sorted({"creds", marker} | image)
    assert not Path("/tmp", marker).exists()


def test_a_containers_temporary_files_are_its_own_and_go_with_its_pod(
    core: Any, ns: str, process_nodes: ProcessNodes
) -> None:
    """As in a container's own /tmp under kubelet: not the host's /tmp, not another container's, gone with the pod."""
    script = "import json, tempfile; print(json.dumps(tempfile.mkdtemp(prefix='mine-')))"
    pod = pod_manifest(
        "temps",
        [container("a", ["python", "-c", script]), container("b", ["python", "-c", script])],
    )
    create_pod(core, ns, pod)
    done = wait_phase(core, ns, "temps", ("Succeeded", "Failed"))
    made = {}
    for name in ("a", "b"):
        log = process_nodes.log_path(ns, "temps", name).read_text()
        assert done.status.phase == "Succeeded", log
        made[name] = Path(json.loads(log.strip().splitlines()[-1]))
        assert made[name].is_dir() and made[name].parent != Path("/tmp"), made[name]
    assert made["a"].parent != made["b"].parent
    core.delete_namespaced_pod("temps", ns)
    wait_for(lambda: not any(p.exists() for p in made.values()), "the pod's temporary files to go with it")


def test_command_that_cannot_start_is_a_start_error(core: Any, ns: str) -> None:
    create_pod(core, ns, pod_manifest("nostart", [container("main", ["no-such-command-here"])]))

    done = wait_phase(core, ns, "nostart", ("Succeeded", "Failed"))

    term = terminated(done, "main")
    assert (done.status.phase, term.exit_code, term.reason) == ("Failed", 128, "StartError")
    assert 'exec: "no-such-command-here": executable file not found in $PATH' in term.message


def numbered(first: int, end: int) -> bytes:
    return b"".join(b"%d\n" % i for i in range(first, end))


@pytest.mark.parametrize(
    ("log", "expected"),
    [
        (b"", b""),
        (b"one\ntwo\n", b"one\ntwo\n"),
        (b"no newline at the end", b"no newline at the end"),
        (numbered(0, 100), numbered(20, 100)),
        (numbered(0, 100) + b"partial", numbered(21, 100) + b"partial"),
        (b"\n" * 100, b"\n" * 80),
        (b"x" * 5000 + b"\nend\n", (b"x" * 5000 + b"\nend\n")[-2048:]),  # few lines, but long: the last 2048 bytes
    ],
)
def test_log_tail_is_the_last_80_lines_then_the_last_2048_bytes(log: bytes, expected: bytes) -> None:
    assert log_tail(log) == expected


# --- spot deaths -------------------------------------------------------------------------------

SIGNAL_PROBE = textwrap.dedent(
    """
    import os, signal, sys, time
    out, name, stubborn = sys.argv[1], sys.argv[2], sys.argv[3] == "stubborn"
    termed = False

    def mark(suffix, text):
        tmp = os.path.join(out, f".{name}.{suffix}")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out, f"{name}.{suffix}"))

    def on_term(signum, frame):
        global termed
        mark("term", "SIGTERM")
        termed = True
        if not stubborn:
            sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    mark("pid", str(os.getpid()))
    while True:
        if termed:
            mark("survived", "still running after SIGTERM")
        time.sleep(0.1)
    """
)


@pytest.mark.parametrize("mode", ["drain", "shutdown", "kill"])
def test_spot_death(core: Any, ns: str, process_nodes: ProcessNodes, tmp_path: Path, mode: str) -> None:
    """Each way a spot node dies: what the processes receive and what the API shows afterwards."""
    signals = tmp_path / "signals"  # a hostPath: the test reads what the pod's processes wrote
    inside = str(tmp_path / "in-pod")
    mount = [{"name": "signals", "mountPath": inside}]

    def probe(name: str, command: list[str]) -> dict[str, Any]:
        return container(name, command, volumeMounts=mount, env=[{"name": "PROBE", "value": f"{ns}-{name}"}])

    pod = pod_manifest(
        "victim",
        [
            probe("graceful", ["python", "-c", SIGNAL_PROBE, inside, "graceful", "graceful"]),
            probe("stubborn", ["python", "-c", SIGNAL_PROBE, inside, "stubborn", "stubborn"]),
            # PID 1 of its container with no SIGTERM handler: ignores SIGTERM, as in a real container.
            probe("plain", ["sleep", "600"]),
        ],
        volumes=[{"name": "signals", "hostPath": {"path": str(signals), "type": "DirectoryOrCreate"}}],
    )
    create_pod(core, ns, pod)
    wait_for(lambda: (signals / "graceful.pid").exists() and (signals / "stubborn.pid").exists(), "both probes up")
    pids = {
        name: int(wait_for(lambda n=name: host_pid(f"{ns}-{n}"), name)) for name in ("graceful", "stubborn", "plain")
    }
    node = core.read_namespaced_pod("victim", ns).spec.node_name
    nodes_before = process_nodes.node_names()

    if mode == "drain":  # through the CLI, as a person or script would
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "testenv.processnode",
                "preempt",
                "--state-dir",
                str(process_nodes.state_dir),
                "--pod",
                "victim",
                "--namespace",
                ns,
                "--mode",
                "drain",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
    else:
        result = process_nodes.preempt("victim", ns, mode)

    assert result["node"] == node and f"{ns}/victim" in result["pods"]
    assert not any(process_alive(pid) for pid in pids.values())
    if mode == "kill":
        assert not list(signals.glob("*.term")), "kill is abrupt: no SIGTERM"
        assert node_gone(core, node)
        names = process_nodes.node_names()
        assert node not in names and result["replacement"] in names and len(names) == len(nodes_before)
        assert _ready(core.read_node(result["replacement"]))
        return
    # Both got SIGTERM; the stubborn one kept running and was SIGKILLed after the grace period.
    assert (signals / "graceful.term").read_text() == "SIGTERM"
    assert (signals / "stubborn.term").read_text() == "SIGTERM"
    assert (signals / "stubborn.survived").exists() and not (signals / "graceful.survived").exists()
    fresh = core.read_node(node)
    assert not fresh.spec.unschedulable and _ready(fresh), "the node comes back empty and schedulable"
    if mode == "drain":
        assert pod_gone(core, ns, "victim")  # graceful deletion finished with a grace-0 delete
        return
    done = core.read_namespaced_pod("victim", ns)
    assert (done.status.phase, done.status.reason, done.status.message) == ("Failed", "Terminated", SHUTDOWN_MESSAGE)
    conditions = {c.type: c for c in done.status.conditions}
    target = conditions["DisruptionTarget"]
    assert (target.status, target.reason) == ("True", "TerminationByKubelet")
    assert terminated(done, "graceful").exit_code == 0
    assert terminated(done, "stubborn").exit_code == 137  # 128 + SIGKILL
    assert terminated(done, "plain").exit_code == 137  # PID 1 ignored SIGTERM: killed after the grace period


def node_gone(core: Any, name: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        core.read_node(name)
    except ApiException as exc:
        return exc.status == 404
    return False


def _ready(node: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions)


def test_preempt_cli_reports_an_unknown_pod_in_one_line(process_nodes: ProcessNodes) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "testenv.processnode",
            "preempt",
            "--state-dir",
            str(process_nodes.state_dir),
            "--pod",
            "no-such-pod",
            "--namespace",
            "default",
            "--mode",
            "kill",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert out.stderr.strip() == "processnode: pod default/no-such-pod not found"
