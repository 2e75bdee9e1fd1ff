"""The test environment itself: real S3, real apiserver, and no leftovers."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from testenv import cluster, trials

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_s3_multipart_roundtrip_is_byte_identical(s3_store: cluster.S3Store, tmp_path: Path) -> None:
    from boto3.s3.transfer import TransferConfig

    data = os.urandom(6 * 1024 * 1024) * 3 + os.urandom(12345)  # 18 MiB + a tail
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    key = f"roundtrip/{uuid.uuid4().hex}.bin"
    cfg = TransferConfig(multipart_threshold=5 * 1024 * 1024, multipart_chunksize=5 * 1024 * 1024, max_concurrency=4)
    client = s3_store.client()
    client.upload_file(str(src), s3_store.bucket, key, Config=cfg)

    head = client.head_object(Bucket=s3_store.bucket, Key=key)
    assert head["ContentLength"] == len(data)
    assert "-" in head["ETag"], f"expected a multipart ETag, got {head['ETag']}"
    dst = tmp_path / "dst.bin"
    client.download_file(s3_store.bucket, key, str(dst), Config=cfg)
    assert hashlib.sha256(dst.read_bytes()).digest() == hashlib.sha256(data).digest()


def test_s3_conditional_put_refuses_existing_key(s3_store: cluster.S3Store) -> None:
    from botocore.exceptions import ClientError

    client = s3_store.client()
    key = f"cond/{uuid.uuid4().hex}"
    client.put_object(Bucket=s3_store.bucket, Key=key, Body=b"one", IfNoneMatch="*")
    with pytest.raises(ClientError) as err:
        client.put_object(Bucket=s3_store.bucket, Key=key, Body=b"two", IfNoneMatch="*")
    assert err.value.response["Error"]["Code"] == "PreconditionFailed"


def _disk_bytes(path: Path) -> int:
    return sum(os.lstat(Path(d) / f).st_blocks * 512 for d, _, files in os.walk(path) for f in files)


def test_s3_reclaim_gives_deleted_objects_space_back(
    s3_store: cluster.S3Store, testenv_supervisor: cluster.Supervisor
) -> None:
    """The benchmarks store and delete many GiB in a row: the store's disk must
    not keep what was deleted (SeaweedFS only marks it as garbage)."""
    data_dir = testenv_supervisor.state_dir / "seaweedfs"
    client = s3_store.client()
    prefix = f"reclaim/{uuid.uuid4().hex}"
    kept = os.urandom(1024 * 1024)
    client.put_object(Bucket=s3_store.bucket, Key=f"{prefix}/kept", Body=kept)
    before = _disk_bytes(data_dir)
    blob = os.urandom(32 * 1024 * 1024)
    keys = [f"{prefix}/gone-{i}" for i in range(4)]
    for key in keys:
        client.put_object(Bucket=s3_store.bucket, Key=key, Body=blob)
    assert _disk_bytes(data_dir) - before >= 4 * len(blob) * 0.9
    for key in keys:
        client.delete_object(Bucket=s3_store.bucket, Key=key)
    s3_store.reclaim()
    assert _disk_bytes(data_dir) < before + len(blob) // 2, "the deleted objects' bytes are still on the disk"
    assert client.get_object(Bucket=s3_store.bucket, Key=f"{prefix}/kept")["Body"].read() == kept


def test_apiserver_serves_custom_resources(kube: cluster.ControlPlane) -> None:
    """Guards the reflect2 patch: an unpatched 1.20 apiserver dies on the first custom resource."""
    from kubernetes import client

    api = kube.api_client()
    ext = client.ApiextensionsV1Api(api)
    group = f"t{uuid.uuid4().hex[:8]}.example.com"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                }
            ],
        },
    }
    ext.create_custom_resource_definition(crd)
    custom = client.CustomObjectsApi(api)
    body = {"apiVersion": f"{group}/v1", "kind": "Widget", "metadata": {"name": "w1"}, "spec": {"size": 3}}
    deadline = time.monotonic() + 30
    while True:
        try:
            custom.create_namespaced_custom_object(group, "v1", "default", "widgets", body)
            break
        except client.ApiException as exc:  # the CRD takes a moment to be served
            if exc.status != 404 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    got = custom.get_namespaced_custom_object(group, "v1", "default", "widgets", "w1")
    assert got["spec"] == {"size": 3}
    ext.delete_custom_resource_definition(f"widgets.{group}")


INNER_TESTS = textwrap.dedent(
    """
    import os, time
    from pathlib import Path

    OUT = Path(os.environ["INNER_OUT"])

    def test_uses_everything(s3_store, kube, process_nodes):
        OUT.write_text(os.environ["SPOTGUARD_TESTENV_RUN"])
        if os.environ.get("INNER_MODE") == "hang":
            time.sleep(600)
        assert False, "this inner test fails on purpose"
    """
)


@pytest.mark.trials
# Interrupted (SIGTERM mid-test) is the harder way out; a failing session tears down as every session does.
@pytest.mark.parametrize("mode", trials.variants(full=["fail", "interrupt"], quick=["interrupt"]))
def test_no_service_outlives_a_session(mode: str, tmp_path: Path) -> None:
    """A whole pytest session with all fixtures, failing or interrupted, leaves no process behind."""
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(INNER_TESTS)
    out = tmp_path / "run-id"
    env = {k: v for k, v in os.environ.items() if k != cluster.RUN_MARKER}
    env.update(INNER_OUT=str(out), INNER_MODE="hang" if mode == "interrupt" else "fail")
    env.pop("SPOTGUARD_TEST_KUBECONFIG", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(ROOT),
            "-o",
            "addopts=",
            str(test_file),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        if mode == "interrupt":
            deadline = time.monotonic() + 240
            while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            assert out.exists(), "inner session never started its services"
            proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = output.decode(errors="replace")
    assert proc.returncode != 0, text
    assert out.exists(), f"inner test did not run:\n{text}"
    run_id = out.read_text()
    left = cluster.leftover_processes(run_id)
    names = [Path(f"/proc/{p}/comm").read_text().strip() for p in left if Path(f"/proc/{p}/comm").exists()]
    assert not left, f"processes of run {run_id} still alive after the session: {names}\n{text[-2000:]}"


def test_a_stopped_store_leaves_nothing_in_tmp(tmp_path: Path) -> None:
    """SeaweedFS writes its log files and unix sockets into /tmp of its own accord; the test world keeps
    them off the host: its logs go to the store's directory, its sockets are removed once it has stopped."""
    state = tmp_path / "store"
    state.mkdir()
    sup = cluster.Supervisor(state)
    try:
        store = cluster.start_seaweedfs(sup)
        store.client().put_object(Bucket=store.bucket, Key="x", Body=b"x")
        weed = sup.services[-1]
        pid = weed.popen.pid
        sockets = list(weed.leaves)
        assert sockets and all(p.exists() for p in sockets), [p for p in sockets if not p.exists()]
        assert any((state / "logs").glob(f"weed.*.{pid}")), "weed's own log files are not in the store's directory"
    finally:
        sup.stop()
    assert not [p for p in sockets if p.exists()]
    assert not list(Path("/tmp").glob(f"weed.*.{pid}"))  # another test's store may write its own meanwhile


