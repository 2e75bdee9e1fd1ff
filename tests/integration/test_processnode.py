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
                env=env, volumeMounts=mount, resources={"limits": {"nvidia.com/gpu": "1"}},
            ),
            container("reader", ["sh", "-c", reader], env=env, volumeMounts=mount),
        ],
        initContainers=[container("init", ["sh", "-c", 'echo ready > "$DIR/from-init"'], env=env, volumeMounts=mount)],
        volumes=[{"name": "shared", "emptyDir": {}}],
    )  # fmt: skip
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
    assert done.status.pod_ip == "127.0.0.1"
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
        [container("main", ["python", "-c", script], args=[str(creds)], env=env,
                   envFrom=[{"configMapRef": {"name": "settings"}}],
                   volumeMounts=[{"name": "creds", "mountPath": str(creds)}])],
        volumes=[{"name": "creds",
                  "secret": {"secretName": "creds", "items": [{"key": "file.txt", "path": "renamed.txt"}]}}],
    )  # fmt: skip
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
        "POD_IP": "127.0.0.1",
        "APP": "processnode-test",
        "GREETING": "hi-config",
    }
    assert seen["files"] == ["renamed.txt"]  # items honoured: only the listed key, under its path
    assert seen["renamed"] == "from-secret"
    assert seen["sa_namespace"] == ns
    assert seen["api_status"] == 200  # the ServiceAccount token authenticates against the real apiserver


def test_on_failure_restarts_the_container_and_keeps_its_emptydir(core: Any, ns: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    # Fails on its first run, succeeds on the second: the run count lives in the emptyDir.
    count = 'n=$(cat "$DIR/runs" 2>/dev/null || echo 0); echo $((n+1)) > "$DIR/runs"; [ "$n" -ge 1 ]'
    pod = pod_manifest(
        "flaky",
        [container("main", ["sh", "-c", count], env=[{"name": "DIR", "value": str(work)}],
                   volumeMounts=[{"name": "work", "mountPath": str(work)}])],
        restartPolicy="OnFailure",
        volumes=[{"name": "work", "emptyDir": {}}],
    )  # fmt: skip
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
        pidfile = tmp_path / "sleeper.pid"
        write_pid = "import os, time; p = os.environ['OUT']; open(p + '.tmp', 'w').write(str(os.getpid()))"
        sleep = f"{write_pid}; os.replace(p + '.tmp', p); time.sleep(600)"
        sleeper = container("main", ["python", "-c", sleep], env=[{"name": "OUT", "value": str(pidfile)}])
        create_pod(core, ns, pod_manifest("sleeper", [sleeper], nodeName=node))
        pid = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), "the sleeper's pid"))
        assert process_alive(pid)
        assert agent.proc is not None
        agent.proc.kill()
        agent.proc.wait()
        wait_for(lambda: not process_alive(pid), "the pod's process to die with its agent")
    finally:
        agent.stop()
    assert node_gone(core, node)  # stop() removed the Node the dead agent left behind


# --- termination messages and mounts ------------------------------------------------------------

# The runtime's /dev, and what the process node may add to it (GPUs on a GPU machine).
DEV_ALLOWED = {"null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "mqueue", "shm",
               "fd", "stdin", "stdout", "stderr", "termination-log"}  # fmt: skip

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
            container("other", ["sh", "-c", f'{guard} printf other > {tlog} && touch "$0/other-wrote"',
                                str(shared)], volumeMounts=mount),
            container("custom", ["sh", "-c", f"printf 'custom path' > {custom}"], terminationMessagePath=str(custom)),
            container("big", ["python", "-c", "open('/dev/termination-log', 'r+').write('a' * 100 + 'b' * 4096)"]),
            container("fallback", ["sh", "-c", f"{hundred_lines}; exit 3"], **fallback),
            container("fallback-ok", ["sh", "-c", "echo fine"], **fallback),
            container("file-wins", ["sh", "-c", f"echo noise; {guard} printf 'from file' > {tlog}; exit 4"],
                      **fallback),
            container("plain-error", ["sh", "-c", "echo not a message; exit 5"]),
        ],
        volumes=[{"name": "shared", "emptyDir": {}}],
    )  # fmt: skip
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
    leaked = {m for m in mount_points(process_nodes.proc.pid) - mounts_before
              if m.startswith(("/dev", "/tmp", "/run", str(process_nodes.state_dir)))}  # fmt: skip
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
        [container("main", ["sh", "-c", script], env=[{"name": "DIR", "value": str(work)}],
                   volumeMounts=[{"name": "work", "mountPath": str(work)}],
                   terminationMessagePolicy="FallbackToLogsOnError")],
        restartPolicy="OnFailure",
        volumes=[{"name": "work", "emptyDir": {}}],
    )  # fmt: skip
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
        [container("main", ["python", "-c", script, marker],
                   volumeMounts=[{"name": "scratch", "mountPath": "/tmp"},
                                 {"name": "creds", "mountPath": "/tmp/creds"}])],
        volumes=[{"name": "scratch", "emptyDir": {}}, {"name": "creds", "secret": {"secretName": "creds"}}],
    )  # fmt: skip
    create_pod(core, ns, pod)

    done = wait_phase(core, ns, "hidden", ("Succeeded", "Failed"))

    log = process_nodes.log_path(ns, "hidden", "main").read_text()
    assert done.status.phase == "Succeeded", f"{log}\n{done.status.container_statuses[0].state}"
    seen = json.loads(log)
    assert seen["password"] == "s3cr3t"
    assert seen["api_status"] == 200  # the ServiceAccount token (a volume source under /tmp) authenticates
    assert seen["tmp"] == ["creds", marker]  # /tmp is the emptyDir, with the secret inside it
    assert not Path("/tmp", marker).exists()


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
    pod = pod_manifest(
        "victim",
        [
            container("graceful", ["python", "-c", SIGNAL_PROBE, inside, "graceful", "graceful"], volumeMounts=mount),
            container("stubborn", ["python", "-c", SIGNAL_PROBE, inside, "stubborn", "stubborn"], volumeMounts=mount),
        ],
        volumes=[{"name": "signals", "hostPath": {"path": str(signals), "type": "DirectoryOrCreate"}}],
    )
    create_pod(core, ns, pod)
    wait_for(lambda: (signals / "graceful.pid").exists() and (signals / "stubborn.pid").exists(), "both probes up")
    pids = {name: int((signals / f"{name}.pid").read_text()) for name in ("graceful", "stubborn")}
    node = core.read_namespaced_pod("victim", ns).spec.node_name
    nodes_before = process_nodes.node_names()

    if mode == "drain":  # through the CLI, as a person or script would
        out = subprocess.run(
            [sys.executable, "-m", "testenv.processnode", "preempt", "--state-dir", str(process_nodes.state_dir),
             "--pod", "victim", "--namespace", ns, "--mode", "drain"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
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
        [sys.executable, "-m", "testenv.processnode", "preempt", "--state-dir", str(process_nodes.state_dir),
         "--pod", "no-such-pod", "--namespace", "default", "--mode", "kill"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.strip() == "processnode: pod default/no-such-pod not found"
