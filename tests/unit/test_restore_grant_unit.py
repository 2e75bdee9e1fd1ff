"""The restore grant's pure parts: its file, its lifetime, what a log line of urllib3 keeps."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from spotguard.checkpoint.restore.grant import GRANT_SECONDS, MAX_GRANT_SECONDS, grant_seconds
from spotguard.contract.grant import (
    GRANT_FILE,
    GrantedCheckpoint,
    RestoreAnswer,
    RestoreGrant,
    parse_grant,
    read_answer,
    read_done,
    read_grant,
    write_answer,
    write_done,
    write_grant,
)
from spotguard.storage.presigned import GrantedStorage

URL = "http://store.example/b/ckpt-000000000002/model.safetensors?X-Amz-Signature=abc123&X-Amz-Credential=k"


def a_grant() -> RestoreGrant:
    return RestoreGrant(
        "g1",
        "s3://b/job",
        1000.0,
        (GrantedCheckpoint("ckpt-000000000002", b'{"step": 2}', {"ckpt-000000000002/model.safetensors": URL}),),
    )


def test_a_grant_round_trips_through_its_file_readable_by_its_owner_alone(tmp_path: Path) -> None:
    write_grant(tmp_path, a_grant())
    assert stat.S_IMODE(os.stat(tmp_path / GRANT_FILE).st_mode) == 0o600
    assert read_grant(tmp_path) == a_grant()
    assert [p.name for p in tmp_path.iterdir()] == [GRANT_FILE]  # no temporary file left
    assert "X-Amz-Signature" not in repr(a_grant())


@pytest.mark.parametrize(
    "doc",
    [
        {"version": 2},
        {"version": 1, "id": "g", "store": "s3://b", "expires": "soon", "checkpoints": []},
        {"version": 1, "id": "g", "store": "s3://b", "expires": 1, "checkpoints": [{"name": "c"}]},
        {"version": 1, "id": "g", "store": "s3://b", "expires": 1, "checkpoints": [{}, {}, {}, {}]},
        {
            "version": 1,
            "id": "g",
            "store": "s3://b",
            "expires": 1,
            "checkpoints": [{"name": "c", "manifest": "{}", "objects": {"k": 3}}],
        },
    ],
)
def test_a_malformed_grant_is_refused_without_naming_a_url(doc: dict[str, object]) -> None:
    with pytest.raises(ValueError) as info:
        parse_grant(json.dumps(doc))
    assert "http" not in str(info.value)


def test_the_answers_round_trip(tmp_path: Path) -> None:
    assert read_answer(tmp_path) is None
    write_answer(tmp_path, RestoreAnswer("g1", None, wait=True))
    assert read_answer(tmp_path) == RestoreAnswer("g1", None, True)
    assert read_done(tmp_path, "g1") == (False, None)
    write_done(tmp_path, "g1", "ckpt-000000000001")
    assert read_done(tmp_path, "g1") == (True, "ckpt-000000000001")
    assert read_done(tmp_path, "other")[0] is False


@pytest.mark.parametrize(
    ("nbytes", "seconds"),
    [(0, GRANT_SECONDS), (50 * 10**9, GRANT_SECONDS + 1000), (10**18, MAX_GRANT_SECONDS)],
)
def test_a_grant_lives_longer_for_more_bytes(nbytes: int, seconds: int) -> None:
    assert grant_seconds(nbytes) == seconds


def test_urllib3s_debug_lines_keep_no_query(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    GrantedStorage("s3://b/job", {}, {}).close()  # installs the filter
    pool = logging.getLogger("urllib3.connectionpool")
    # What other modules of the session did to urllib3's logger (its level, disabled by a logging
    # setup) must not hide the line: the handler is the logger's own, after the logger's filters.
    monkeypatch.setattr(pool, "disabled", False)
    caplog.set_level(logging.DEBUG, logger=pool.name)
    pool.addHandler(caplog.handler)
    try:
        pool.debug('%s "GET %s HTTP/1.1" 206 5', "http://store", URL[19:])
    finally:
        pool.removeHandler(caplog.handler)
    assert "abc123" not in caplog.text and "?<redacted>" in caplog.text
