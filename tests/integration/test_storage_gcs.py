"""gs:// storage against a real GCS JSON API server on 127.0.0.1 (fake-gcs-server, fixture ``gcs_store``).

What GCS gives natively and spotguard relies on: the CRC32C the service keeps
for every object (verification without reading back), generations (create-only
and compare-and-swap writes, conditional reads, ranged reads of one generation),
resumable uploads, retries; then credentials, the CLI, and the checkpoint-level
suite at small scale (verify, walk back past damage, incremental chunks and
their garbage collection, the poller). The generic storage contract and the
checkpoint suites that take a storage kind run against gs:// too
(``test_storage.py``, ``test_checkpoint_remote.py``, ``test_checkpoint_verify.py``).

What the server lacks, and where the same path is tested instead:

- Conditional reads: it ignores ``ifGenerationNotMatch`` and always sends the
  object; here the backend's answer for a server that ignores the condition
  (same generation: unchanged) is what runs. A 304 answer is handled like
  S3's (``test_latest_watch.py::test_s3_conditional_read_answers_304_and_is_retried``).
- ``ifGenerationMatch`` on resumable uploads: ignored (it is honoured on
  single-request uploads, which conditional writes of pointers and manifests
  use: those are tested here). Conditional writes in general: S3 in
  ``test_storage.py::test_conditional_writes`` and ``test_sharded_storage.py``.
- Checking the CRC32C sent with an upload: ignored (GCS refuses a mismatch with
  400, and the uploader sends the bytes again). So a byte flipped in transit is
  stored here, and ``test_a_byte_flipped_on_the_way_is_caught_by_the_crc32c_the_store_computed``
  shows verification catching it; refuse-and-resend is tested against S3
  (``test_faults.py::test_bytes_corrupted_in_transit_are_refused_sent_again_and_verified``).
- Batch requests: none, so deletions go one request per object here (the
  default for a custom endpoint); batched multi-object deletes are tested
  against S3 (``test_storage.py::test_delete``, ``test_checkpoint_remote.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest
from ckpt_helpers import assert_state_matches, commit_local, write_part

from spotguard.checkpoint import (
    KnownChunks,
    LatestWatch,
    RetentionPolicy,
    collect_garbage,
    latest_verified,
    load_checkpoint_state,
    read_manifest,
    restore_checkpoint,
    restore_latest,
    upload_checkpoint,
    verify_checkpoint,
)
from spotguard.checkpoint.format.manifest import CHUNKS_DIR, MANIFEST_NAME, POINTER_NAME, checkpoint_name
from spotguard.checkpoint.local.codec import snapshot_state
from spotguard.checkpoint.local.commit import write_checkpoint
from spotguard.checkpoint.store.gc import sweep_chunks
from spotguard.storage import (
    UNCHANGED,
    CredentialsError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
    StoreChecksums,
    open_storage,
)
from spotguard.storage.gcs import GcsStorage
from testenv.faultproxy import FaultProxy, corrupt, reset, status

pytestmark = pytest.mark.integration

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
#: Small resumable pieces and read ranges, so a few MiB take those paths; fast retries.
SMALL = {
    "resumable_threshold": 1 * MiB,
    "chunk_size": 256 << 10,
    "read_chunk_size": 1 * MiB,
    "max_concurrency": 4,
    "retry_initial_delay": 0.05,
}


def gs(gcs_store: Any, uri: str, **options: Any) -> GcsStorage:
    storage = open_storage(uri, **{**gcs_store.options(), **SMALL, **options})
    assert isinstance(storage, GcsStorage)
    return storage


@pytest.fixture
def proxy(gcs_store: Any) -> Iterator[FaultProxy]:
    with FaultProxy(gcs_store.endpoint_url) as p:
        yield p


def crc(data: bytes) -> str:
    return f"{google_crc32c.value(data):08x}"


def object_path(storage: GcsStorage, key: str) -> str:
    """How a request target names the object (the name URL-encoded)."""
    return f"/b/{storage.bucket}/o/{storage._key(key).replace('/', '%2F')}"  # noqa: SLF001


def data_gets(proxy: FaultProxy, storage: GcsStorage, name: str) -> list[str]:
    """Media GETs of a checkpoint's data files (bytes read back), by target."""
    prefix = object_path(storage, name) + "%2F"
    return [
        r.target
        for r in proxy.requests("GET", r"alt=media")
        if prefix in r.target and f"{prefix}{MANIFEST_NAME}?" not in r.target
    ]


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotguard.cli", *args], env=env, capture_output=True, text=True, timeout=120, cwd=REPO
    )


