"""Build the pod of one attempt (pure): the user's template plus spotguard's parts.

Layout of every pod:

* init container ``spotguard-restore``: stages the newest verified checkpoint
  into the shared volume (``spotguard restore``);
* the user's containers (the trainer), with the Checkpointer's environment;
* the sidecar ``spotguard-sidecar``: a native sidecar (init container with
  ``restartPolicy: Always``) on servers >= 1.29, else a regular container that
  delays its own exit until the emergency upload is verified;
* a staging volume shared by all of them at ``/var/lib/spotguard`` (checkpoints in
  ``/var/lib/spotguard/checkpoints``): an ``emptyDir`` without a limit unless
  ``spec.checkpoint.staging`` places it (:func:`staging_volume`);
* with the ``k8s`` notice source and a notice relay (``OperatorConfig.notice_url``):
  a projected ServiceAccount token of the pod (audience ``spotguard.dev/notices``),
  mounted into the sidecar only, which asks the operator for its pod's
  disruption state with it (:mod:`spotguard.notice_relay`). The pod runs as
  its template's own ServiceAccount (or ``default``): spotguard makes none.

spotguard's containers run non-root with a read-only root filesystem, as Pod
Security "restricted" asks (:mod:`~spotguard.operator.podsecurity`); the
user's containers keep the template's security context.

The same injection serves the mutating webhook, for pods from the user's own
Jobs or JobSets.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from spotguard import notice_relay as relay
from spotguard.contract import env as envvars
from spotguard.contract.final import trainer_final_verify_seconds
from spotguard.operator.hostports import DEFAULT_RANGE, pair_count, preferred_index
from spotguard.operator.jobstatus import member_pod_name
from spotguard.operator.podsecurity import injected_security_context, tmp_mount, tmp_volume, trainers_read_ours
from spotguard.operator.spec import (
    API_VERSION,
    EMERGENCY_VOLUME,
    GCS_KEY_VOLUME,
    KIND,
    NOTICE_TOKEN_VOLUME,
    RESTORE_CONTAINER,
    SHARED_VOLUME,
    SIDECAR_CONTAINER,
    TMP_VOLUME,
    CheckpointSpec,
    TrainingJobSpec,
)
from spotguard.operator.staging import StagingSpec, sidecar_pod_dir
from spotguard.version import __version__

LABEL_JOB = "spotguard.dev/job"
LABEL_ATTEMPT = "spotguard.dev/attempt"
LABEL_NODE_RANK = "spotguard.dev/node-rank"
LABEL_INJECT = "spotguard.dev/inject"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
ANNOTATION_INJECTED = "spotguard.dev/injected"
#: On every pod the operator creates: the identity of the operator process that created it.
ANNOTATION_OPERATOR_INSTANCE = "spotguard.dev/operator-instance"

# Not "/spotguard": with the container's working directory at "/", a top-level
# directory named like the package would shadow it for `python -m spotguard...`
# under an editable install (it becomes a namespace package).
MOUNT_PATH = "/var/lib/spotguard"
#: gs:// jobs with a credentials Secret: where its service account key is mounted (read-only).
GCS_KEY_DIR = "/var/run/spotguard/gcs"
GCS_KEY_NAME = "key.json"
GCS_KEY_FILE = f"{GCS_KEY_DIR}/{GCS_KEY_NAME}"
CHECKPOINT_DIR = f"{MOUNT_PATH}/checkpoints"
CONTROL_DIR = f"{CHECKPOINT_DIR}/.control"
#: ``checkpoint.memoryStaging``: where the trainer and the sidecar mount the memory volume.
EMERGENCY_DIR = "/var/lib/spotguard-emergency"
#: The memory volume's limit: this many times the last checkpoint (a larger one is written to the disk).
EMERGENCY_CHECKPOINTS = 1.25

#: A staging volume holds the checkpoint being written, the last local one, and slack: this many checkpoints.
STAGING_CHECKPOINTS = 3
#: A per-pod claim needs a size: this one when none is given and no checkpoint was verified yet.
DEFAULT_EPHEMERAL_SIZE = "100Gi"
#: hostPath staging: each pod's own subdirectory of the node's directory (the contract's env gives both).
HOST_PATH_SUBDIR = "$(POD_NAMESPACE)/$(POD_NAME)"

DEFAULT_IMAGE = f"spotguard/spotguard:{__version__}"
DEFAULT_SIDECAR_RESOURCES: Mapping[str, Any] = {
    "requests": {"cpu": "100m", "memory": "256Mi"},
    "limits": {"memory": "1Gi"},
}


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    """Operator-wide settings that shape every pod."""

    image: str = DEFAULT_IMAGE
    image_pull_policy: str | None = None
    #: The server supports native sidecars (Kubernetes >= 1.29).
    native_sidecar: bool = False
    sidecar_resources: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_SIDECAR_RESOURCES))
    #: The notice relay the sidecars of jobs with the ``k8s`` source ask (``--notice-url``); None: no relay.
    notice_url: str | None = None
    #: The nodes' directory a job's hostPath staging must lie under (None: hostPath staging is refused).
    host_path_prefix: str | None = None


@dataclass(frozen=True, slots=True)
class Injection:
    """Everything the injection needs, whether for a TrainingJob or a labelled pod."""

    job: str
    namespace: str
    storage_uri: str
    checkpoint: CheckpointSpec
    grace_period_seconds: int
    attempt: int | None = None
    image: str = DEFAULT_IMAGE
    image_pull_policy: str | None = None
    native_sidecar: bool = False
    metrics_port: int = 9400
    sidecar_resources: Mapping[str, Any] | None = None
    #: Early notice sources the sidecar polls (``SPOTGUARD_NOTICES``).
    notices: tuple[str, ...] = ()
    #: The notice relay's URL, for the ``k8s`` source (None: the sidecar reads its pod itself).
    notice_url: str | None = None
    #: torchrun's environment for this pod (every container), empty for one process.
    torchrun_env: tuple[tuple[str, str], ...] = ()
    #: Bytes of the job's newest verified checkpoint, if known: sizes a staging volume the spec gives no size.
    staging_bytes: int | None = None
    #: The sidecar's exit status after a preemption (``SPOTGUARD_PREEMPTED_EXIT_CODE``); the webhook's pods: 143.
    preempted_exit_code: int = 0


def server_supports_native_sidecars(major: str, minor: str) -> bool:
    """Whether a server version (``/version``'s major/minor) has native sidecars (>= 1.29)."""
    try:
        return (int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)) >= (1, 29)
    except ValueError:
        return False


