"""``spotguard demo``: the zero-setup main job, run as a user runs it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from sidecar_helpers import base_env, spotguard_argv


def _demo(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        spotguard_argv("demo", *args), env=env, cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )


def test_demo_is_bitwise_identical(tmp_path: Path) -> None:
    result = _demo([], base_env(), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "bitwise identical: yes"
    assert "  preemptions survived: 3/3" in lines
    assert "  steps lost per preemption: 0, 0, 0" in lines
    # Temporary files are cleaned up; nothing is left in the working directory.
    assert list(tmp_path.iterdir()) == []


@pytest.mark.integration
def test_demo_on_s3(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    result = _demo(
        [
            "--storage",
            s3_uri,
            "--steps",
            "100",
            "--preemptions",
            "1",
            "--seed",
            "7",
            "--workdir",
            str(tmp_path / "demo"),
        ],
        base_env(s3_store.env()),
        tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "bitwise identical: yes"
    assert "  preemptions survived: 1/1" in lines
    assert f"storage: {s3_uri}" in lines