def cli_env(**extra: str) -> dict[str, str]:
    """This environment without spotguard or Google settings (the run marker kept), plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SPOTGUARD_", "GOOGLE_", "STORAGE_EMULATOR")) or k == "SPOTGUARD_TESTENV_RUN"
    }
    env["PYTHONPATH"] = str(REPO)
    return {**env, **extra}


# -- the store's own checksums, resumable uploads, ranged reads ------------------------------


def test_stored_checksums_are_the_crc32c_of_the_bytes_by_every_upload_path(
    gcs_store: Any, gs_uri: str, tmp_path: Path
) -> None:
    storage = gs(gcs_store, gs_uri)
    assert isinstance(storage, StoreChecksums)
    files = {
        "small.bin": os.urandom(1000),  # one request
        "large.bin": os.urandom(3 * MiB + 12345),  # resumable, 13 pieces of 256 KiB
        "exact.bin": os.urandom(4 * (256 << 10)),  # resumable, ending exactly on a piece
        "empty.bin": b"",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    seen: list[int] = []
    storage.upload_files([(tmp_path / n, f"up/{n}") for n in files], seen.append)
    assert sum(seen) == sum(len(d) for d in files.values())
    storage.write_checked("up/checked.bin", b"written checked")
    storage.write_bytes("up/plain.bin", b"written plain")
    files |= {"checked.bin": b"written checked", "plain.bin": b"written plain"}
    for name, data in files.items():
        stored = storage.stored_checksum(f"up/{name}")
        assert stored is not None, name
        assert (stored.algorithm, stored.value, stored.size, stored.source) == (
            "crc32c",
            crc(data),
            len(data),
            "full-object",
        ), name
    with pytest.raises(NotFoundError):
        storage.stored_checksum("up/missing.bin")
    # Read back whole and in concurrent ranges of one generation.
    large = files["large.bin"]
    assert b"".join(storage.iter_chunks("up/large.bin")) == large
    got: list[int] = []
    storage.download_files(
        [("up/large.bin", tmp_path / "dl" / "large.bin"), ("up/exact.bin", tmp_path / "dl" / "exact.bin")], got.append
    )
    assert (tmp_path / "dl" / "large.bin").read_bytes() == large
    assert (tmp_path / "dl" / "exact.bin").read_bytes() == files["exact.bin"]
    assert sum(got) == len(large) + len(files["exact.bin"])
    assert sorted(p.name for p in (tmp_path / "dl").iterdir()) == ["exact.bin", "large.bin"]
    # Resumable sessions cannot be listed: nothing to report or abort.
    assert storage.list_pending_uploads("") == []


def test_large_files_go_up_as_resumable_uploads_and_many_files_at_once(
    gcs_store: Any, gs_uri: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    storage = gs(gcs_store, gs_uri, endpoint_url=proxy.url)
    big = os.urandom(2 * MiB + 1)
    (tmp_path / "big.bin").write_bytes(big)
    many = {f"f{i:03d}.bin": os.urandom(100 + i) for i in range(101)}  # deleted in two batches of up to 100
    for name, data in many.items():
        (tmp_path / name).write_bytes(data)
    storage.upload_files([(tmp_path / "big.bin", "big.bin"), *[(tmp_path / n, f"many/{n}") for n in many]])
    assert len(proxy.requests("POST", r"uploadType=resumable")) == 1
    assert len(proxy.requests("POST", r"uploadType=multipart")) == len(many)
    assert storage.read_bytes("big.bin") == big
    assert {o.key: o.size for o in storage.list_objects("many/")} == {f"many/{n}": len(d) for n, d in many.items()}
    # The server has no batch endpoint: a batched delete says so and deletes nothing.
    with pytest.raises(StorageError, match="does not take batch requests: open .* with batch_deletes=False"):
        gs(gcs_store, gs_uri, endpoint_url=proxy.url, batch_deletes=True).delete(["many/f000.bin"])
    assert proxy.requests("POST", r"/batch/storage/v1") and storage.stat("many/f000.bin") is not None
    # More than one batch (100) of deletions, one request each here; missing objects are ignored.
    storage.delete([f"many/{n}" for n in many] + ["many/missing"])
    assert list(storage.list_objects("many/")) == []
    assert storage.list_dirs("") == []


def test_a_large_file_goes_up_as_parallel_pieces_composed_by_the_service(
    gcs_store: Any, gs_uri: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """A file above ``composite_threshold``: its pieces go up at once, one compose
    request joins them, the object's CRC32C is the file's, no piece is left. A
    composite upload that dies before its compose leaves its pieces listed as a
    pending upload, which the collector removes as it aborts S3's multipart uploads."""
    storage = gs(gcs_store, gs_uri, endpoint_url=proxy.url, composite_threshold=2 * MiB, composite_piece=512 << 10)
    big = os.urandom(5 * MiB + 3)
    (tmp_path / "big.bin").write_bytes(big)
    small = os.urandom(100 << 10)  # one request
    (tmp_path / "small.bin").write_bytes(small)
    seen: list[int] = []
    key = f"{checkpoint_name(1)}/model.safetensors"
    storage.upload_files([(tmp_path / "big.bin", key), (tmp_path / "small.bin", "small.bin")], progress=seen.append)
    assert sum(seen) == len(big) + len(small)
    assert len(proxy.requests("POST", r"uploadType=resumable")) == 11  # ceil((5 MiB + 3) / 512 KiB) pieces
    assert len(proxy.requests("POST", r"/compose")) == 1
    assert storage.read_bytes(key) == big and storage.read_bytes("small.bin") == small
    stored = storage.stored_checksum(key)
    assert stored is not None and (stored.value, stored.size) == (crc(big), len(big))
    assert list(storage.list_objects("gc/")) == [] and storage.list_pending_uploads() == []

    # The compose refused, and the pieces' deletion too: they stay, listed as one pending upload.
    proxy.add(status(403, "forbidden"), method="POST", path=r"/compose", times=1)
    proxy.add(status(403, "forbidden"), method="DELETE")
    with pytest.raises(StorageError):
        storage.upload_files([(tmp_path / "big.bin", f"{checkpoint_name(2)}/model.safetensors")])
    proxy.clear()
    assert storage.stat(f"{checkpoint_name(2)}/model.safetensors") is None
    pending = storage.list_pending_uploads()
    assert [p.key for p in pending] == [f"{checkpoint_name(2)}/model.safetensors"], pending
    assert storage.list_pending_uploads(f"{checkpoint_name(1)}/") == []
    assert len(list(storage.list_objects("gc/compose/"))) == 11
    report = collect_garbage(storage, RetentionPolicy(keep_last=5), stale_upload_age=0.0)
    assert [u.upload_id for u in report.aborted_uploads] == [pending[0].upload_id]
    assert list(storage.list_objects("gc/compose/")) == [] and storage.list_pending_uploads() == []