_T = TypeVar("_T", str, int, float, bool)


def _env_value(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _contract_value(var: envvars.Var[_T, Any], value: _T) -> dict[str, Any]:
    """A variable of the in-pod contract, rendered as its readers parse it (:func:`~spotguard.contract.env.to_env`)."""
    return _env_value(var.name, envvars.to_env(var, value))


def _secret_env(name: str, secret: str, key: str, optional: bool = False) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def contract_env(inj: Injection, *, credentials: bool = True) -> list[dict[str, Any]]:
    """The in-pod contract's environment, shared by every container.

    ``credentials`` adds the storage credentials (as ``secretKeyRef``: their
    values never pass through the operator). Only the restore init container
    and the sidecar talk to storage, so the trainer gets them only when the
    spec asks (``checkpoint.exposeCredentialsToTrainer``).
    """
    ck = inj.checkpoint
    env = [
        _contract_value(envvars.CHECKPOINT_DIR, CHECKPOINT_DIR),
        _contract_value(envvars.CONTROL_DIR, CONTROL_DIR),
        _contract_value(envvars.STORAGE_URI, inj.storage_uri),
        _contract_value(envvars.JOB, inj.job),
        _contract_value(envvars.CHECKSUM, ck.checksum),
        _contract_value(envvars.GRACE_SECONDS, inj.grace_period_seconds),
        *(_env_value(name, value) for name, value in ck.retention.to_env().items()),
    ]
    if inj.attempt is not None:
        env.append(_contract_value(envvars.ATTEMPT, inj.attempt))
    if emergency_volume(inj) is not None:
        env.append(_contract_value(envvars.EMERGENCY_STAGING, EMERGENCY_DIR))
        if ck.reserve_staging:
            env.append(_contract_value(envvars.STAGING_RESERVE, True))
    if ck.every_steps is not None:
        env.append(_contract_value(envvars.SAVE_EVERY_STEPS, ck.every_steps))
    if ck.every_seconds is not None:
        env.append(_contract_value(envvars.SAVE_EVERY_SECONDS, ck.every_seconds))
    env += [
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        # The sidecar ties its Events (MetricsPortUnavailable) to its pod without reading it.
        _field_env("POD_UID", "metadata.uid"),
    ]
    sec = ck.credentials_secret if credentials else None
    if ck.storage.startswith("gs://"):
        # Google Cloud Storage: a service account key as a file (never an env value), or no Secret at
        # all and the pod's own identity (Workload Identity); an endpoint is an emulator's.
        if sec is not None:
            env.append(_env_value("GOOGLE_APPLICATION_CREDENTIALS", GCS_KEY_FILE))
        if ck.endpoint:
            env.append(_env_value("STORAGE_EMULATOR_HOST", ck.endpoint))
        env += [_env_value(k, v) for k, v in inj.torchrun_env]
        return env
    if sec is not None:
        env.append(_secret_env("AWS_ACCESS_KEY_ID", sec.name, sec.access_key_id_key))
        env.append(_secret_env("AWS_SECRET_ACCESS_KEY", sec.name, sec.secret_access_key_key))
    # Where the store is (not a secret unless it comes from the Secret).
    if ck.endpoint:
        env.append(_env_value("AWS_ENDPOINT_URL_S3", ck.endpoint))
        env.append(_env_value("AWS_ENDPOINT_URL", ck.endpoint))
    elif sec is not None:
        env.append(_secret_env("AWS_ENDPOINT_URL_S3", sec.name, sec.endpoint_key, optional=True))
        env.append(_secret_env("AWS_ENDPOINT_URL", sec.name, sec.endpoint_key, optional=True))
    if ck.region:
        env.append(_env_value("AWS_DEFAULT_REGION", ck.region))
        env.append(_env_value("AWS_REGION", ck.region))
    env += [_env_value(k, v) for k, v in inj.torchrun_env]
    return env


def trainer_env(inj: Injection) -> list[dict[str, Any]]:
    """The environment of the user's containers: the contract, credentials only on request.

    Without the job's credentials the trainer gets no ``SPOTGUARD_STORAGE_URI``
    either: the restore init container has staged the newest verified
    checkpoint, and a Checkpointer that found none would otherwise try the
    store itself and fail for want of credentials. A job without a credentials
    Secret (node or workload identity) keeps the URI.
    """
    ck = inj.checkpoint
    exposed = ck.expose_credentials_to_trainer
    env = contract_env(inj, credentials=exposed)
    if ck.credentials_secret is not None and not exposed:
        env = [e for e in env if e["name"] != envvars.STORAGE_URI.name]
    # kubelet stops a native sidecar once the trainer exits: a trainer that finished waits for its last
    # checkpoint to be verified first (a classic sidecar keeps the pod up itself).
    wait = trainer_final_verify_seconds(inj.native_sidecar, envvars.FINISH_SECONDS.default)
    if wait:
        env.append(_contract_value(envvars.FINAL_VERIFY_SECONDS, wait))
    return env


def _merge_env(container: dict[str, Any], env: list[dict[str, Any]]) -> None:
    """Add the contract's variables; a variable the user set explicitly wins."""
    own = list(container.get("env") or [])
    names = {e.get("name") for e in own if isinstance(e, Mapping)}
    container["env"] = [e for e in env if e["name"] not in names] + own


def last_checkpoint_bytes(status: Mapping[str, Any] | None) -> int | None:
    """The size of the job's newest verified checkpoint (``status.lastVerifiedCheckpoint.bytes``), if known."""
    last = (status or {}).get("lastVerifiedCheckpoint")
    value = last.get("bytes") if isinstance(last, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def staging_size(staging: StagingSpec, checkpoint_bytes: int | None) -> str | None:
    """The size of a staging volume: the spec's own, else ``STAGING_CHECKPOINTS`` x the last checkpoint.

    Rounded up to whole GiB (a quantity the user reads at a glance). A
    ``hostPath`` has no size; an ``emptyDir`` with neither stays unlimited;
    a claim (``ephemeral``) must ask for something: :data:`DEFAULT_EPHEMERAL_SIZE`.
    """
    if staging.kind == "hostPath":
        return None
    if staging.size is not None:
        return staging.size
    if checkpoint_bytes:
        return f"{math.ceil(STAGING_CHECKPOINTS * checkpoint_bytes / 2**30)}Gi"
    return DEFAULT_EPHEMERAL_SIZE if staging.kind == "ephemeral" else None


def staging_volume(inj: Injection) -> dict[str, Any]:
    """The shared volume the checkpoints are staged in, as ``spec.checkpoint.staging`` places it.

    Absent: an ``emptyDir`` without a limit, as pods always had. A generic
    ephemeral volume is a claim per pod (deleted with the pod), so each attempt
    is sized from the newest checkpoint; a ``hostPath`` (the node's NVMe) is
    shared by every pod on the node, so each pod mounts its own subdirectory
    (:data:`HOST_PATH_SUBDIR`).
    """
    staging = inj.checkpoint.staging
    if staging is None:
        return {"name": SHARED_VOLUME, "emptyDir": {}}
    size = staging_size(staging, inj.staging_bytes)
    if staging.kind == "hostPath":
        return {"name": SHARED_VOLUME, "hostPath": {"path": staging.path, "type": "DirectoryOrCreate"}}
    if staging.kind == "ephemeral":
        claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}
        if staging.storage_class:
            claim["storageClassName"] = staging.storage_class
        template = {"metadata": {"labels": {LABEL_JOB: inj.job, LABEL_MANAGED_BY: "spotguard"}}, "spec": claim}
        return {"name": SHARED_VOLUME, "ephemeral": {"volumeClaimTemplate": template}}
    empty: dict[str, Any] = {}
    if staging.medium:
        empty["medium"] = staging.medium
    if size is not None:
        empty["sizeLimit"] = size
    return {"name": SHARED_VOLUME, "emptyDir": empty}


def emergency_volume(inj: Injection) -> dict[str, Any] | None:
    """The memory volume a preemption's checkpoint is written to (``checkpoint.memoryStaging``), if any.

    None when switched off, or when the staging volume is in memory already.
    Its limit, when the last checkpoint's size is known, is
    :data:`EMERGENCY_CHECKPOINTS` times it: the kubelet sizes the tmpfs to
    it, and a checkpoint that does not fit is written to the staging volume.
    """
    ck = inj.checkpoint
    if not ck.memory_staging or (ck.staging is not None and ck.staging.medium == "Memory"):
        return None
    empty: dict[str, Any] = {"medium": "Memory"}
    if inj.staging_bytes:
        empty["sizeLimit"] = f"{math.ceil(EMERGENCY_CHECKPOINTS * inj.staging_bytes / 2**20)}Mi"
    return {"name": EMERGENCY_VOLUME, "emptyDir": empty}


def shared_mount(inj: Injection) -> dict[str, Any]:
    """How every container mounts the staging volume (a hostPath: the pod's own subdirectory)."""
    mount: dict[str, Any] = {"name": SHARED_VOLUME, "mountPath": MOUNT_PATH}
    staging = inj.checkpoint.staging
    if staging is not None and staging.kind == "hostPath":
        mount["subPathExpr"] = HOST_PATH_SUBDIR
    return mount


def _mounts(inj: Injection) -> list[dict[str, Any]]:
    """The staging volume's mount, and the memory volume's (the same path in every container:
    the trainer commits a link to it that the sidecar follows)."""
    mounts = [shared_mount(inj)]
    if emergency_volume(inj) is not None:
        mounts.append({"name": EMERGENCY_VOLUME, "mountPath": EMERGENCY_DIR})
    return mounts


def _mount(container: dict[str, Any], inj: Injection) -> None:
    ours = (SHARED_VOLUME, EMERGENCY_VOLUME)
    mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") not in ours]
    container["volumeMounts"] = mounts + _mounts(inj)


def gcs_key_volume(inj: Injection) -> dict[str, Any] | None:
    """The Secret volume with a gs:// job's service account key, if it names a credentials Secret."""
    sec = inj.checkpoint.credentials_secret
    if sec is None or not inj.checkpoint.storage.startswith("gs://"):
        return None
    items = [{"key": sec.key_file_key, "path": GCS_KEY_NAME}]
    return {"name": GCS_KEY_VOLUME, "secret": {"secretName": sec.name, "items": items, "defaultMode": 0o440}}


def _key_mount() -> dict[str, Any]:
    return {"name": GCS_KEY_VOLUME, "mountPath": GCS_KEY_DIR, "readOnly": True}


def _spotguard_container(name: str, inj: Injection, command: list[str]) -> dict[str, Any]:
    mounts = [*_mounts(inj), tmp_mount()]  # its root is read-only: /tmp is a volume
    if gcs_key_volume(inj) is not None:
        mounts.append(_key_mount())
    c: dict[str, Any] = {
        "name": name,
        "image": inj.image,
        "command": command,
        "env": contract_env(inj),
        "volumeMounts": mounts,
        "resources": copy.deepcopy(dict(inj.sidecar_resources or DEFAULT_SIDECAR_RESOURCES)),
    }
    if inj.image_pull_policy:
        c["imagePullPolicy"] = inj.image_pull_policy
    return c


def restore_container(inj: Injection, grant: bool = False) -> dict[str, Any]:
    """The init container that stages the newest verified checkpoint.

    With ``grant`` (the trainers can read the files it writes), where the store signs reads it
    grants the trainer reads of the newest checkpoints instead (``--grant``): the trainer streams
    one into its tensors, and the sidecar restores the local copy after the trainer's answer
    (:mod:`spotguard.sidecar.granting`); else it restores as without it."""
    command = ["spotguard", "restore", "--storage", f"$({envvars.STORAGE_URI.name})", "--dest", CHECKPOINT_DIR]
    c = _spotguard_container(RESTORE_CONTAINER, inj, [*command, "--grant"] if grant else command)
    # A failed restore says why in its log: its tail becomes the termination message.
    c["terminationMessagePolicy"] = "FallbackToLogsOnError"
    return c


def sidecar_container(inj: Injection) -> dict[str, Any]:
    """The sidecar; native (init container, ``restartPolicy: Always``) or classic."""
    c = _spotguard_container(SIDECAR_CONTAINER, inj, ["spotguard", "sidecar"])
    mode = "native" if inj.native_sidecar else "classic"
    c["env"] += [
        _contract_value(envvars.SIDECAR_MODE, mode),
        _contract_value(envvars.METRICS_PORT, inj.metrics_port),
    ]
    if inj.notices:
        c["env"].append(_contract_value(envvars.NOTICES, ",".join(inj.notices)))
    if notice_token_volume(inj) is not None:
        # The k8s source asks the operator, with a token only this container sees.
        assert inj.notice_url is not None
        c["env"] += [
            _contract_value(envvars.NOTICE_URL, inj.notice_url),
            _contract_value(envvars.NOTICE_TOKEN_FILE, relay.TOKEN_FILE),
        ]
        c["volumeMounts"].append({"name": NOTICE_TOKEN_VOLUME, "mountPath": relay.TOKEN_DIR, "readOnly": True})
    if inj.preempted_exit_code:
        c["env"].append(_contract_value(envvars.PREEMPTED_EXIT_CODE, inj.preempted_exit_code))
    if not inj.checkpoint.incremental:
        # Only the sidecar uploads; absent when on (its default).
        c["env"].append(_contract_value(envvars.INCREMENTAL, False))
    pod_dir = sidecar_pod_dir(SHARED_VOLUME, inj.checkpoint.staging)
    if pod_dir is not None:  # hostPath staging: it removes its pod's directory of the node at its end
        c["volumeMounts"].append(pod_dir[0])
        c["env"].append(pod_dir[1])
    if inj.metrics_port:
        c["ports"] = [{"name": "sg-metrics", "containerPort": inj.metrics_port, "protocol": "TCP"}]
    # The sidecar leaves its report here (spotguard.contract.report); see classify.sidecar_report.
    c["terminationMessagePath"] = "/dev/termination-log"
    # Its log's tail when it failed without a report: the operator quotes it.
    c["terminationMessagePolicy"] = "FallbackToLogsOnError"
    if inj.native_sidecar:
        c["restartPolicy"] = "Always"
    return c


def inject(pod_spec: Mapping[str, Any], inj: Injection) -> dict[str, Any]:
    """Return a copy of ``pod_spec`` with spotguard's volume, env and containers added.

    Idempotent: injecting twice gives the same pod spec as injecting once.
    """
    spec = copy.deepcopy(dict(pod_spec))
    env = trainer_env(inj)
    reserved = {SIDECAR_CONTAINER, RESTORE_CONTAINER}
    containers = [copy.deepcopy(c) for c in spec.get("containers") or [] if c.get("name") not in reserved]
    for c in containers:
        _merge_env(c, env)
        _mount(c, inj)
    user_init = [copy.deepcopy(c) for c in spec.get("initContainers") or [] if c.get("name") not in reserved]
    for c in user_init:
        _merge_env(c, env)
        _mount(c, inj)
    sidecar = sidecar_container(inj)
    # The grant is a file of mode 0600: only for trainers that run as its writer.
    restore = restore_container(inj, grant=inj.checkpoint.restore_grant and trainers_read_ours(spec, containers))
    for ours_c in (restore, sidecar):
        ours_c["securityContext"] = injected_security_context(spec)
    if inj.native_sidecar:
        # Native sidecars start in order: restore first, then the sidecar, which
        # keeps running beside the trainer and is stopped after it.
        spec["initContainers"] = [restore, sidecar, *user_init]
        spec["containers"] = containers
    else:
        spec["initContainers"] = [restore, *user_init]
        spec["containers"] = [*containers, sidecar]
    ours = (SHARED_VOLUME, GCS_KEY_VOLUME, EMERGENCY_VOLUME, TMP_VOLUME)
    volumes = [v for v in spec.get("volumes") or [] if v.get("name") not in ours]
    volumes += [staging_volume(inj), tmp_volume()]
    memory = emergency_volume(inj)
    if memory is not None:
        volumes.append(memory)
    key = gcs_key_volume(inj)
    if key is not None:
        volumes.append(key)
        if inj.checkpoint.expose_credentials_to_trainer:
            for c in [*containers, *user_init]:
                c["volumeMounts"] = [
                    *(m for m in c.get("volumeMounts") or [] if m.get("name") != GCS_KEY_VOLUME),
                    _key_mount(),
                ]
    spec["volumes"] = volumes
    token = notice_token_volume(inj)
    if token is not None:
        spec["volumes"] = [*(v for v in volumes if v.get("name") != NOTICE_TOKEN_VOLUME), token]
    spec["terminationGracePeriodSeconds"] = inj.grace_period_seconds
    return spec


def notice_token_volume(inj: Injection) -> dict[str, Any] | None:
    """The projected token the sidecar shows the notice relay: only with the ``k8s`` source and a relay.

    Audience ``spotguard.dev/notices`` (the apiserver refuses it), bound to the
    pod by kubelet (worthless once the pod is gone), renewed by kubelet before
    it expires. Its account is the pod's own, whatever it is: the relay needs no
    rights of it.
    """
    if "k8s" not in inj.notices or not inj.notice_url:
        return None
    source = {"audience": relay.AUDIENCE, "expirationSeconds": relay.TOKEN_EXPIRATION_SECONDS, "path": relay.TOKEN_NAME}
    return {"name": NOTICE_TOKEN_VOLUME, "projected": {"sources": [{"serviceAccountToken": source}]}}


def host_ports(uid: str, port_range: tuple[int, int] = DEFAULT_RANGE) -> tuple[int, int]:
    """The preferred (master port, sidecar metrics port) of a job whose pods share their node's network.

    Where the job starts looking for a free pair (see ``hostports``); the pods
    use the pair the operator allocated, this one only when none was given.
    """
    first, last = port_range
    k = preferred_index(uid, pair_count(first, last))
    return first + 2 * k, first + 2 * k + 1


def effective_ports(spec: TrainingJobSpec, uid: str, allocated: tuple[int, int] | None = None) -> tuple[int, int]:
    """The master port and the sidecar's metrics port the pods of this job use.

    With ``hostNetwork``, a port the spec does not set comes from ``allocated``
    (the job's pair in ``status.hostPorts``). Both are declared as container
    ports, so they are host ports and the scheduler never puts two pods that
    use one on the same node.
    """
    master, metrics = spec.master_port, spec.sidecar.metrics_port
    if spec.host_network:
        auto_master, auto_metrics = allocated or host_ports(uid)
        master = master if spec.master_port_set else auto_master
        metrics = metrics if spec.metrics_port_set else auto_metrics
    return master, metrics


def service_name(job: str) -> str:
    """The headless Service of a job of several nodes (and the pods' subdomain)."""
    return job


def node_hostname(job: str, rank: int) -> str:
    """Stable hostname of node rank ``rank`` (the same in every attempt)."""
    return f"{job}-{rank}"


def master_addr(job: str, namespace: str, spec: TrainingJobSpec) -> str:
    """Where node rank 0's rendezvous store listens: its DNS name behind the headless Service."""
    if spec.nodes <= 1:
        return "127.0.0.1"
    return f"{node_hostname(job, 0)}.{service_name(job)}.{namespace}.svc.cluster.local"


def torchrun_env(job: str, namespace: str, spec: TrainingJobSpec, rank: int, port: int) -> tuple[tuple[str, str], ...]:
    """torchrun's environment (``PET_*`` are its option defaults) plus the usual torch.distributed names."""
    if not spec.distributed:
        return ()
    addr = master_addr(job, namespace, spec)
    return (
        ("PET_NNODES", str(spec.nodes)),
        ("PET_NPROC_PER_NODE", str(spec.nproc_per_node)),
        ("PET_NODE_RANK", str(rank)),
        ("PET_MASTER_ADDR", addr),
        ("PET_MASTER_PORT", str(port)),
        ("MASTER_ADDR", addr),
        ("MASTER_PORT", str(port)),
        ("WORLD_SIZE", str(spec.world_size)),
        ("NODE_RANK", str(rank)),
        # torchrun SIGKILLs its workers 30 s after a SIGTERM unless told otherwise:
        # the emergency save gets the whole grace period.
        ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(spec.preemption.grace_period_seconds)),
    )


