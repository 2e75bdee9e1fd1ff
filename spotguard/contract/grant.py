"""The restore grant: the uploader lets the trainer read checkpoints from the store for a while.

A trainer holds no credentials of the store. To resume without a local copy
first (bytes from the socket straight into its own tensors), the party that
does (``spotguard run``'s supervisor) writes ``restore-grant.json`` into the
control directory before it starts the trainer:

``{"version": 1, "id", "store", "expires", "checkpoints": [{"name",
"manifest", "objects": {key: url}}]}``

- ``checkpoints``: the newest checkpoints of the store that the trainer may
  resume from, newest first (at most :data:`MAX_GRANTED`): each one's name,
  its manifest as stored (the JSON text), and one presigned GET URL per
  stored object the manifest needs (``<name>/<path>`` of a whole file, the
  chunk's key of a checkpoint stored incrementally);
- ``expires``: unix time after which the URLs are refused (HTTP 403);
- ``store``: the store's root URI, what messages name (never a URL).

The URLs are credentials for as long as they live: the file is created with
mode 0600 (temporary file, fsync, rename), never logged, and removed by the
trainer once it has read it. The trainer answers with
``restore-answer.json``: ``{"grant", "name", "wait"}``, the checkpoint it
loaded (``name`` null: none of them), and with ``wait`` whether it waits for
the uploader to restore a checkpoint into the checkpoint directory for it
(today's path); the uploader answers that with ``restore-done.json``
``{"grant", "name"}`` once the copy is there (``name`` null: none).
A loaded checkpoint is restored into the checkpoint directory by the
uploader afterwards, in the background (a restart on the same machine, the
next save's links to unchanged files). Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotguard.contract.control import atomic_write_json, json_object

GRANT_FILE = "restore-grant.json"
ANSWER_FILE = "restore-answer.json"
DONE_FILE = "restore-done.json"
GRANT_VERSION = 1
#: Checkpoints one grant names at most (the newest, and older ones to walk back to).
MAX_GRANTED = 3


@dataclass(frozen=True)
class GrantedCheckpoint:
    """One checkpoint the trainer may read: its stored manifest and a URL per object it needs."""

    name: str
    manifest: bytes
    objects: Mapping[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "manifest": self.manifest.decode("utf-8"), "objects": dict(self.objects)}


@dataclass(frozen=True)
class RestoreGrant:
    """``restore-grant.json`` (see the module's docstring)."""

    id: str
    store: str
    expires: float
    checkpoints: tuple[GrantedCheckpoint, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": GRANT_VERSION,
            "id": self.id,
            "store": self.store,
            "expires": self.expires,
            "checkpoints": [c.to_json() for c in self.checkpoints],
        }

    def __repr__(self) -> str:  # never the URLs
        names = ", ".join(c.name for c in self.checkpoints)
        return f"RestoreGrant(id={self.id!r}, store={self.store!r}, checkpoints=[{names}])"


def new_grant_id() -> str:
    return uuid.uuid4().hex


def parse_grant(data: bytes | str) -> RestoreGrant:
    """Pure: parse ``restore-grant.json``; raises ValueError when malformed (the
    message names no URL)."""
    doc = json_object(data, "restore grant")
    if doc.get("version") != GRANT_VERSION:
        raise ValueError(f"restore grant version {doc.get('version')!r} is not {GRANT_VERSION}")
    gid, store, expires, listed = doc.get("id"), doc.get("store"), doc.get("expires"), doc.get("checkpoints")
    if not isinstance(gid, str) or not gid or not isinstance(store, str):
        raise ValueError("restore grant has no string 'id' or 'store'")
    if not isinstance(expires, int | float) or isinstance(expires, bool):
        raise ValueError("restore grant 'expires' is not a number")
    if not isinstance(listed, list) or len(listed) > MAX_GRANTED:
        raise ValueError(f"restore grant 'checkpoints' is not a list of at most {MAX_GRANTED}")
    out: list[GrantedCheckpoint] = []
    for item in listed:
        name = item.get("name") if isinstance(item, dict) else None
        manifest = item.get("manifest") if isinstance(item, dict) else None
        objects = item.get("objects") if isinstance(item, dict) else None
        if not isinstance(name, str) or not isinstance(manifest, str) or not isinstance(objects, dict):
            raise ValueError("a checkpoint of the restore grant lacks its name, manifest or objects")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in objects.items()):
            raise ValueError(f"restore grant of {name}: objects are not key -> URL strings")
        out.append(GrantedCheckpoint(name, manifest.encode("utf-8"), dict(objects)))
    return RestoreGrant(gid, store, float(expires), tuple(out))


