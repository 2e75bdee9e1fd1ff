"""A container registry on 127.0.0.1 that nodes pull the project's images from.

Debian's ``docker-registry`` (distribution 2.8), plain HTTP on a free loopback
port, its storage under a state directory, started and stopped by a
``testenv.cluster.Supervisor`` (own process group, nothing left running).

    with running_registry(sup) as reg:        # or start_registry(sup); sup.stop() stops it
        refs = reg.push_images(build_all())   # {"spotguard": "127.0.0.1:PORT/spotguard/spotguard:0.1.0", ...}
        reg.address                           # "127.0.0.1:PORT": the chart's image.registry value
        reg.tags("spotguard/spotguard")       # what the registry serves

A node's runtime pulls ``<address>/spotguard/spotguard:<version>`` and
``<address>/spotguard/spotguard-torch:<version>`` over plain HTTP: containerd
needs the address declared as an HTTP host (``hosts.toml`` with
``server = "http://<address>"``), as for any insecure registry.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testenv.cluster import Service, Supervisor, free_port, wait_until
from testenv.images import TARGETS, BuiltImage, ImageBuildError, build_all, images_dir, push, report, tool


@dataclass
class Registry:
    """A running registry: ``address`` (``127.0.0.1:PORT``) and the images pushed to it."""

    address: str
    storage: Path
    service: Service
    #: target -> reference in this registry, for each image pushed by :meth:`push_images`.
    refs: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def get(self, path: str) -> Any:
        """A JSON answer of the registry's v2 API."""
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as resp:  # noqa: S310 - a loopback URL
            return json.loads(resp.read())

    def catalog(self) -> list[str]:
        repos: list[str] = self.get("/v2/_catalog")["repositories"] or []
        return repos

    def tags(self, repository: str) -> list[str]:
        tags: list[str] = self.get(f"/v2/{repository}/tags/list").get("tags") or []
        return tags

    def push_images(self, images: Iterable[BuiltImage]) -> dict[str, str]:
        images = list(images)
        for img, ref in zip(images, push(images, self.address, tls_verify=False), strict=True):
            self.refs[img.target] = ref
        return dict(self.refs)


def _config(storage: Path, port: int) -> str:
    # JSON is YAML: the registry reads it as its config file.
    return json.dumps(
        {
            "version": 0.1,
            "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
            "http": {"addr": f"127.0.0.1:{port}", "headers": {"X-Content-Type-Options": ["nosniff"]}},
        },
        indent=2,
    )


def start_registry(sup: Supervisor, storage: Path | None = None) -> Registry:
    """A registry under ``sup`` (stopped with it); its blobs in ``storage``, by default kept in the
    cache (``$SPOTGUARD_CACHE/images/registry``): a push then sends only the layers that registry
    has not seen, compressed once. Registries of parallel sessions may share it: blobs are
    content-addressed and a tag names the same image in every session."""
    exe = tool("docker-registry")
    state = sup.state_dir / "registry"
    state.mkdir(parents=True, exist_ok=True)
    storage = storage or images_dir() / "registry"
    storage.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = state / "config.yml"
    config.write_text(_config(storage, port))
    svc = sup.start("registry", [exe, "serve", str(config)])
    address = f"127.0.0.1:{port}"

    def ready() -> bool:
        with urllib.request.urlopen(f"http://{address}/v2/", timeout=2) as resp:  # noqa: S310 - a loopback URL
            return bool(resp.status == 200)

    wait_until(ready, 30, "registry", svc)
    return Registry(address, storage, svc)


@contextlib.contextmanager
def running_registry(state_dir: Path) -> Iterator[Registry]:
    """A registry of its own supervisor in ``state_dir``, stopped on leaving."""
    sup = Supervisor(state_dir)
    try:
        yield start_registry(sup)
    finally:
        sup.stop()


def serve(state_dir: Path, images: dict[str, BuiltImage]) -> int:
    """``python -m testenv.registry``: push ``images`` to a fresh registry and keep it up
    until SIGINT/SIGTERM; its address is also written to ``<state_dir>/address``."""
    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    report(images)
    stop = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        with running_registry(state_dir) as reg:
            for target, ref in reg.push_images(images.values()).items():
                print(f"{target}: {ref}", flush=True)
            (state_dir / "address").write_text(reg.address)
            print(f"registry on {reg.url}: helm ... --set image.registry={reg.address}; Ctrl-C stops it", flush=True)
            while not stop and reg.service.popen.poll() is None:
                time.sleep(0.5)
    except ImageBuildError as exc:
        print(f"registry: {exc}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(OSError):
            (state_dir / "address").unlink()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testenv.registry", description=serve.__doc__)
    parser.add_argument("--state-dir", default=".dev/registry")
    parser.add_argument("--target", action="append", choices=TARGETS, help="only this image (repeatable)")
    args = parser.parse_args(argv)
    try:
        images = build_all(args.target or TARGETS)
    except ImageBuildError as exc:
        print(f"registry: {exc}", file=sys.stderr)
        return 1
    return serve(Path(args.state_dir), images)


if __name__ == "__main__":
    sys.exit(main())
