"""Uploads a preemption can stop, and the resumption of a stopped one.

A routine upload must never hold an emergency upload back. With a
``should_stop``, :func:`upload_stoppable` runs the upload in a thread of its
own and watches ``should_stop`` every :data:`STOP_POLL_SECONDS`: once it says
yes, the upload is told to stop at its next request and
:class:`~spotguard.checkpoint.store.upload.UploadCancelled` is raised at once, while
the stopped upload's requests on the wire drain. A stopped upload writes no
manifest and moves no pointer; the chunks it stored are handed to
``on_stopped``, and the next upload of the same checkpoint resumes it: its
chunks count as known (:func:`with_stored_chunks`), its complete files are not
sent again. :class:`~spotguard.sidecar.shipper.CheckpointShipper` keeps the
record of stopped uploads and decides what to ship; the upload itself is
:mod:`spotguard.checkpoint`'s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard.checkpoint.store.chunked import KnownChunks, Prestored

if TYPE_CHECKING:
    from spotguard.storage import Storage

#: How often a routine upload in flight asks whether a preemption came.
STOP_POLL_SECONDS = 0.02


def upload_stoppable(
    path: Path,
    storage: Storage,
    known: KnownChunks | None,
    earlier: tuple[float, dict[str, int]] | None,
    should_stop: Callable[[], bool] | None,
    on_stopped: Callable[[dict[str, int]], None],
    prestored: Prestored | None = None,
) -> Any:
    """Upload ``path`` without moving the pointer (that waits for verification).

    ``known`` (None: not incremental) are the chunks the upload may reuse;
    ``earlier`` (when and what an earlier stopped upload of the same
    checkpoint stored, or None) is resumed: its chunks count as known, its
    complete files are not sent again. With ``should_stop`` the upload runs in
    a thread of its own and this one watches ``should_stop``: once it says
    yes, the upload is told to stop at its next request and
    :class:`UploadCancelled` is raised here at once (the stopped upload's
    requests on the wire drain meanwhile; ``on_stopped`` gets the chunks it
    stored when it ends, and ``{}`` at once). ``prestored``: chunks of this
    checkpoint stored while it was written (an incremental upload's).
    """
    from spotguard.checkpoint import upload_checkpoint
    from spotguard.checkpoint.store.upload import UploadCancelled

    name = path.name
    incremental: bool | KnownChunks = False
    if known is not None:
        incremental = with_stored_chunks(known, earlier, time.monotonic())
    resume = earlier is not None
    if should_stop is None:
        return upload_checkpoint(
            path, storage, update_pointer=False, incremental=incremental, resume=resume, prestored=prestored
        )
    stop = threading.Event()
    done = threading.Event()
    outcome: list[Any] = []

    def work() -> None:
        try:
            outcome.append(
                upload_checkpoint(
                    path,
                    storage,
                    update_pointer=False,
                    incremental=incremental,
                    should_stop=stop.is_set,
                    resume=resume,
                    prestored=prestored,
                )
            )
        except UploadCancelled as exc:
            on_stopped(exc.stored_chunks)
            outcome.append(exc)
        except BaseException as exc:  # noqa: BLE001 - handed to the shipping thread
            outcome.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=work, name=f"spotguard-upload-{name}", daemon=True)
    thread.start()
    while not done.wait(STOP_POLL_SECONDS):
        if should_stop():
            stop.set()
            if not done.is_set():
                on_stopped({})
                raise UploadCancelled(name)
            break
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def with_stored_chunks(known: KnownChunks, stopped: tuple[float, dict[str, int]] | None, now: float) -> KnownChunks:
    """Pure: ``known`` plus the chunks a stopped upload of the same checkpoint
    stored (``stopped``: when it stopped, by ``time.monotonic``, and its
    chunks), while that is younger than half the orphan grace (a chunk sweep
    keeps unreferenced chunks younger than the grace). Reused chunks are
    checked to exist before a manifest names them, and the upload's intent
    names them, so a collector keeps them meanwhile."""
    from spotguard.checkpoint.store.gc import DEFAULT_ORPHAN_GRACE

    if stopped is None or not stopped[1] or now - stopped[0] >= DEFAULT_ORPHAN_GRACE / 2:
        return known
    return known.with_chunks(stopped[1])
