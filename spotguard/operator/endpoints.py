"""Which storage endpoints the operator may connect to, with a job's credentials.

A TrainingJob names its store's endpoint (``spec.checkpoint.endpoint``, or
the ``AWS_ENDPOINT_URL`` of its credentials Secret), and the operator reads
that store with the credentials of the job's Secret: without a limit, the
author of a job could have the operator send a Secret it may not read
itself (a gs:// bearer token) to a host of its choosing. So the platform
lists the endpoints the operator may reach (``--allowed-endpoints``, the
chart's ``operator.allowedEndpoints``); a job whose endpoint is not listed
is never connected to, and says so in a condition.

Patterns are ``host`` or ``host:port``; ``*`` stands for one whole DNS label
(``*.minio.svc`` matches ``a.minio.svc``, not ``a.b.minio.svc``), a port of
``*`` or no port for any port, and ``*`` alone for every endpoint.
Always allowed, list or not:

* no endpoint at all: the store the operator's own environment names
  (``AWS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST``) or the cloud's, both the
  platform's choice;
* the cloud's own endpoints for the storage's scheme over HTTPS: AWS S3's for
  s3://, Google's for gs:// (:data:`CLOUD_ENDPOINTS`). Credentials sent there
  go back to the provider that issued them.

Pure: no I/O.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

#: The cloud's own storage endpoints per URI scheme, allowed over HTTPS without being listed.
CLOUD_ENDPOINTS: dict[str, tuple[str, ...]] = {
    "s3": (
        "s3.amazonaws.com",
        "s3.*.amazonaws.com",
        "s3.dualstack.*.amazonaws.com",
        "s3-fips.*.amazonaws.com",
        "s3-fips.dualstack.*.amazonaws.com",
        "s3.*.amazonaws.com.cn",
    ),
    "gs": ("storage.googleapis.com",),
}

_LABEL = re.compile(r"^(\*|[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)$")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def parse_patterns(text: str | Iterable[str]) -> tuple[str, ...]:
    """Pure: the patterns of ``--allowed-endpoints`` (comma-separated, or a list), normalized.

    Raises ValueError naming a pattern that is not ``host[:port]`` (a URL's
    scheme or path, an empty label, a port that is no number)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    for raw in items:
        item = raw.strip().lower()
        if not item:
            continue
        host, port = _split(item)
        problem = _pattern_problem(host, port)
        if problem:
            raise ValueError(f"{raw.strip()!r} is not an endpoint pattern ({problem}): use HOST or HOST:PORT")
        out.append(item)
    return tuple(dict.fromkeys(out))


def _split(item: str) -> tuple[str, str | None]:
    """``host[:port]`` (an IPv6 address in brackets) into host and port (None: none given)."""
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else (rest or None)
    if item.count(":") == 1:
        host, _, port = item.partition(":")
        return host, port
    return item, None


def _pattern_problem(host: str, port: str | None) -> str | None:
    if "/" in host or "@" in host:
        return "no scheme, user or path"
    if port is not None and port != "*" and not (port.isdigit() and 0 < int(port) < 65536):
        return f"port {port!r}"
    if host == "*":
        return None
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"host {host!r}"
        return None
    if not all(_LABEL.match(label) for label in host.split(".")):
        return f"host {host!r}"
    return None


def _host_matches(pattern: str, host: str) -> bool:
    if pattern == "*":
        return True
    want, got = pattern.split("."), host.split(".")
    return len(want) == len(got) and all(w in ("*", g) for w, g in zip(want, got, strict=True))


def matches(pattern: str, endpoint: str) -> bool:
    """Pure: whether an endpoint URL (``http(s)://host[:port]/...``) matches one pattern."""
    parts = urlsplit(endpoint.strip())
    host = (parts.hostname or "").lower().rstrip(".")
    try:
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme.lower())
    except ValueError:
        return False
    if not host or parts.scheme.lower() not in _DEFAULT_PORTS:
        return False
    want_host, want_port = _split(pattern)
    if want_port not in (None, "*") and str(port) != want_port:
        return False
    return _host_matches(want_host, host)


def endpoint_allowed(storage: str, endpoint: str | None, allowed: Sequence[str]) -> bool:
    """Pure: whether the operator may connect to ``endpoint`` for the storage URI ``storage``.

    ``None`` (no endpoint: the operator's own default) always may; the cloud's
    endpoints of the URI's scheme over HTTPS always may; otherwise a pattern of
    ``allowed`` must match."""
    if not endpoint:
        return True
    scheme = storage.split("://", 1)[0].lower() if "://" in storage else ""
    if urlsplit(endpoint.strip()).scheme.lower() == "https" and any(
        matches(p, endpoint) for p in CLOUD_ENDPOINTS.get(scheme, ())
    ):
        return True
    return any(matches(p, endpoint) for p in allowed)


def endpoint_name(endpoint: str) -> str:
    """Pure: an endpoint's ``host[:port]`` as messages name it (never a user or password in the URL)."""
    parts = urlsplit(endpoint.strip())
    host = parts.hostname or "?"
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{host}:{port}" if port else host


def refusal(storage: str, endpoint: str | None, allowed: Sequence[str], source: str) -> str | None:
    """Pure: why the operator does not connect to a job's endpoint (one line), or None when it may.

    ``source`` names where the endpoint came from (``spec.checkpoint.endpoint``, the Secret's key)."""
    if endpoint_allowed(storage, endpoint, allowed):
        return None
    assert endpoint is not None
    listed = ", ".join(allowed) if allowed else "none besides the cloud's own"
    return (
        f"the endpoint {endpoint_name(endpoint)} ({source}) is not among those the platform allows"
        f" (--allowed-endpoints: {listed}): the operator sent it no request and no credential."
        " Use an allowed endpoint, or ask the cluster's administrators to allow this one"
    )


__all__ = ["CLOUD_ENDPOINTS", "endpoint_allowed", "endpoint_name", "matches", "parse_patterns", "refusal"]