def test_generations_are_the_entity_tags(gcs_store: Any, gs_uri: str, proxy: FaultProxy) -> None:
    storage = gs(gcs_store, gs_uri, endpoint_url=proxy.url)
    first = storage.write_bytes("latest", b"1", if_none_match=True)
    assert first.isdigit()
    with pytest.raises(PreconditionFailedError):
        storage.write_bytes("latest", b"2", if_none_match=True)  # create-only, refused the second time
    assert proxy.requests("POST", r"ifGenerationMatch=0")
    assert storage.read_if_changed("latest", first) is UNCHANGED
    assert proxy.requests("GET", rf"ifGenerationNotMatch={first}"), "the read is conditional on the generation"
    second = storage.write_bytes("latest", b"2", if_match=first)
    assert second != first
    with pytest.raises(PreconditionFailedError):
        storage.write_bytes("latest", b"3", if_match=first)  # stale generation
    with pytest.raises(PreconditionFailedError):
        storage.write_bytes("latest", b"3", if_match='"an-s3-etag"')  # not a generation: can never match
    assert storage.read_if_changed("latest", first) == (b"2", second)
    assert storage.read_if_changed("latest", None) == (b"2", second)
    assert storage.read_if_changed("missing", first) is None
    assert storage.read_with_etag("missing") is None