def build_pod(
    job: str,
    namespace: str,
    uid: str,
    spec: TrainingJobSpec,
    attempt: int,
    config: OperatorConfig,
    rank: int = 0,
    allocated: tuple[int, int] | None = None,
    checkpoint_bytes: int | None = None,
) -> dict[str, Any]:
    """The pod of node rank ``rank`` in attempt ``attempt`` of TrainingJob ``namespace/job`` (owner ``uid``).

    ``allocated``: the job's host ports (``status.hostPorts``), for ``hostNetwork``.
    ``checkpoint_bytes``: the newest verified checkpoint's size (:func:`last_checkpoint_bytes`),
    which sizes a staging volume the spec gives no size.
    """
    master, metrics = effective_ports(spec, uid, allocated)
    inj = Injection(
        job=job,
        namespace=namespace,
        storage_uri=spec.checkpoint.job_uri(namespace, job),
        checkpoint=spec.checkpoint,
        grace_period_seconds=spec.preemption.grace_period_seconds,
        attempt=attempt,
        image=spec.sidecar.image or config.image,
        image_pull_policy=config.image_pull_policy,
        native_sidecar=config.native_sidecar,
        metrics_port=metrics,
        sidecar_resources=spec.sidecar.resources or config.sidecar_resources,
        notices=spec.preemption.notices,
        notice_url=config.notice_url,
        torchrun_env=torchrun_env(job, namespace, spec, rank, master),
        staging_bytes=checkpoint_bytes,
    )
    pod_spec = inject(spec.template.spec, inj)
    pod_spec["restartPolicy"] = "Never"
    labels = {
        **spec.template.labels,
        LABEL_JOB: job,
        LABEL_ATTEMPT: str(attempt),
        LABEL_MANAGED_BY: "spotguard",
    }
    if spec.nodes > 1:
        labels[LABEL_NODE_RANK] = str(rank)
        pod_spec["hostname"] = node_hostname(job, rank)
        pod_spec["subdomain"] = service_name(job)
    if spec.nodes > 1 and spec.host_network and not pod_spec.get("dnsPolicy"):
        # With the node's network a pod uses the node's resolver unless told otherwise:
        # rank 0's name behind the headless Service must resolve.
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    if spec.distributed and rank == 0 and spec.host_network:
        # Rank 0's rendezvous store listens on the node's network: a host port.
        trainer = pod_spec["containers"][0]
        ports = [p for p in trainer.get("ports") or [] if p.get("containerPort") != master]
        trainer["ports"] = [*ports, {"name": "sg-c10d", "containerPort": master, "protocol": "TCP"}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": member_pod_name(job, attempt, rank, spec.nodes),
            "namespace": namespace,
            "labels": labels,
            "annotations": dict(spec.template.annotations),
            # What kopf.adopt() would add; built here so the builder stays pure.
            "ownerReferences": [_owner_ref(job, uid)],
        },
        "spec": pod_spec,
    }


