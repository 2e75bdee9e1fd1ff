"""One uploader's known-chunk table, without I/O: what a failed check makes it forget, and what
a verified checkpoint makes it know again."""

from __future__ import annotations

from spotguard.checkpoint.format.chunks import hash_chunk
from spotguard.checkpoint.format.manifest import FileEntry, Manifest, new_manifest, to_chunked
from spotguard.checkpoint.store.known import KnownChunkTable
from spotguard.checkpoint.store.stored import CheckpointCorruptError
from spotguard.storage.checksum import checksum_bytes

BASE, ADAPTER = b"frozen base " * 100, b"adapter"


def chunked_manifest(step: int) -> Manifest:
    data = {"model.safetensors": BASE + ADAPTER}
    files = [FileEntry(p, len(b), checksum_bytes(b, "crc32c")) for p, b in data.items()]
    plain = new_manifest(step, files, "crc32c")
    return to_chunked(plain, {"model.safetensors": [hash_chunk(BASE), hash_chunk(ADAPTER)]})


def test_a_chunk_a_check_names_is_forgotten_until_a_verified_checkpoint_holds_it_again() -> None:
    table = KnownChunkTable()
    table.verified(chunked_manifest(10), trusted=0)
    base, adapter = hash_chunk(BASE), hash_chunk(ADAPTER)
    assert table.digests() == {base.hash: base.size, adapter.hash: adapter.size}

    problem = f"{base.key}: crc32c checksum mismatch (chunk of model.safetensors) (part 0)"
    assert table.forget("ckpt-000000000020", [problem, "state.json: missing"]) == {base.hash}
    assert table.digests() == {adapter.hash: adapter.size}
    # Learning a checkpoint read from storage does not make a suspect chunk known again...
    table.learn(chunked_manifest(20))
    assert base.hash not in table.digests()
    # ...a verified one that holds it does (its upload sent it again).
    table.verified(chunked_manifest(30), trusted=0)
    assert base.hash in table.digests()


def test_a_part_upload_that_failed_its_own_check_forgets_what_it_named() -> None:
    table = KnownChunkTable()
    table.verified(chunked_manifest(10), trusted=0)
    base = hash_chunk(BASE)
    corrupt = CheckpointCorruptError("ckpt-000000000020", [f"{base.key}: missing (chunk of model.safetensors)"])
    assert table.forget_failed("ckpt-000000000020", corrupt) == {base.hash}
    assert base.hash not in table.digests()
    # Any other failure (the store is down) says nothing of the chunks.
    assert table.forget_failed("ckpt-000000000030", OSError("connection refused")) == set()
    assert table.forget("ckpt-000000000030", ["state.json: missing"]) == set()
