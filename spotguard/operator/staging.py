"""The staging spec: where a pod writes its checkpoints before the sidecar uploads them.

``spec.checkpoint.staging`` picks the pod volume behind the shared checkpoint
directory: an ``emptyDir`` (the node's disk, or memory), an ``ephemeral``
volume (a per-pod claim of a StorageClass), or a ``hostPath`` (a node's local
NVMe). This module parses and validates it, including the Kubernetes
quantities of its sizes (:func:`quantity_bytes`); :mod:`~spotguard.operator.spec`
holds it in ``CheckpointSpec.staging``, and :mod:`~spotguard.operator.podbuilder`
turns it into the pod's volume.
"""

from __future__ import annotations

import math
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from spotguard.contract import env as envvars
from spotguard.operator.specfields import DNS_SUBDOMAIN_RE, SpecError, read_obj, read_str

#: A Kubernetes quantity (``resource.Quantity``): a decimal number and an optional suffix.
_QUANTITY_RE = re.compile(
    r"^(?P<num>\+?([0-9]+(\.[0-9]*)?|\.[0-9]+))(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
#: Its suffixes: below one (n, u, m), powers of 1000 (k to E) and powers of 1024 (Ki to Ei).
_QUANTITY_FACTORS: Mapping[str, Decimal] = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    **{prefix: Decimal(1000) ** power for power, prefix in enumerate("kMGTPE", start=1)},
    **{prefix + "i": Decimal(1024) ** power for power, prefix in enumerate("KMGTPE", start=1)},
}
#: The kinds of ``spec.checkpoint.staging``, as the pod volume sources they become.
STAGING_KINDS = ("emptyDir", "ephemeral", "hostPath")
EMPTY_DIR_MEDIA = ("", "Memory")
#: hostPath staging: where the sidecar mounts its namespace's directory of the node (its pod's own is in it).
NODE_DIR = "/var/lib/spotguard-node"


@dataclass(frozen=True, slots=True)
class StagingSpec:
    """``spec.checkpoint.staging``: the volume the checkpoints are written to before they are uploaded.

    ``kind`` is the pod volume source it becomes (one of :data:`STAGING_KINDS`).
    ``size`` is the quantity the user gave (``emptyDir.sizeLimit`` or
    ``ephemeral.size``); None lets the pod builder derive one from the size of
    the job's last verified checkpoint (see ``podbuilder.staging_size``).
    """

    kind: str
    size: str | None = None
    #: emptyDir: "" (the node's disk) or "Memory" (a tmpfs, counted against the pod's memory).
    medium: str = ""
    #: ephemeral: the StorageClass of the per-pod claim (None: the cluster's default class).
    storage_class: str | None = None
    #: hostPath: the node's directory (local NVMe); each pod gets its own subdirectory in it.
    path: str | None = None


