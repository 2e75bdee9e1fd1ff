"""Pure decisions behind "a preemption comes first": what a resumed upload sends again, and which
chunks a stopped upload left for the next upload of the same checkpoint (no I/O)."""

from __future__ import annotations

from spotguard.checkpoint.format.manifest import FileEntry, new_manifest
from spotguard.checkpoint.store.chunked import KnownChunks
from spotguard.checkpoint.store.gc import DEFAULT_ORPHAN_GRACE
from spotguard.checkpoint.store.upload import files_to_send
from spotguard.sidecar.stoppable import with_stored_chunks
from spotguard.storage.base import StoredChecksum

MANIFEST = new_manifest(
    10,
    [
        FileEntry("a.safetensors", 100, "0000000a"),
        FileEntry("b.safetensors", 200, "0000000b"),
        FileEntry("c.json", 3, "0000000c"),
    ],
    "crc32c",
)


def held(value: str, size: int, algorithm: str = "crc32c") -> StoredChecksum:
    return StoredChecksum(algorithm, value, size, "full-object")


def test_a_resumed_upload_sends_only_what_the_store_does_not_hold_as_recorded() -> None:
    assert files_to_send(MANIFEST, []) == ["a.safetensors", "b.safetensors", "c.json"]
    stored = [("a.safetensors", held("0000000a", 100)), ("b.safetensors", held("0000000b", 200))]
    assert files_to_send(MANIFEST, stored) == ["c.json"]
    # Another checksum, size or algorithm, or none computed by the store: sent again.
    assert files_to_send(MANIFEST, [("a.safetensors", held("ffffffff", 100))])[0] == "a.safetensors"
    assert files_to_send(MANIFEST, [("a.safetensors", held("0000000a", 99))])[0] == "a.safetensors"
    assert files_to_send(MANIFEST, [("a.safetensors", held("0000000a", 100, "sha256"))])[0] == "a.safetensors"
    assert files_to_send(MANIFEST, [("a.safetensors", None)])[0] == "a.safetensors"


def test_a_stopped_uploads_chunks_count_as_known_while_younger_than_half_the_grace() -> None:
    known = KnownChunks({"k1": 5}, "ckpt-000000000005", 100.0)
    stopped = (1000.0, {"s1": 7, "k1": 5})
    merged = with_stored_chunks(known, stopped, 1000.0 + DEFAULT_ORPHAN_GRACE / 2 - 1)
    assert merged.chunks == {"k1": 5, "s1": 7}
    assert (merged.source, merged.since) == (known.source, known.since)
    assert with_stored_chunks(known, stopped, 1000.0 + DEFAULT_ORPHAN_GRACE / 2) is known  # a sweep may take them
    assert with_stored_chunks(known, None, 1000.0) is known
    assert with_stored_chunks(known, (1000.0, {}), 1000.0) is known
