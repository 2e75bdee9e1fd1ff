"""``spotguard run`` and the sidecar against a failing store: 503 SlowDown for a while, connection
resets, the store stopped and restarted during a run, a preemption while the store
is unreachable.

Every run goes through the fault proxy (``testenv/faultproxy.py``), whose request
log tells when each manifest was stored. A monitor watches the local checkpoint
directory the whole time: a local checkpoint may only disappear once it, or a
newer one, is complete in storage (and verifies at the end). Each run must end with
its newest checkpoint verified, and its metrics must count the failures it met.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sidecar_helpers import (
    Proc,
    base_env,
    free_port,
    metric,
    reaping,
    scrape,
    spotguard_argv,
    wait_until,
)

from spotguard.checkpoint import latest_verified, list_local_committed, upload_checkpoint, verify_checkpoint
from spotguard.storage import StorageError, open_storage
from testenv import cluster
from testenv.faultproxy import FaultProxy, reset, status

pytestmark = pytest.mark.integration

FAILURES = "spotguard_checkpoint_failures_total"

#: A trainer without torch (starts in a second): numpy state through the Checkpointer,
#: the demo trainer's output lines ("resumed from step N", "step N", "preempted after step N").
#: It finishes early, with a final checkpoint, once the stop file exists.
TRAINER = """
import sys, time
import numpy as np
import spotguard

import os
steps, delay, every, stop_file = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ckpt = spotguard.Checkpointer.from_env(save_every_steps=every)
restored = ckpt.restore()
w = np.zeros(100_000, dtype=np.float32)
start = 0
if restored is not None:
    w, start = np.array(restored["w"]), restored.step + 1
    print(f"resumed from step {restored.step}", flush=True)
else:
    print("starting from scratch", flush=True)
step = start - 1
for step in range(start, steps):
    w += np.float32(step % 7)
    print(f"step {step}", flush=True)
    if ckpt.should_save(step):
        ckpt.save(step, {"w": w, "step": step})
    if ckpt.preempted:
        ckpt.close()
        print(f"preempted after step {step}", flush=True)
        sys.exit(0)
    if os.path.exists(stop_file):
        break  # the test has seen what it needed: finish now
    time.sleep(delay)
ckpt.save(step, {"w": w, "step": step}, blocking=True)
ckpt.close()
print(f"finished {steps} steps", flush=True)
"""


def trainer(steps: int, delay: float, save_every: int, stop_file: Path) -> list[str]:
    return [sys.executable, "-c", TRAINER, str(steps), str(delay), str(save_every), str(stop_file)]


def step_of(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


class LossMonitor:
    """Polls a local checkpoint directory and notes when each checkpoint appears and
    disappears, to judge afterwards whether one vanished before it was safe in storage."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.seen: dict[str, float] = {}
        self.gone: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LossMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            names = {p.name for p in list_local_committed(self.directory)} if self.directory.is_dir() else set()
            for name in names:
                self.seen.setdefault(name, now)
                self.gone.pop(name, None)
            for name in set(self.seen) - names:
                self.gone.setdefault(name, now)
            time.sleep(0.05)

    def lost(self, proxy: FaultProxy, storage: Any) -> list[str]:
        """Checkpoints that vanished locally while neither they nor a newer one were
        complete in storage (by the proxy's log of stored manifests), or whose
        stand-in does not verify now."""
        stored = {r.key.split("/")[-2]: r.when for r in proxy.requests("PUT", r"/manifest\.json$") if r.status == 200}
        verifies: dict[str, bool] = {}
        lost = []
        for name, when in sorted(self.gone.items()):
            covering = [y for y, t in stored.items() if step_of(y) >= step_of(name) and t <= when]
            ok = False
            for y in covering:
                if y not in verifies:
                    verifies[y] = verify_checkpoint(storage, y).ok
                ok = ok or verifies[y]
            if not ok:
                lost.append(f"{name} (gone at {when:.2f}; stored manifests {sorted(stored)})")
        return lost


