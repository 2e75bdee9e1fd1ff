"""The probes server's pure parts: reading a request's head, writing an answer."""

from __future__ import annotations

import json

import pytest

from spotguard.operator.probes import BadRequest, parse_head, render


def test_a_request_head_is_read_with_its_headers_by_lowercase_name() -> None:
    head = b"GET /healthz?x=1 HTTP/1.1\r\nHost: 10.0.0.1:8081\r\nAuthorization: Bearer abc\r\n\r\n"
    request = parse_head(head)
    assert (request.method, request.path, request.body) == ("GET", "/healthz", b"")
    assert request.headers == {"host": "10.0.0.1:8081", "authorization": "Bearer abc"}


@pytest.mark.parametrize(
    "head",
    [b"GET /healthz\r\n\r\n", b"hello\r\n\r\n", b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", b"GET / FTP/1\r\n\r\n"],
)
def test_a_head_that_is_no_http_request_is_a_400(head: bytes) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_head(head)
    assert caught.value.status == 400


def test_an_answer_is_json_and_closes_the_connection() -> None:
    answer = render(503, {"ready": False})
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 503 Service Unavailable"
    assert {"Content-Type: application/json", f"Content-Length: {len(body)}", "Connection: close"} <= set(lines)
    assert json.loads(body) == {"ready": False}
