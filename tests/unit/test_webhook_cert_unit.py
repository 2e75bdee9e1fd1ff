"""The webhook's serving certificate as the operator keeps it: what it makes, and when it makes it again."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta

from cryptography import x509

from spotguard.operator.webhookcert import (
    Bundle,
    ca_bundle_patch,
    host_names,
    issue,
    next_look,
    renewal_due,
)

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
NAMES = host_names("sg.spotguard-system.svc")


def certs(pem: bytes) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(pem)


def test_a_services_name_is_listed_the_ways_the_apiserver_may_use_it() -> None:
    assert NAMES == ("sg.spotguard-system.svc", "sg.spotguard-system", "sg")
    assert host_names("127.0.0.1") == ("127.0.0.1",)
    assert host_names("webhook.example.com") == ("webhook.example.com",)


def test_a_new_certificate_is_signed_by_its_ca_for_every_name() -> None:
    bundle = issue(NAMES, NOW)
    (cert,), (ca,) = certs(bundle.tls_crt), certs(bundle.ca_crt)
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == set(NAMES)
    assert cert.not_valid_after_utc == NOW + timedelta(days=365)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert renewal_due(bundle, NAMES, NOW) is None
    # The Secret's data round-trips.
    assert Bundle.from_data(bundle.data()) == bundle
    assert Bundle.from_data({"tls.crt": "eA=="}) is None
    ip = issue(["127.0.0.1"], NOW)
    assert renewal_due(ip, ["127.0.0.1"], NOW) is None


def test_renewal_falls_due_when_a_third_of_the_life_is_left_and_keeps_the_ca() -> None:
    bundle = issue(NAMES, NOW)
    renew_at = NOW + timedelta(days=365) * 2 / 3
    assert renewal_due(bundle, NAMES, renew_at - timedelta(hours=1)) is None
    why = renewal_due(bundle, NAMES, renew_at + timedelta(hours=1))
    assert why is not None and "expires at" in why
    later = renew_at + timedelta(hours=1)
    renewed = issue(NAMES, later, previous=bundle)
    # Same CA: the webhook configurations' caBundle does not change.
    assert renewed.ca_crt == bundle.ca_crt and renewed.ca_key == bundle.ca_key
    assert renewed.tls_crt != bundle.tls_crt
    certs(renewed.tls_crt)[0].verify_directly_issued_by(certs(bundle.ca_crt)[0])
    assert renewal_due(renewed, NAMES, later) is None
    # Looks again at the next renewal, never later than the check interval.
    assert next_look(renewed, later, 600.0) == 600.0
    assert 0 < next_look(renewed, later + timedelta(days=240), 1e9) < 1e9


def test_an_expiring_ca_is_replaced_and_the_old_one_stays_trusted_until_it_expires() -> None:
    bundle = issue(NAMES, NOW, ca_days=30, serving_days=10)
    later = NOW + timedelta(days=25)
    assert "CA expires" in (renewal_due(bundle, NAMES, later) or "")
    renewed = issue(NAMES, later, previous=bundle)
    new_ca, old_ca = certs(renewed.ca_crt)
    assert old_ca == certs(bundle.ca_crt)[0] and new_ca != old_ca
    certs(renewed.tls_crt)[0].verify_directly_issued_by(new_ca)
    assert renewal_due(renewed, NAMES, later) is None


def test_a_certificate_that_misses_a_name_is_made_again() -> None:
    bundle = issue(["sg.other.svc"], NOW)
    assert "does not name" in (renewal_due(bundle, NAMES, NOW) or "")
    assert renewal_due(None, NAMES, NOW) == "no certificate yet"


def test_the_ca_goes_into_every_webhook_that_lacks_it() -> None:
    ca = b"-----BEGIN CERTIFICATE-----\n"
    value = base64.b64encode(ca).decode()
    config = {"webhooks": [{"clientConfig": {"service": {}}}, {"clientConfig": {"caBundle": value}}]}
    assert ca_bundle_patch(config, ca) == [{"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": value}]
    assert ca_bundle_patch({"webhooks": [{"clientConfig": {"caBundle": value}}]}, ca) == []


def test_the_operator_refuses_a_kept_certificate_it_cannot_make() -> None:
    from spotguard.cli import build_parser
    from spotguard.operator.cli import cert_secret_problem

    def problem(*args: str) -> str | None:
        return cert_secret_problem(build_parser().parse_args(["operator", "--webhook", *args]))

    assert "needs --webhook-host" in (problem("--webhook-cert-secret", "s") or "")
    assert "go together" in (problem("--webhook-cert-secret", "s", "--webhook-host", "h", "--webhook-cert", "c") or "")
    assert "at most 3650" in (
        problem("--webhook-cert-secret", "s", "--webhook-host", "h", "--webhook-cert-days", "0") or ""
    )
    assert problem("--webhook-cert-secret", "s", "--webhook-host", "sg.ns.svc") is None
