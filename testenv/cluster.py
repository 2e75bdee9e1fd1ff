"""Start and stop a real control plane and a real S3 store on 127.0.0.1.

Used by the pytest fixtures (``tests/conftest.py``) and by ``make dev-cluster``.
Every service runs on free loopback ports, in its own process group, with
``PR_SET_PDEATHSIG`` so it dies with whoever started it, and with the
environment marker ``SPOTGUARD_TESTENV_RUN=<run id>`` so that leftovers of a run
can be found afterwards (``leftover_processes``).

    python -m testenv.cluster serve --state-dir .dev [--nodes 2]   # foreground
    python -m testenv.cluster down --state-dir .dev
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testenv import pki
from testenv.processnode.hostservices import HostServices

log = logging.getLogger(__name__)

RUN_MARKER = "SPOTGUARD_TESTENV_RUN"


def cache_dir() -> Path:
    return Path(os.environ.get("SPOTGUARD_CACHE", Path.home() / ".cache" / "spotguard"))


def bin_dir() -> Path:
    return cache_dir() / "testenv" / "bin"


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def venv_bin() -> Path:
    """Directory of the interpreter running us (the project's virtualenv)."""
    return Path(sys.executable).parent


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1: held open together while they are chosen, so the
    kernel cannot hand one out twice (ports chosen one after another, each released at once,
    can repeat: a service then fails to bind its second use)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def wait_until(check: Callable[[], bool], timeout: float, what: str, proc: Service | None = None) -> None:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}; log:\n{proc.log_tail()}")
        try:
            if check():
                return
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
            last = exc
        time.sleep(0.25)
    tail = f"\n{proc.name} log:\n{proc.log_tail()}" if proc else ""
    raise TimeoutError(f"{what} not ready after {timeout:.0f}s (last error: {last}){tail}")


_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    """In the child: own process group, and die when the parent dies."""
    os.setsid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Service:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    #: Seconds to wait after SIGTERM before SIGKILL (None: the supervisor's default).
    stop_timeout: float | None = None
    #: Files the service makes outside the state directory, removed once it has stopped.
    leaves: tuple[Path, ...] = ()

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


