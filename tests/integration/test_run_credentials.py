"""``spotguard run`` keeps every cloud credential variable from the command unless asked.

A real supervisor starts a real command that writes down the environment it
got; the supervisor itself keeps what it was given (it restores and ships).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from sidecar_helpers import PY, base_env, spotguard_argv

from spotguard.contract.env import PASS_CREDENTIALS, STORAGE_URI

# What a cloud SDK in the command would find credentials through: keys, token files, profiles, endpoints.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "example-secret",
    "AWS_SESSION_TOKEN": "example-session",
    "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/secrets/eks.amazonaws.com/serviceaccount/token",
    "AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/trainer",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI": "http://169.254.170.23/v1/credentials",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE": "/var/run/secrets/pods.eks.amazonaws.com/token",
    "AWS_SHARED_CREDENTIALS_FILE": "/home/user/.aws/credentials",
    "AWS_PROFILE": "training",
    "GOOGLE_APPLICATION_CREDENTIALS": "/home/user/key.json",
    "CLOUDSDK_AUTH_ACCESS_TOKEN_FILE": "/home/user/gcloud-token",
    "AZURE_CLIENT_SECRET": "example-azure-secret",
    "AZURE_FEDERATED_TOKEN_FILE": "/var/run/secrets/azure/tokens/azure-identity-token",
    "AZURE_STORAGE_CONNECTION_STRING": "DefaultEndpointsProtocol=https;AccountKey=example",
}
# Where the store is: no secret, passed on.
NOT_SECRET = {
    "AWS_DEFAULT_REGION": "eu-west-1",
    "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:1",
    "GOOGLE_CLOUD_PROJECT": "p",
}


def child_environment(tmp_path: Path, *options: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Run ``spotguard run [options] -- <a command that dumps its environment>``; the command's environment."""
    dump = tmp_path / "env.json"
    script = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"
    argv = spotguard_argv(
        "run",
        "--workdir",
        str(tmp_path / "work"),
        "--storage",
        (tmp_path / "store").as_uri(),
        *options,
        "--",
        PY,
        "-c",
        script,
        str(dump),
    )
    env = base_env({**CREDENTIALS, **NOT_SECRET, **(extra or {})})
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    for value in CREDENTIALS.values():
        assert value not in result.stderr  # names may be logged, values never
    got: dict[str, str] = json.loads(dump.read_text())
    return got


@pytest.mark.integration
def test_the_command_gets_no_credential_variable_by_default(tmp_path: Path) -> None:
    env = child_environment(tmp_path)
    leaked = sorted(set(CREDENTIALS) & set(env))
    assert leaked == [], f"the command got {leaked}"
    assert STORAGE_URI.name not in env
    assert {k: env.get(k) for k in NOT_SECRET} == NOT_SECRET
    assert env["SPOTGUARD_CHECKPOINT_DIR"] == str(tmp_path / "work" / "checkpoints")


@pytest.mark.integration
@pytest.mark.parametrize(
    ("options", "extra"),
    [(["--pass-credentials"], {}), ([], {PASS_CREDENTIALS.name: "true"})],
    ids=["option", "variable"],
)
def test_the_command_gets_them_when_asked(tmp_path: Path, options: list[str], extra: dict[str, str]) -> None:
    env = child_environment(tmp_path, *options, extra=extra)
    assert {k: env.get(k) for k in CREDENTIALS} == CREDENTIALS
    assert env[STORAGE_URI.name] == (tmp_path / "store").as_uri()


@pytest.mark.integration
def test_a_bad_opt_in_value_is_one_line_naming_the_variable(tmp_path: Path) -> None:
    argv = spotguard_argv("run", "--workdir", str(tmp_path / "w"), "--", "true")
    env = base_env({PASS_CREDENTIALS.name: "sometimes"})
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert f"{PASS_CREDENTIALS.name} must be" in result.stderr and "Traceback" not in result.stderr