# -- retries and errors ----------------------------------------------------------------------


def test_throttling_server_errors_and_resets_are_retried(
    gcs_store: Any, gs_uri: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    storage = gs(gcs_store, gs_uri, endpoint_url=proxy.url)
    proxy.add(status(503, "backendError"), method="POST", path=r"uploadType=multipart", times=2)
    proxy.add(status(429, "rateLimitExceeded"), method="GET", path=r"alt=media", times=2)
    proxy.add(reset(), method="GET", path=r"/o\?", times=1)  # a listing
    proxy.add(status(500, "internalError"), method="DELETE", times=1)
    upload_checkpoint(commit_local(tmp_path / "local", 3), storage)
    result = verify_checkpoint(storage, checkpoint_name(3), deep=True)
    assert result.ok, result.problems
    storage.delete([f"{checkpoint_name(3)}/state.json"])
    assert storage.stat(f"{checkpoint_name(3)}/state.json") is None
    faults = [(r.method, r.fault) for r in proxy.faults()]
    assert len(faults) == 6, faults


def test_a_store_that_stays_down_is_one_clear_error(gcs_store: Any, gs_uri: str) -> None:
    storage = gs(gcs_store, gs_uri, endpoint_url="http://127.0.0.1:9", retry_deadline=1.0)
    with pytest.raises(StorageError, match=r"cannot reach the GCS endpoint \(http://127.0.0.1:9\)"):
        storage.check()


def test_a_missing_bucket_is_one_clear_error(gcs_store: Any) -> None:
    storage = gs(gcs_store, "gs://no-such-bucket-spotguard/x")
    with pytest.raises(NotFoundError, match="bucket 'no-such-bucket-spotguard' does not exist"):
        storage.check()
    with pytest.raises(NotFoundError, match="does not exist"):
        list(storage.list_objects(""))


def test_credentials_missing_or_unusable_are_one_clear_error_without_secrets(
    gcs_store: Any, gs_uri: str, tmp_path: Path
) -> None:
    key = tmp_path / "key.json"
    key.write_text(
        json.dumps(
            {
                "type": "service_account",
                "client_email": "trainer@project.iam.gserviceaccount.com",
                "private_key": "-----BEGIN PRIVATE KEY-----\nNOTAKEYSECRET0123\n-----END PRIVATE KEY-----\n",
                "token_uri": "http://127.0.0.1:9/token",
            }
        )
    )
    with pytest.raises(CredentialsError) as err:
        open_storage(gs_uri, credentials_file=str(key)).check()
    assert str(key) in str(err.value) and "NOTAKEYSECRET" not in str(err.value)

    # The CLI without any credentials (and no metadata server to ask): one line saying what to do.
    no_gce = {
        "NO_GCE_CHECK": "true",
        "GCE_METADATA_HOST": "127.0.0.1:9",
        "GCE_METADATA_IP": "127.0.0.1:9",
        "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),
    }
    bare = cli("ckpt", "ls", gs_uri, env=cli_env(**no_gce))
    assert bare.returncode != 0
    assert "no Google Cloud credentials found" in bare.stderr and "Workload Identity" in bare.stderr, bare.stderr
    assert "Traceback" not in bare.stderr
    keyed = cli("ckpt", "ls", gs_uri, env=cli_env(**no_gce, GOOGLE_APPLICATION_CREDENTIALS=str(key)))
    assert keyed.returncode != 0 and f"GOOGLE_APPLICATION_CREDENTIALS={key} cannot be used" in keyed.stderr, (
        keyed.stderr
    )
    assert "NOTAKEYSECRET" not in keyed.stderr + keyed.stdout


# -- checkpoints ------------------------------------------------------------------------------


def test_verify_by_the_crc32c_the_store_computed_reads_nothing_back(
    gcs_store: Any, gs_uri: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    storage = gs(gcs_store, gs_uri, endpoint_url=proxy.url)
    upload_checkpoint(commit_local(tmp_path / "local", 7, numel=300_000), storage)
    assert len(proxy.requests("POST", r"uploadType=resumable")) == 2  # model and optimizer, over 1 MiB
    proxy.log.clear()
    result = verify_checkpoint(storage, checkpoint_name(7))
    assert result.ok and result.method == "store-checksum", result
    assert result.read_back == 0 and result.checked_bytes == 0
    assert data_gets(proxy, storage, checkpoint_name(7)) == [], "the fast path read data back"
    proxy.log.clear()
    deep = verify_checkpoint(storage, checkpoint_name(7), deep=True)
    assert deep.ok and deep.method == "read-back"
    assert deep.checked_bytes == deep.manifest.total_size  # type: ignore[union-attr]
    assert len(data_gets(proxy, storage, checkpoint_name(7))) >= len(deep.manifest.files)  # type: ignore[union-attr]


def test_a_byte_flipped_on_the_way_is_caught_by_the_crc32c_the_store_computed(
    gcs_store: Any, gs_uri: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """GCS itself refuses such an upload (the CRC32C sent with it does not match);
    this server stores it, and verification catches it: the CRC32C the store
    computed of what it stored is not the manifest's."""
    direct = gs(gcs_store, gs_uri)
    local = tmp_path / "local"
    upload_checkpoint(commit_local(local, 1), direct)
    second = commit_local(local, 2, numel=100_000)
    upload_checkpoint(second, direct)
    through = gs(gcs_store, gs_uri, endpoint_url=proxy.url, resumable_threshold=8 * MiB)
    proxy.add(corrupt(), method="POST", path=r"uploadType=multipart", times=1)
    key = f"{checkpoint_name(2)}/model.safetensors"
    through.upload_files([(second / "model.safetensors", key)])
    assert proxy.faults()
    stored = direct.stored_checksum(key)
    assert stored is not None and stored.value != crc((second / "model.safetensors").read_bytes())
    result = verify_checkpoint(direct, checkpoint_name(2))
    assert not result.ok and result.method == "store-checksum"
    assert any(
        p.startswith("model.safetensors: crc32c checksum mismatch (the store computed") for p in result.problems
    ), result.problems
    info, skipped = latest_verified(direct)
    assert info is not None and info.step == 1 and [s.step for s in skipped] == [2]
    restored = restore_latest(direct, tmp_path / "restore")
    assert restored is not None and restored.step == 1
    assert_state_matches(load_checkpoint_state(Path(restored.uri)), 1)


def test_the_poller_costs_one_request_while_nothing_changes_and_sees_global_commits(
    gcs_store: Any, gs_uri: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    writer = gs(gcs_store, gs_uri)
    upload_checkpoint(commit_local(tmp_path / "local", 10), writer)
    watch = LatestWatch(gs(gcs_store, gs_uri, endpoint_url=proxy.url))
    info, _ = watch.poll()
    assert info is not None and info.step == 10 and watch.last_full
    for _ in range(3):
        proxy.log.clear()
        info, _ = watch.poll()
        assert info is not None and info.step == 10 and not watch.last_full
        [request] = proxy.log
        assert request.method == "GET" and object_path(writer, POINTER_NAME) in request.target
        assert "ifGenerationNotMatch=" in request.target
    # A distributed checkpoint: the global manifest is a create-only write by whichever part
    # completes the set; the pointer moves then.
    for index in (0, 1):
        upload_checkpoint(write_part(tmp_path / f"part{index}", 30, index), writer)
        if index == 0:
            assert watch.poll()[0].step == 10  # type: ignore[union-attr]
    info, _ = watch.poll()
    assert info is not None and info.step == 30 and watch.last_full
    assert verify_checkpoint(writer, checkpoint_name(30)).ok
    with pytest.raises(PreconditionFailedError):
        writer.write_bytes(f"{checkpoint_name(30)}/{MANIFEST_NAME}", b"{}", if_none_match=True)


FROZEN_NUMEL = 320 * 1024  # 1.25 MiB of float32: a chunk of its own


def fine_tune(step: int, adapter: int) -> dict[str, Any]:
    """A frozen base (the same at every step) and a small adapter of version ``adapter``."""
    base = np.random.default_rng(0)
    trained = np.random.default_rng(100 + adapter)
    return {
        "model": {
            "base.a": base.standard_normal(FROZEN_NUMEL, dtype=np.float32),
            "base.b": base.standard_normal(FROZEN_NUMEL, dtype=np.float32),
            "adapter": trained.standard_normal(4096, dtype=np.float32),
        },
        "step": step,
    }


def test_incremental_chunks_upload_verify_walk_back_and_collect(gcs_store: Any, gs_uri: str, tmp_path: Path) -> None:
    storage = gs(gcs_store, gs_uri)
    local = tmp_path / "local"

    def ship(step: int, adapter: int, known: bool | KnownChunks) -> Any:
        return upload_checkpoint(
            write_checkpoint(local, step, snapshot_state(fine_tune(step, adapter))), storage, incremental=known
        )

    first = ship(10, 0, True)
    second = ship(20, 1, KnownChunks.of(read_manifest(storage, checkpoint_name(10))))
    assert second.reused_bytes > 2 * MiB and second.new_bytes < 0.2 * (second.new_bytes + second.reused_bytes)
    m10, m20 = read_manifest(storage, checkpoint_name(10)), read_manifest(storage, checkpoint_name(20))
    assert m20.format_version == 3
    result = verify_checkpoint(storage, checkpoint_name(20))
    assert result.ok and result.method == "store-checksum" and result.checked_bytes == 0, result
    restored = Path(restore_checkpoint(storage, checkpoint_name(20), tmp_path / "restored").uri)
    assert np.array_equal(load_checkpoint_state(restored)["model"]["adapter"], fine_tune(20, 1)["model"]["adapter"])

    # The CLI reads gs:// through the client's own emulator setting.
    listing = cli("ckpt", "ls", "--json", gs_uri, env=cli_env(**gcs_store.env()))
    assert listing.returncode == 0, listing.stderr
    rows = {r["step"]: r for r in json.loads(listing.stdout)["checkpoints"]}
    assert rows[10]["verified"] and rows[20]["verified"] and rows[20]["new_bytes"] == second.new_bytes

    # Retention deletes 10; after the grace the chunks only 10 used go, the shared base stays.
    only_10 = set(m10.chunk_refs()) - set(m20.chunk_refs())
    assert only_10 and first.new_chunks > len(only_10)
    assert collect_garbage(storage, RetentionPolicy(keep_last=1), orphan_grace=3600).deleted == [checkpoint_name(10)]
    sweep = sweep_chunks(storage, grace=0)
    assert {k.rsplit("/", 1)[1] for k in sweep.deleted} == only_10
    stored = {o.key.rsplit("/", 1)[1] for o in storage.list_objects(f"{CHUNKS_DIR}/")}
    assert stored == set(m20.chunk_refs())
    assert verify_checkpoint(storage, checkpoint_name(20), deep=True).ok

    # 30 and 40 share an adapter chunk 20 lacks: damaged, both fail naming it, resume walks back to 20.
    ship(30, 2, KnownChunks.of(m20))
    ship(40, 2, KnownChunks.of(read_manifest(storage, checkpoint_name(30))))
    m30, m40 = read_manifest(storage, checkpoint_name(30)), read_manifest(storage, checkpoint_name(40))
    [digest] = (set(m30.chunk_refs()) & set(m40.chunk_refs())) - set(m20.chunk_refs())
    chunk_key = m40.chunk_refs()[digest].key
    good = storage.read_bytes(chunk_key)
    storage.write_bytes(chunk_key, bytes([good[0] ^ 0xFF]) + good[1:])
    for step in (30, 40):
        bad = verify_checkpoint(storage, checkpoint_name(step))
        assert not bad.ok and any(p.startswith(f"{chunk_key}: ") for p in bad.problems), bad.problems
    info, skipped = latest_verified(storage)
    assert info is not None and info.step == 20 and [s.step for s in skipped] == [40, 30]
    back = restore_latest(storage, tmp_path / "fresh")
    assert back is not None and back.step == 20
    assert np.array_equal(load_checkpoint_state(Path(back.uri))["model"]["base.b"], fine_tune(20, 1)["model"]["base.b"])
