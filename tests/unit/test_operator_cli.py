"""``spotguard operator`` refuses to start with one clear line, not a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotguard.cli", "operator", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_no_configuration(tmp_path: Path) -> None:
    result = run(env={"KUBECONFIG": str(tmp_path / "missing"), "KUBERNETES_SERVICE_HOST": ""})
    assert result.returncode == 2
    assert result.stderr.startswith("spotguard operator: no Kubernetes configuration")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_unreachable_apiserver(tmp_path: Path) -> None:
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {"server": f"https://127.0.0.1:{closed_port()}", "insecure-skip-tls-verify": True},
                    }
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    result = run("--metrics-port", "0", env={"KUBECONFIG": str(cfg), "KUBERNETES_SERVICE_HOST": ""})
    assert result.returncode == 2
    assert result.stderr.startswith("spotguard operator: cannot reach the Kubernetes API")
    assert "Traceback" not in result.stderr


def test_webhook_needs_certificates() -> None:
    result = run("--webhook", env={})
    assert result.returncode == 2
    assert "--webhook needs --webhook-cert and --webhook-key" in result.stderr


def test_help_is_fast_to_import() -> None:
    # The CLI module must not import kopf, kubernetes or prometheus at import time.
    code = (
        "import sys, spotguard.operator.cli; "
        "print(sorted(m for m in ('kopf', 'kubernetes', 'prometheus_client') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
