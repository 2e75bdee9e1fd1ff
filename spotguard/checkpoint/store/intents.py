"""Uploads in progress, visible to garbage collection.

Before an upload stores anything it writes an *intent*,
``gc/uploads/<checkpoint>.<token>.json``: the checkpoint's name and the chunks
it may reuse without storing them (those it knows to be stored). While the
upload runs, a heartbeat ``gc/uploads/<checkpoint>.<token>.alive`` is
written again every third of the lease; both go once the manifest is written
(or the upload fails). A collector takes an intent as live while it or its
heartbeat is younger than the lease, and for a live intent keeps

- every chunk the intent names (what the upload may reuse), and
- every chunk stored since the intent was (by the store's own clock: the
  intent object's modified time), the chunks the upload is storing,

and deletes no prefix of that checkpoint. So a sweep is safe for an upload
of any length, not only for one shorter than the grace period; see
:func:`spotguard.checkpoint.store.gc.sweep_chunks` for the whole argument.

The lease (``SPOTGUARD_GC_LEASE_SECONDS``, default 60) is the uploader's:
it is stored in the intent, and a collector judges each intent by the lease
stored with it (its own only for an intent that stores none, written by an
older spotguard), so uploaders and collectors configured differently still
agree on which uploads are alive. A collection's grace must be a finite
number of seconds, not negative (:func:`check_grace`), and not shorter than
the lease (:func:`check_orphan_grace`), so a chunk is not deleted while an
upload that stalled for less than the grace may still name it.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from spotguard.contract.env import GC_LEASE_SECONDS, from_env
from spotguard.storage.base import NotFoundError, ObjectInfo, Storage

log = logging.getLogger(__name__)

UPLOADS_DIR = "gc/uploads"
_INTENT_SUFFIX = ".json"
_ALIVE_SUFFIX = ".alive"


def lease_seconds(env: Mapping[str, str] | None = None) -> float:
    """The intent lease: ``SPOTGUARD_GC_LEASE_SECONDS``, default 60 (a finite number more than 0, or
    ValueError naming it)."""
    lease = from_env(GC_LEASE_SECONDS, env)
    if not math.isfinite(lease):
        raise ValueError(f"{GC_LEASE_SECONDS.name} must be a finite number of seconds, not {lease!r}")
    return lease


def minimum_orphan_grace(env: Mapping[str, str] | None = None) -> float:
    """The shortest grace a collection may use: the intent lease."""
    return lease_seconds(env)


def check_grace(grace: float) -> float:
    """Pure: ``grace`` when it is a finite number of seconds, 0 or more; else ValueError saying so.

    A grace of ``nan`` compares false with every age, so "younger than the grace"
    would never hold and fresh prefixes would be deleted; ``inf`` would keep
    everything for ever while looking like a setting that collects."""
    if isinstance(grace, bool) or not isinstance(grace, int | float) or not math.isfinite(grace) or grace < 0:
        raise ValueError(f"an orphan grace must be a finite number of seconds, 0 or more, not {grace!r}")
    return float(grace)


def check_orphan_grace(grace: float, env: Mapping[str, str] | None = None) -> None:
    """Refuse a grace the protocol cannot work with: not finite, negative (:func:`check_grace`) or
    shorter than the upload lease (ValueError saying what to do)."""
    check_grace(grace)
    least = minimum_orphan_grace(env)
    if grace < least:
        raise ValueError(
            f"an orphan grace of {grace:g}s is shorter than the upload lease ({least:g}s): a chunk of an upload "
            f"that stalled briefly could be deleted; use at least {least:g}, or a lease of at most {grace:g} "
            f"(the lease is {GC_LEASE_SECONDS.name})"
        )


def _stored_lease(doc: object, default: float) -> float:
    """Pure: the lease an intent's document stores, or ``default`` where it stores none that is
    usable (an intent of an older spotguard, or an unreadable one)."""
    lease = doc.get("lease") if isinstance(doc, dict) else None
    if isinstance(lease, bool) or not isinstance(lease, int | float) or not math.isfinite(lease) or lease <= 0:
        return default
    return float(lease)


@dataclass(frozen=True)
class Intent:
    """A live upload: its checkpoint, the chunks it may reuse, since when
    (store clock) it may have stored chunks, and the lease it was judged by."""

    key: str
    checkpoint: str
    known: frozenset[str]
    since: float
    lease: float | None = None


@dataclass
class Intents:
    """What :func:`read_intents` found."""

    live: list[Intent] = field(default_factory=list)
    #: Keys of intents and heartbeats no longer live (their uploader died).
    dead: list[str] = field(default_factory=list)

    @property
    def known(self) -> set[str]:
        return {d for i in self.live for d in i.known}

    @property
    def floor(self) -> float | None:
        """Chunks modified at or after this (store clock) may belong to a live upload."""
        return min((i.since for i in self.live), default=None)

    @property
    def checkpoints(self) -> set[str]:
        return {i.checkpoint for i in self.live}


def read_intents(storage: Storage, now: float | None = None, lease: float | None = None) -> Intents:
    """The intents in ``storage``, live and dead, at ``now`` (unix seconds). Each intent is
    judged by the lease stored with it; ``lease`` (default: :func:`lease_seconds`) stands
    for it where none is stored, and judges heartbeats left without their intent."""
    now = time.time() if now is None else now
    lease = lease_seconds() if lease is None else lease
    objects: dict[str, ObjectInfo] = {o.key: o for o in storage.list_objects(f"{UPLOADS_DIR}/")}
    found = Intents()
    for key, info in sorted(objects.items()):
        if not key.endswith(_INTENT_SUFFIX):
            base = key[: -len(_ALIVE_SUFFIX)] if key.endswith(_ALIVE_SUFFIX) else key
            if f"{base}{_INTENT_SUFFIX}" not in objects and now - info.modified >= lease:
                found.dead.append(key)  # a heartbeat left without its intent
            continue
        alive = objects.get(key[: -len(_INTENT_SUFFIX)] + _ALIVE_SUFFIX)
        last = max(info.modified, alive.modified if alive else 0.0)
        try:
            doc = json.loads(storage.read_bytes(key))
        except NotFoundError:
            continue  # the upload finished meanwhile: its manifest is written
        except ValueError:
            doc = {}
        held = _stored_lease(doc, lease)
        if now - last >= held:
            found.dead.append(key)
            if alive is not None:
                found.dead.append(alive.key)
            continue
        known = doc.get("known") if isinstance(doc, dict) else None
        checkpoint = doc.get("checkpoint") if isinstance(doc, dict) else None
        found.live.append(
            Intent(
                key=key,
                checkpoint=checkpoint if isinstance(checkpoint, str) else "",
                known=frozenset(d for d in known if isinstance(d, str)) if isinstance(known, list) else frozenset(),
                # An unreadable intent protects everything stored since it was.
                since=info.modified,
                lease=held,
            )
        )
    return found


@contextmanager
def upload_intent(
    storage: Storage, checkpoint: str, known: Iterable[str] = (), lease: float | None = None
) -> Iterator[str]:
    """Make an upload of ``checkpoint`` that may reuse ``known`` visible to
    collectors for as long as the block runs; yields the intent's key. The
    intent stores ``lease`` (default :func:`lease_seconds`), the one its
    heartbeat keeps and collectors judge it by.
    Storage errors writing the intent propagate (the upload must not go on
    unseen); errors removing it are logged (it dies with its lease)."""
    lease = lease_seconds() if lease is None else lease
    base = f"{UPLOADS_DIR}/{checkpoint}.{uuid.uuid4().hex[:16]}"
    key = base + _INTENT_SUFFIX
    doc = {"checkpoint": checkpoint, "known": sorted(set(known)), "lease": lease}
    storage.write_bytes(key, json.dumps(doc).encode())
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(lease / 3):
            try:
                storage.write_bytes(base + _ALIVE_SUFFIX, b"")
            except Exception as exc:  # noqa: BLE001 - the next beat tries again
                log.warning("upload heartbeat %s: %s", storage.uri_for(base + _ALIVE_SUFFIX), exc)

    thread = threading.Thread(target=beat, name="spotguard-upload-intent", daemon=True)
    thread.start()
    try:
        yield key
    finally:
        stop.set()
        thread.join()
        try:
            storage.delete([key, base + _ALIVE_SUFFIX])
        except Exception as exc:  # noqa: BLE001 - it dies with its lease
            log.warning("could not remove upload intent %s: %s", storage.uri_for(key), exc)