def quantity_bytes(value: Any, path: str) -> int:
    """The bytes a Kubernetes quantity (``"200Gi"``, ``"1.5T"``, ``1000000``) stands for, rounded up.

    Refuses (naming ``path``) anything the apiserver would not take as a
    quantity, and zero or negative sizes: a staging volume of no bytes cannot
    hold a checkpoint.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise SpecError(path, f"must be a Kubernetes quantity such as 200Gi, not {value!r}")
    match = _QUANTITY_RE.match(str(value).strip()) if isinstance(value, str) else _QUANTITY_RE.match(str(value))
    if match is None:
        raise SpecError(path, f"must be a Kubernetes quantity such as 200Gi or 500G, not {value!r}")
    suffix = match.group("suffix") or ""
    try:
        number = Decimal(match.group("num"))
        factor = Decimal(10) ** int(suffix[1:]) if suffix[:1] in ("e", "E") else _QUANTITY_FACTORS[suffix]
    except (InvalidOperation, ValueError, KeyError):
        raise SpecError(path, f"must be a Kubernetes quantity such as 200Gi, not {value!r}") from None
    size = math.ceil(number * factor)
    if size <= 0:
        raise SpecError(path, f"must be a positive size, not {value!r}")
    return size


def _quantity(raw: Mapping[str, Any], key: str, path: str) -> str | None:
    value = raw.get(key)
    if value is None or value == "":
        return None
    quantity_bytes(value, f"{path}.{key}")
    return str(value)


def parse_staging(raw: Any, path: str = "spec.checkpoint.staging") -> StagingSpec | None:
    """Parse ``checkpoint.staging``: exactly one of ``emptyDir``, ``ephemeral``, ``hostPath`` (None when absent)."""
    if raw is None:
        return None
    obj = read_obj(raw, path)
    unknown = sorted(str(k) for k in obj if k not in STAGING_KINDS)
    if unknown:
        raise SpecError(f"{path}.{unknown[0]}", f"is not a staging kind: use one of {', '.join(STAGING_KINDS)}")
    given = [k for k in STAGING_KINDS if obj.get(k) is not None]
    if len(given) != 1:
        what = "none" if not given else " and ".join(given)
        raise SpecError(path, f"must set exactly one of {', '.join(STAGING_KINDS)}, not {what}")
    kind = given[0]
    kpath = f"{path}.{kind}"
    body = read_obj(obj.get(kind), kpath)
    if kind == "emptyDir":
        medium = body.get("medium") or ""
        if medium not in EMPTY_DIR_MEDIA:
            raise SpecError(f"{kpath}.medium", f'must be "" (the node\'s disk) or "Memory", not {medium!r}')
        return StagingSpec(kind, size=_quantity(body, "sizeLimit", kpath), medium=medium)
    if kind == "ephemeral":
        storage_class = read_str(body, "storageClassName", kpath)
        if storage_class is not None and not DNS_SUBDOMAIN_RE.match(storage_class):
            raise SpecError(f"{kpath}.storageClassName", f"must be a StorageClass name, not {storage_class!r}")
        return StagingSpec(kind, size=_quantity(body, "size", kpath), storage_class=storage_class)
    host = read_str(body, "path", kpath, required=True)
    assert host is not None
    parts = host.split("/")
    if not host.startswith("/") or host.rstrip("/") == "" or ".." in parts:
        raise SpecError(f"{kpath}.path", f"must be an absolute directory on the node other than /, not {host!r}")
    return StagingSpec(kind, path=host.rstrip("/"))


def parse_host_path_prefix(text: str | None) -> str | None:
    """The operator's ``--staging-host-path-prefix`` (None or "": hostPath staging is off).

    Raises ValueError for a prefix that is not an absolute, normalized
    directory, or that is ``/`` (which would let a job have any directory of
    its node).
    """
    if not text:
        return None
    prefix = text.rstrip("/")
    if not text.startswith("/") or not prefix:
        raise ValueError(f"must be an absolute directory other than /, not {text!r}")
    if posixpath.normpath(prefix) != prefix:
        raise ValueError(f"must be a normalized path (no '.', '..' or '//'), not {text!r}")
    return prefix


def check_host_path(staging: StagingSpec | None, prefix: str | None, path: str = "spec.checkpoint.staging") -> None:
    """Refuse a ``hostPath`` staging the platform does not allow (``SpecError`` naming the field).

    A hostPath gives the pod a directory of its node, outside anything the
    cluster accounts for: it must lie under the prefix the platform set
    (``--staging-host-path-prefix``, the chart's ``staging.hostPathPrefix``),
    and without one no job may use hostPath staging at all.
    """
    if staging is None or staging.kind != "hostPath":
        return
    field = f"{path}.hostPath.path"
    if prefix is None:
        raise SpecError(
            field,
            "hostPath staging is off in this cluster: the platform allows it by setting the operator's"
            " staging host path prefix (chart value staging.hostPathPrefix); use emptyDir or ephemeral staging",
        )
    host = staging.path or ""
    if posixpath.normpath(host) != host or not (host == prefix or host.startswith(f"{prefix}/")):
        raise SpecError(field, f"must be a normalized directory under {prefix}/ (the platform's prefix), not {host!r}")


def sidecar_pod_dir(volume: str, staging: StagingSpec | None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """hostPath staging: the sidecar's mount of its namespace's directory of the node (of volume ``volume``),
    and the variable naming its pod's own directory there, which it removes at its end
    (see :mod:`~spotguard.operator.stagingdirs`). None for any other staging.

    ``$(POD_NAME)`` is expanded by kubelet: the contract's environment defines it earlier.
    """
    if staging is None or staging.kind != "hostPath":
        return None
    mount = {"name": volume, "mountPath": NODE_DIR, "subPathExpr": "$(POD_NAMESPACE)"}
    value = envvars.to_env(envvars.STAGING_POD_DIR, f"{NODE_DIR}/$(POD_NAME)")
    return mount, {"name": envvars.STAGING_POD_DIR.name, "value": value}
