"""The rendered pod carries what a finished trainer's wait for its last checkpoint needs
(beside a native sidecar, which kubelet stops once the trainer exits)."""

from __future__ import annotations

from typing import Any

import pytest

from spotguard.contract import env as envvars
from spotguard.operator.podbuilder import OperatorConfig, build_pod
from spotguard.operator.spec import parse
from spotguard.trainer.config import CheckpointerConfig

SPEC: dict[str, Any] = {
    "nodes": 2,
    "template": {
        "spec": {
            "initContainers": [{"name": "fetch-data", "image": "fetch:1"}],
            "containers": [{"name": "trainer", "image": "trainer:1"}],
        }
    },
    "checkpoint": {"storage": "s3://bucket/root", "credentialsSecret": {"name": "s3"}},
    "preemption": {"gracePeriodSeconds": 45},
}


def render(native: bool, rank: int = 0) -> dict[str, Any]:
    cfg = OperatorConfig(image="spotguard:test", native_sidecar=native)
    return build_pod("demo", "team-a", "uid-1", parse(SPEC), 2, cfg, rank=rank)["spec"]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def by_name(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


@pytest.mark.parametrize("rank", [0, 1])
def test_beside_a_native_sidecar_the_trainer_waits_for_its_last_checkpoint(rank: int) -> None:
    spec = render(native=True, rank=rank)
    pods = by_name(spec)
    name = envvars.FINAL_VERIFY_SECONDS.name
    trainer = env_of(pods["trainer"])
    # As long as a classic sidecar would ship a finished trainer's last checkpoint without progress.
    assert trainer[name] == envvars.to_env(envvars.FINISH_SECONDS, envvars.FINISH_SECONDS.default) == "600"
    # The Checkpointer in that container reads it as its bound.
    assert CheckpointerConfig.from_env(trainer).final_verify_seconds == 600.0
    # Only the training code's containers wait; spotguard's own never do.
    assert name not in env_of(pods["spotguard-sidecar"]) and name not in env_of(pods["spotguard-restore"])
    # The wait comes before kubelet stops the sidecar: the grace period is the spec's, for preemptions.
    assert spec["terminationGracePeriodSeconds"] == 45
    assert pods["spotguard-sidecar"]["restartPolicy"] == "Always"


def test_beside_a_classic_sidecar_the_trainer_does_not_wait() -> None:
    pods = by_name(render(native=False))
    # The classic sidecar keeps the pod up itself until the last checkpoint is verified.
    assert envvars.FINAL_VERIFY_SECONDS.name not in env_of(pods["trainer"])
    assert CheckpointerConfig.from_env(env_of(pods["trainer"])).final_verify_seconds == 0.0