@dataclass
class Supervisor:
    """Starts processes and stops them all, by process group, in reverse order.

    :attr:`host_services` lists the services of this test world that pods on
    process nodes may reach (the apiserver, the object store; a test adds its own
    servers): give its directory to the process node agent.
    """

    state_dir: Path
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    services: list[Service] = field(default_factory=list)
    host_services: HostServices = field(init=False)

    def __post_init__(self) -> None:
        self.host_services = HostServices(self.state_dir / "host-services")

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env[RUN_MARKER] = self.run_id
        env["PATH"] = f"{venv_bin()}:{bin_dir()}:{env.get('PATH', '/usr/bin:/bin')}"
        env.update(extra or {})
        return env

    def start(
        self,
        name: str,
        argv: list[str],
        extra_env: dict[str, str] | None = None,
        stop_timeout: float | None = None,
        leaves: tuple[Path, ...] = (),
    ) -> Service:
        log = self.state_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(extra_env),
                preexec_fn=_child_setup,  # noqa: PLW1509 - needed for setsid + pdeathsig
                cwd=self.state_dir,
            )
        svc = Service(name, popen, log, stop_timeout, leaves)
        self.services.append(svc)
        self._write_pids()
        return svc

    def _write_pids(self) -> None:
        pids = {s.name: s.popen.pid for s in self.services}
        (self.state_dir / "pids.json").write_text(json.dumps({"run_id": self.run_id, "pids": pids}))

    def stop(self, timeout: float = 10.0) -> None:
        # One at a time, newest first: a service still has what it depends on while it
        # stops (the process nodes delete their Node objects through the apiserver).
        for svc in reversed(self.services):
            _stop_service(svc, timeout)
        self.services.clear()
        with contextlib.suppress(OSError):
            (self.state_dir / "pids.json").unlink()
        # Anything that escaped its group (a daemonising child) still carries the marker.
        for pid in leftover_processes(self.run_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def discard(self, svc: Service) -> None:
        """Stop one service that failed to start, and forget it (another is started in its place)."""
        _stop_service(svc, 10.0)
        self.services.remove(svc)
        self._write_pids()


def _stop_service(svc: Service, timeout: float) -> None:
    _signal_group(svc.popen.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        svc.popen.wait(timeout if svc.stop_timeout is None else svc.stop_timeout)
    _signal_group(svc.popen.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        svc.popen.wait(5)
    for path in svc.leaves:
        with contextlib.suppress(OSError):
            path.unlink()


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def leftover_processes(run_id: str) -> list[int]:
    """PIDs of live processes whose environment carries this run's marker."""
    needle = f"{RUN_MARKER}={run_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


# --- S3 (SeaweedFS) ---------------------------------------------------------


@dataclass(frozen=True)
class S3Store:
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    bucket: str
    #: The SeaweedFS master's HTTP address: where :meth:`reclaim` asks for deleted objects' space back.
    master_url: str = ""

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
        }

    def reclaim(self, settle: float = 2.0, rounds: int = 3, timeout: float = 300.0) -> None:
        """Give the disk space of deleted objects back now.

        SeaweedFS's filer deletes an object's chunks in the background, and
        the volume server only marks their bytes as garbage; a volume is
        compacted later, once its garbage passes a threshold, on the master's
        schedule. A benchmark that stores and deletes many GiB in a row asks
        for the compaction itself (``/vol/vacuum``), a few times, ``settle``
        seconds apart, so that deletions still queued are compacted too."""
        if not self.master_url:
            return
        url = f"{self.master_url}/vol/vacuum?garbageThreshold=0.0001"
        for _ in range(rounds):
            time.sleep(settle)
            with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback, our own store)
                resp.read()


#: The unix sockets ``weed server`` makes (``/tmp/seaweedfs-<kind>-<port>.sock``), by the port each is named after.
_WEED_SOCKETS = (
    ("master-grpc", "mg"),
    ("volume-grpc", "vg"),
    ("filer", "filer"),
    ("filer-grpc", "fg"),
    ("s3", "s3"),
    ("s3-grpc", "sg"),
)


def start_seaweedfs(sup: Supervisor, bucket: str = "spotguard-test") -> S3Store:
    weed = venv_bin() / "weed"
    if not weed.exists():
        raise FileNotFoundError(f"{weed} not found: run `bash testenv/provision.sh` first")
    access, secret = "spotguard-" + secrets.token_hex(4), secrets.token_hex(16)
    identities = {
        "identities": [
            {
                "name": "admin",
                "credentials": [{"accessKey": access, "secretKey": secret}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    config = sup.state_dir / "s3-identities.json"
    config.write_text(json.dumps(identities))
    config.chmod(0o600)
    data = sup.state_dir / "seaweedfs"
    for attempt in range(1, _WEED_STARTS):
        try:
            return _start_weed(sup, weed, data, config, access, secret, bucket)
        except RuntimeError as exc:
            # Its ten ports are free when chosen, but weed binds them one service after another, and
            # meanwhile the kernel may give one to another process's connection (the ports come from
            # the same range): it then exits "address already in use". It starts again on others.
            if "address already in use" not in str(exc):
                raise
            log.warning("SeaweedFS could not bind a port (attempt %d); starting it on other ports", attempt)
            shutil.rmtree(data, ignore_errors=True)  # the next start reads nothing the failed one left
    return _start_weed(sup, weed, data, config, access, secret, bucket)


#: How many times SeaweedFS is started on fresh ports when one was taken before it bound it.
_WEED_STARTS = 3


def _start_weed(
    sup: Supervisor, weed: Path, data: Path, config: Path, access: str, secret: str, bucket: str
) -> S3Store:
    data.mkdir(parents=True, exist_ok=True)
    names = ("master", "volume", "filer", "s3", "mg", "vg", "fg", "sg", "metrics", "iam")
    p = dict(zip(names, free_ports(len(names)), strict=True))
    svc = sup.start(
        "weed",
        [
            str(weed),
            f"-logdir={sup.state_dir / 'logs'}",  # its own log files, which it would write to /tmp
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=256",
            "-volume.max=0",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['mg']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['vg']}",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['fg']}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['sg']}",
            f"-s3.config={config}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-iam.port={p['iam']}",
            f"-metricsPort={p['metrics']}",
        ],
        # weed takes over 10 s to leave on SIGTERM; its data is throwaway test state.
        stop_timeout=2.0,
        # weed's own services talk over unix sockets it makes in /tmp, whatever its TMPDIR, and leaves there.
        leaves=tuple(Path(f"/tmp/seaweedfs-{kind}-{p[port]}.sock") for kind, port in _WEED_SOCKETS),
    )
    store = S3Store(
        f"http://127.0.0.1:{p['s3']}", access, secret, "us-east-1", bucket, master_url=f"http://127.0.0.1:{p['master']}"
    )

    def bucket_ready() -> bool:
        client = store.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        client.put_object(Bucket=bucket, Key=".ready", Body=b"ok")
        return True

    try:
        wait_until(bucket_ready, 90, "SeaweedFS S3", svc)
    except RuntimeError:
        sup.discard(svc)
        raise
    sup.host_services.add(p["s3"], "object store (SeaweedFS S3)")  # pods reach the store, not its innards
    return store


# --- Prometheus -----------------------------------------------------------------


@dataclass(frozen=True)
class PrometheusServer:
    url: str

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result vector (``[{"metric": {...}, "value": [t, "v"]}, ...]``)."""
        from urllib.parse import urlencode

        with urllib.request.urlopen(f"{self.url}/api/v1/query?{urlencode({'query': expr})}", timeout=10) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return list(body["data"]["result"])

    def rules(self) -> list[dict[str, Any]]:
        """The rule groups with each rule's ``health`` and ``lastError``."""
        with urllib.request.urlopen(f"{self.url}/api/v1/rules", timeout=10) as resp:
            return list(json.loads(resp.read())["data"]["groups"])


def start_prometheus(
    sup: Supervisor,
    scrape: dict[str, list[str]],
    *,
    interval: str = "1s",
    rule_files: list[Path] | None = None,
    pods: dict[str, tuple[str | Path, str, str]] | None = None,
) -> PrometheusServer:
    """Prometheus scraping ``scrape`` (job name -> ["127.0.0.1:port", ...]) with honor_labels,
    so the scraped series keep their own ``namespace``/``job`` labels (as the chart's monitors do).

    ``pods`` (job name -> (kubeconfig, namespace, container port name)) scrapes the
    Pending/Running pods of the namespace at their pod IP and that declared port,
    as a PodMonitor does (pod IPs change with every new pod). Debian's Prometheus
    has no Kubernetes discovery, so a thread of this process lists the pods every
    second into a ``file_sd`` file, for as long as Prometheus runs.
    """
    port = free_port()
    d = sup.state_dir / f"prometheus-{port}"
    d.mkdir(parents=True, exist_ok=True)
    scrape_configs: list[dict[str, Any]] = [
        {"job_name": name, "honor_labels": True, "static_configs": [{"targets": targets}]}
        for name, targets in scrape.items()
    ]
    for name in pods or {}:
        (d / f"{name}.targets.json").write_text("[]")
        scrape_configs.append(
            {
                "job_name": name,
                "honor_labels": True,
                "file_sd_configs": [{"files": [str(d / f"{name}.targets.json")], "refresh_interval": "1s"}],
            }
        )
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(f) for f in rule_files or []],
        "scrape_configs": scrape_configs,
    }
    (d / "prometheus.yml").write_text(json.dumps(config))  # JSON is valid YAML
    url = f"http://127.0.0.1:{port}"
    svc = sup.start(
        f"prometheus-{port}",
        [
            "prometheus",
            f"--config.file={d / 'prometheus.yml'}",
            f"--storage.tsdb.path={d / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
    )
    wait_until(lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200, 60, "prometheus", svc)
    if pods:
        threading.Thread(target=_pod_targets, args=(svc, d, pods), name="prometheus pods", daemon=True).start()
    return PrometheusServer(url)


def _pod_targets(svc: Service, d: Path, pods: dict[str, tuple[str | Path, str, str]]) -> None:
    """Keep the ``file_sd`` files of :func:`start_prometheus` current while its Prometheus runs."""
    from kubernetes import client, config

    apis: dict[str, Any] = {}
    while svc.popen.poll() is None:
        for name, (kubeconfig, namespace, port_name) in pods.items():
            try:
                if str(kubeconfig) not in apis:
                    cfg = client.Configuration()
                    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
                    apis[str(kubeconfig)] = client.CoreV1Api(client.ApiClient(cfg))
                targets = []
                # Plain JSON, not the client's models: this runs every second of an end-to-end module, and
                # building the models of a namespace's pods cost four times the CPU of reading them.
                listed = apis[str(kubeconfig)].list_namespaced_pod(namespace, _preload_content=False)
                for pod in json.loads(listed.data)["items"]:
                    status, spec = pod.get("status", {}), pod["spec"]
                    if status.get("phase") not in ("Pending", "Running") or not status.get("podIP"):
                        continue
                    for c in [*spec.get("initContainers", []), *spec["containers"]]:  # native sidecars too
                        for p in c.get("ports", []):
                            if p.get("name") == port_name:
                                targets.append(f"{status['podIP']}:{p['containerPort']}")
                text = json.dumps([{"targets": sorted(targets)}])
                path = d / f"{name}.targets.json"
                if path.read_text() != text:
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(text)
                    tmp.replace(path)
            except Exception:  # noqa: BLE001, S112 - the apiserver may be restarting; try again
                continue
        time.sleep(1.0)


# --- Kubernetes control plane ------------------------------------------------


@dataclass(frozen=True)
class ControlPlane:
    kubeconfig: Path
    server: str
    token: str
    bin_dir: Path
    # The cluster CA: of the apiserver's client certificate for kubelets (process nodes serve logs only to
    # it) and of the client certificates the apiserver trusts (a real node's kubelet's); its key beside it.
    kubelet_client_ca: Path | None = None
    # The apiserver's audit log (JSON lines, see AUDIT_POLICY); None for a cluster the tests did not start.
    audit_log: Path | None = None

    def api_client(self) -> Any:
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=cfg)
        return client.ApiClient(cfg)

    def env(self) -> dict[str, str]:
        return {"KUBECONFIG": str(self.kubeconfig)}


def write_kubeconfig(path: Path, server: str, token: str, ca_file: Path) -> None:
    # The apiserver's self-generated serving certificate (with its CA) lists 127.0.0.1.
    ca = base64.b64encode(ca_file.read_bytes()).decode()
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "spotguard-dev", "cluster": {"server": server, "certificate-authority-data": ca}}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [
            {"name": "spotguard-dev", "context": {"cluster": "spotguard-dev", "user": "admin", "namespace": "default"}}
        ],
        "current-context": "spotguard-dev",
    }
    path.write_text(json.dumps(cfg, indent=2))  # JSON is valid YAML
    path.chmod(0o600)