def test_processes_the_tests_start_keep_their_temporary_files_in_the_session(session_tmpdir: Path) -> None:
    """What a started process makes in its temporary directory (torchrun's ``torchelastic_*``
    directories, for one) goes below the session's, which is removed at its end, not into ``/tmp``."""
    made = subprocess.run(
        [sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp(prefix='torchelastic_'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(made).parent == session_tmpdir


def test_a_store_whose_port_was_taken_before_it_bound_it_starts_on_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SeaweedFS binds its ten ports one service after another; one taken meanwhile (here its S3 gRPC
    port, held by this test) makes it exit "address already in use". It starts again on other ports,
    from an empty data directory, and the failed process is gone."""
    import socket

    state = tmp_path / "store"
    state.mkdir()
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real = cluster.free_ports
    calls: list[list[int]] = []

    def ports(n: int) -> list[int]:
        chosen = real(n)
        if not calls and n == 10:
            chosen[7] = int(taken.getsockname()[1])  # the S3 gRPC port ("sg")
        calls.append(chosen)
        return chosen

    monkeypatch.setattr(cluster, "free_ports", ports)
    sup = cluster.Supervisor(state)
    try:
        store = cluster.start_seaweedfs(sup)
        store.client().put_object(Bucket=store.bucket, Key="x", Body=b"x")
        assert len(calls) == 2, calls  # started again, on other ports
        assert [s.name for s in sup.services] == ["weed"]  # the failed one forgotten
        assert "address already in use" in (state / "logs" / "weed.log").read_text(errors="replace")
    finally:
        sup.stop()
        taken.close()