def run_argv(workdir: Path, uri: str, port: int, *train: str, grace: float = 8.0) -> list[str]:
    return spotguard_argv(
        "run",
        "--workdir",
        str(workdir),
        "--storage",
        uri,
        "--max-restarts",
        "3",
        "--backoff",
        "0.1",
        "--metrics-port",
        str(port),
        "--grace-seconds",
        str(grace),
        "--",
        *train,
    )


#: Requests of each writing method answered 503 SlowDown in a load-shedding
#: episode: with two attempts per request, several failures spotguard must retry.
SHED = 6


def run_env(store: Any, proxy: FaultProxy) -> dict[str, str]:
    """The store's credentials, its endpoint replaced by the proxy; two attempts per
    request, so that a fault reaches spotguard's own retries (and metrics) quickly."""
    return base_env(
        {**store.env(), "AWS_ENDPOINT_URL_S3": proxy.url, "AWS_ENDPOINT_URL": proxy.url, "AWS_MAX_ATTEMPTS": "2"}
    )


def manifests_stored(proxy: FaultProxy) -> int:
    return sum(1 for r in proxy.requests("PUT", r"/manifest\.json$") if r.status == 200)


def failures(port: int, stage: str | None = None) -> float:
    """Failures the run's metrics counted, of one stage or of all."""
    samples = scrape(port)
    if stage is not None:
        return metric(samples, FAILURES, stage=stage) or 0.0
    return sum(v for (name, _), v in samples.items() if name == FAILURES)


def shed_load_then_reset(proxy: FaultProxy, port: int) -> None:
    """The store sheds load (every write answers 503 SlowDown until SHED of them are
    spent: counted, not timed, as a loaded machine may send nothing for seconds)
    until the metrics on ``port`` count a failure; then the next three requests,
    whenever they come, have their connection reset."""
    slow = [proxy.add(status(503, "SlowDown"), method=m, times=SHED) for m in ("PUT", "POST")]
    wait_until(lambda: failures(port) >= 1, 60, "a failure counted")
    # Small checkpoints are single PUTs: the episode ends when the PUTs are spent.
    wait_until(lambda: not slow[0].live(time.monotonic()), 60, "the 503s to end")
    proxy.remove(slow[1])
    resets = proxy.add(reset(), times=3)
    wait_until(lambda: resets.hits >= 3, 90, "three reset connections")


def direct(store: Any, uri: str, **options: Any) -> Any:
    return open_storage(
        uri,
        endpoint_url=store.endpoint_url,
        access_key=store.access_key,
        secret_key=store.secret_key,
        region=store.region,
        **options,
    )


def assert_ends_safe(proc: Proc, monitor: LossMonitor, proxy: FaultProxy, storage: Any) -> None:
    """Nothing lost, and the newest checkpoint the trainer wrote is verified in storage."""
    assert not monitor.lost(proxy, storage), monitor.lost(proxy, storage)
    info, _ = latest_verified(storage)
    newest_local = max(monitor.seen, key=step_of)
    assert info is not None and info.step == step_of(newest_local), (info, newest_local, proc.tail())


@pytest.fixture
def proxy(s3_store: Any) -> Iterator[FaultProxy]:
    with FaultProxy(s3_store.endpoint_url) as p:
        yield p