def egress_selector_config(socket_path: Path) -> dict[str, Any]:
    """The apiserver's EgressSelectorConfiguration: its ``cluster`` traffic (webhooks called by Service,
    kubelets, the ``proxy`` subresources) through the CONNECT proxy on the unix socket ``socket_path``
    (over TCP, 1.20 speaks only TLS to its proxy); the rest direct."""
    connection = {"proxyProtocol": "HTTPConnect", "transport": {"uds": {"udsName": str(socket_path)}}}
    return {
        "apiVersion": "apiserver.k8s.io/v1beta1",
        "kind": "EgressSelectorConfiguration",
        "egressSelections": [{"name": "cluster", "connection": connection}],
    }


def _unix_listening(path: Path) -> bool:
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
        return True
    return False


def _https_get(url: str, token: str) -> tuple[int, bytes]:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def kubelet_client_certs(certs: Path) -> tuple[Path, Path, Path]:
    """The cluster CA and the apiserver's client certificate for calls to kubelets (``kubectl logs``):
    (ca, cert, key). The CA's key lies beside it (:func:`testenv.pki.ca_key_path`): the apiserver
    trusts the client certificates it signs (``--client-ca-file``), each real node's kubelet's among them."""
    ca = pki.make_ca(certs / "ca.crt", "spotguard-test-cluster-ca")
    cert, key = certs / "apiserver-kubelet-client.crt", certs / "apiserver-kubelet-client.key"
    # No group: the kubelets ask nothing of it, and the apiserver trusts this CA too (it is no admin there).
    pki.write_client_cert(ca, "kube-apiserver-kubelet-client", (), cert, key)
    return ca, cert, key


