"""The admission webhooks' serving certificate, kept by the operator in a Secret (``--webhook-cert-secret``).

At start, and again before it expires, each replica makes sure that the Secret
holds a self-signed CA and a serving certificate it signed for the webhook's
host names; writes the certificate and key to the files the admission server
serves (which reloads them when they change); and puts the CA into the
``caBundle`` of the webhook configurations (``--webhook-configuration``, the
chart's). The chart then renders no key, no certificate and no time: two
renders of the same values are byte-identical (GitOps), and an upgrade never
churns the certificate.

Secret data (``kubernetes.io/tls``): ``tls.crt``, ``tls.key`` (the serving
pair), ``ca.crt`` (the CA bundle: the current CA first, then the one it
replaced while that is still valid, so that a replica still serving a
certificate of the old CA is trusted during a rotation) and ``ca.key``.

Several replicas: none is elected for this. Every write carries the
``resourceVersion`` that was read, so of two replicas that find the
certificate due at once exactly one writes; the other gets 409 Conflict,
reads again and takes what the first wrote. Patching the ``caBundle`` with
the Secret's bundle is idempotent.

Renewal: a serving certificate is renewed once two thirds of its life have
passed (default life 365 days), the CA (10 years) likewise; a serving
certificate that does not name every host is made again at once.

The decisions (:func:`renewal_due`, :func:`issue`) are pure functions of the
certificates and ``now``; :class:`CertificateKeeper` does the I/O.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from spotguard.operator.apierrors import api_reason, api_status
from spotguard.operator.background import BackgroundThread

log = logging.getLogger("spotguard.operator")

#: Life of a serving certificate, and of the CA that signs it.
SERVING_DAYS = 365
CA_DAYS = 3650
#: A certificate is renewed when this share of its life is left.
RENEW_WHEN_LEFT = 1 / 3
#: How often the keeper looks at the Secret at most (it also wakes for a renewal that falls due sooner).
CHECK_SECONDS = 600.0
#: How soon to try again after an error (the apiserver away, a conflict).
RETRY_SECONDS = 5.0
#: Certificates are back-dated a little: the apiserver's clock may run behind this one.
BACKDATE = timedelta(minutes=5)

CRT, KEY, CA_CRT, CA_KEY = "tls.crt", "tls.key", "ca.crt", "ca.key"


# --- pure: names, certificates, decisions --------------------------------------------


def host_names(host: str) -> tuple[str, ...]:
    """Pure: the names a serving certificate for ``host`` lists.

    A Service's DNS name ``<svc>.<ns>.svc`` also gets ``<svc>.<ns>`` and
    ``<svc>`` (how the apiserver may address it); an IP address is itself.
    """
    parts = host.split(".")
    if len(parts) == 3 and parts[2] == "svc":
        return (host, f"{parts[0]}.{parts[1]}", parts[0])
    return (host,)


@dataclass(frozen=True, slots=True)
class Bundle:
    """The Secret's four PEM values."""

    tls_crt: bytes
    tls_key: bytes
    ca_crt: bytes
    ca_key: bytes

    def data(self) -> dict[str, str]:
        """The Secret's ``data`` (base64)."""
        pairs = ((CRT, self.tls_crt), (KEY, self.tls_key), (CA_CRT, self.ca_crt), (CA_KEY, self.ca_key))
        return {k: base64.b64encode(v).decode() for k, v in pairs}

    @classmethod
    def from_data(cls, data: Mapping[str, Any] | None) -> Bundle | None:
        """From a Secret's ``data``; None when a value is missing or not base64."""
        data = data or {}
        try:
            values = [base64.b64decode(str(data[k]), validate=True) for k in (CRT, KEY, CA_CRT, CA_KEY)]
        except (KeyError, ValueError):
            return None
        return cls(*values)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    """``key`` as unencrypted PKCS#8 PEM."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def new_ca(common_name: str, now: datetime, days: float) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA (EC P-256, valid from a little before ``now`` for ``days``): its certificate and key."""
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # keyCertSign, cRLSign
        .sign(key, hashes.SHA256())
    )
    return cert, key


