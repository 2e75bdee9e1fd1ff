"""``spotguard run --notices``: a cloud notice yields a verified checkpoint before any SIGTERM.

The same fake metadata servers (``notice_fakes``) as ``test_notices.py``;
the trainer runs under ``spotguard run``, whose in-process sidecar duties
include the notice pollers.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
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


@pytest.mark.integration
@pytest.mark.parametrize("name", ["aws", "gce", "azure"])
def test_run_notices_checkpoint_before_sigterm(name: str, s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    make, notices, flag, trigger, source = PROVIDERS[name]
    port = free_port()
    storage = s3_storage(s3_store, s3_uri)
    with serve(make()) as fake, reaping() as procs:
        # No routine checkpoints: only the notice can cause one. The
        # notice sources come from the environment here, the endpoint from a flag.
        env = base_env({**s3_store.env(), "SPOTGUARD_NOTICES": notices})
        run = Proc(
            spotguard_argv(
                "run",
                "--workdir",
                str(tmp_path / "work"),
                "--storage",
                s3_uri,
                "--metrics-port",
                str(port),
                "--notice-interval",
                "0.2",
                flag,
                fake.url,
                "--",
                *train_argv(100_000, None, 0.02, save_every=1_000_000),
            ),
            env,
            tmp_path / "run.log",
        )
        procs.append(run)
        run.wait_for_step(3)
        wait_until(lambda: scrape(port), 60, "the metrics endpoint")
        assert latest_verified(storage)[0] is None
        noticed_at = run.last_step
        assert noticed_at is not None
        trigger(fake)
        info = wait_until(lambda: latest_verified(storage)[0], 120, "a checkpoint verified after the notice")
        assert info.step >= noticed_at
        wait_until(
            lambda: metric(scrape(port), "spotguard_checkpoint_emergency_duration_seconds_count", source=source) == 1,
            60,
            "the notice's checkpoint in the metrics",
        )
        settled: Callable[[], bool] = lambda: True  # noqa: E731
        if name == "azure":
            settled = lambda: fake.approved == ["602d9444-d2cd-49c7-8624-8643e7171297"]  # noqa: E731
        wait_until(settled, 30, "the provider to be acknowledged")
        assert metric(scrape(port), "spotguard_preemption_notices_total", source=source) == 1
        # Before any SIGTERM: training goes on.
        assert run.popen.poll() is None
        assert f"notice source={source}" in run.text()
        run.signal(signal.SIGTERM)
        assert run.wait() == 128 + signal.SIGTERM, run.tail()
    final, _ = latest_verified(storage)
    assert final is not None and final.step > info.step
