"""The storage probe's bounds: the operator's flags, and the pool that stands in for an overrun read."""

from __future__ import annotations

import argparse
import threading

import pytest

from spotguard.operator.probe import MAX_OBJECT_BYTES, READ_TIMEOUT_SECONDS, DaemonPool


def parse_args(*args: str) -> argparse.Namespace:
    from spotguard.operator import cli

    top = argparse.ArgumentParser()
    cli.register(top.add_subparsers())
    return top.parse_args(["operator", *args])


def test_flag_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ALLOWED_ENDPOINTS", "CHECKPOINT_READ_TIMEOUT_SECONDS", "CHECKPOINT_MAX_OBJECT_BYTES"):
        monkeypatch.delenv(f"SPOTGUARD_{name}", raising=False)
    args = parse_args()
    assert args.allowed_endpoints == ""  # the cloud's own endpoints only
    assert args.checkpoint_read_timeout_seconds == READ_TIMEOUT_SECONDS == 60.0
    assert args.checkpoint_max_object_bytes == MAX_OBJECT_BYTES == 16 << 20
    monkeypatch.setenv("SPOTGUARD_ALLOWED_ENDPOINTS", "minio.svc:9000")
    monkeypatch.setenv("SPOTGUARD_CHECKPOINT_READ_TIMEOUT_SECONDS", "5")
    monkeypatch.setenv("SPOTGUARD_CHECKPOINT_MAX_OBJECT_BYTES", "1024")
    args = parse_args()
    assert (args.allowed_endpoints, args.checkpoint_read_timeout_seconds, args.checkpoint_max_object_bytes) == (
        "minio.svc:9000",
        5.0,
        1024,
    )
    assert parse_args("--allowed-endpoints", "a.b,c.d:1").allowed_endpoints == "a.b,c.d:1"


def test_the_apiserver_timeout_flag_reaches_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from spotguard.cliutil import options_from
    from spotguard.operator.handlers import API_TIMEOUT_SECONDS, OperatorOptions

    monkeypatch.delenv("SPOTGUARD_API_TIMEOUT_SECONDS", raising=False)
    assert parse_args().api_timeout_seconds == API_TIMEOUT_SECONDS == OperatorOptions().api_timeout_seconds == 30.0
    monkeypatch.setenv("SPOTGUARD_API_TIMEOUT_SECONDS", "7")
    assert options_from(OperatorOptions, parse_args()).api_timeout_seconds == 7.0
    assert options_from(OperatorOptions, parse_args("--api-timeout-seconds", "2.5")).api_timeout_seconds == 2.5


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--allowed-endpoints", "http://minio.svc"], "--allowed-endpoints: 'http://minio.svc' is not an endpoint"),
        (["--checkpoint-read-timeout-seconds", "0"], "must be more than 0"),
        (["--checkpoint-max-object-bytes", "0"], "must be more than 0"),
        (["--api-timeout-seconds", "0"], "--api-timeout-seconds must be more than 0"),
        (["--api-timeout-seconds", "nan"], "--api-timeout-seconds must be more than 0"),
    ],
)
def test_bad_values_stop_the_operator_with_a_message(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from spotguard.operator.cli import run_operator

    assert run_operator(parse_args(*args)) == 2
    assert says in capsys.readouterr().err


def test_options_default_to_the_cloud_only() -> None:
    from spotguard.operator.handlers import OperatorOptions

    options = OperatorOptions()
    assert options.allowed_endpoints == ()
    assert (options.checkpoint_read_timeout_seconds, options.checkpoint_max_object_bytes) == (60.0, 16 << 20)


def test_a_stood_in_thread_keeps_the_pool_serving_and_it_shrinks_back() -> None:
    pool = DaemonPool(1, "test-pool")
    release = threading.Event()
    held: list[int] = []

    def hang() -> bool:
        held.append(threading.get_ident())
        return release.wait()

    try:
        stuck = pool.submit(hang)
        queued = pool.submit(lambda: "served")
        with pytest.raises(TimeoutError):
            queued.result(timeout=0.3)  # the only thread is held
        pool.stand_in(held[0])
        pool.stand_in(held[0])  # once per held thread
        assert queued.result(timeout=5) == "served" and pool.threads() == 2
        release.set()
        assert stuck.result(timeout=5) is True
        # The held thread ends after its call: the pool is its size again, and still serves.
        for _ in range(100):
            if pool.threads() == 1:
                break
            threading.Event().wait(0.05)
        assert pool.threads() == 1
        assert pool.submit(lambda: "again").result(timeout=5) == "again"
        pool.stand_in(held[0])  # a call that already ended: nothing to stand in for
        assert pool.threads() == 1
    finally:
        release.set()
        pool.shutdown(wait=False)