#: What the test cluster's apiserver writes to its audit log: who wrote (user, userAgent) which object when,
#: for the objects the operator and its replicas write (no bodies: Metadata level). Node heartbeats,
#: pod status from the nodes and every read are left out, so it stays small and cheap.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "namespaces": ["kube-system", "kube-node-lease"]},
        {
            "level": "Metadata",
            "verbs": ["create", "update", "patch", "delete", "deletecollection"],
            "resources": [
                {"group": "", "resources": ["pods", "events", "services", "serviceaccounts"]},
                {"group": "coordination.k8s.io", "resources": ["leases"]},
                {"group": "rbac.authorization.k8s.io", "resources": ["rolebindings"]},
                {"group": "spotguard.dev", "resources": ["trainingjobs", "trainingjobs/status"]},
            ],
        },
        {"level": "None"},
    ],
}


def start_control_plane(sup: Supervisor) -> ControlPlane:
    bins = bin_dir()
    for b in ("kube-apiserver", "kube-controller-manager", "kube-scheduler"):
        if not (bins / b).exists():
            raise FileNotFoundError(f"{bins / b} not found: run `bash testenv/provision.sh` first")
    d = sup.state_dir / "k8s"
    (d / "certs").mkdir(parents=True, exist_ok=True)
    sa_key = d / "sa.key"
    subprocess.run(["openssl", "genrsa", "-out", str(sa_key), "2048"], check=True, capture_output=True)
    token = secrets.token_hex(24)
    tokens = d / "tokens.csv"
    tokens.write_text(f"{token},admin,admin,system:masters\n")
    tokens.chmod(0o600)

    kubelet_ca, kubelet_cert, kubelet_key = kubelet_client_certs(d / "certs")
    audit_policy, audit_log = d / "audit-policy.json", d / "audit.log"
    audit_policy.write_text(json.dumps(AUDIT_POLICY))
    etcd_port, etcd_peer, api_port = free_ports(3)
    etcd_url, peer_url = f"http://127.0.0.1:{etcd_port}", f"http://127.0.0.1:{etcd_peer}"
    etcd = sup.start(
        "etcd",
        [
            "etcd",
            "--name=default",
            f"--data-dir={d / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
            "--listen-metrics-urls=",
        ],
    )
    wait_until(lambda: urllib.request.urlopen(f"{etcd_url}/health", timeout=2).status == 200, 30, "etcd", etcd)

    server = f"https://127.0.0.1:{api_port}"
    kubeconfig = d / "kubeconfig"
    # The apiserver's way to webhooks by Service, kubelets and pods: a CONNECT proxy of the test world that
    # routes ClusterIPs to ready pods as kube-proxy would (testenv/realnode/svcproxy.py); up before the
    # apiserver, which may dial it at once, and stopped after it.
    # A unix socket's path has at most 107 bytes: a test's state directory (or TMPDIR) may be longer.
    egress_sock = Path("/tmp") / f"spotguard-egress-{sup.run_id}.sock"
    egress = d / "egress-selector.json"
    egress.write_text(json.dumps(egress_selector_config(egress_sock)))
    proxy = sup.start(
        "svcproxy",
        [sys.executable, "-m", "testenv.realnode.svcproxy", f"--socket={egress_sock}", f"--kubeconfig={kubeconfig}"],
        extra_env={"PYTHONPATH": str(repo_root())},
        stop_timeout=5.0,
        leaves=(egress_sock,),
    )
    wait_until(lambda: _unix_listening(egress_sock), 30, "the apiserver's egress proxy", proxy)
    api = sup.start(
        "kube-apiserver",
        [
            str(bins / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            f"--cert-dir={d / 'certs'}",
            f"--secure-port={api_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--token-auth-file={tokens}",
            # Kubelets of real nodes authenticate as their node (a client certificate of the cluster CA,
            # ``system:node:<name>`` in ``system:nodes``); the Node authorizer and NodeRestriction (added to
            # 1.20's default plugins) hold each to its own Node, its pods and what they use, as on a cluster.
            f"--client-ca-file={kubelet_ca}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--service-account-key-file={sa_key}",
            f"--service-account-signing-key-file={sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--enable-priority-and-fairness=false",
            "--allow-privileged=true",
            "--profiling=false",
            # Logs (kubectl logs) come from the node's kubelet endpoint: reach it at 127.0.0.1, with a client cert.
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            f"--kubelet-client-certificate={kubelet_cert}",
            f"--kubelet-client-key={kubelet_key}",
            # Who wrote what, in the apiserver's own order (tests of the operator's replicas read it).
            f"--audit-policy-file={audit_policy}",
            f"--audit-log-path={audit_log}",
            "--audit-log-format=json",
            "--audit-log-maxsize=200",
            "--audit-log-maxbackup=1",
            f"--egress-selector-config-file={egress}",
        ],
    )
    wait_until(lambda: _https_get(f"{server}/readyz", token)[0] == 200, 90, "kube-apiserver", api)
    sup.host_services.add(api_port, "kube-apiserver")

    write_kubeconfig(kubeconfig, server, token, d / "certs" / "apiserver.crt")
    sup.start(
        "kube-controller-manager",
        [
            str(bins / "kube-controller-manager"),
            f"--kubeconfig={kubeconfig}",
            f"--service-account-private-key-file={sa_key}",
            f"--root-ca-file={d / 'certs' / 'apiserver.crt'}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            "--secure-port=0",
            "--port=0",
            "--controllers=*,-csrsigning",
            "--profiling=false",
        ],
    )
    sup.start(
        "kube-scheduler",
        [
            str(bins / "kube-scheduler"),
            f"--kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            "--port=0",
            "--secure-port=0",
            "--profiling=false",
        ],
    )
    # Pods are refused until the controller-manager has made the default ServiceAccount.
    wait_until(
        lambda: _https_get(f"{server}/api/v1/namespaces/default/serviceaccounts/default", token)[0] == 200,
        90,
        "default ServiceAccount (kube-controller-manager)",
    )
    return ControlPlane(kubeconfig, server, token, bins, kubelet_ca, audit_log)


@dataclass
class TestEnv:
    """A control plane and an S3 store under one supervisor."""

    __test__ = False  # not a pytest test class

    sup: Supervisor
    kube: ControlPlane | None = None
    s3: S3Store | None = None

    def stop(self) -> None:
        self.sup.stop()


@contextlib.contextmanager
def running(state_dir: Path, *, kube: bool = True, s3: bool = True) -> Iterator[TestEnv]:
    state_dir.mkdir(parents=True, exist_ok=True)
    env = TestEnv(Supervisor(state_dir))
    try:
        if s3:
            env.s3 = start_seaweedfs(env.sup)
        if kube:
            env.kube = start_control_plane(env.sup)
        yield env
    finally:
        env.stop()


# --- dev cluster CLI ---------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    state = Path(args.state_dir).resolve()
    state.mkdir(parents=True, exist_ok=True)
    stop = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    (state / "serve.pid").write_text(str(os.getpid()))
    # A dev cluster starts empty, like a fresh test session: no Nodes or pods of an
    # earlier run that the scheduler could still pick before they are marked NotReady.
    for sub in ("k8s", "seaweedfs", "nodes", "realnodes", "logs"):
        shutil.rmtree(state / sub, ignore_errors=True)
    with running(state) as env:
        assert env.kube is not None and env.s3 is not None
        (state / "kubeconfig").write_text(env.kube.kubeconfig.read_text())
        (state / "kubeconfig").chmod(0o600)
        s3env = {
            **env.s3.env(),
            "SPOTGUARD_S3_BUCKET": env.s3.bucket,
            "SPOTGUARD_STORAGE_URI": f"s3://{env.s3.bucket}/checkpoints",
        }
        (state / "s3.env").write_text("".join(f"export {k}={v}\n" for k, v in s3env.items()))
        (state / "s3.env").chmod(0o600)
        if args.nodes and args.nodes_kind == "real":
            _start_real_nodes(env, state / "realnodes", args.nodes, args.registry)
        elif args.nodes:
            node_state = state / "nodes"
            node_state.mkdir(exist_ok=True)
            nodes = env.sup.start(
                "processnode",
                [
                    sys.executable,
                    "-m",
                    "testenv.processnode",
                    "run",
                    "--kubeconfig",
                    str(state / "kubeconfig"),
                    "--nodes",
                    str(args.nodes),
                    "--state-dir",
                    str(node_state),
                    "--client-ca-file",
                    str(env.kube.kubelet_client_ca),
                    "--host-services-dir",
                    str(env.sup.host_services.directory),
                ],
                extra_env={"PYTHONPATH": str(repo_root())},
            )
            # The agent writes its control file once its nodes are registered and Ready.
            wait_until(lambda: (node_state / "control.json").exists(), 60, "process nodes", nodes)
        (state / "ready").write_text(env.sup.run_id)
        print(f"dev cluster ready: KUBECONFIG={state / 'kubeconfig'}; S3 settings in {state / 's3.env'}", flush=True)
        while not stop and all(s.popen.poll() is None for s in env.sup.services):
            time.sleep(0.5)
        for s in env.sup.services:
            if s.popen.poll() is not None and not stop:
                print(f"{s.name} exited ({s.popen.returncode}); stopping the dev cluster", file=sys.stderr)
    for f in ("ready", "serve.pid"):
        with contextlib.suppress(OSError):
            (state / f).unlink()
    return 0


def _start_real_nodes(env: TestEnv, state: Path, count: int, registry: str | None) -> None:
    """Real nodes (kubelet + containerd) for the dev cluster (``make dev-cluster REAL=1``), as a service:
    ``python -m testenv.realnode run``, which leaves nothing behind when it is stopped."""
    assert env.kube is not None and env.kube.kubelet_client_ca is not None
    state.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "testenv.realnode", "run", "--kubeconfig", str(env.kube.kubeconfig)]
    argv += ["--client-ca", str(env.kube.kubelet_client_ca), "--state-dir", str(state), "--nodes", str(count)]
    argv += ["--registry", registry] if registry else []
    argv += ["--host-services-dir", str(env.sup.host_services.directory)]  # pods reach the store, as on process nodes
    # Its stop kills every node's processes, then unmounts and removes what they made: give it time.
    svc = env.sup.start("realnodes", argv, extra_env={"PYTHONPATH": str(repo_root())}, stop_timeout=60.0)
    wait_until(lambda: (state / "ready.json").exists(), 180, "real nodes", svc)