def build_pods(
    job: str,
    namespace: str,
    uid: str,
    spec: TrainingJobSpec,
    attempt: int,
    config: OperatorConfig,
    allocated: tuple[int, int] | None = None,
    checkpoint_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """Every pod of an attempt, by node rank."""
    return [
        build_pod(job, namespace, uid, spec, attempt, config, rank, allocated, checkpoint_bytes)
        for rank in range(spec.nodes)
    ]


def build_service(
    job: str, namespace: str, uid: str, spec: TrainingJobSpec, allocated: tuple[int, int] | None = None
) -> dict[str, Any] | None:
    """The headless Service that gives a gang's pods their DNS names (None for one node).

    ``publishNotReadyAddresses``: rank 0's name must resolve as soon as its pod
    has an address, before any readiness, or the other ranks cannot rendezvous.
    """
    if spec.nodes <= 1:
        return None
    master, _ = effective_ports(spec, uid, allocated)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(job),
            "namespace": namespace,
            "labels": {LABEL_JOB: job, LABEL_MANAGED_BY: "spotguard"},
            "ownerReferences": [_owner_ref(job, uid)],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: job},
            "ports": [{"name": "c10d", "port": master, "targetPort": master, "protocol": "TCP"}],
        },
    }


def _owner_ref(job: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
