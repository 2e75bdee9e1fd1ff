"""spotguard's own containers work with a read-only root filesystem, on a real apiserver and process nodes.

The process node honours ``readOnlyRootFilesystem`` as a runtime does: the
container's root is read-only in its own mount namespace, and only its
volumes (and ``/dev``) can be written. A job resumes from a checkpoint in S3
(the restore init container downloads it), trains, and the sidecar uploads
and verifies its checkpoints: everything spotguard's containers write lands
in the volumes the pod declares for them. While the sidecar runs, its mount
table shows the root read-only and every writable path a declared volume.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spotguard.checkpoint import latest_verified, upload_checkpoint
from spotguard.storage import open_storage
from spotguard.trainer import Checkpointer
from testenv.kubetest import Env, fast_preemption, job_body, operator_namespace, trainer_log, wait_for

pytestmark = pytest.mark.integration

SIDECAR = "spotguard-sidecar"
#: Resumes from step 30 (exits 3 otherwise), then saves ten more steps, slowly enough to be looked at.
TRAINER = r"""
import sys, time
import numpy as np
from spotguard.trainer import Checkpointer
ck = Checkpointer.from_env()
restored = ck.restore()
start = restored.step if restored is not None else 0
print("resumed from", start, flush=True)
if start != 30:
    sys.exit(3)
for step in range(start + 1, start + 11):
    time.sleep(0.5)
    ck.save(step, {"model": {"w": np.full(256, step, dtype=np.float32)}}, blocking=True)
ck.close()
print("done", flush=True)
"""
#: Where spotguard's containers may write: their volumes.
DECLARED = ("/var/lib/spotguard", "/var/lib/spotguard-emergency", "/tmp")
#: And what every container has: the kernel's filesystems, and kubelet's hosts file.
KERNEL = ("/dev", "/proc", "/sys", "/etc/hosts")


@pytest.fixture
def env(kube: Any, apis: tuple[Any, Any], crd: None, process_nodes: Any, tmp_path: Path) -> Iterator[Env]:
    (tmp_path / "logs").mkdir()
    with operator_namespace(kube, apis, process_nodes, "rofs", tmp_path / "logs", poll_seconds=1) as e:
        yield e


def storage_of(s3_store: Any, uri: str) -> Any:
    return open_storage(
        uri,
        endpoint_url=s3_store.endpoint_url,
        access_key=s3_store.access_key,
        secret_key=s3_store.secret_key,
        region=s3_store.region,
    )


def container_process(e: Env, pod: str, container: str) -> int | None:
    """The container's process in its own mount namespace (the shim's child), if it runs."""
    pidfile = e.nodes.pod_dir(e.ns, pod) / f"{container}.pid"
    try:
        pid = int(pidfile.read_text().split()[0])
        host_ns = os.readlink("/proc/self/ns/mnt")
        todo = [pid]
        while todo:
            p = todo.pop()
            if os.readlink(f"/proc/{p}/ns/mnt") != host_ns:
                return p
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            todo += [int(c) for c in children]
    except (OSError, ValueError, IndexError):
        return None
    return None


def writable_mounts(pid: int) -> dict[str, bool]:
    """Mount point -> writable, from the process's mount table."""
    out = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        out[fields[4]] = "rw" in fields[5].split(",")
    return out


def test_injected_containers_run_with_a_read_only_root(
    env: Env, s3_store: Any, s3_uri: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    e = env
    job = "rofs"
    e.core.create_namespaced_secret(
        e.ns,
        {
            "metadata": {"name": "s3"},
            "stringData": {
                "AWS_ACCESS_KEY_ID": s3_store.access_key,
                "AWS_SECRET_ACCESS_KEY": s3_store.secret_key,
                "AWS_ENDPOINT_URL": s3_store.endpoint_url,
            },
        },
    )
    store = storage_of(s3_store, f"{s3_uri}/{e.ns}/{job}")
    ck = Checkpointer(tmp_path / "local", async_save=False, handle_signals=False)
    saved = ck.save(30, {"model": {"w": np.full(256, 30, dtype=np.float32)}}, blocking=True)
    ck.close()
    assert saved is not None
    upload_checkpoint(saved, store)

    body = job_body(
        job,
        s3_uri,
        {"name": "trainer", "image": "trainer", "command": ["python", "-c", TRAINER]},
        sidecar={"metricsPort": 0},
        preemption=fast_preemption(0, 0, 10),
    )
    body["spec"]["checkpoint"]["credentialsSecret"] = {"name": "s3"}
    e.create_job(body)

    pid = wait_for(lambda: container_process(e, f"{job}-a1", SIDECAR), "the sidecar to run", timeout=90)
    mounts = writable_mounts(pid)
    assert mounts["/"] is False, mounts
    writable = {m for m, rw in mounts.items() if rw}
    # The host's other filesystems, which the process node does not hide (a runtime shows none of them).
    host = set(writable_mounts(os.getpid())) - {"/"}
    # The test world's own files stay writable on process nodes (see testenv.pytest_nodes): they stand in for
    # what a real pod reaches over the network (a file:// store), never for its root filesystem.
    allowed = (*DECLARED, *KERNEL, str(tmp_path_factory.getbasetemp().resolve()))
    undeclared = {m for m in writable - host if not any(m == d or m.startswith(f"{d}/") for d in allowed)}
    assert not undeclared, f"writable outside the declared volumes: {sorted(undeclared)}"
    assert {"/var/lib/spotguard", "/tmp"} <= writable

    st = e.wait_status(job, "Succeeded", lambda s: s.get("phase") in ("Succeeded", "Failed"), timeout=120)
    assert st["phase"] == "Succeeded", (st, trainer_log(e, f"{job}-a1"))
    assert "resumed from 30" in trainer_log(e, f"{job}-a1")
    info, _ = latest_verified(store, checksums=True)
    assert info is not None and info.step == 40
