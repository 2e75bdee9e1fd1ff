"""Chunk planning and the version 3 (incremental) manifest: pure logic, local files only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from spotguard.checkpoint.format.chunks import (
    MAX_CHUNK,
    MIN_CHUNK,
    distcp_regions,
    fixed_chunks,
    group_regions,
    hash_chunk,
    plan_file,
    plan_safetensors,
    safetensors_head_size,
)
from spotguard.checkpoint.format.manifest import (
    FORMAT_VERSION_CHUNKED,
    ChunkRef,
    FileEntry,
    ManifestError,
    Sharding,
    chunk_key,
    new_manifest,
    parse_chunk_key,
    parse_manifest,
    to_chunked,
    to_plain,
)
from spotguard.checkpoint.store.global_manifest import build_global_manifest
from spotguard.storage.checksum import checksum_bytes

MiB = 1 << 20


def covers(chunks: list[tuple[int, int]], size: int) -> bool:
    at = 0
    for offset, length in chunks:
        if offset != at or length <= 0:
            return False
        at += length
    return at == size


@pytest.mark.parametrize(
    ("regions", "size", "want"),
    [
        # one big region: cut at MAX_CHUNK from its start
        ([(0, 40 * MiB)], 40 * MiB, [(0, 16 * MiB), (16 * MiB, 16 * MiB), (32 * MiB, 8 * MiB)]),
        # small header, big tensor, small tail: the big tensor starts its own chunk
        (
            [(0, 100), (100, 100 + 20 * MiB)],
            100 + 20 * MiB + 50,
            [(0, 100), (100, 16 * MiB), (100 + 16 * MiB, 4 * MiB), (100 + 20 * MiB, 50)],
        ),
        # many small regions are grouped up to MIN_CHUNK
        (
            [(i * 300_000, (i + 1) * 300_000) for i in range(7)],
            2_100_000,
            [(0, 900_000), (900_000, 900_000), (1_800_000, 300_000)],
        ),
        # overlapping regions: fixed offsets
        ([(0, 10), (5, 20)], 20, [(0, 20)]),
        # the bytes between declared regions are regions too
        ([(10, 2 * MiB)], 3 * MiB, [(0, 10), (10, 2 * MiB - 10), (2 * MiB, MiB)]),
        ([], 0, []),
    ],
)
def test_group_regions(regions: list[tuple[int, int]], size: int, want: list[tuple[int, int]]) -> None:
    got = group_regions(regions, size)
    assert got == want
    assert covers(got, size)
    assert all(length <= MAX_CHUNK for _, length in got)


def test_fixed_chunks() -> None:
    assert fixed_chunks(0) == []
    assert fixed_chunks(5, 2) == [(0, 2), (2, 2), (4, 1)]


def chunk_bytes(path: Path) -> list[bytes]:
    data = path.read_bytes()
    return [data[o : o + n] for o, n in plan_file(path)]


def test_unchanged_tensor_gives_the_same_chunks_when_others_change(tmp_path: Path) -> None:
    """A frozen tensor yields the same chunks from one save to the next even when
    small adapter tensors that sort between its neighbours change, and a
    changed adapter costs at most one small group."""
    torch.manual_seed(0)
    frozen = {f"layers.{i}.weight": torch.randn(1024, 1024) for i in range(3)}  # 4 MiB each
    adapter = {f"layers.{i}.lora_a": torch.randn(8, 1024) for i in range(3)}
    save_file({**frozen, **adapter}, str(tmp_path / "a.safetensors"))
    for t in adapter.values():
        t.add_(1.0)
    save_file({**frozen, **adapter}, str(tmp_path / "b.safetensors"))
    a, b = chunk_bytes(tmp_path / "a.safetensors"), chunk_bytes(tmp_path / "b.safetensors")
    assert covers(plan_file(tmp_path / "a.safetensors"), (tmp_path / "a.safetensors").stat().st_size)
    changed = set(b) - set(a)
    assert sum(len(c) for c in changed) <= MIN_CHUNK + 3 * 8 * 1024 * 4
    frozen_bytes = sum(t.numel() * 4 for t in frozen.values())
    assert sum(len(c) for c in set(b) & set(a)) >= frozen_bytes


def test_zip_entries_keep_their_chunks_when_the_pickle_grows(tmp_path: Path) -> None:
    """``torch.save`` archives: a larger ``data.pkl`` shifts every later entry
    (and changes its header padding), but an unchanged tensor storage keeps
    its chunks."""
    big = torch.randn(1024, 1024)
    torch.save({"w": big, "note": "x"}, tmp_path / "a.pt")
    torch.save({"w": big, "note": "x" * 5000, "more": list(range(300))}, tmp_path / "b.pt")
    a, b = chunk_bytes(tmp_path / "a.pt"), chunk_bytes(tmp_path / "b.pt")
    storage_bytes = big.numpy().tobytes()
    assert storage_bytes in set(a) & set(b)


def test_a_safetensors_files_chunks_are_known_from_its_header(tmp_path: Path) -> None:
    """What a follower plans from the header of a file being written is what the upload plans
    from the complete file, for large, small and split tensors, and for bytes that are no header."""
    torch.manual_seed(1)
    tensors = {
        "big": torch.randn(5 * 1024, 1024),  # 20 MiB: cut at 16 MiB
        "mid": torch.randn(512, 1024),  # 2 MiB
        "small.a": torch.randn(8, 64),
        "small.b": torch.randn(8, 64),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    data = path.read_bytes()
    need = safetensors_head_size(data[:8])
    assert need is not None and 8 < need < 4096
    assert plan_safetensors(data[:need], len(data)) == plan_file(path)
    assert plan_safetensors(data[: need - 1], len(data)) == fixed_chunks(len(data))  # the header is not all there
    assert safetensors_head_size(b"\xff" * 8) is None and safetensors_head_size(b"\x01") is None
    bogus = tmp_path / "bad.safetensors"
    bogus.write_bytes(b"\xff" * 100)
    assert plan_safetensors(b"\xff" * 100, 100) == plan_file(bogus)


def _bytes_read(fn: Any) -> int:
    """How many bytes this process read (``rchar`` of ``/proc/self/io``) while ``fn`` ran."""

    def rchar() -> int:
        return int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0])

    before = rchar()
    fn()
    return rchar() - before - len(Path("/proc/self/io").read_bytes())  # less the one read of /proc/self/io


def test_planning_a_large_safetensors_file_reads_its_header_only(tmp_path: Path) -> None:
    """A frozen base's file is planned at every upload: what that costs is its header, not its size
    (it read the first 100 MiB before)."""
    path = tmp_path / "base.safetensors"
    save_file({f"w{i}": torch.full((4 << 20,), float(i)) for i in range(8)}, str(path))  # 128 MiB
    data_start = safetensors_head_size(path.read_bytes()[:8])
    assert data_start is not None
    with open(path, "rb") as f:
        expected = plan_safetensors(f.read(data_start), path.stat().st_size)
    plans: list[list[tuple[int, int]]] = []
    read = _bytes_read(lambda: plans.append(plan_file(path)))
    assert plans == [expected] and len(expected) == 9  # the header, then a chunk per 16 MiB tensor
    assert read <= data_start + MiB, read  # slack for what other threads of a test worker read meanwhile
    # A header that claims more than the file holds, or more than a header may be: fixed chunks, as before.
    for claimed in (path.stat().st_size, 1 << 40):
        bogus = tmp_path / f"claims-{claimed}.safetensors"
        bogus.write_bytes(claimed.to_bytes(8, "little") + b"{}" + b"\0" * (MIN_CHUNK * 3))
        assert plan_file(bogus) == fixed_chunks(bogus.stat().st_size)


def test_other_files_use_fixed_offsets(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    path.write_bytes(b"\x01" * (MAX_CHUNK + 10))
    assert plan_file(path) == [(0, MAX_CHUNK), (MAX_CHUNK, 10)]
    bogus = tmp_path / "bad.safetensors"
    bogus.write_bytes(b"\xff" * 100)
    assert plan_file(bogus) == [(0, 100)]


def test_hash_chunk_and_keys() -> None:
    ref = hash_chunk(b"abc")
    assert ref.hash == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert ref.size == 3 and ref.checksum == checksum_bytes(b"abc", "crc32c")
    assert chunk_key(ref.hash) == f"chunks/ba/{ref.hash}" == ref.key
    assert parse_chunk_key(ref.key) == ref.hash
    assert parse_chunk_key(f"chunks/aa/{ref.hash}") is None
    assert parse_chunk_key("chunks/ba/xyz") is None
    with pytest.raises(ValueError):
        chunk_key("../etc")


def plain_manifest(data: dict[str, bytes]) -> Any:
    files = [FileEntry(p, len(b), checksum_bytes(b, "crc32c")) for p, b in data.items()]
    return new_manifest(7, files, "crc32c", epoch=1, metrics={"loss": 0.5}, job="ns/j", attempt=2)


def test_chunked_manifest_roundtrip_and_plain_copy() -> None:
    data = {"model.safetensors": b"a" * 100 + b"b" * 50, "state.json": b"{}"}
    plain = plain_manifest(data)
    tables = {
        "model.safetensors": [hash_chunk(b"a" * 100), hash_chunk(b"b" * 50)],
        "state.json": [hash_chunk(b"{}")],
    }
    chunked = to_chunked(plain, tables)
    assert chunked.chunked and chunked.format_version == FORMAT_VERSION_CHUNKED == 3
    doc = json.loads(chunked.to_json())
    assert doc["files"][0]["chunks"][1] == [
        tables["model.safetensors"][1].hash,
        50,
        tables["model.safetensors"][1].checksum,
    ]
    assert parse_manifest(chunked.to_json(), expected_name="ckpt-000000000007") == chunked
    assert set(chunked.chunk_refs()) == {r.hash for refs in tables.values() for r in refs}
    back = to_plain(chunked)
    assert back.to_json() == plain.to_json()


def chunked_doc(**overrides: Any) -> dict[str, Any]:
    data = b"a" * 100 + b"b" * 50
    a, b = hash_chunk(b"a" * 100), hash_chunk(b"b" * 50)
    doc: dict[str, Any] = {
        "format_version": 3,
        "step": 1,
        "created": "2026-01-01T00:00:00Z",
        "checksum_algorithm": "crc32c",
        "files": [
            {
                "path": "m.safetensors",
                "size": 150,
                "checksum": checksum_bytes(data, "crc32c"),
                "chunks": [[a.hash, a.size, a.checksum], [b.hash, b.size, b.checksum]],
            }
        ],
    }
    doc.update(overrides)
    return doc


def test_chunked_manifest_parses() -> None:
    m = parse_manifest(json.dumps(chunked_doc()))
    assert m.files[0].chunks is not None and len(m.files[0].chunks) == 2


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["files"][0]["chunks"].pop(), "chunks add up to 100 bytes, the file has 150"),
        (lambda d: d["files"][0]["chunks"][0].__setitem__(0, "../x"), "is not a SHA-256 hex digest"),
        (lambda d: d["files"][0]["chunks"][0].__setitem__(1, 0), "not a positive integer"),
        (lambda d: d["files"][0]["chunks"][0].__setitem__(2, "zz"), "is not a crc32c hex digest"),
        (lambda d: d["files"][0]["chunks"].reverse(), "do not combine to the file's checksum"),
        (lambda d: d["files"][0].pop("chunks"), "'chunks' must be a list"),
        (lambda d: d.__setitem__("format_version", 1), "'chunks' needs format_version 3"),
        (
            lambda d: d.__setitem__("sharding", {"world_size": 1, "parts": 1, "part": None, "ranks": [0]}),
            "global manifest does not list parts/00000.json",
        ),
    ],
)
def test_chunked_manifest_rejects(edit: Any, message: str) -> None:
    doc = chunked_doc()
    edit(doc)
    with pytest.raises(ManifestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_manifest(json.dumps(doc))


def test_to_chunked_refuses_a_file_changed_since_the_manifest() -> None:
    plain = plain_manifest({"m.bin": b"x" * 10})
    with pytest.raises(ManifestError, match="do not combine"):
        to_chunked(plain, {"m.bin": [hash_chunk(b"y" * 10)]})
    with pytest.raises(ManifestError, match="no chunks given"):
        to_chunked(plain, {})


def test_distributed_parts_are_chunked_and_the_global_manifest_keeps_part_manifests_whole() -> None:
    """A part manifest stored incrementally lists its files' chunks; the global
    manifest built from such parts keeps them and lists the part manifests
    themselves as whole files (the only entries without chunks)."""
    parts = []
    for rank in (0, 1):
        data = {f"dcp/__{rank}_0.distcp": bytes([rank]) * 300, f"ranks/{rank:05d}/state.json": b"{}"}
        files = [FileEntry(p, len(b), checksum_bytes(b, "crc32c")) for p, b in data.items()]
        part = new_manifest(3, files, "crc32c", sharding=Sharding(2, 2, rank, (rank,), save_id="s1"))
        chunked = to_chunked(
            part, {p: [hash_chunk(b[i : i + 100]) for i in range(0, len(b), 100)] for p, b in data.items()}
        )
        assert chunked.chunked and chunked.is_part and to_plain(chunked) == part
        assert parse_manifest(chunked.to_json()) == chunked
        parts.append((chunked.to_json(), chunked))
    whole = build_global_manifest([(to_plain(m).to_json(), to_plain(m)) for _, m in parts])
    assert not whole.chunked
    g = build_global_manifest(parts)
    assert g.chunked and g.is_global
    assert [f.path for f in g.files if f.chunks is None] == ["parts/00000.json", "parts/00001.json"]
    assert len(g.chunk_refs()) == 3  # equal bytes share a chunk: one per rank's data file, one for both {}
    doc = json.loads(g.to_json())
    doc["files"][-1]["chunks"] = [[hash_chunk(b"x").hash, 1, hash_chunk(b"x").checksum]]
    with pytest.raises(ManifestError, match="a part manifest is stored whole"):
        parse_manifest(json.dumps(doc))
    with pytest.raises(ManifestError, match="part 1 is stored whole, but part 0 is stored as chunks"):
        build_global_manifest([parts[0], (to_plain(parts[1][1]).to_json(), to_plain(parts[1][1]))])


def test_distcp_items_are_chunk_regions(tmp_path: Path) -> None:
    """A DCP data file's items (``torch.save`` archives back to back) are found from the
    file's end; an unchanged large item keeps its chunks when the items before it grow."""
    import torch.distributed.checkpoint as dcp

    big = torch.randn(1024, 1024)  # 4 MiB: chunks of its own
    for name, small in (("a", torch.zeros(10)), ("b", torch.zeros(70_000))):
        dcp.save({"big": big, "small": small}, checkpoint_id=tmp_path / name, no_dist=True)
    for name in ("a", "b"):
        path = tmp_path / name / "__0_0.distcp"
        metadata = dcp.FileSystemReader(tmp_path / name).read_metadata()
        want = sorted((i.offset, i.offset + i.length) for i in metadata.storage_data.values())
        assert distcp_regions(path, path.stat().st_size) == want
    a, b = chunk_bytes(tmp_path / "a" / "__0_0.distcp"), chunk_bytes(tmp_path / "b" / "__0_0.distcp")
    assert sum(len(c) for c in set(a) & set(b)) >= big.numel() * 4
    damaged = tmp_path / "damaged.distcp"
    damaged.write_bytes((tmp_path / "a" / "__0_0.distcp").read_bytes()[:-1] + b"\x01")
    assert distcp_regions(damaged, damaged.stat().st_size) is None
    assert plan_file(damaged) == fixed_chunks(damaged.stat().st_size)


