"""The security context of the containers spotguard injects (pure), and the writable paths they need.

Every container spotguard adds to a pod (the restore init container, the
sidecar) runs as Pod Security "restricted" asks: not as root, no privilege
escalation, every capability dropped, the runtime's default seccomp profile,
and a read-only root filesystem. The user's own containers are left as the
template has them.

With the root read-only, spotguard's containers write only to their volumes:

* the staging volume (``/var/lib/spotguard``: the checkpoints and the control
  directory) and the memory volume (``checkpoint.memoryStaging``), as before;
* ``/tmp``, an ``emptyDir`` of their own (:data:`TMP_DIR`): Python's temporary
  files (a pickle being verified spills there past 64 MiB);
* the termination message file (``/dev/termination-log``), which kubelet
  provides outside the root filesystem.

The user and group are the template's when it names a non-root one (the
trainer's container first, then the pod's): the trainer and the sidecar
share files in the staging volume, and each must be able to remove what the
other wrote. Otherwise the image's own user, 65532 (see the Dockerfile).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spotguard.operator.spec import TMP_VOLUME

#: The user and group of the spotguard image (``USER 65532:65532`` in the Dockerfile).
IMAGE_UID = 65532
IMAGE_GID = 65532
#: Where spotguard's containers get a writable temporary directory.
TMP_DIR = "/tmp"  # noqa: S108 - an emptyDir of the pod's own, mounted at the usual place


def _context_id(context: Any, key: str) -> int | None:
    value = context.get(key) if isinstance(context, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _template_id(pod_spec: Mapping[str, Any], key: str) -> int | None:
    """A non-root ``runAsUser``/``runAsGroup`` the template names: its first container's, else the pod's."""
    containers = pod_spec.get("containers") or []
    first = containers[0] if containers and isinstance(containers[0], Mapping) else {}
    return _context_id(first.get("securityContext"), key) or _context_id(pod_spec.get("securityContext"), key)


def injected_security_context(pod_spec: Mapping[str, Any]) -> dict[str, Any]:
    """The ``securityContext`` of each container spotguard injects into ``pod_spec`` (its template).

    Root (0) in the template is not taken over: ``runAsNonRoot`` must hold for
    spotguard's containers whatever the trainer runs as.
    """
    return {
        "runAsNonRoot": True,
        "runAsUser": _template_id(pod_spec, "runAsUser") or IMAGE_UID,
        "runAsGroup": _template_id(pod_spec, "runAsGroup") or IMAGE_GID,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
        "readOnlyRootFilesystem": True,
    }


def _named_user(context: Any) -> int | None:
    value = context.get("runAsUser") if isinstance(context, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def trainers_read_ours(pod_spec: Mapping[str, Any], trainers: list[Mapping[str, Any]]) -> bool:
    """Pure: whether every one of ``trainers`` runs as the user spotguard's containers run as,
    by the template's own words, so that a file of mode 0600 one of them writes (the restore
    grant) is the trainers' to read. A trainer whose user the template does not name runs as its
    image's, which may be another: False."""
    ours = injected_security_context(pod_spec)["runAsUser"]
    pod = _named_user(pod_spec.get("securityContext"))
    users = [_named_user(c.get("securityContext")) for c in trainers]
    return bool(trainers) and all((pod if u is None else u) == ours for u in users)


def tmp_volume() -> dict[str, Any]:
    """The ``emptyDir`` behind spotguard's containers' ``/tmp`` (no limit: as the writable layer had none)."""
    return {"name": TMP_VOLUME, "emptyDir": {}}


def tmp_mount() -> dict[str, Any]:
    """How spotguard's containers mount :func:`tmp_volume`."""
    return {"name": TMP_VOLUME, "mountPath": TMP_DIR}