class RestartableStore:
    """A SeaweedFS of this test's own that can be stopped and started again on the
    same ports and data directory (through the project's store class)."""

    def __init__(self, sup: cluster.Supervisor) -> None:
        self.sup = sup
        self.store = cluster.start_seaweedfs(sup)
        self.service = sup.services[-1]
        self.argv = list(self.service.popen.args)  # type: ignore[arg-type]

    def stop(self) -> None:
        """The store goes away at once (SeaweedFS takes longer than a test should to
        stop on SIGTERM); what it acknowledged is on disk, as after a crash."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.service.popen.pid, signal.SIGKILL)
        self.service.popen.wait(30)
        self.sup.services.remove(self.service)

    def start(self) -> None:
        self.service = self.sup.start(
            "weed", self.argv, stop_timeout=self.service.stop_timeout, leaves=self.service.leaves
        )

        def ready() -> bool:
            self.store.client().head_bucket(Bucket=self.store.bucket)
            return True

        cluster.wait_until(ready, 90, "SeaweedFS after a restart", self.service)


@pytest.fixture(scope="module")
def own_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestartableStore]:
    sup = cluster.Supervisor(tmp_path_factory.mktemp("own-store"))
    store: RestartableStore | None = None
    try:
        store = RestartableStore(sup)
        yield store
    finally:
        sup.stop()
        if store is not None:  # a store stopped as if it crashed leaves its sockets, as weed does
            for path in store.service.leaves:
                path.unlink(missing_ok=True)


def test_run_rides_out_slowdown_resets_and_a_store_restart(own_store: RestartableStore, tmp_path: Path) -> None:
    store = own_store.store
    uri = f"s3://{store.bucket}/run-{tmp_path.name}"
    port = free_port()
    workdir = tmp_path / "work"
    stop = tmp_path / "stop"
    # Trains until the scenario is over (the step count only bounds a hang).
    argv = run_argv(workdir, uri, port, *trainer(5000, 0.05, 10, stop))
    with FaultProxy(store.endpoint_url) as proxy, reaping() as procs, LossMonitor(workdir / "checkpoints") as monitor:
        run = Proc(argv, run_env(store, proxy), tmp_path / "run.log")
        procs.append(run)
        wait_until(lambda: manifests_stored(proxy) >= 1, 120, "a first checkpoint in storage")
        shed_load_then_reset(proxy, port)
        # Then the store goes away, and comes back.
        stored_before = manifests_stored(proxy)
        failed_before = failures(port)
        own_store.stop()
        wait_until(lambda: failures(port) > failed_before, 90, "a failure counted while the store is down")
        newest_before = max(monitor.seen, key=step_of)
        wait_until(
            lambda: step_of(max(monitor.seen, key=step_of)) > step_of(newest_before),
            60,
            "a checkpoint written while the store is down",
        )
        counted = failures(port)
        # A store that cannot be reached is an error, never "no checkpoint" or "broken".
        unreachable = direct(store, uri, max_attempts=1)
        with pytest.raises(StorageError):
            latest_verified(unreachable)
        with pytest.raises(StorageError):
            upload_checkpoint(workdir / "checkpoints" / newest_before, unreachable)
        own_store.start()
        wait_until(lambda: manifests_stored(proxy) > stored_before, 120, "a checkpoint stored after the restart")
        stop.touch()
        assert run.wait(240) == 0, run.tail()
    assert counted >= 2
    assert "failed" in run.text()
    assert_ends_safe(run, monitor, proxy, direct(store, uri))


def test_preemption_while_the_store_is_unreachable_keeps_the_checkpoint_and_resumes_from_it(
    s3_store: Any, s3_uri: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    port = free_port()
    workdir = tmp_path / "work"
    stop = tmp_path / "stop"
    argv = run_argv(workdir, s3_uri, port, *trainer(5000, 0.04, 10, stop), grace=4.0)
    storage = direct(s3_store, s3_uri)
    with reaping() as procs, LossMonitor(workdir / "checkpoints") as monitor:
        first = Proc(argv, run_env(s3_store, proxy), tmp_path / "run1.log")
        procs.append(first)
        wait_until(lambda: manifests_stored(proxy) >= 1, 120, "a first checkpoint in storage")
        down = proxy.add(reset())  # the store is unreachable from now on
        wait_until(lambda: failures(port) >= 1, 60, "a failure counted")
        first.signal(signal.SIGTERM)
        first.wait(60)
        stopped = first.wait_for_stopped_step()
        verified, _ = latest_verified(storage)
        assert verified is not None and verified.step < stopped
        # The emergency checkpoint could not be shipped: it is still here.
        local = [p.name for p in list_local_committed(workdir / "checkpoints")]
        assert f"ckpt-{stopped:012d}" in local, (local, first.tail())

        proxy.remove(down)
        second = Proc(argv, run_env(s3_store, proxy), tmp_path / "run2.log")
        procs.append(second)
        line = second.wait_for_line(lambda ln: ln.startswith(("resumed from step", "starting from scratch")))
        assert line == f"resumed from step {stopped}", (line, second.tail())
        stop.touch()
        assert second.wait(180) == 0, second.tail()
    assert_ends_safe(second, monitor, proxy, storage)


def test_preemption_while_the_store_sheds_load_still_verifies_the_emergency_checkpoint(
    s3_store: Any, s3_uri: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """503 SlowDown for the first seconds of the grace period: the emergency upload is
    retried with backoff until the deadline, not given up after the first refusals."""
    port = free_port()
    workdir = tmp_path / "work"
    argv = run_argv(workdir, s3_uri, port, *trainer(5000, 0.04, 10, tmp_path / "stop"), grace=20.0)
    storage = direct(s3_store, s3_uri)
    with reaping() as procs, LossMonitor(workdir / "checkpoints") as monitor:
        run = Proc(argv, run_env(s3_store, proxy), tmp_path / "run.log")
        procs.append(run)
        wait_until(lambda: manifests_stored(proxy) >= 1, 120, "a first checkpoint in storage")
        for method in ("PUT", "POST"):
            proxy.add(status(503, "SlowDown"), method=method, times=SHED)
        run.signal(signal.SIGTERM)
        run.wait(60)
        stopped = run.wait_for_stopped_step()
    assert [r for r in proxy.log if r.status == 503], "the store never refused anything: the test tested nothing"
    info, _ = latest_verified(storage)
    assert info is not None and info.step == stopped, (info, stopped, run.tail())
    assert not monitor.lost(proxy, storage)


def test_sidecar_rides_out_503_slowdown_and_resets(
    s3_store: Any, s3_uri: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """The in-pod path: a classic sidecar beside the trainer, the store refusing and
    dropping requests for a while; the sidecar leaves after the trainer with
    everything verified, and its metrics counted the failures."""
    port = free_port()
    ckpt_dir = tmp_path / "ckpt"
    stop = tmp_path / "stop"
    env = {**run_env(s3_store, proxy), "SPOTGUARD_CHECKPOINT_DIR": str(ckpt_dir), "SPOTGUARD_STORAGE_URI": s3_uri}
    storage = direct(s3_store, s3_uri)
    with reaping() as procs, LossMonitor(ckpt_dir) as monitor:
        sidecar = Proc(
            spotguard_argv(
                "sidecar",
                "--mode",
                "classic",
                "--metrics-port",
                str(port),
                "--metrics-addr",
                "127.0.0.1",
                "--termination-log",
                str(tmp_path / "termination-log"),
            ),
            env,
            tmp_path / "sidecar.log",
        )
        training = Proc(trainer(5000, 0.04, 10, stop), env, tmp_path / "trainer.log")
        procs += [sidecar, training]
        wait_until(lambda: manifests_stored(proxy) >= 1, 120, "a first checkpoint in storage")
        shed_load_then_reset(proxy, port)
        counted = failures(port)
        stored = manifests_stored(proxy)
        wait_until(lambda: manifests_stored(proxy) > stored, 60, "a checkpoint stored after the faults")
        stop.touch()
        assert training.wait(120) == 0, training.tail()
        assert sidecar.wait(120) == 0, sidecar.tail()
    assert counted >= 1
    assert "failed" in sidecar.text()
    assert not monitor.lost(proxy, storage), monitor.lost(proxy, storage)
    info, _ = latest_verified(storage)
    assert info is not None and info.step == step_of(max(monitor.seen, key=step_of)), (info, sidecar.tail())
