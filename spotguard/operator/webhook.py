"""Sidecar injection for pods the user's own controllers create (Jobs, JobSets).

A pod labelled ``spotguard.dev/inject: "true"`` gets the same restore init
container, sidecar, shared volume and environment as a TrainingJob's pod,
configured by annotations:

==========================================  ====================================
``spotguard.dev/storage`` (required)        storage root (``s3://…`` / ``file:///…``)
``spotguard.dev/job-name``                  job name (default: the JobSet's name, else
                                            the Job's name, else the owner's name)
``spotguard.dev/credentials-secret``        Secret with ``AWS_ACCESS_KEY_ID`` etc.
``spotguard.dev/endpoint``                  S3 endpoint URL
``spotguard.dev/region``                    S3 region
``spotguard.dev/save-every-steps``          checkpoint interval in steps
``spotguard.dev/save-every-seconds``        checkpoint interval in seconds
``spotguard.dev/checksum``                  ``crc32c`` or ``sha256``
``spotguard.dev/keep-last``                 checkpoints to keep
``spotguard.dev/incremental``               ``"false"``: upload whole files (default
                                            ``"true"``: only the chunks storage does
                                            not hold yet)
``spotguard.dev/expose-credentials-to-      ``"true"``: the pod's own containers get the
trainer``                                   storage credentials too (default: only
                                            spotguard's containers)
``spotguard.dev/restore-grant``             ``"true"``: resume through a restore grant
                                            (``checkpoint.restoreGrant``)
==========================================  ====================================

The grace period is the pod's own ``terminationGracePeriodSeconds`` (default 60).

Pods of one distributed job (a JobSet, or an indexed Job, one pod per
``torchrun`` node) must share one checkpoint prefix, so that the parts of a
step meet in storage: the job name comes from the JobSet's name label
(``jobset.sigs.k8s.io/jobset-name``, shared by all its replicated jobs),
else from the Job's name label, never from the pod (whose name and index
differ per node). A JobSet's ``jobset.sigs.k8s.io/restart-attempt`` becomes
``SPOTGUARD_ATTEMPT``. The pod's own containers get
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` equal to the grace period unless they set
it, so that ``torchrun`` does not kill its workers in the middle of the
emergency checkpoint. Restarting failed pods stays with the pod's controller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spotguard.operator.podbuilder import ANNOTATION_INJECTED, Injection, OperatorConfig, inject
from spotguard.operator.spec import RESTORE_CONTAINER, SIDECAR_CONTAINER, parse_checkpoint
from spotguard.operator.specfields import SpecError

PREFIX = "spotguard.dev/"

# annotation suffix -> (checkpoint field, type)
_ANNOTATIONS: dict[str, tuple[str, type]] = {
    "storage": ("storage", str),
    "credentials-secret": ("credentialsSecret", str),
    "endpoint": ("endpoint", str),
    "region": ("region", str),
    "save-every-steps": ("everySteps", int),
    "save-every-seconds": ("everySeconds", float),
    "checksum": ("checksum", str),
    "keep-last": ("keepLast", int),
    "incremental": ("incremental", bool),
    "expose-credentials-to-trainer": ("exposeCredentialsToTrainer", bool),
    "restore-grant": ("restoreGrant", bool),
}
_FIELD_TO_ANNOTATION = {f: f"metadata.annotations[{PREFIX}{a}]" for a, (f, _t) in _ANNOTATIONS.items()}

#: Set by the JobSet controller (as label and annotation) on every pod of a JobSet.
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOBSET_RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
#: Set by the Job controller on its pods. A JobSet's pods carry them too, but
#: with the name of their child Job (one per replicated job and index).
JOB_NAME_LABELS = ("batch.kubernetes.io/job-name", "job-name")
#: ``torchrun`` SIGKILLs its workers this many seconds after a SIGTERM (30 by default).
TORCHRUN_SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
#: The injected sidecar's exit status after a preemption: a container's when SIGTERM ended it (128 + 15).
PREEMPTED_EXIT_CODE = 143


def _meta_value(meta: Mapping[str, Any], key: str) -> str | None:
    """A label, else the annotation of the same key; None when empty or absent."""
    for where in ("labels", "annotations"):
        value = (meta.get(where) or {}).get(key)
        if value:
            return str(value)
    return None


def job_name_of(pod: Mapping[str, Any]) -> str | None:
    """The job a labelled pod belongs to: the same for every pod of one JobSet or Job.

    In order: the ``spotguard.dev/job-name`` annotation, the JobSet's name
    (all replicated jobs of a JobSet share it), the Job's name, the
    controlling owner's name. Never the pod's own name, which differs per pod.
    """
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    name = annotations.get(f"{PREFIX}job-name")
    if name:
        return str(name)
    for key in (JOBSET_NAME, *JOB_NAME_LABELS):
        value = _meta_value(meta, key)
        if value:
            return value
    for ref in meta.get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") and ref.get("name"):
            return str(ref["name"])
    return None


def attempt_of(pod: Mapping[str, Any]) -> int | None:
    """The JobSet restart attempt a pod belongs to (``SPOTGUARD_ATTEMPT``); None elsewhere."""
    value = _meta_value(pod.get("metadata") or {}, JOBSET_RESTART_ATTEMPT)
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


def with_torchrun_shutdown(pod_spec: Mapping[str, Any], grace_seconds: int) -> dict[str, Any]:
    """Give the pod's own containers ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` = the grace period.

    ``torchrun`` forwards a SIGTERM to its workers and kills them after this
    many seconds (30 by default), which would cut a longer emergency save
    short. A value the container sets in ``env`` wins. Returns a new spec.
    """
    spec = dict(pod_spec)
    reserved = {SIDECAR_CONTAINER, RESTORE_CONTAINER}
    containers = []
    for container in spec.get("containers") or []:
        env = list(container.get("env") or [])
        if container.get("name") not in reserved and not any(
            isinstance(e, Mapping) and e.get("name") == TORCHRUN_SHUTDOWN_ENV for e in env
        ):
            container = {**container, "env": [*env, {"name": TORCHRUN_SHUTDOWN_ENV, "value": str(grace_seconds)}]}
        containers.append(container)
    spec["containers"] = containers
    return spec


def injection_for_pod(pod: Mapping[str, Any], namespace: str, config: OperatorConfig) -> Injection:
    """Read the annotations of a labelled pod; raises ``SpecError`` naming the annotation."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    raw: dict[str, Any] = {}
    retention: dict[str, Any] = {}
    for suffix, (fld, typ) in _ANNOTATIONS.items():
        value = annotations.get(PREFIX + suffix)
        if value is None:
            continue
        where = _FIELD_TO_ANNOTATION[fld]
        if typ is bool:
            if value not in ("true", "false"):
                raise SpecError(where, f'must be "true" or "false", not {value!r}')
            value = value == "true"
        elif typ is not str:
            try:
                value = typ(value)
            except ValueError:
                raise SpecError(where, f"must be a number, not {value!r}") from None
        (retention if fld == "keepLast" else raw)[fld] = value
    if retention:
        raw["retention"] = retention
    if "storage" not in raw:
        raise SpecError(_FIELD_TO_ANNOTATION["storage"], "is required on pods labelled spotguard.dev/inject")
    try:
        checkpoint = parse_checkpoint(raw, "checkpoint")
    except SpecError as exc:
        leaf = exc.field.rsplit(".", 1)[-1]
        raise SpecError(_FIELD_TO_ANNOTATION.get(leaf, exc.field), exc.message) from None
    job = job_name_of(pod)
    if not job:
        raise SpecError(f"metadata.annotations[{PREFIX}job-name]", "is required (no Job, JobSet or owner found)")
    spec = pod.get("spec") or {}
    grace = spec.get("terminationGracePeriodSeconds")
    grace = grace if isinstance(grace, int) and grace > 0 else 60
    return Injection(
        job=job,
        namespace=namespace,
        storage_uri=checkpoint.job_uri(namespace, job),
        checkpoint=checkpoint,
        grace_period_seconds=grace,
        attempt=attempt_of(pod),
        image=config.image,
        image_pull_policy=config.image_pull_policy,
        native_sidecar=config.native_sidecar,
        sidecar_resources=config.sidecar_resources,
        # Only the pod's phase tells a Job (or any workload) that this attempt did not finish:
        # after a preemption the sidecar fails it, as a container killed by SIGTERM would.
        preempted_exit_code=PREEMPTED_EXIT_CODE,
    )


def mutated_pod(pod: Mapping[str, Any], namespace: str, config: OperatorConfig) -> tuple[dict[str, Any], str]:
    """The pod's new spec and the annotation value recording the injection."""
    inj = injection_for_pod(pod, namespace, config)
    spec = inject(pod.get("spec") or {}, inj)
    return with_torchrun_shutdown(spec, inj.grace_period_seconds), inj.storage_uri


def apply_to_patch(body: Mapping[str, Any], patch: Any, namespace: str | None, config: OperatorConfig) -> None:
    """Fill ``patch`` (a dict merged into the pod: its new ``spec`` and the injection's annotation) for a
    labelled pod; raises ``SpecError``. The admission server turns it into a JSONPatch
    (``spotguard.operator.admission.json_patch``)."""
    ns = namespace or (body.get("metadata") or {}).get("namespace") or "default"
    spec, uri = mutated_pod(body, ns, config)
    patch["spec"] = spec
    patch.setdefault("metadata", {}).setdefault("annotations", {})[ANNOTATION_INJECTED] = uri
