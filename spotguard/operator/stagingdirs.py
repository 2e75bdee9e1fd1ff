"""hostPath staging: each pod's own directory of its node, and its removal when the attempt ends.

A ``spec.checkpoint.staging.hostPath`` is shared by every pod on the node, so
each pod mounts its own subdirectory ``<path>/<namespace>/<pod>``
(``podbuilder.HOST_PATH_SUBDIR``). kubelet never removes it, as it removes an
emptyDir; spotguard does, in two steps:

1. **The sidecar, at its end.** It also mounts ``<path>/<namespace>`` (at
   ``staging.NODE_DIR``) and, once the trainer is gone and its last upload is
   done, removes its pod's directory and says so in its termination report
   (``podDirRemoved``). This covers every end the sidecar lives through: the
   trainer finishing or failing, a drain (eviction), a graceful node shutdown.
2. **The operator, for the rest.** A pod that ended (``Succeeded`` or
   ``Failed``) without that word from its sidecar (the sidecar was killed, or
   could not remove a file), or that is being deleted (its sidecar may not
   live through it), gets a cleanup pod on its node while the node exists
   (:func:`cleanup_pod`): the spotguard image, ``rm -rf`` of that one
   directory once the pod's grace period is over, under the same security
   context as the injected containers. A cleanup pod that succeeded goes once
   its pod has gone (until then it records that the directory is gone); one
   that failed is reported by a ``StagingCleanupFailed`` Event on the job.

A node that is gone (its Node object deleted: a spot instance reclaimed) took
its disk with it, and nothing is left to remove. The directory holds only
what its pod staged: the next attempt resumes from storage, never from it,
exactly as from an emptyDir.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from spotguard.contract.report import TerminationReport
from spotguard.operator.apierrors import api_reason, api_status
from spotguard.operator.jobstatus import Event
from spotguard.operator.kubeapi import Context, NotOursYet, create_pod, delete_pod, node_exists, post_event
from spotguard.operator.podbuilder import LABEL_ATTEMPT, LABEL_JOB, LABEL_MANAGED_BY
from spotguard.operator.podsecurity import injected_security_context
from spotguard.operator.spec import API_VERSION, KIND, SHARED_VOLUME, SIDECAR_CONTAINER, TrainingJobSpec
from spotguard.operator.times import parse_time

log = logging.getLogger("spotguard.operator")

#: On a cleanup pod: the attempt pod whose directory it removes.
LABEL_CLEANUP_OF = "spotguard.dev/staging-cleanup-of"
#: Where a cleanup pod mounts its namespace's directory of the node.
CLEANUP_MOUNT = "/staging"
CLEANUP_CONTAINER = "cleanup"
#: A pod being deleted may still write until its grace period is over: the cleanup waits this much longer.
GRACE_MARGIN_SECONDS = 5
#: A cleanup that cannot finish in this time after its wait (a hung disk) ends Failed, and is reported.
CLEANUP_DEADLINE_SECONDS = 300
R_CLEANUP_FAILED = "StagingCleanupFailed"
_ENDED = ("Succeeded", "Failed")


def cleanup_pod_name(pod: str) -> str:
    """The cleanup pod of attempt pod ``pod`` (deterministic: created once, adopted after a restart)."""
    return f"{pod}-staging-cleanup"


def cleanup_pod(
    job: str,
    namespace: str,
    uid: str,
    spec: TrainingJobSpec,
    target: CleanupTarget,
    image: str,
    image_pull_policy: str | None = None,
) -> dict[str, Any]:
    """Pure: the pod that removes ``target``'s directory of its node (hostPath staging)."""
    staging = spec.checkpoint.staging
    assert staging is not None and staging.kind == "hostPath" and staging.path
    script = 'sleep "$1" && exec rm -rf -- "$2"'
    container: dict[str, Any] = {
        "name": CLEANUP_CONTAINER,
        "image": image,
        "command": ["sh", "-c", script, "cleanup", str(target.wait_seconds), f"{CLEANUP_MOUNT}/{target.pod}"],
        "volumeMounts": [{"name": SHARED_VOLUME, "mountPath": CLEANUP_MOUNT, "subPath": namespace}],
        "securityContext": injected_security_context(spec.template.spec),
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if image_pull_policy:
        container["imagePullPolicy"] = image_pull_policy
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": cleanup_pod_name(target.pod),
            "namespace": namespace,
            "labels": {LABEL_JOB: job, LABEL_CLEANUP_OF: target.pod, LABEL_MANAGED_BY: "spotguard"},
            "ownerReferences": [{"apiVersion": API_VERSION, "kind": KIND, "name": job, "uid": uid, "controller": True}],
        },
        "spec": {
            # Bound to the node by name (no scheduling), whatever its taints: a cordoned or draining node too.
            "nodeName": target.node,
            "tolerations": [{"operator": "Exists"}],
            "restartPolicy": "Never",
            "activeDeadlineSeconds": target.wait_seconds + CLEANUP_DEADLINE_SECONDS,
            "automountServiceAccountToken": False,
            "containers": [container],
            "volumes": [{"name": SHARED_VOLUME, "hostPath": {"path": staging.path, "type": "DirectoryOrCreate"}}],
        },
    }


