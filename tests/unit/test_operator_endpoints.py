"""Which storage endpoints the operator may connect to (``--allowed-endpoints``): pure, table-tested."""

from __future__ import annotations

import pytest

from spotguard.operator.endpoints import endpoint_allowed, endpoint_name, matches, parse_patterns, refusal


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ()),
        (" , ", ()),
        ("minio.storage.svc:9000", ("minio.storage.svc:9000",)),
        ("MinIO.Storage.svc, 127.0.0.1:9000 ,", ("minio.storage.svc", "127.0.0.1:9000")),
        ("*.minio.svc:*", ("*.minio.svc:*",)),
        ("*", ("*",)),
        ("[::1]:9000", ("[::1]:9000",)),
        ("a.b,a.b", ("a.b",)),
    ],
)
def test_patterns_are_parsed(text: str, expected: tuple[str, ...]) -> None:
    assert parse_patterns(text) == expected


@pytest.mark.parametrize(
    "bad",
    [
        "http://minio:9000",
        "minio/path",
        "user@minio",
        "minio:port",
        "minio:0",
        "minio:70000",
        "a..b",
        "-a.b",
        "a b",
        "a:b:c",
    ],
)
def test_bad_patterns_are_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match="is not an endpoint pattern"):
        parse_patterns(f"ok.example, {bad}")


@pytest.mark.parametrize(
    ("pattern", "endpoint", "expected"),
    [
        ("minio.svc", "http://minio.svc:9000", True),  # no port: any port
        ("minio.svc", "https://MINIO.svc/", True),
        ("minio.svc:9000", "http://minio.svc:9000", True),
        ("minio.svc:9000", "http://minio.svc:9001", False),
        ("minio.svc:80", "http://minio.svc", True),  # the scheme's port
        ("minio.svc:443", "https://minio.svc/path", True),
        ("minio.svc:*", "http://minio.svc:1234", True),
        ("*.svc", "http://minio.svc", True),
        ("*.svc", "http://a.minio.svc", False),  # one label, as in certificates
        ("*.svc", "http://svc", False),
        ("minio.svc", "http://minio.svc.evil.example", False),
        ("minio.svc", "http://evil.example/minio.svc", False),
        ("minio.svc", "http://minio.svc@evil.example", False),  # the user part is not the host
        ("127.0.0.1:9000", "http://127.0.0.1:9000", True),
        ("127.0.0.1", "http://127.0.0.2:9000", False),
        ("[::1]:9000", "http://[::1]:9000", True),
        ("*", "http://anything.example:1", True),
        ("minio.svc", "ftp://minio.svc", False),
        ("minio.svc", "http://minio.svc:notaport", False),
    ],
)
def test_one_pattern_against_one_endpoint(pattern: str, endpoint: str, expected: bool) -> None:
    assert matches(pattern, endpoint) is expected


@pytest.mark.parametrize(
    ("storage", "endpoint", "allowed", "expected"),
    [
        # No endpoint: the operator's own default (its environment's, or the cloud's).
        ("s3://b/p", None, (), True),
        ("gs://b/p", "", (), True),
        # The cloud's own over HTTPS, for the URI's scheme only.
        ("s3://b/p", "https://s3.amazonaws.com", (), True),
        ("s3://b/p", "https://s3.eu-west-1.amazonaws.com", (), True),
        ("s3://b/p", "https://s3.dualstack.us-east-2.amazonaws.com", (), True),
        ("s3://b/p", "https://s3.cn-north-1.amazonaws.com.cn", (), True),
        ("s3://b/p", "http://s3.eu-west-1.amazonaws.com", (), False),  # not over plain HTTP
        ("s3://b/p", "https://abc.execute-api.eu-west-1.amazonaws.com", (), False),  # anyone's API
        ("s3://b/p", "https://storage.googleapis.com", (), False),  # another scheme's cloud
        ("gs://b/p", "https://storage.googleapis.com", (), True),
        ("gs://b/p", "https://s3.amazonaws.com", (), False),
        # Anything else only when listed.
        ("s3://b/p", "http://127.0.0.1:9000", (), False),
        ("s3://b/p", "http://127.0.0.1:9000", ("127.0.0.1",), True),
        ("s3://b/p", "http://127.0.0.1:9000", ("127.0.0.1:9001",), False),
        ("gs://b/p", "http://fake-gcs.test:4443", ("minio.svc", "fake-gcs.test:4443"), True),
        ("s3://b/p", "http://evil.example", ("*",), True),
    ],
)
def test_what_the_operator_may_connect_to(
    storage: str, endpoint: str | None, allowed: tuple[str, ...], expected: bool
) -> None:
    assert endpoint_allowed(storage, endpoint, allowed) is expected


def test_a_refusal_names_the_endpoint_and_its_source_never_a_password() -> None:
    assert refusal("s3://b/p", "http://127.0.0.1:9000", ("127.0.0.1",), "spec.checkpoint.endpoint") is None
    message = refusal("s3://b/p", "http://key:s3cret@evil.example:8443/x", ("minio.svc",), "key E of Secret s")
    assert message is not None
    assert "evil.example:8443 (key E of Secret s)" in message and "minio.svc" in message
    assert "s3cret" not in message and "key:" not in message
    assert "the operator sent it no request and no credential" in message
    empty = refusal("s3://b/p", "http://evil.example", (), "spec.checkpoint.endpoint")
    assert empty is not None and "none besides the cloud's own" in empty
    assert endpoint_name("https://minio.svc/") == "minio.svc"