def _up(args: argparse.Namespace) -> int:
    """Start ``serve`` detached and wait until it is ready."""
    state = Path(args.state_dir).resolve()
    state.mkdir(parents=True, exist_ok=True)
    if (state / "ready").exists():
        print(f"dev cluster already running (state in {state}); `make dev-cluster-down` stops it")
        return 0
    log = (state / "serve.log").open("ab")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "testenv.cluster", "serve", "--state-dir", str(state), "--nodes", str(args.nodes)),
            *("--nodes-kind", args.nodes_kind, *(("--registry", args.registry) if args.registry else ())),
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(repo_root())},
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if (state / "ready").exists():
            print(f"dev cluster up.\n  export KUBECONFIG={state / 'kubeconfig'}\n  source {state / 's3.env'}")
            return 0
        if proc.poll() is not None:
            print(f"dev cluster failed to start; see {state / 'serve.log'}", file=sys.stderr)
            print((state / "serve.log").read_text()[-3000:], file=sys.stderr)
            return 1
        time.sleep(0.5)
    print(f"dev cluster not ready after 240 s; see {state / 'serve.log'}", file=sys.stderr)
    return 1


def _down(args: argparse.Namespace) -> int:
    state = Path(args.state_dir).resolve()
    pidfile = state / "serve.pid"
    if not pidfile.exists():
        print("dev cluster not running")
        return 0
    pid = int(pidfile.read_text())
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.2)
    pids = state / "pids.json"
    if pids.exists():  # serve did not clean up: kill what it started
        data = json.loads(pids.read_text())
        for p in data["pids"].values():
            _signal_group(p, signal.SIGKILL)
        for p in leftover_processes(data["run_id"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        pids.unlink()
    for f in ("ready", "serve.pid"):
        with contextlib.suppress(OSError):
            (state / f).unlink()
    print("dev cluster stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testenv.cluster")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, func in (("serve", _serve), ("up", _up), ("down", _down)):
        p = sub.add_parser(name)
        p.add_argument("--state-dir", default=".dev")
        p.add_argument("--nodes", type=int, default=2)
        p.add_argument(
            "--nodes-kind",
            choices=("process", "real"),
            default="process",
            help="process nodes (pods as local processes) or real nodes (kubelet + containerd)",
        )
        p.add_argument("--registry", help="a plain-http registry (127.0.0.1:PORT) that real nodes pull from")
        p.set_defaults(func=func)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
