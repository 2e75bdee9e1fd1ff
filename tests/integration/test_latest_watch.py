"""LatestWatch: the newest verified checkpoint for a poller, one conditional request while nothing changed.

Against a real SeaweedFS store (requests counted with a boto3 event hook on the
watched storage's own client) and a local directory (calls counted on the way
in). Checkpoints are written by a second storage handle, as the sidecar would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import PART_LAYOUT, commit_local, s3_options, write_part

from spotguard.checkpoint import POINTER_NAME, LatestWatch, latest_verified, update_latest_pointer, upload_checkpoint
from spotguard.storage import UNCHANGED, StorageError, open_storage
from spotguard.storage.file import FileStorage
from spotguard.storage.s3 import S3Storage
from testenv.faultproxy import FaultProxy, reset, status

pytestmark = pytest.mark.integration

#: The storage methods a reader calls (each one request, or one listing, against S3).
READS = (
    "read_if_changed",
    "read_with_etag",
    "read_bytes",
    "list_dirs",
    "list_objects",
    "stat",
    "iter_chunks",
    "stored_checksum",
)


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountedFile:
    """A FileStorage whose reads are counted where they come in (calls it makes itself are not)."""

    def __init__(self, inner: FileStorage) -> None:
        self.inner = inner
        self.calls: list[str] = []
        self.before_list: Callable[[], None] | None = None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in READS:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if name == "list_dirs" and self.before_list is not None:
                hook, self.before_list = self.before_list, None
                hook()
            return attr(*args, **kwargs)

        return counted


class Watched:
    """The storage a watch reads, what it sent, and a second handle that writes."""

    def __init__(self, kind: str, storage: Any, writer: Any) -> None:
        self.kind, self.storage, self.writer = kind, storage, writer
        self.sent: list[tuple[str, str, str | None]] = []  # S3: (method, url, If-None-Match)
        self._before_list: Callable[[], None] | None = None
        if isinstance(storage, S3Storage):
            storage.client.meta.events.register("before-send.s3", self._sending)

    def _sending(self, request: Any, **_: Any) -> None:
        self.sent.append((request.method, request.url, request.headers.get("If-None-Match")))
        if self._before_list is not None and request.method == "GET" and "list-type=2" in request.url:
            hook, self._before_list = self._before_list, None
            hook()

    def requests(self) -> list[str]:
        """What was sent since the last :meth:`clear`: S3 requests, or file storage reads."""
        if isinstance(self.storage, CountedFile):
            return list(self.storage.calls)
        return ["LIST" if "list-type=2" in u else f"{m} {u.split('?')[0].rsplit('/', 1)[-1]}" for m, u, _ in self.sent]

    def clear(self) -> None:
        self.sent.clear()
        if isinstance(self.storage, CountedFile):
            self.storage.calls.clear()

    def before_next_list(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` (once) just before the watched storage's next listing is sent."""
        if isinstance(self.storage, CountedFile):
            self.storage.before_list = hook
        else:
            self._before_list = hook

    def upload(self, local: Path, step: int, *, pointer: bool = True) -> None:
        upload_checkpoint(commit_local(local / f"s{step}", step), self.writer, update_pointer=pointer)


@pytest.fixture(params=["file", "s3"])
def watched(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Watched]:
    if request.param == "file":
        root = tmp_path / "remote" / "job"
        yield Watched("file", CountedFile(FileStorage(root)), FileStorage(root))
        return
    s3_store = request.getfixturevalue("s3_store")
    s3_uri = request.getfixturevalue("s3_uri")
    yield Watched("s3", open_storage(s3_uri, **s3_options(s3_store)), open_storage(s3_uri, **s3_options(s3_store)))


def test_unchanged_polls_cost_one_request_each(watched: Watched, tmp_path: Path) -> None:
    watched.upload(tmp_path, 10)
    watch = LatestWatch(watched.storage, clock=Clock())
    info, skipped = watch.poll()
    assert info is not None and info.step == 10 and skipped == []
    assert watch.last_full and watch.full_reads == 1
    for _ in range(5):
        watched.clear()
        info, _ = watch.poll()
        assert info is not None and info.step == 10
        assert not watch.last_full
        if watched.kind == "s3":
            # One GET of the pointer, conditional on the tag seen at the full read.
            ((method, url, if_none_match),) = watched.sent
            assert method == "GET" and url.endswith(f"/{POINTER_NAME}") and if_none_match
        else:
            assert watched.requests() == ["read_if_changed"]
    assert watch.unchanged_polls == 5 and watch.full_reads == 1


