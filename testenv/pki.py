"""Certificates of the test world: a control plane's cluster CA and the client certificates it signs.

One CA per control plane, as kubeadm's ``ca.crt``: the apiserver authenticates
clients by it (``--client-ca-file``: a certificate's CN is the user, its O the
groups), and kubelets trust the apiserver's own client certificate by it (logs,
exec). Its key lies beside it (:func:`ca_key_path`), so that whoever adds a
kubelet can give it the identity of its node.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from spotguard.operator.webhookcert import BACKDATE, new_ca, pem_key

VALIDITY = datetime.timedelta(days=365)
#: Certificates are valid from a little before they are made: a clock a second behind must not refuse them.
CLOCK_SKEW = BACKDATE


def ca_key_path(ca: Path) -> Path:
    """Where the key of the CA certificate ``ca`` lies (``ca.crt`` -> ``ca.key``)."""
    return ca.with_suffix(".key")


def _write_secret(path: Path, data: bytes) -> None:
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_bytes(data)


def make_ca(ca: Path, common_name: str) -> Path:
    """A new CA: its certificate at ``ca``, its key (0600) at :func:`ca_key_path`; returns ``ca``. The same
    kind of CA the operator makes for its webhooks."""
    cert, key = new_ca(common_name, datetime.datetime.now(datetime.UTC), VALIDITY.days)
    _write_secret(ca_key_path(ca), pem_key(key))
    ca.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return ca


def client_cert(ca: Path, user: str, groups: Sequence[str] = ()) -> tuple[bytes, bytes]:
    """A client certificate from the CA ``ca`` for ``user`` in ``groups`` (CN and O, as the apiserver
    reads them): the PEM of the certificate and of its key."""
    ca_cert = x509.load_pem_x509_certificate(ca.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path(ca).read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{ca_key_path(ca)}: not the EC key of a CA made by make_ca")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            *(x509.NameAttribute(NameOID.ORGANIZATION_NAME, group) for group in groups),
            x509.NameAttribute(NameOID.COMMON_NAME, user),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True
        )  # digitalSignature
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), pem_key(key)


def write_client_cert(ca: Path, user: str, groups: Sequence[str], cert: Path, key: Path) -> None:
    """:func:`client_cert` written to ``cert`` and ``key`` (0600)."""
    cert_pem, key_pem = client_cert(ca, user, groups)
    _write_secret(key, key_pem)
    cert.write_bytes(cert_pem)
