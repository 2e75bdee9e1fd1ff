"""Access to the apiserver: plain JSON in and out, authenticated by a kubeconfig."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from testenv.processnode.common import JSON


class ApiError(Exception):
    """A non-2xx answer from the apiserver."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status
        self.body = body


class Kube:
    """Minimal JSON-in/JSON-out access to the apiserver, authenticated by a kubeconfig.

    Objects stay plain dicts (camelCase, as on the wire); that keeps status
    patches exact and avoids model round-trips.
    """

    def __init__(self, kubeconfig: str | os.PathLike[str]) -> None:
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        cfg.connection_pool_maxsize = 64  # one thread per pod, plus heartbeats
        self._api = client.ApiClient(cfg)
        self.server: str = cfg.host

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float | tuple[float, float] = 30.0,
        stream: bool = False,
    ) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = self._api.call_api(
                path,
                method,
                query_params=list((query or {}).items()),
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout,
            )
        except ApiException as exc:
            raise ApiError(int(exc.status or 0), str(exc.body or exc.reason)) from None
        if stream:
            return resp
        return json.loads(resp.data) if resp.data else {}

    def get(self, path: str, query: dict[str, str] | None = None) -> JSON:
        return dict(self.request("GET", path, query=query))

    def post(self, path: str, body: JSON) -> JSON:
        return dict(self.request("POST", path, body))

    def patch(self, path: str, body: JSON) -> JSON:
        """JSON merge patch: lists are replaced whole, which status updates rely on."""
        return dict(self.request("PATCH", path, body, content_type="application/merge-patch+json"))

    def delete(self, path: str, body: JSON | None = None) -> None:
        self.request("DELETE", path, body)


def ignore_missing(exc: ApiError) -> None:
    if exc.status != 404:
        raise exc


def watch_lines(resp: Any) -> Iterator[bytes]:
    """Newline-delimited JSON from a streaming watch response."""
    buf = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield line
    if buf.strip():
        yield buf