def test_a_new_checkpoint_is_seen_at_the_next_poll(watched: Watched, tmp_path: Path) -> None:
    watched.upload(tmp_path, 10)
    watch = LatestWatch(watched.storage, clock=Clock())
    assert watch.poll()[0].step == 10  # type: ignore[union-attr]
    watched.upload(tmp_path, 20)
    watched.clear()
    info, _ = watch.poll()
    assert info is not None and info.step == 20 and watch.last_full
    assert len(watched.requests()) > 1  # the pointer, then the listing and the manifest
    watched.clear()
    assert watch.poll()[0].step == 20 and len(watched.requests()) == 1  # type: ignore[union-attr]

    # A distributed checkpoint: the pointer moves when the last part commits it.
    for index in PART_LAYOUT:
        upload_checkpoint(write_part(tmp_path / f"part{index}", 30, index), watched.writer)
        if index < max(PART_LAYOUT):
            assert watch.poll()[0].step == 20  # type: ignore[union-attr]  # not committed yet
    info, _ = watch.poll()
    assert info is not None and info.step == 30 and watch.last_full
    assert watch.poll()[0].step == 30 and not watch.last_full  # type: ignore[union-attr]


def test_a_missing_pointer_means_a_full_read_at_every_poll(watched: Watched, tmp_path: Path) -> None:
    watch = LatestWatch(watched.storage, clock=Clock())
    assert watch.poll() == (None, [])  # an empty root: nothing yet
    watched.upload(tmp_path, 10, pointer=False)
    for _ in range(3):
        watched.clear()
        info, _ = watch.poll()
        assert info is not None and info.step == 10 and watch.last_full
        requests = watched.requests()
        assert len(requests) > 1
        if watched.kind == "s3":
            assert requests[0] == f"GET {POINTER_NAME}" and "LIST" in requests
        else:
            assert requests[0] == "read_with_etag" and "list_dirs" in requests
    assert update_latest_pointer(watched.writer, 10)
    assert watch.poll()[0].step == 10 and watch.last_full  # type: ignore[union-attr]  # the pointer appeared
    watched.clear()
    assert watch.poll()[0].step == 10 and not watch.last_full  # type: ignore[union-attr]
    assert len(watched.requests()) == 1


def test_full_read_after_the_interval_or_at_every_poll_with_zero(watched: Watched, tmp_path: Path) -> None:
    watched.upload(tmp_path, 10)
    clock = Clock()
    watch = LatestWatch(watched.storage, full_read_seconds=100, clock=clock)
    watch.poll()
    clock.now += 99
    watch.poll()
    assert not watch.last_full
    clock.now += 1
    watched.clear()
    watch.poll()
    assert watch.last_full and watch.full_reads == 2
    assert len(watched.requests()) > 1
    clock.now += 50
    watch.poll()
    assert not watch.last_full  # the interval counts from the last full read
    assert watch.poll(full=True)[0].step == 10 and watch.last_full  # type: ignore[union-attr]

    # 0: the old behaviour, latest_verified at every poll, the pointer never read.
    every = LatestWatch(watched.storage, full_read_seconds=0, clock=clock)
    for _ in range(3):
        watched.clear()
        info, _ = every.poll()
        assert info is not None and info.step == 10 and every.last_full
        requests = watched.requests()
        assert not any(POINTER_NAME in r or r in ("read_if_changed", "read_with_etag") for r in requests), requests
    assert every.full_reads == 3 and every.unchanged_polls == 0


def test_a_lagging_pointer_is_caught_by_the_periodic_full_read(watched: Watched, tmp_path: Path) -> None:
    watched.upload(tmp_path, 10)
    clock = Clock()
    watch = LatestWatch(watched.storage, full_read_seconds=1800, clock=clock)
    assert watch.poll()[0].step == 10  # type: ignore[union-attr]
    # Step 20 is complete and verifies, but its writer died before moving the pointer.
    watched.upload(tmp_path, 20, pointer=False)
    assert latest_verified(watched.writer, checksums=False)[0].step == 20  # type: ignore[union-attr]
    clock.now += 30
    assert watch.poll()[0].step == 10  # type: ignore[union-attr]  # the pointer says nothing changed
    clock.now += 1800
    info, _ = watch.poll()
    assert info is not None and info.step == 20 and watch.last_full


def test_a_pointer_ahead_of_what_verifies_is_not_trusted(watched: Watched, tmp_path: Path) -> None:
    watched.upload(tmp_path, 10)
    watched.upload(tmp_path, 20)
    clock = Clock()
    watch = LatestWatch(watched.storage, full_read_seconds=1800, clock=clock)
    assert watch.poll()[0].step == 20  # type: ignore[union-attr]
    # Step 20 loses a file behind spotguard's back: nothing signals it; the periodic full read finds it.
    watched.writer.delete(["ckpt-000000000020/model.safetensors"])
    clock.now += 1800
    info, skipped = watch.poll()
    assert info is not None and info.step == 10 and [s.step for s in skipped] == [20]
    # The pointer still names 20 and moves only forward: it cannot signal step 15, so every poll reads in full.
    clock.now += 30
    watch.poll()
    assert watch.last_full
    watched.upload(tmp_path, 15)  # resumed from 10; the pointer stays at 20
    clock.now += 30
    info, _ = watch.poll()
    assert info is not None and info.step == 15 and watch.last_full
    # Once a checkpoint at or past the pointer verifies, the pointer is trusted again.
    watched.upload(tmp_path, 30)
    clock.now += 30
    assert watch.poll()[0].step == 30 and watch.last_full  # type: ignore[union-attr]
    watched.clear()
    clock.now += 30
    assert watch.poll()[0].step == 30 and not watch.last_full  # type: ignore[union-attr]
    assert len(watched.requests()) == 1


