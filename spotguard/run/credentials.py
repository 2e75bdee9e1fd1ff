"""Which environment variables are cloud credentials: ``spotguard run`` keeps them from the command.

The supervisor restores and uploads for the command, so the trainer never
needs storage, as in a pod, where only the restore init container and the
sidecar get the credentials. The command gets none of these variables, nor
``SPOTGUARD_STORAGE_URI``, unless the user asks (``--pass-credentials``,
``SPOTGUARD_PASS_CREDENTIALS``). Where the store is (``AWS_ENDPOINT_URL*``,
``AWS_DEFAULT_REGION``, ...) is no secret and is passed on. Files the
command can read anyway (``~/.aws/credentials`` of the same user) are not
the environment's to hide: run the command as another user for that.
"""

from __future__ import annotations

from collections.abc import Mapping

from spotguard.contract import env as envvars

#: The variables that hand a process cloud credentials, or say where to find
#: them (a key, a token file, a profile, a credentials endpoint).
CREDENTIAL_ENV = frozenset(
    {
        # AWS: static keys, temporary credentials, profiles and the files and endpoints that hold them.
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_CREDENTIAL_EXPIRATION",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_SHARED_CREDENTIALS_FILE",
        "AWS_CONFIG_FILE",
        "AWS_ROLE_ARN",
        "AWS_ROLE_SESSION_NAME",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
        # Google Cloud: Application Default Credentials, gcloud's configuration and tokens.
        "GOOGLE_APPLICATION_CREDENTIALS",
        "GOOGLE_CREDENTIALS",
        "GOOGLE_OAUTH_ACCESS_TOKEN",
        "CLOUDSDK_CONFIG",
        "CLOUDSDK_CORE_ACCOUNT",
        "CLOUDSDK_AUTH_ACCESS_TOKEN_FILE",
        "CLOUDSDK_AUTH_CREDENTIAL_FILE_OVERRIDE",
        # Azure: service principals, workload identity, storage keys, az's token cache, managed identity.
        "AZURE_CLIENT_ID",
        "AZURE_CLIENT_SECRET",
        "AZURE_TENANT_ID",
        "AZURE_CLIENT_CERTIFICATE_PATH",
        "AZURE_CLIENT_CERTIFICATE_PASSWORD",
        "AZURE_FEDERATED_TOKEN_FILE",
        "AZURE_USERNAME",
        "AZURE_PASSWORD",
        "AZURE_STORAGE_KEY",
        "AZURE_STORAGE_ACCESS_KEY",
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_SAS_TOKEN",
        "AZURE_CONFIG_DIR",
        "IDENTITY_ENDPOINT",
        "IDENTITY_HEADER",
        "MSI_ENDPOINT",
        "MSI_SECRET",
    }
)
#: A cloud's variable with one of these words in its name, or ending in ``_KEY``, is a credential too (a kin
#: not listed above, such as ``GOOGLE_API_KEY``).
_CLOUD_PREFIXES = ("AWS_", "GOOGLE_", "GCLOUD_", "CLOUDSDK_", "AZURE_", "ARM_")
_SECRET_WORDS = ("SECRET", "TOKEN", "PASSWORD", "CREDENTIAL", "ACCESS_KEY", "CONNECTION_STRING")


def is_credential(name: str) -> bool:
    """Pure: whether the variable ``name`` hands out cloud credentials (:data:`CREDENTIAL_ENV`, or a cloud's
    variable named like a secret)."""
    if name in CREDENTIAL_ENV:
        return True
    return name.startswith(_CLOUD_PREFIXES) and (name.endswith("_KEY") or any(w in name for w in _SECRET_WORDS))


def without_credentials(env: Mapping[str, str]) -> dict[str, str]:
    """Pure: ``env`` without the cloud credentials (:func:`is_credential`) and the storage URI."""
    return {k: v for k, v in env.items() if not is_credential(k) and k != envvars.STORAGE_URI.name}
