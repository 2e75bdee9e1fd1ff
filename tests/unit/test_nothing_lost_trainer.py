"""Pure rules behind the trainer's safety nets: when an emergency save may skip
its fsync, how an uploader's heartbeat is read, how an emergency upload is
retried, how a refused local checkpoint is named, which variables ``spotguard
run`` keeps from its command."""

from __future__ import annotations

import argparse
import json

import pytest


@pytest.mark.parametrize(
    "preempt, pruner, shipping, durable",
    [
        (False, "uploader", True, True),  # routine saves are always fsynced
        (False, "self", True, True),
        (True, "uploader", True, False),  # a live uploader ships it at once: its upload makes it durable
        (True, "self", True, False),
        (True, "uploader", False, True),  # no sign of a live uploader: the local copy is all there is
        (True, "self", False, True),
        (True, "local-only", True, True),  # nothing ships it
        (True, "local-only", False, True),
    ],
)
def test_an_emergency_save_skips_fsync_only_for_a_live_uploader(
    preempt: bool, pruner: str, shipping: bool, durable: bool
) -> None:
    from spotguard.trainer.shipping import emergency_save_is_durable

    assert emergency_save_is_durable(preempt, pruner, shipping) is durable


def test_a_heartbeat_counts_only_while_fresh_and_shipping() -> None:
    from spotguard.contract.control import HEARTBEAT_FRESH_SECONDS, heartbeat_says_shipping, parse_heartbeat

    beat = parse_heartbeat(json.dumps({"pid": 7, "time": 1000.0, "shipping": True}))
    assert (beat.pid, beat.time, beat.shipping) == (7, 1000.0, True)
    assert heartbeat_says_shipping(beat, 1000.5)
    assert heartbeat_says_shipping(beat, 1000.0 + HEARTBEAT_FRESH_SECONDS)
    assert not heartbeat_says_shipping(beat, 1000.0 + HEARTBEAT_FRESH_SECONDS + 0.1)  # stale: the uploader stopped
    assert not heartbeat_says_shipping(beat, 990.0)  # from the future: a clock that cannot be trusted
    assert not heartbeat_says_shipping(None, 1000.0)
    failing = parse_heartbeat(json.dumps({"pid": 7, "time": 1000.0, "shipping": False}))
    assert not heartbeat_says_shipping(failing, 1000.5)  # alive, but its uploads fail


@pytest.mark.parametrize(
    "doc", ["[]", "{}", '{"time": "now", "shipping": true}', '{"time": 1.0, "shipping": 1}', "not json"]
)
def test_a_malformed_heartbeat_is_refused(doc: str) -> None:
    from spotguard.contract.control import parse_heartbeat

    with pytest.raises(ValueError):
        parse_heartbeat(doc)


def test_an_emergency_upload_is_retried_with_backoff_until_the_deadline() -> None:
    from spotguard.trainer.shipping import emergency_upload_pause

    pauses = [emergency_upload_pause(n, 100.0, 110.0) for n in range(1, 6)]
    assert pauses == [0.25, 0.5, 1.0, 2.0, 2.0]  # the sidecar's emergency backoff
    assert emergency_upload_pause(3, 109.5, 110.0) == 0.5  # never past the deadline
    assert emergency_upload_pause(1, 110.0, 110.0) is None  # out of time: give up
    assert emergency_upload_pause(1, 111.0, 110.0) is None


def test_a_refused_checkpoint_gets_a_name_no_listing_takes_for_a_checkpoint() -> None:
    from spotguard.checkpoint.format.manifest import checkpoint_name, parse_checkpoint_name
    from spotguard.checkpoint.local.commit import refused_name

    name = refused_name(checkpoint_name(42), 0.0)
    assert name == "ckpt-000000000042.refused-19700101T000000Z"
    assert parse_checkpoint_name(name) is None
    assert not name.startswith(".tmp-")  # never swept away as a leftover


def test_run_strips_the_cloud_credentials_from_the_commands_environment() -> None:
    from spotguard.run.credentials import CREDENTIAL_ENV, is_credential, without_credentials

    named = {  # the static keys, and what points at credentials elsewhere: files, profiles, endpoints
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
        "AWS_SHARED_CREDENTIALS_FILE",
        "AWS_PROFILE",
        "AWS_ROLE_ARN",
        "CLOUDSDK_AUTH_ACCESS_TOKEN_FILE",
        "AZURE_CLIENT_SECRET",
        "AZURE_FEDERATED_TOKEN_FILE",
        "AZURE_STORAGE_ACCOUNT_KEY",
    }
    assert named <= CREDENTIAL_ENV
    # Kin the list does not name: a cloud's prefix and a secret's word.
    assert is_credential("GOOGLE_API_KEY") and is_credential("AWS_SOME_NEW_TOKEN_FILE")
    env = {
        **dict.fromkeys(named, "secret"),
        "SPOTGUARD_STORAGE_URI": "s3://b/p",
        "AWS_ENDPOINT_URL_S3": "http://e",
        "AWS_DEFAULT_REGION": "r",
        "AWS_CA_BUNDLE": "/etc/ca.pem",
        "GOOGLE_CLOUD_PROJECT": "p",
        "PATH": "/bin",
    }
    assert without_credentials(env) == {  # where the store is, and everything else, stays
        "AWS_ENDPOINT_URL_S3": "http://e",
        "AWS_DEFAULT_REGION": "r",
        "AWS_CA_BUNDLE": "/etc/ca.pem",
        "GOOGLE_CLOUD_PROJECT": "p",
        "PATH": "/bin",
    }
    assert env["AWS_SECRET_ACCESS_KEY"] == "secret"  # the caller's mapping is left alone


@pytest.mark.parametrize(
    ("argv", "environ", "passed"),
    [
        ([], {}, False),
        (["--pass-credentials"], {}, True),
        ([], {"SPOTGUARD_PASS_CREDENTIALS": "yes"}, True),
        (["--no-pass-credentials"], {"SPOTGUARD_PASS_CREDENTIALS": "1"}, False),
    ],
)
def test_run_passes_the_credentials_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], environ: dict[str, str], passed: bool
) -> None:
    from spotguard.contract import env
    from spotguard.run import cli

    monkeypatch.delenv(env.PASS_CREDENTIALS.name, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    p = argparse.ArgumentParser(prog="spotguard")
    cli.register(p.add_subparsers(dest="command"))
    option = p.parse_args(["run", *argv, "--", "true"]).pass_credentials
    assert env.option_or_env(env.PASS_CREDENTIALS, option) is passed