def issue(
    names: Sequence[str],
    now: datetime,
    *,
    previous: Bundle | None = None,
    serving_days: float = SERVING_DAYS,
    ca_days: float = CA_DAYS,
) -> Bundle:
    """Pure (but for fresh random keys): a serving certificate for ``names``, signed by ``previous``'s CA
    while that CA has more than a third of its life left, else by a new CA (the old one stays in the bundle)."""
    ca_cert: x509.Certificate | None = None
    ca_key: ec.EllipticCurvePrivateKey | None = None
    ca_bundle = b""
    if previous is not None:
        current = _first_cert(previous.ca_crt)
        loaded = serialization.load_pem_private_key(previous.ca_key, None)
        if current is not None and isinstance(loaded, ec.EllipticCurvePrivateKey) and not _due(current, now):
            ca_cert, ca_key, ca_bundle = current, loaded, previous.ca_crt
    if ca_cert is None or ca_key is None:
        ca_cert, ca_key = new_ca(f"spotguard-webhook-ca-{now:%Y%m%d%H%M%S}", now, ca_days)
        ca_bundle = ca_cert.public_bytes(serialization.Encoding.PEM)
        old = _first_cert(previous.ca_crt) if previous is not None else None
        if old is not None and _not_after(old) > now:
            ca_bundle += old.public_bytes(serialization.Encoding.PEM)  # trusted until it expires
    key = _key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(min(now + timedelta(days=serving_days), _not_after(ca_cert)))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(_san(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return Bundle(
        tls_crt=cert.public_bytes(serialization.Encoding.PEM),
        tls_key=pem_key(key),
        ca_crt=ca_bundle,
        ca_key=pem_key(ca_key),
    )


def _first_cert(pem: bytes) -> x509.Certificate | None:
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError:
        return None
    return certs[0] if certs else None


def _not_after(cert: x509.Certificate) -> datetime:
    return cert.not_valid_after_utc


def _renew_at(cert: x509.Certificate) -> datetime:
    """When a third of the certificate's life (from its making, not its back-dated start) is left."""
    start, end = cert.not_valid_before_utc + BACKDATE, cert.not_valid_after_utc
    return end - max(timedelta(0), end - start) * RENEW_WHEN_LEFT


def _due(cert: x509.Certificate, now: datetime) -> bool:
    return now >= _renew_at(cert)


def _names_of(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(n) for n in san.get_values_for_type(x509.DNSName)} | {
        str(ip) for ip in san.get_values_for_type(x509.IPAddress)
    }


def renewal_due(bundle: Bundle | None, names: Sequence[str], now: datetime) -> str | None:
    """Pure: why the Secret's certificate must be made again now (one line), or None."""
    if bundle is None:
        return "no certificate yet"
    cert, ca = _first_cert(bundle.tls_crt), _first_cert(bundle.ca_crt)
    if cert is None or ca is None:
        return "the certificate or its CA does not load"
    if not set(names) <= _names_of(cert):
        return f"the certificate does not name {', '.join(sorted(set(names) - _names_of(cert)))}"
    if cert.issuer != ca.subject:
        return "the certificate is not signed by the bundle's CA"
    if _due(ca, now):
        return f"its CA expires at {_not_after(ca):%Y-%m-%dT%H:%M:%SZ}"
    if _due(cert, now):
        return f"it expires at {_not_after(cert):%Y-%m-%dT%H:%M:%SZ}"
    return None


def next_look(bundle: Bundle, now: datetime, check_seconds: float) -> float:
    """Pure: seconds until the keeper looks again: at the next renewal, at most ``check_seconds``."""
    times = [_renew_at(c) for c in (_first_cert(bundle.tls_crt), _first_cert(bundle.ca_crt)) if c is not None]
    soonest = min(times, default=now)
    return max(1.0, min(check_seconds, (soonest - now).total_seconds()))


def ca_bundle_patch(configuration: Mapping[str, Any], bundle: bytes) -> list[dict[str, Any]]:
    """Pure: the JSONPatch that puts ``bundle`` into every webhook of a configuration (empty: all have it)."""
    value = base64.b64encode(bundle).decode()
    ops: list[dict[str, Any]] = []
    for i, hook in enumerate(configuration.get("webhooks") or []):
        client = hook.get("clientConfig") or {}
        if client.get("caBundle") != value:
            ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": value})
    return ops


# --- I/O ----------------------------------------------------------------------------


def _write_atomically(path: str, content: bytes, mode: int) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:  # no temporary file left, an interrupt too; raised again
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class CertificateKeeper(BackgroundThread):
    """Keeps the Secret, the files the admission server serves, and the configurations' ``caBundle``.

    ``core`` is a ``CoreV1Api``, ``admission`` an ``AdmissionregistrationV1Api``.
    ``configuration``: the name of the Mutating- and ValidatingWebhookConfiguration
    whose ``caBundle`` to keep (None: none; a configuration not there is skipped).
    """

    thread_name = "webhook-certificate"

    def __init__(
        self,
        core: Any,
        admission: Any,
        namespace: str,
        secret: str,
        names: Sequence[str],
        certfile: str,
        keyfile: str,
        *,
        configuration: str | None = None,
        serving_days: float = SERVING_DAYS,
        check_seconds: float = CHECK_SECONDS,
    ) -> None:
        super().__init__()
        self.core = core
        self.admission = admission
        self.namespace = namespace
        self.secret = secret
        self.names = tuple(names)
        self.certfile = certfile
        self.keyfile = keyfile
        self.configuration = configuration
        self.serving_days = serving_days
        self.check_seconds = check_seconds
        #: The bundle as last read or written (None: not yet).
        self.bundle: Bundle | None = None

    @property
    def where(self) -> str:
        return f"{self.namespace}/{self.secret}"

    # -- one round

    def _read(self) -> tuple[Bundle | None, str | None, bool]:
        """The Secret's bundle, its resourceVersion, and whether the Secret exists."""
        try:
            secret = self.core.read_namespaced_secret(self.secret, self.namespace)
        except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
            if api_status(exc) == 404:
                return None, None, False
            raise
        return Bundle.from_data(secret.data), secret.metadata.resource_version, True

    def ensure_secret(self, now: datetime | None = None) -> Bundle:
        """Read the Secret; create it, or renew what it holds when due (a 409 reads again)."""
        while True:
            now = now or datetime.now(UTC)
            bundle, version, exists = self._read()
            why = renewal_due(bundle, self.names, now)
            if why is None:
                assert bundle is not None
                return bundle
            fresh = issue(self.names, now, previous=bundle, serving_days=self.serving_days)
            body = {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "kubernetes.io/tls",
                "metadata": {
                    "name": self.secret,
                    "namespace": self.namespace,
                    "labels": {"app.kubernetes.io/managed-by": "spotguard-operator"},
                    **({"resourceVersion": version} if version else {}),
                },
                "data": fresh.data(),
            }
            try:
                if exists:
                    self.core.replace_namespaced_secret(self.secret, self.namespace, body)
                else:
                    self.core.create_namespaced_secret(self.namespace, body)
            except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
                if api_status(exc) == 409:  # another replica wrote first: take its certificate
                    log.info("webhook certificate: another replica wrote %s first; reading it", self.where)
                    now = None
                    continue
                raise
            log.info("webhook certificate: %s in %s (%s)", "renewed" if exists else "created", self.where, why)
            return fresh

    def write_files(self, bundle: Bundle) -> bool:
        """Write the serving pair where the admission server reads it, if it differs (key first)."""
        written = False
        for path, content, mode in ((self.keyfile, bundle.tls_key, 0o600), (self.certfile, bundle.tls_crt, 0o644)):
            try:
                with open(path, "rb") as f:
                    if f.read() == content:
                        continue
            except OSError:
                pass  # not there yet: written below
            _write_atomically(path, content, mode)
            written = True
        return written

    def patch_configurations(self, bundle: Bundle) -> None:
        """Put the CA bundle into the webhook configurations (only where it differs)."""
        if not self.configuration:
            return
        kinds = (
            (self.admission.read_mutating_webhook_configuration, self.admission.patch_mutating_webhook_configuration),
            (
                self.admission.read_validating_webhook_configuration,
                self.admission.patch_validating_webhook_configuration,
            ),
        )
        for read, patch in kinds:
            try:
                current = read(self.configuration, _preload_content=False)
            except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
                if api_status(exc) == 404:  # e.g. the validating webhook is off
                    continue
                raise
            ops = ca_bundle_patch(json.loads(current.data), bundle.ca_crt)
            if ops:
                patch(self.configuration, ops)
                log.info("webhook certificate: put the CA into %s (%d webhook(s))", self.configuration, len(ops))

    def sync(self, now: datetime | None = None) -> Bundle:
        """One round: the Secret, the files, the configurations."""
        bundle = self.ensure_secret(now)
        self.bundle = bundle
        if self.write_files(bundle):
            log.info("webhook certificate: serving the certificate of %s", self.where)
        self.patch_configurations(bundle)
        return bundle

    # -- the loop

    def _run(self) -> None:
        reported = ""
        while not self._stop.is_set():
            try:
                bundle = self.sync()
                reported = ""
                wait = next_look(bundle, datetime.now(UTC), self.check_seconds)
            except Exception as exc:  # noqa: BLE001 - any client, API or file error is retried
                if api_reason(exc) != reported:
                    reported = api_reason(exc)
                    log.warning("webhook certificate: cannot keep %s: %s; trying again", self.where, reported)
                wait = RETRY_SECONDS
            self._stop.wait(wait)