def test_a_pointer_moved_during_a_full_read_is_read_again(watched: Watched, tmp_path: Path) -> None:
    watched.upload(tmp_path, 10)
    local = commit_local(tmp_path / "s20", 20)
    watch = LatestWatch(watched.storage, clock=Clock())
    # Step 20 lands (pointer included) after the watch read the pointer, before it lists.
    watched.before_next_list(lambda: upload_checkpoint(local, watched.writer))
    info, _ = watch.poll()
    assert info is not None and info.step == 20  # the listing saw it
    # The tag kept is the one read before the listing (step 10's): one more full read, then quiet.
    info, _ = watch.poll()
    assert info is not None and info.step == 20 and watch.last_full and watch.full_reads == 2
    watched.clear()
    assert watch.poll()[0].step == 20 and not watch.last_full  # type: ignore[union-attr]
    assert len(watched.requests()) == 1


def test_s3_conditional_read_answers_304_and_is_retried(s3_store: Any, s3_uri: str, tmp_path: Path) -> None:
    writer = open_storage(s3_uri, **s3_options(s3_store))
    upload_checkpoint(commit_local(tmp_path / "s10", 10), writer)
    with FaultProxy(s3_store.endpoint_url) as proxy:
        storage = open_storage(s3_uri, **{**s3_options(s3_store), "endpoint_url": proxy.url})
        found = storage.read_if_changed(POINTER_NAME, None)
        assert isinstance(found, tuple)
        data, etag = found
        proxy.log.clear()
        assert storage.read_if_changed(POINTER_NAME, etag) is UNCHANGED
        ((record,),) = [proxy.requests("GET", rf"/{POINTER_NAME}$")]
        assert record.status == 304  # SeaweedFS answers If-None-Match with 304 Not Modified

        # 503s and a reset are retried as for every read.
        proxy.log.clear()
        proxy.add(status(503, "SlowDown"), method="GET", path=rf"/{POINTER_NAME}$", times=2)
        assert storage.read_if_changed(POINTER_NAME, etag) is UNCHANGED
        assert [r.status for r in proxy.requests("GET", rf"/{POINTER_NAME}$")] == [503, 503, 304]
        proxy.add(reset(), method="GET", path=rf"/{POINTER_NAME}$", times=1)
        assert storage.read_if_changed(POINTER_NAME, etag) is UNCHANGED

        # A changed object comes with its new tag; a missing one is None.
        update_latest_pointer(writer, 11)
        found = storage.read_if_changed(POINTER_NAME, etag)
        assert isinstance(found, tuple) and found[1] != etag and b"11" in found[0]
        assert storage.read_if_changed("no-such-object", etag) is None

        # A watch whose storage fails keeps what it had: the next poll reads again.
        flaky = open_storage(s3_uri, **{**s3_options(s3_store), "endpoint_url": proxy.url}, max_attempts=2)
        watch = LatestWatch(flaky, clock=Clock())
        assert watch.poll()[0].step == 10  # type: ignore[union-attr]
        upload_checkpoint(commit_local(tmp_path / "s20", 20), writer)
        failing = proxy.add(status(503, "SlowDown"), method="GET", path=r"list-type=2")
        with pytest.raises(StorageError):
            watch.poll()  # the pointer moved; the listing failed (every attempt)
        proxy.remove(failing)
        info, _ = watch.poll()
        assert info is not None and info.step == 20 and watch.last_full
        assert watch.poll()[0].step == 20 and not watch.last_full  # type: ignore[union-attr]
    assert data


def test_a_pointer_read_without_a_version_tag_is_read_in_full_every_poll(
    gcs_store: Any, gs_uri: str, tmp_path: Path
) -> None:
    """Against the GCS emulator, its answers stripped of the object's generation (as from a store or
    proxy that does not report one): the pointer's version tag is empty, so unknown. The watch never
    takes it for "unchanged": a new verified checkpoint is seen at the next poll."""
    watched = open_storage(gs_uri, **gcs_store.options())
    writer = open_storage(gs_uri, **gcs_store.options())

    def no_generation(response: Any, *args: Any, **kwargs: Any) -> Any:
        response.headers.pop("X-Goog-Generation", None)
        return response

    watched.client._http.hooks["response"].append(no_generation)  # type: ignore[attr-defined]
    upload_checkpoint(commit_local(tmp_path / "s10", 10), writer)
    watch = LatestWatch(watched, full_read_seconds=3600, clock=Clock())
    assert watch.poll()[0].step == 10  # type: ignore[union-attr]
    assert watched.read_with_etag(POINTER_NAME)[1] == ""  # type: ignore[index]  # the tag really is empty
    upload_checkpoint(commit_local(tmp_path / "s20", 20), writer)
    info, _ = watch.poll()
    assert info is not None and info.step == 20 and watch.last_full
    assert watch.poll()[0].step == 20 and watch.last_full  # type: ignore[union-attr]