def sidecar_removed_dir(pod: Mapping[str, Any]) -> bool:
    """Whether the pod's sidecar reported its directory removed (its termination report's ``podDirRemoved``)."""
    status = pod.get("status") or {}
    for cs in [*(status.get("containerStatuses") or []), *(status.get("initContainerStatuses") or [])]:
        if not isinstance(cs, Mapping) or cs.get("name") != SIDECAR_CONTAINER:
            continue
        message = ((cs.get("state") or {}).get("terminated") or {}).get("message")
        try:
            return isinstance(message, str) and TerminationReport.parse(message).pod_dir_removed
        except ValueError:
            return False
    return False


@dataclass(frozen=True)
class CleanupTarget:
    """An attempt pod whose directory of its node is to be removed."""

    pod: str
    node: str
    #: Seconds to wait first: what is left of the grace period of a pod being deleted, plus a margin.
    wait_seconds: int = 0


@dataclass(frozen=True)
class CleanupPlan:
    """What to do about the job's pods' directories now."""

    #: Cleanup pods to create, once their node is known to exist.
    create: tuple[CleanupTarget, ...] = ()
    #: Cleanup pods that are done and whose attempt pod has gone.
    delete: tuple[str, ...] = ()
    #: (cleanup pod, why) for the cleanup pods that failed.
    failed: tuple[tuple[str, str], ...] = ()


def plan_cleanup(pods: Sequence[Mapping[str, Any]], now: datetime) -> CleanupPlan:
    """Pure: from every pod of a job (attempt pods and cleanup pods), the cleanups to start, drop and report."""
    attempts: dict[str, Mapping[str, Any]] = {}
    cleanups: dict[str, Mapping[str, Any]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(LABEL_CLEANUP_OF):
            cleanups[str(labels[LABEL_CLEANUP_OF])] = pod
        elif labels.get(LABEL_ATTEMPT):
            attempts[str(meta.get("name"))] = pod
    create = []
    for name, pod in sorted(attempts.items()):
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or name in cleanups:
            continue
        meta = pod.get("metadata") or {}
        deleting = parse_time(meta.get("deletionTimestamp"))
        ended = (pod.get("status") or {}).get("phase") in _ENDED
        if ended and sidecar_removed_dir(pod):
            continue
        if ended:
            create.append(CleanupTarget(name, str(node)))
        elif deleting is not None:
            left = max(0.0, (deleting - now).total_seconds())
            create.append(CleanupTarget(name, str(node), math.ceil(left) + GRACE_MARGIN_SECONDS))
    delete, failed = [], []
    for target, pod in sorted(cleanups.items()):
        name = str((pod.get("metadata") or {}).get("name"))
        status = pod.get("status") or {}
        phase = status.get("phase")
        if phase == "Failed":
            failed.append((name, _why(status)))
        if phase in _ENDED and target not in attempts:
            delete.append(name)
    return CleanupPlan(tuple(create), tuple(delete), tuple(failed))


def _why(status: Mapping[str, Any]) -> str:
    for cs in status.get("containerStatuses") or []:
        terminated = ((cs or {}).get("state") or {}).get("terminated") or {}
        if terminated:
            text = str(terminated.get("message") or "").strip()
            return f"exit code {terminated.get('exitCode')}" + (f": {text}" if text else "")
    return str(status.get("message") or status.get("reason") or "no reason given")


# --- the shell ------------------------------------------------------------------------


def clean_staging(ctx: Context, job: Mapping[str, Any], spec: TrainingJobSpec, now: datetime) -> None:
    """Carry out :func:`plan_cleanup` for a job with hostPath staging (one list call when nothing is to do).

    API errors are logged and tried again at the next look: a directory left a
    little longer never holds the job up.
    """
    staging = spec.checkpoint.staging
    if staging is None or staging.kind != "hostPath":
        return
    meta = job["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
    try:
        listed = ctx.core.list_namespaced_pod(namespace, label_selector=f"{LABEL_JOB}={name}", _preload_content=False)
        plan = plan_cleanup(json.loads(listed.data).get("items") or [], now)
        for failed, why in plan.failed:
            if f"{namespace}/{failed}" not in ctx.reported_cleanups:
                ctx.reported_cleanups.add(f"{namespace}/{failed}")
                message = (
                    f"pod {failed} could not remove a pod's staging directory under {staging.path} on its node"
                    f" ({why}); remove it by hand, and run the trainer as the user of spotguard's containers"
                    " (the template's runAsUser, else 65532) so that they can"
                )
                post_event(ctx, job, Event("Warning", R_CLEANUP_FAILED, message), now)
        for target in plan.create:
            if not node_exists(ctx, target.node):
                continue  # the node went, and its disk with it
            body = cleanup_pod(name, namespace, uid, spec, target, ctx.config.image, ctx.config.image_pull_policy)
            if create_pod(ctx, body, uid):
                log.info(
                    "%s/%s: removing the staging directory of pod %s on node %s",
                    namespace,
                    name,
                    target.pod,
                    target.node,
                )
        for done in plan.delete:
            delete_pod(ctx, namespace, done, force=False)
            ctx.reported_cleanups.discard(f"{namespace}/{done}")
    except NotOursYet:
        return  # a cleanup pod of an older job of this name is still there: the next look
    except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
        if api_status(exc) is None:
            raise
        log.warning("%s/%s: staging cleanup: %s; trying again at the next look", namespace, name, api_reason(exc))
