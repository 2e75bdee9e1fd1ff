"""The test world's certificates (testenv/pki.py): a CA, and client certificates the apiserver reads as
user (CN) and groups (O), as it does a kubelet's ``system:node:<name>`` in ``system:nodes``."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from testenv import pki


def names(cert: x509.Certificate, oid: x509.ObjectIdentifier) -> list[str]:
    return [str(a.value) for a in cert.subject.get_attributes_for_oid(oid)]


def test_client_cert_is_signed_by_the_ca_for_its_user_and_groups(tmp_path: Path) -> None:
    ca_path = pki.make_ca(tmp_path / "ca.crt", "test-ca")
    assert pki.ca_key_path(ca_path) == tmp_path / "ca.key"
    assert (tmp_path / "ca.key").stat().st_mode & 0o777 == 0o600
    ca = x509.load_pem_x509_certificate(ca_path.read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca

    cert_pem, key_pem = pki.client_cert(ca_path, "system:node:127.0.100.1", ["system:nodes"])
    cert = x509.load_pem_x509_certificate(cert_pem)
    cert.verify_directly_issued_by(ca)  # raises where another key signed it
    assert names(cert, NameOID.COMMON_NAME) == ["system:node:127.0.100.1"]
    assert names(cert, NameOID.ORGANIZATION_NAME) == ["system:nodes"]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert b"PRIVATE KEY" in key_pem


def test_written_client_cert_keeps_its_key_private_and_has_no_group_unless_asked(tmp_path: Path) -> None:
    ca_path = pki.make_ca(tmp_path / "ca.crt", "test-ca")
    pki.write_client_cert(ca_path, "someone", (), tmp_path / "c.crt", tmp_path / "c.key")
    assert (tmp_path / "c.key").stat().st_mode & 0o777 == 0o600
    cert = x509.load_pem_x509_certificate((tmp_path / "c.crt").read_bytes())
    assert names(cert, NameOID.COMMON_NAME) == ["someone"]
    assert names(cert, NameOID.ORGANIZATION_NAME) == []


def test_a_ca_of_the_same_name_did_not_sign_it(tmp_path: Path) -> None:
    """Each control plane's CA is its own: a certificate of one is no certificate of another."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ca_a = pki.make_ca(tmp_path / "a" / "ca.crt", "test-ca")
    ca_b = x509.load_pem_x509_certificate(pki.make_ca(tmp_path / "b" / "ca.crt", "test-ca").read_bytes())
    cert = x509.load_pem_x509_certificate(pki.client_cert(ca_a, "x")[0])
    with pytest.raises(InvalidSignature):
        cert.verify_directly_issued_by(ca_b)
