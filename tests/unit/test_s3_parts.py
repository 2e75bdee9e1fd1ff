"""The parts of an S3 multipart upload: the reused buffer and the asking request body."""

from __future__ import annotations

import io
import threading

import pytest

from spotguard.storage.s3_parts import ASK_EVERY, AskingBody, PartStopped, part_buffer


def test_a_thread_reads_its_parts_into_one_buffer_while_their_size_stays() -> None:
    first = part_buffer(5 << 20)
    assert part_buffer(5 << 20) is first  # the next part of the same size: the same memory
    last = part_buffer(123)
    assert len(last) == 123 and last is not first
    other: list[bytearray] = []
    t = threading.Thread(target=lambda: other.append(part_buffer(123)))
    t.start()
    t.join()
    assert other[0] is not last  # each upload thread has its own


def test_the_body_reads_the_buffer_in_place_seeks_and_asks_every_mib() -> None:
    data = bytearray(bytes(range(256)) * (3 * ASK_EVERY // 256 + 7))
    asked: list[int] = []
    body = AskingBody(data, asked.append)
    assert len(body) == len(data) and body.tell() == 0
    got = b"".join(iter(lambda: body.read(64 * 1024), b""))
    assert got == bytes(data)
    assert len(asked) == 3  # once per MiB read
    assert body.seek(0, io.SEEK_END) == len(data) and body.seek(0) == 0  # how botocore finds its length, a retry
    assert body.read() == bytes(data)
    body.seek(10)
    assert body.read(5) == bytes(data[10:15]) and body.tell() == 15


def test_a_stop_asked_mid_part_ends_the_body() -> None:
    def ask(_: int) -> None:
        raise KeyboardInterrupt("preempted")

    body = AskingBody(bytearray(3 * ASK_EVERY), ask)
    body.read(ASK_EVERY)
    with pytest.raises(PartStopped) as caught:
        body.read(ASK_EVERY)
    assert isinstance(caught.value.cause, KeyboardInterrupt)
