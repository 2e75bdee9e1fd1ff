"""``read_body_into`` on a body that is not urllib3's (no socket to read into): read and copied."""

from __future__ import annotations

import io

import pytest
from botocore.exceptions import IncompleteReadError

from spotguard.storage.s3_client import read_body_into


def test_a_body_without_a_socket_is_read_and_copied_into_the_sinks() -> None:
    data = bytes(range(256)) * 40
    sinks = [bytearray(1), bytearray(0), bytearray(5000), bytearray(len(data) - 5001)]
    read_body_into(io.BytesIO(data), [memoryview(s) for s in sinks])
    assert b"".join(sinks) == data


def test_a_short_body_is_an_incomplete_read() -> None:
    with pytest.raises(IncompleteReadError):
        read_body_into(io.BytesIO(b"abc"), [memoryview(bytearray(4))])
