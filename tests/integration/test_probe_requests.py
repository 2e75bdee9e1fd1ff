"""The operator's storage probe against a real S3 store: what a poll costs, counted in
``spotguard_operator_storage_requests_total``, and what it logs.

No control plane: the probe reads each job from the reconcile's last look
(``ctx.jobs``), filled here, and the jobs name no credentials Secret (the
store's credentials come from the environment), so no API call is made.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import commit_local, s3_options

from spotguard.checkpoint import upload_checkpoint
from spotguard.operator import kubeapi as rc
from spotguard.operator.metrics import OperatorMetrics
from spotguard.operator.podbuilder import OperatorConfig
from spotguard.operator.probe import CheckpointProbe
from spotguard.storage import open_storage
from testenv.kubetest import job_body

pytestmark = pytest.mark.integration

NS = "team-a"
TRAINER = {"name": "trainer", "image": "trainer:1", "command": ["python", "-m", "train"]}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_probe(s3_store: Any, storage: str, names: list[str], clock: Clock, **kwargs: Any) -> CheckpointProbe:
    ctx = rc.Context(core=None, custom=None, config=OperatorConfig(image="spotguard:test"), metrics=OperatorMetrics())
    for name in names:
        job = job_body(
            name,
            storage,
            TRAINER,
            checkpoint={"storage": storage, "endpoint": s3_store.endpoint_url, "region": s3_store.region},
        )
        job["status"] = {"phase": "Running"}
        ctx.jobs[(NS, name)] = job
    return CheckpointProbe(ctx, workers=1, clock=clock, allowed_endpoints=("127.0.0.1",), **kwargs)


def requests(probe: CheckpointProbe) -> float:
    return probe.ctx.metrics.registry.get_sample_value("spotguard_operator_storage_requests_total") or 0.0


@pytest.fixture
def store_env(s3_store: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The store's credentials in the environment, where a job without a Secret takes them from."""
    for key, value in s3_store.env().items():
        monkeypatch.setenv(key, value)
    return s3_store


def upload(s3_store: Any, uri: str, local: Path, step: int) -> None:
    upload_checkpoint(commit_local(local / f"s{step}", step), open_storage(uri, **s3_options(s3_store)))


def test_a_poll_that_finds_nothing_new_costs_one_request(
    store_env: Any, s3_uri: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    probe = make_probe(store_env, s3_uri, ["a", "b"], clock)
    try:
        for name in ("a", "b"):
            upload(store_env, f"{s3_uri}/{NS}/{name}", tmp_path / name, 10)
        with caplog.at_level(logging.DEBUG):
            assert probe.probe_once(NS, "a") == "changed"
            assert probe.probe_once(NS, "b") == "changed"
            first = requests(probe)
            assert first > 4  # two full reads: the pointer, the listings, the manifests
            assert probe.connections() == 1  # one S3 client for both jobs, its requests counted once
            caplog.clear()
            for round_ in range(1, 4):
                clock.now += 30
                assert probe.probe_once(NS, "a") == "unchanged"
                assert probe.probe_once(NS, "b") == "unchanged"
                assert requests(probe) == first + 2 * round_
        # Nothing changed, so nothing at INFO: neither the probe nor the verification.
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []
        assert not any("ok by sizes-only" in r.getMessage() for r in caplog.records)  # not even at DEBUG: no full read

        # A new checkpoint: read in full at the next poll, said once at INFO.
        upload(store_env, f"{s3_uri}/{NS}/a", tmp_path / "a", 20)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            before = requests(probe)
            assert probe.probe_once(NS, "a") == "changed"
            assert requests(probe) > before + 1
            assert probe.ctx.verified.get(NS, "a")["step"] == 20  # type: ignore[index]
            assert probe.probe_once(NS, "a") == "unchanged"
        infos = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
        assert len(infos) == 1 and infos[0].startswith(f"{NS}/a: newest verified checkpoint: step 20 ("), infos

        # Past the full-read interval: one full read, then quiet again.
        clock.now += 1800
        before = requests(probe)
        assert probe.probe_once(NS, "b") == "unchanged"
        assert requests(probe) > before + 1
        before = requests(probe)
        assert probe.probe_once(NS, "b") == "unchanged"
        assert requests(probe) == before + 1

        # A finished job's last look is a full read, whatever the pointer says.
        probe.ctx.jobs[(NS, "b")]["status"] = {"phase": "Succeeded"}
        before = requests(probe)
        assert probe.probe_once(NS, "b") == "settled"
        assert requests(probe) > before + 1
    finally:
        probe.shutdown()


def test_full_read_seconds_zero_reads_everything_at_every_poll(store_env: Any, s3_uri: str, tmp_path: Path) -> None:
    clock = Clock()
    probe = make_probe(store_env, s3_uri, ["a"], clock, full_read_seconds=0)
    try:
        upload(store_env, f"{s3_uri}/{NS}/a", tmp_path / "a", 10)
        assert probe.probe_once(NS, "a") == "changed"
        costs = []
        for _ in range(3):
            before = requests(probe)
            assert probe.probe_once(NS, "a") == "unchanged"
            costs.append(requests(probe) - before)
        # The old behaviour: the listing, the manifest, the checkpoint's listing, every poll.
        assert costs == [3.0, 3.0, 3.0]
    finally:
        probe.shutdown()


def test_jobs_read_at_once_share_one_client_and_count_once(store_env: Any, s3_uri: str, tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    names = [f"j{i}" for i in range(8)]
    clock = Clock()
    probe = make_probe(store_env, s3_uri, names, clock)
    try:
        for name in names:
            upload(store_env, f"{s3_uri}/{NS}/{name}", tmp_path / name, 10)
        # An operator starting: every job's first read at the same time.
        with ThreadPoolExecutor(len(names)) as pool:
            assert set(pool.map(lambda n: probe.probe_once(NS, n), names)) == {"changed"}
        assert probe.connections() == 1
        assert len({id(h.storage.client) for h in probe._clients.values()}) == 1  # noqa: SLF001
        before = requests(probe)
        with ThreadPoolExecutor(len(names)) as pool:
            assert set(pool.map(lambda n: probe.probe_once(NS, n), names)) == {"unchanged"}
        assert requests(probe) == before + len(names)
    finally:
        probe.shutdown()
