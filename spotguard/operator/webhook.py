"""Sidecar injection for pods the user's own controllers create (Jobs, JobSets).

A pod labelled ``spotguard.dev/inject: "true"`` gets the same restore init
container, sidecar, shared volume and environment as a TrainingJob's pod,
configured by annotations:

==========================================  ====================================
``spotguard.dev/storage`` (required)        storage root (``s3://…`` / ``file:///…``)
``spotguard.dev/job-name``                  job name (default: the ``job-name`` or
                                            JobSet label, else the owner's name)
``spotguard.dev/credentials-secret``        Secret with ``AWS_ACCESS_KEY_ID`` etc.
``spotguard.dev/endpoint``                  S3 endpoint URL
``spotguard.dev/region``                    S3 region
``spotguard.dev/save-every-steps``          checkpoint interval in steps
``spotguard.dev/save-every-seconds``        checkpoint interval in seconds
``spotguard.dev/checksum``                  ``crc32c`` or ``sha256``
``spotguard.dev/keep-last``                 checkpoints to keep
``spotguard.dev/expose-credentials-to-      ``"true"``: the pod's own containers get the
trainer``                                   storage credentials too (default: only
                                            spotguard's containers)
==========================================  ====================================

The grace period is the pod's own ``terminationGracePeriodSeconds`` (default 60).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spotguard.operator.podbuilder import ANNOTATION_INJECTED, Injection, OperatorConfig, inject
from spotguard.operator.spec import SpecError, parse_checkpoint

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
    "expose-credentials-to-trainer": ("exposeCredentialsToTrainer", bool),
}
_FIELD_TO_ANNOTATION = {f: f"metadata.annotations[{PREFIX}{a}]" for a, (f, _t) in _ANNOTATIONS.items()}

_JOB_LABELS = ("job-name", "batch.kubernetes.io/job-name", "jobset.sigs.k8s.io/jobset-name")


def job_name_of(pod: Mapping[str, Any]) -> str | None:
    """The job a labelled pod belongs to (annotation, Job/JobSet label, or owner)."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    labels = meta.get("labels") or {}
    name = annotations.get(f"{PREFIX}job-name")
    if name:
        return str(name)
    for key in _JOB_LABELS:
        if labels.get(key):
            return str(labels[key])
    for ref in meta.get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") and ref.get("name"):
            return str(ref["name"])
    return None


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
                raise SpecError(where, f"must be \"true\" or \"false\", not {value!r}")
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
        image=config.image,
        image_pull_policy=config.image_pull_policy,
        native_sidecar=config.native_sidecar,
        sidecar_resources=config.sidecar_resources,
    )


def mutated_pod(pod: Mapping[str, Any], namespace: str, config: OperatorConfig) -> tuple[dict[str, Any], str]:
    """The pod's new spec and the annotation value recording the injection."""
    inj = injection_for_pod(pod, namespace, config)
    return inject(pod.get("spec") or {}, inj), inj.storage_uri


def apply_to_patch(body: Mapping[str, Any], patch: Any, namespace: str | None, config: OperatorConfig) -> None:
    """Fill kopf's admission ``patch`` for a labelled pod (raises ``SpecError``)."""
    ns = namespace or (body.get("metadata") or {}).get("namespace") or "default"
    spec, uri = mutated_pod(body, ns, config)
    patch["spec"] = spec
    patch.setdefault("metadata", {}).setdefault("annotations", {})[ANNOTATION_INJECTED] = uri
