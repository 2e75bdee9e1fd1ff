"""Pure helpers that read a pod spec: ``$(VAR)`` expansion, downward API values, volume items, log tails."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from testenv.processnode.common import JSON, LOOPBACK

# Volume kinds kubelet always mounts read-only.
READ_ONLY_VOLUMES = ("secret", "configMap", "downwardAPI", "projected")

# Kubelet's termination messages: the file's last 4096 bytes; with
# FallbackToLogsOnError and an empty file after a failure, the last 80 lines of
# the run's log, at most their last 2048 bytes.
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"
MAX_TERMINATION_MESSAGE = 4096
MAX_LOG_TAIL_LINES = 80
MAX_LOG_TAIL_BYTES = 2048


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_vars(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined variables are replaced, ``$$`` is ``$``."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(sub, text)


def read_only_root(container: JSON) -> bool:
    """Whether a container asks for a read-only root filesystem (``securityContext.readOnlyRootFilesystem``)."""
    context = container.get("securityContext") or {}
    return context.get("readOnlyRootFilesystem") is True


class Unsupported(Exception):
    """The pod asks for something this stand-in does not emulate (a permanent error)."""


class NotYet(Exception):
    """Something the pod needs does not exist yet (a Secret, a key): kubelet retries."""


_LABEL_REF = re.compile(r"metadata\.(labels|annotations)\['(.+)'\]")


def field_value(pod: JSON, path: str, pod_ip: str = LOOPBACK) -> str:
    """A downward API ``fieldRef`` value for a pod with IP ``pod_ip`` running on this loopback node."""
    md, spec = pod["metadata"], pod["spec"]
    m = _LABEL_REF.fullmatch(path)
    if m:
        return str((md.get(m.group(1)) or {}).get(m.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):  # downwardAPI volumes only
        items = md.get(path.split(".")[1]) or {}
        return "".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(items.items()))
    simple = {
        "metadata.name": md.get("name", ""),
        "metadata.namespace": md.get("namespace", ""),
        "metadata.uid": md.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": LOOPBACK,
    }
    if path not in simple:
        raise Unsupported(f"fieldRef {path!r} is not supported by the process node")
    return str(simple[path])


def log_tail(data: bytes, max_lines: int = MAX_LOG_TAIL_LINES, max_bytes: int = MAX_LOG_TAIL_BYTES) -> bytes:
    """Kubelet's fallback termination message: the last ``max_lines`` lines of a log, then their last ``max_bytes``."""
    start = len(data)
    for _ in range(max_lines):
        if start == 0:
            break
        start = data.rfind(b"\n", 0, start - 1) + 1
    return data[start:][-max_bytes:] if max_bytes else b""


def read_tail(path: Path, limit: int, start: int = 0) -> bytes:
    """At most the last ``limit`` bytes of ``path`` from offset ``start`` on; empty if it cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(max(start, os.fstat(f.fileno()).st_size - limit))
            return f.read(limit)
    except OSError:
        return b""


def exit_code_of(returncode: int) -> int:
    """Popen's returncode (negative for signals) as a container exit code (128 + signal)."""
    return 128 - returncode if returncode < 0 else returncode


def safe_relpath(rel: str) -> str:
    """A volume item path must stay inside its volume, as the apiserver also checks."""
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or ".." in parts:
        raise Unsupported(f"volume item path {rel!r} must be relative and must not contain '..'")
    return rel


def projected_items(
    data: dict[str, bytes], items: list[JSON] | None, optional: bool, what: str
) -> dict[str, tuple[bytes, int | None]]:
    """Files of a secret/configMap volume source: every key, or just the listed ``items``.

    ``what`` names the kind in kubelet's message for a missing key: ``secret`` or ``config``.
    """
    if not items:
        return {safe_relpath(k): (v, None) for k, v in data.items()}
    out: dict[str, tuple[bytes, int | None]] = {}
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise NotYet(f"references non-existent {what} key: {item['key']}")
        out[safe_relpath(item["path"])] = (data[item["key"]], item.get("mode"))
    return out
