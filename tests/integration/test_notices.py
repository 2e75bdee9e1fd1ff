"""Early notices end to end: each provider's notice gets a checkpoint verified before SIGTERM.

The providers are the fake metadata servers of ``notice_fakes``; the
Kubernetes notice is a DisruptionTarget condition on a real pod.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from notice_fakes import PROVIDERS, serve
from sidecar_helpers import (
    Proc,
    base_env,
    free_port,
    metric,
    reaping,
    s3_storage,
    scrape,
    spotguard_argv,
    train_argv,
    wait_until,
)

from spotguard.checkpoint import latest_verified

# --- A notice from each provider gets a checkpoint verified before any SIGTERM ---------------


def _notice_run(
    tmp_path: Path,
    s3_store: Any,
    s3_uri: str,
    sidecar_args: list[str],
    extra_env: dict[str, str],
    trigger: Callable[[], None],
    source: str,
    settled: Callable[[], bool] = lambda: True,
) -> None:
    """Trainer + sidecar; fire the notice; a checkpoint must verify while both still run."""
    port = free_port()
    storage = s3_storage(s3_store, s3_uri)
    env = base_env(
        {
            **s3_store.env(),
            **extra_env,
            "SPOTGUARD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
            "SPOTGUARD_STORAGE_URI": s3_uri,
        }
    )
    with reaping() as procs:
        # No routine checkpoints: only the notice can cause one.
        trainer = Proc(train_argv(100_000, None, 0.02, save_every=1_000_000), env, tmp_path / "trainer.log")
        sidecar = Proc(
            spotguard_argv(
                "sidecar",
                "--metrics-port",
                str(port),
                "--metrics-addr",
                "127.0.0.1",
                "--notice-interval",
                "0.2",
                *sidecar_args,
            ),
            env,
            tmp_path / "sidecar.log",
        )
        procs += [trainer, sidecar]
        trainer.wait_for_step(3)
        wait_until(lambda: scrape(port), 60, "the metrics endpoint")
        assert latest_verified(storage)[0] is None
        noticed_at = trainer.last_step
        assert noticed_at is not None
        trigger()
        info = wait_until(lambda: latest_verified(storage)[0], 120, "a checkpoint verified after the notice")
        assert info.step >= noticed_at
        wait_until(
            lambda: metric(scrape(port), "spotguard_checkpoint_emergency_duration_seconds_count", source=source) == 1,
            60,
            "the notice's checkpoint in the metrics",
        )
        wait_until(settled, 30, "the provider to be acknowledged")
        samples = scrape(port)
        assert metric(samples, "spotguard_preemption_notices_total", source=source) == 1
        # The metric names a verified step: the notice's, or one verified since the test read storage.
        newest = latest_verified(storage)[0]
        assert newest is not None
        assert info.step <= (metric(samples, "spotguard_checkpoint_last_verified_step") or -1) <= newest.step
        # Before any SIGTERM: the trainer keeps training, the sidecar keeps running.
        assert trainer.popen.poll() is None and sidecar.popen.poll() is None
        assert f"notice source={source}" in sidecar.text()
        # Then the preemption itself, as kubelet delivers it.
        trainer.signal(signal.SIGTERM)
        sidecar.signal(signal.SIGTERM)
        assert sidecar.wait() == 0, sidecar.tail()
        assert trainer.wait() == 0, trainer.tail()
    final, _ = latest_verified(storage)
    assert final is not None and final.step > info.step


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(PROVIDERS))
def test_cloud_notice_checkpoints_before_sigterm(name: str, s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    make, notices, flag, trigger, source = PROVIDERS[name]
    with serve(make()) as fake:
        settled: Callable[[], bool] = lambda: True  # noqa: E731
        if name == "azure":
            settled = lambda: fake.approved == ["602d9444-d2cd-49c7-8624-8643e7171297"]  # noqa: E731
        _notice_run(
            tmp_path,
            s3_store,
            s3_uri,
            ["--notices", notices, flag, fake.url],
            {},
            lambda: trigger(fake),
            source,
            settled,
        )
        if name == "azure":
            # Approved only after the checkpoint was verified: exactly once.
            assert fake.count("POST", "/metadata/scheduledevents") == 1


@pytest.mark.integration
def test_kubernetes_disruption_target_checkpoints_before_sigterm(
    kube: Any, s3_store: Any, s3_uri: str, tmp_path: Path
) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube.api_client())
    name = f"notice-{uuid.uuid4().hex[:8]}"
    core.create_namespaced_pod(
        "default",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "terminationGracePeriodSeconds": 60,
                # Never scheduled: only its status matters here.
                "nodeSelector": {"spotguard.dev/no-such-node": "true"},
                "containers": [{"name": "trainer", "image": "trainer:latest", "command": ["true"]}],
            },
        },
    )

    def disrupt() -> None:
        core.patch_namespaced_pod_status(
            name,
            "default",
            {
                "status": {
                    "conditions": [
                        {
                            "type": "DisruptionTarget",
                            "status": "True",
                            "reason": "TerminationByKubelet",
                            "message": "Pod was terminated in response to imminent node shutdown.",
                            "lastTransitionTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                        }
                    ]
                }
            },
        )

    try:
        _notice_run(
            tmp_path,
            s3_store,
            s3_uri,
            ["--notices", "k8s"],
            {"POD_NAME": name, "POD_NAMESPACE": "default", **kube.env()},
            disrupt,
            "k8s",
        )
    finally:
        core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
