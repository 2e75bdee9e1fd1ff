"""The file backend's conditional read (``read_if_changed``): the semantics of S3's If-None-Match."""

from __future__ import annotations

from pathlib import Path

from spotguard.storage import UNCHANGED, Storage
from spotguard.storage.file import FileStorage


def test_unchanged_while_the_tag_matches(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "root")
    assert isinstance(storage, Storage)  # still the protocol, with the new method
    etag = storage.write_bytes("latest", b'{"step": 1}')
    assert storage.read_if_changed("latest", etag) is UNCHANGED
    # The same bytes written again keep the tag (as an S3 ETag of a plain put does).
    assert storage.write_bytes("latest", b'{"step": 1}') == etag
    assert storage.read_if_changed("latest", etag) is UNCHANGED


def test_changed_object_comes_with_its_new_tag(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "root")
    first = storage.write_bytes("latest", b'{"step": 1}')
    second = storage.write_bytes("latest", b'{"step": 2}')
    assert second != first
    assert storage.read_if_changed("latest", first) == (b'{"step": 2}', second)
    assert storage.read_with_etag("latest") == (b'{"step": 2}', second)
    # No tag: an unconditional read.
    assert storage.read_if_changed("latest", None) == (b'{"step": 2}', second)
    # Any other tag (another backend's, a made-up one): the object.
    assert storage.read_if_changed("latest", '"0123"') == (b'{"step": 2}', second)


def test_missing_object_is_none(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "root")
    assert storage.read_if_changed("latest", None) is None
    etag = storage.write_bytes("latest", b"x")
    storage.delete(["latest"])
    assert storage.read_if_changed("latest", etag) is None
    assert storage.read_if_changed("no/such/dir/latest", etag) is None