def _write_private(path: Path, payload: Mapping[str, Any]) -> None:
    """Write JSON atomically (temporary file, fsync, rename), readable by the owner alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(dict(payload), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:  # no temporary file holding URLs left behind, an interrupt too; raised again
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_grant(control_dir: Path, grant: RestoreGrant) -> None:
    """Place ``grant`` in ``control_dir`` (uploader side; mode 0600)."""
    _write_private(control_dir / GRANT_FILE, grant.to_json())


def read_grant(control_dir: Path) -> RestoreGrant | None:
    """The grant in ``control_dir``, or None (absent or malformed: the trainer resumes as without one)."""
    try:
        return parse_grant((control_dir / GRANT_FILE).read_bytes())
    except (OSError, ValueError):
        return None


def remove_grant(control_dir: Path) -> None:
    """Remove the grant (the trainer once it read it; the uploader on a new start)."""
    with contextlib.suppress(FileNotFoundError):
        (control_dir / GRANT_FILE).unlink()


@dataclass(frozen=True)
class RestoreAnswer:
    """The trainer's answer to a grant: what it loaded (``name`` None: nothing), and whether it
    waits for a local copy restored by the uploader."""

    grant: str
    name: str | None
    wait: bool = False


def write_answer(control_dir: Path, answer: RestoreAnswer) -> None:
    atomic_write_json(
        control_dir / ANSWER_FILE, {"grant": answer.grant, "name": answer.name, "wait": answer.wait}, durable=False
    )


def read_answer(control_dir: Path) -> RestoreAnswer | None:
    try:
        doc = json_object((control_dir / ANSWER_FILE).read_bytes(), "restore answer")
    except (OSError, ValueError):
        return None
    gid, name = doc.get("grant"), doc.get("name")
    if not isinstance(gid, str) or not (name is None or isinstance(name, str)):
        return None
    return RestoreAnswer(gid, name, doc.get("wait") is True)


def write_done(control_dir: Path, grant: str, name: str | None) -> None:
    """The uploader restored ``name`` into the checkpoint directory for a trainer that waits (None: nothing)."""
    atomic_write_json(control_dir / DONE_FILE, {"grant": grant, "name": name}, durable=False)


def read_done(control_dir: Path, grant: str) -> tuple[bool, str | None]:
    """Whether the uploader answered ``grant``'s wait, and with which checkpoint."""
    try:
        doc = json_object((control_dir / DONE_FILE).read_bytes(), "restore done")
    except (OSError, ValueError):
        return False, None
    name = doc.get("name")
    return doc.get("grant") == grant, name if isinstance(name, str) else None


def clear_restore_messages(control_dir: Path) -> None:
    """Remove the grant and the messages about it (an uploader that starts again)."""
    for name in (GRANT_FILE, ANSWER_FILE, DONE_FILE):
        with contextlib.suppress(FileNotFoundError):
            (control_dir / name).unlink()


__all__ = [
    "ANSWER_FILE",
    "DONE_FILE",
    "GRANT_FILE",
    "MAX_GRANTED",
    "GrantedCheckpoint",
    "RestoreAnswer",
    "RestoreGrant",
    "clear_restore_messages",
    "new_grant_id",
    "parse_grant",
    "read_answer",
    "read_done",
    "read_grant",
    "remove_grant",
    "write_answer",
    "write_done",
    "write_grant",
]