def test_chunk_ref_key() -> None:
    ref = ChunkRef("0" * 64, 1, "00000000")
    assert ref.key == "chunks/00/" + "0" * 64


def test_crc32c_combine_matches_the_crc_of_the_concatenation() -> None:
    """The combination the version 3 manifest check relies on, for lengths
    covering every bit position a chunk size can have set."""
    import random

    import google_crc32c

    from spotguard.storage.checksum import crc32c_combine, crc32c_of_parts

    rng = random.Random(7)
    for size in [0, 1, 2, 3, 7, 8, 9, 255, 256, 4097, 65_537, 1_000_003, rng.randrange(1, 3_000_000)]:
        a, b = rng.randbytes(rng.randrange(0, 5000)), rng.randbytes(size)
        assert crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b)) == google_crc32c.value(a + b)
    parts = [rng.randbytes(rng.randrange(1, 70_000)) for _ in range(20)]
    joined = b"".join(parts)
    assert crc32c_of_parts((google_crc32c.value(p), len(p)) for p in parts) == google_crc32c.value(joined)


def test_the_chunks_a_verification_names_are_read_from_its_problems_and_leave_the_known_set() -> None:
    from spotguard.checkpoint.store.chunked import KnownChunks, chunks_named

    a, b, c = ("a" * 64), ("b" * 64), ("c" * 64)
    problems = [
        f"{chunk_key(a)}: crc32c checksum mismatch (the store computed 1, manifest says 2) (chunk of a.bin)",
        f"{chunk_key(b)}: missing (chunk of model.safetensors and 1 other file)",
        "optimizer.pt: size 3 bytes, manifest says 4 (truncated)",
        f"chunks/{a[:2]}/{a[:12]}: not a whole key",
    ]
    assert chunks_named(problems) == {a, b}
    known = KnownChunks({a: 1, b: 2, c: 3}, "ckpt-000000000010", 5.0)
    assert known.without({a, b}) == KnownChunks({c: 3}, "ckpt-000000000010", 5.0)
    assert known.without({"d" * 64}) is known


def test_pieces_name_the_tensor_bytes_a_range_holds() -> None:
    from spotguard.checkpoint.local.codec import TensorSpan
    from spotguard.checkpoint.local.unchanged import _part_of, _pieces

    spans = [TensorSpan("a", "F32", (4,), 100, 116), TensorSpan("b", "F32", (8,), 116, 148)]
    assert _pieces(spans, 100, 16) == (("a", 0, 16),)
    assert _pieces(spans, 104, 20) == (("a", 4, 16), ("b", 0, 8))
    assert _pieces(spans, 120, 28) == (("b", 4, 32),)
    assert _pieces(spans, 0, 116) is None  # the header is not a tensor's
    assert _pieces(spans, 140, 16) is None  # past the last tensor
    assert _pieces(spans, 100, 0) is None
    assert _pieces([], 0, 8) is None
    assert _part_of("model.kept.safetensors") == _part_of("model.safetensors") == "model"
    assert _part_of("ranks/00001/optimizer.safetensors") == "ranks/00001/optimizer"


def test_an_upload_result_carries_every_chunk_counter_of_its_chunked_upload() -> None:
    from dataclasses import fields

    from spotguard.checkpoint.store import upload
    from spotguard.checkpoint.store.chunked import ChunkCounts, ChunkedUpload
    from spotguard.checkpoint.store.publish import UploadResult

    counts = {f.name: i + 1 for i, f in enumerate(fields(ChunkCounts))}
    manifest = new_manifest(1, [], "crc32c")
    chunked = ChunkedUpload(manifest, b"{}", trusted={"ab": 4}, **counts)
    result = UploadResult(
        step=1,
        name=manifest.name,
        bytes=2,
        seconds=0.1,
        uri="file:///x",
        pointer_updated=False,
        **upload._chunk_counts(chunked),
    )
    assert result.counts() == chunked.counts() == counts and result.trusted_chunks == {"ab": 4}
    assert ChunkCounts().counts() == dict.fromkeys(counts, 0)


def test_each_way_of_uploading_reports_its_checkpoint_from_the_same_place(tmp_path: Path) -> None:
    import time

    from spotguard.checkpoint.store import upload
    from spotguard.storage import open_storage

    storage = open_storage((tmp_path / "store").as_uri())
    manifest = new_manifest(3, [], "crc32c")
    sending = upload._Sending(tmp_path, storage, manifest, b"{}", None, time.monotonic() - 2.0)
    result = sending.result(10, new_bytes=8, committed=False)
    assert (result.step, result.name, result.bytes, result.new_bytes, result.committed) == (
        3,
        manifest.name,
        10,
        8,
        False,
    )
    assert result.uri == storage.uri_for(manifest.name) and not result.pointer_updated and result.seconds >= 2.0
