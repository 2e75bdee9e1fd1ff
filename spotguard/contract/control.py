"""The trainer <-> uploader control protocol: one module, used by both sides.

The Checkpointer (trainer side) and the sidecar or ``spotguard run``
(uploader side) talk through files in a shared directory
(``SPOTGUARD_CONTROL_DIR``, default ``<checkpoint dir>/.control``):

- ``checkpoint-request.json`` (uploader, atomically):
  ``{"id", "reason", "deadline", "preempt"}``;
- ``checkpoint-ack.json`` (trainer, after it committed the requested
  checkpoint): ``{"id", "step", "name"}`` plus ``"complete": false`` when it
  could not commit one in time;
- ``trainer.pid`` (trainer): ``{"pid": N}``, so a signal can wake it up when
  the process is visible;
- ``trainer-exit.json`` (trainer, when it is done):
  ``{"pid", "preempted", "last_step"}``; tells an uploader that cannot see
  the trainer's process that it has exited, and why;
- ``uploader-heartbeat.json`` (uploader, every round of its loop):
  ``{"pid", "time", "shipping", "verified"}``; ``time`` is unix time,
  ``shipping`` false while a checkpoint newer than the newest verified one
  could not be shipped, ``verified`` the step of the newest checkpoint it
  verified in storage (null: none yet; a part of a distributed checkpoint
  only once the global commit is verified). A preemption's save skips the
  fsync of its data only while this is fresh (:data:`HEARTBEAT_FRESH_SECONDS`)
  and says ``shipping``; a trainer that finished waits on its way out until
  ``verified`` reaches its last checkpoint (:mod:`~spotguard.contract.final`);
- ``staging-full.json`` (trainer, when a save found the checkpoint volume
  full): ``{"step", "time", "free_bytes", "error"}``; the uploader passes it
  on in its report (:func:`read_staging_full`). Removed by the next commit.
- ``checkpoint-writing.json`` (trainer, before a preemption's save that
  an uploader ships at once writes its data): ``{"step", "time", "dirs",
  "files"}``: the directories its ``.tmp-ckpt-<step>-*`` is in, and each
  data file's path and final size. An uploader that stores whole files may
  send them while they are written (:class:`WritePlan`).
- ``verified-local.json`` (uploader, after it verified a local checkpoint
  whole: restored it from storage, or checksummed the one a start resumes
  from): ``{"checkpoints": {name: {file: [inode, size, mtime_ns,
  ctime_ns]}}}``, the stamps of the manifest and every file it read. A
  trainer that finds them all unchanged loads that checkpoint without
  checksumming it again (:func:`read_verified_local`;
  :mod:`spotguard.checkpoint.local.inplace` says why that is safe). Kept
  across the command's restarts; removed when the uploader starts
  (:func:`forget_verified_local`): a crash of the machine may have torn
  files that were never fsynced under unchanged stamps.

The trainer reads requests at step boundaries; the signal (SIGUSR1) only
makes it notice sooner. Files are the contract, signals are a courtesy.
Both sides import this module from :mod:`spotguard.contract`, the floor below
them both, so neither imports the other. Standard library only.

Also here, so that both sides agree: the reasons a save records in its
manifest (:func:`save_reason_label`) and whether a run ended preempted or
finished (:func:`decide_run_end`, the only place that decides it).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from spotguard.contract.env import CONTROL_DIR, from_env
from spotguard.contract.report import POD_DIR_REMOVED, StagingFull

#: The termination report's key for a removed pod directory (its home is :mod:`~spotguard.contract.report`).
REPORT_POD_DIR_REMOVED = POD_DIR_REMOVED

REQUEST_FILE = "checkpoint-request.json"
ACK_FILE = "checkpoint-ack.json"
PID_FILE = "trainer.pid"
EXIT_FILE = "trainer-exit.json"
HEARTBEAT_FILE = "uploader-heartbeat.json"
STAGING_FULL_FILE = "staging-full.json"
WRITING_FILE = "checkpoint-writing.json"
VERIFIED_FILE = "verified-local.json"
CONTROL_SUBDIR = ".control"
# Cleared between runs; the heartbeat is not (a stale one says nothing).
CONTROL_FILES = (REQUEST_FILE, ACK_FILE, PID_FILE, EXIT_FILE, STAGING_FULL_FILE, WRITING_FILE)

# An uploader's heartbeat older than this says nothing: its loop is stuck or gone.
HEARTBEAT_FRESH_SECONDS = 5.0
# Clock slack between the two sides (a heartbeat from further ahead is not trusted).
_HEARTBEAT_SKEW_SECONDS = 1.0

# Ids of requests the trainer makes for itself (a signal, an in-process
# call); the uploader's requests carry random hex ids.
INTERNAL_REQUEST_PREFIXES = ("sigterm-", "sigusr1-", "local-")


@dataclass(frozen=True)
class CheckpointRequest:
    """A request for the trainer to checkpoint at its next step boundary.

    ``deadline`` is unix time (None: no deadline); ``preempt`` asks the
    trainer to stop after the checkpoint. ``written_at`` is when the
    uploader wrote it (not part of the wire form).
    """

    id: str
    reason: str
    deadline: float | None = None
    preempt: bool = False
    written_at: float | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        """The wire form (the contract's four keys)."""
        return {"id": self.id, "reason": self.reason, "deadline": self.deadline, "preempt": self.preempt}


def json_object(data: bytes | str, what: str) -> dict[str, Any]:
    """Pure: the JSON object ``data`` holds; raises ValueError (naming ``what``) when it holds none."""
    doc = json.loads(data)
    if not isinstance(doc, dict):
        raise ValueError(f"{what} is not a JSON object")
    return doc


def parse_request(data: bytes | str) -> CheckpointRequest:
    """Parse ``checkpoint-request.json``; raises ValueError when malformed."""
    doc = json_object(data, "checkpoint request")
    rid = doc.get("id")
    if not isinstance(rid, str) or not rid:
        raise ValueError("checkpoint request has no string 'id'")
    reason = doc.get("reason", "")
    deadline = doc.get("deadline")
    if deadline is not None and (not isinstance(deadline, int | float) or isinstance(deadline, bool)):
        raise ValueError(f"checkpoint request deadline {deadline!r} is not a number")
    preempt = doc.get("preempt", False)
    if not isinstance(preempt, bool):
        raise ValueError(f"checkpoint request 'preempt' {preempt!r} is not a boolean")
    return CheckpointRequest(
        id=rid,
        reason=str(reason),
        deadline=None if deadline is None else float(deadline),
        preempt=preempt,
    )


@dataclass(frozen=True)
class CheckpointAck:
    """The trainer's answer: which checkpoint it committed for which request.

    ``step``/``name`` are None, or ``complete`` False, when the trainer could
    not commit a checkpoint for the request (deadline passed, write failed).
    """

    id: str | None
    step: int | None
    name: str | None
    mtime: float
    complete: bool = True


def ack_json(request_id: str, committed_name: str | None, complete: bool) -> dict[str, Any]:
    """Pure: the wire form of an acknowledgement (trainer side).

    ``committed_name`` is the newest committed checkpoint (the requested one,
    or an older one when the request could not be met).
    """
    doc: dict[str, Any] = {"id": request_id, "step": None, "name": None}
    if committed_name is not None:
        doc.update(step=int(committed_name.rsplit("-", 1)[1]), name=committed_name)
    if not complete or committed_name is None:
        doc["complete"] = False
    return doc


@dataclass(frozen=True)
class TrainerExit:
    """``trainer-exit.json``: the trainer is done (``preempted`` None: it did not say)."""

    pid: int | None
    preempted: bool | None
    last_step: int | None

    def to_json(self) -> dict[str, Any]:
        """The wire form."""
        return {"pid": self.pid, "preempted": self.preempted, "last_step": self.last_step}


def read_trainer_exit(control_dir: Path) -> TrainerExit | None:
    """The trainer's exit file, if it wrote one (None also when unreadable)."""
    try:
        doc = json.loads((control_dir / EXIT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    pid, preempted, last = doc.get("pid"), doc.get("preempted"), doc.get("last_step")
    return TrainerExit(
        pid=pid if isinstance(pid, int) else None,
        preempted=preempted if isinstance(preempted, bool) else None,
        last_step=last if isinstance(last, int) and not isinstance(last, bool) else None,
    )


@dataclass(frozen=True)
class UploaderHeartbeat:
    """``uploader-heartbeat.json``: the uploader's loop ran at ``time`` (unix);
    ``shipping`` is False while a checkpoint newer than the newest verified
    one could not be shipped; ``verified`` is the newest step it verified in
    storage (None: none yet, or an uploader that does not say);
    ``emergency``: it is on its preemption's path (save, upload, verify of
    the newest checkpoint), which a preempted trainer waits for."""

    pid: int | None
    time: float
    shipping: bool
    verified: int | None = None
    emergency: bool = False

    def to_json(self) -> dict[str, Any]:
        """The wire form."""
        return {
            "pid": self.pid,
            "time": self.time,
            "shipping": self.shipping,
            "verified": self.verified,
            "emergency": self.emergency,
        }


def parse_heartbeat(data: bytes | str) -> UploaderHeartbeat:
    """Parse ``uploader-heartbeat.json``; raises ValueError when malformed."""
    doc = json_object(data, "heartbeat")
    when, shipping, pid = doc.get("time"), doc.get("shipping"), doc.get("pid")
    if not isinstance(when, int | float) or isinstance(when, bool):
        raise ValueError(f"heartbeat time {when!r} is not a number")
    if not isinstance(shipping, bool):
        raise ValueError(f"heartbeat 'shipping' {shipping!r} is not a boolean")
    verified = doc.get("verified")
    return UploaderHeartbeat(
        pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        float(when),
        shipping,
        verified if isinstance(verified, int) and not isinstance(verified, bool) else None,
        doc.get("emergency") is True,
    )


def heartbeat_says_shipping(
    beat: UploaderHeartbeat | None, now: float, max_age: float = HEARTBEAT_FRESH_SECONDS
) -> bool:
    """Pure: does this heartbeat show an uploader alive and shipping at ``now``?"""
    if beat is None or not beat.shipping:
        return False
    return -_HEARTBEAT_SKEW_SECONDS <= now - beat.time <= max_age


def write_heartbeat(
    control_dir: Path,
    shipping: bool,
    now: float | None = None,
    verified: int | None = None,
    *,
    emergency: bool = False,
    tmp_tag: str = "",
) -> None:
    """Refresh the uploader's heartbeat (replaced atomically; not fsynced:
    a heartbeat that does not survive a crash is one that says nothing).
    ``tmp_tag``: in the temporary file's name, for a writer that may interrupt
    another in the same process (a signal handler)."""
    beat = UploaderHeartbeat(os.getpid(), time.time() if now is None else now, shipping, verified, emergency)
    control_dir.mkdir(parents=True, exist_ok=True)
    path = control_dir / HEARTBEAT_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}{tmp_tag}.tmp")
    tmp.write_text(json.dumps(beat.to_json()), encoding="utf-8")
    os.replace(tmp, path)


def read_heartbeat(control_dir: Path) -> UploaderHeartbeat | None:
    """The uploader's heartbeat in ``control_dir``, or None (absent, malformed)."""
    try:
        return parse_heartbeat((control_dir / HEARTBEAT_FILE).read_bytes())
    except (OSError, ValueError):
        return None


def uploader_shipping(control_dir: Path, now: float | None = None) -> bool:
    """Whether an uploader's fresh heartbeat in ``control_dir`` says it is
    alive and shipping (trainer side)."""
    return heartbeat_says_shipping(read_heartbeat(control_dir), time.time() if now is None else now)


def control_dir_from_env(checkpoint_dir: Path, env: Mapping[str, str] | None = None) -> Path:
    """``SPOTGUARD_CONTROL_DIR``, else ``<checkpoint dir>/.control``."""
    value = from_env(CONTROL_DIR, env)
    return Path(value) if value else checkpoint_dir / CONTROL_SUBDIR


def atomic_write_json(path: Path, payload: Mapping[str, Any], *, durable: bool = True) -> None:
    """Write JSON so readers see either the old file or the whole new one.

    ``durable=False`` skips the fsync: for a message between processes of
    one node, which the rename alone makes visible whole, and which a crash
    of the node makes moot (a checkpoint request). An fsync waits for the
    filesystem's journal, which a large delete or writeback elsewhere can
    hold for tens of milliseconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(dict(payload), fh)
        fh.flush()
        if durable:
            os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_verified_local(control_dir: Path, name: str, stamps: Mapping[str, list[int]]) -> None:
    """Record that local checkpoint ``name`` verified whole while its files had ``stamps``
    (file -> ``[inode, size, mtime_ns, ctime_ns]``; uploader side, :data:`VERIFIED_FILE`)."""
    record = read_verified_local(control_dir)
    record[name] = {path: [int(x) for x in stamp] for path, stamp in stamps.items()}
    atomic_write_json(control_dir / VERIFIED_FILE, {"checkpoints": record}, durable=False)


def forget_verified_local(control_dir: Path) -> None:
    """Remove the record of :func:`write_verified_local` (an uploader that starts verifies again)."""
    with contextlib.suppress(FileNotFoundError):
        (control_dir / VERIFIED_FILE).unlink()


def read_verified_local(control_dir: Path) -> dict[str, dict[str, list[int]]]:
    """The local checkpoints the uploader verified whole, with the stamps of their files then
    (empty when there is no record or it cannot be read: everything is checksummed again)."""
    try:
        doc = json.loads((control_dir / VERIFIED_FILE).read_bytes())
    except (OSError, ValueError):
        return {}
    found = doc.get("checkpoints") if isinstance(doc, dict) else None
    if not isinstance(found, dict):
        return {}
    out: dict[str, dict[str, list[int]]] = {}
    for name, stamps in found.items():
        if isinstance(stamps, dict) and all(
            isinstance(v, list) and len(v) == 4 and all(isinstance(x, int) for x in v) for v in stamps.values()
        ):
            out[str(name)] = {str(k): list(v) for k, v in stamps.items()}
    return out


@dataclass(frozen=True)
class WritePlan:
    """What a preemption's save is about to write: ``checkpoint-writing.json``."""

    step: int
    time: float
    #: Where the writer's temporary directory (``.tmp-ckpt-<step:012d>-*``) is made.
    dirs: tuple[str, ...]
    #: Each data file: its path in the checkpoint and its final size.
    files: tuple[tuple[str, int], ...]

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "time": self.time, "dirs": list(self.dirs), "files": [list(f) for f in self.files]}


def parse_write_plan(data: bytes | str) -> WritePlan:
    """Parse ``checkpoint-writing.json``; raises ValueError when malformed."""
    doc = json_object(data, "write plan")
    step, when, dirs, files = doc.get("step"), doc.get("time"), doc.get("dirs"), doc.get("files")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"bad step {step!r}")
    if not isinstance(when, int | float) or isinstance(when, bool):
        raise ValueError(f"bad time {when!r}")
    if not isinstance(dirs, list) or not all(isinstance(d, str) and d for d in dirs):
        raise ValueError(f"bad dirs {dirs!r}")
    if not isinstance(files, list):
        raise ValueError(f"bad files {files!r}")
    out: list[tuple[str, int]] = []
    for f in files:
        ok = isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and isinstance(f[1], int)
        if not ok or isinstance(f[1], bool) or f[1] < 0 or not f[0] or f[0].startswith("/") or ".." in f[0].split("/"):
            raise ValueError(f"bad file {f!r}")
        out.append((f[0], f[1]))
    return WritePlan(step, float(when), tuple(dirs), tuple(out))


def read_write_plan(control_dir: Path) -> WritePlan | None:
    """The trainer's ``checkpoint-writing.json``, or None (absent, malformed)."""
    try:
        return parse_write_plan((control_dir / WRITING_FILE).read_bytes())
    except (OSError, ValueError):
        return None


def read_staging_full(control_dir: Path) -> StagingFull | None:
    """The trainer's ``staging-full.json``: its last save found the checkpoint volume full (None: it did not)."""
    try:
        doc = json.loads((control_dir / STAGING_FULL_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    full = StagingFull.from_json(doc)
    if full is None or full.error is not None:
        return full
    return replace(full, error="no space left on the checkpoint volume")


# -- what a save was for, and how a run ended ---------------------------------


def save_reason_label(reason: str | None) -> str:
    """Pure: a manifest's save reason as a bounded label.

    ``interval`` (routine), ``sigterm``, ``notice``, ``proactive`` or ``other``.
    """
    if reason in (None, "", "interval"):
        return "interval"
    assert reason is not None
    if reason.startswith("notice:"):
        return "notice"
    if reason in ("sigterm", "signal", "sigint"):
        return "sigterm"
    if reason == "proactive":
        return "proactive"
    return "other"


@dataclass(frozen=True)
class RunEnd:
    """How a run ended: ``preempted`` and the reason (``sigterm``, ``sigint``,
    ``notice:<source>``, or ``finished``)."""

    preempted: bool
    reason: str


def trainer_said_preempted(
    trainer_exit: TrainerExit | None, newest_save_reason: str | None, stop_reason: str | None
) -> bool | None:
    """Pure: did a trainer that has exited stop for a preemption?

    Its exit file says so; without one, the reason recorded in its newest
    checkpoint does (an emergency save is the last one; a notice's save only
    when that notice was asked to stop training, ``stop_reason``). None when
    neither can tell.
    """
    if trainer_exit is not None and trainer_exit.preempted is not None:
        return trainer_exit.preempted
    if newest_save_reason is None:
        return None
    label = save_reason_label(newest_save_reason)
    return label == "sigterm" or (label == "notice" and stop_reason is not None)


def decide_run_end(
    *,
    signal_source: str | None,
    trainer_gone_before_signal: bool,
    trainer_preempted: bool | None,
    stop_reason: str | None,
) -> RunEnd:
    """Pure: whether a run ended preempted or finished; the one place that decides.

    - ``signal_source``: the preemption signal the uploader got (``sigterm``,
      ``sigint``), None when the trainer exited on its own first;
    - ``trainer_gone_before_signal``: the trainer had already exited when the
      signal came (a native sidecar is stopped after the trainer, also when
      the trainer simply finished);
    - ``trainer_preempted``: :func:`trainer_said_preempted`;
    - ``stop_reason``: a notice asked the trainer to stop after its checkpoint.
    """
    if signal_source is not None:
        if not trainer_gone_before_signal or trainer_preempted is not False:
            # Unknown counts as preempted: a wrong "finished" would end the job.
            return RunEnd(True, signal_source)
        return RunEnd(False, "finished")
    if stop_reason is not None:
        return RunEnd(True, stop_reason)
    if trainer_preempted:
        # The trainer stopped on its own SIGTERM; ours is still on its way.
        return RunEnd(True, "sigterm")
    return RunEnd(False, "finished")


# -- the uploader's side -------------------------------------------------------


class ControlChannel:
    """Writes checkpoint requests and reads acknowledgements in a control directory."""

    def __init__(self, control_dir: Path, pid_file: Path | None = None) -> None:
        self.dir = control_dir
        self.pid_file = pid_file if pid_file is not None else control_dir / PID_FILE

    @property
    def request_path(self) -> Path:
        """Where requests go."""
        return self.dir / REQUEST_FILE

    @property
    def ack_path(self) -> Path:
        """Where the trainer acknowledges."""
        return self.dir / ACK_FILE

    def request_checkpoint(
        self, reason: str, deadline: float, preempt: bool, request_id: str | None = None
    ) -> CheckpointRequest:
        """Atomically (re)place the pending request; a newer request supersedes an older one."""
        req = CheckpointRequest(
            id=request_id or uuid.uuid4().hex,
            reason=reason,
            deadline=deadline,
            preempt=preempt,
            written_at=time.time(),
        )
        # Not fsynced: the trainer on this node reads it within a step; on a preemption the
        # fsync could wait tens of milliseconds for the journal (a large delete in flight).
        atomic_write_json(self.request_path, req.to_json(), durable=False)
        return req

    def read_ack(self) -> CheckpointAck | None:
        """The current acknowledgement, or None (missing or half-visible file)."""
        try:
            stat = self.ack_path.stat()
            doc = json.loads(self.ack_path.read_text(encoding="utf-8"))
            ack_id, step, name = doc.get("id"), doc.get("step"), doc.get("name")
            return CheckpointAck(
                id=str(ack_id) if ack_id is not None else None,
                step=int(step) if step is not None else None,
                name=str(name) if name is not None else None,
                mtime=stat.st_mtime,
                complete=bool(doc.get("complete", True)) and step is not None,
            )
        except (OSError, ValueError, TypeError, AttributeError):
            return None

    def read_exit(self) -> TrainerExit | None:
        """The trainer's ``trainer-exit.json``, if any."""
        return read_trainer_exit(self.dir)

    def trainer_pid(self) -> int | None:
        """The trainer's pid as the Checkpointer recorded it, if any."""
        try:
            text = self.pid_file.read_text(encoding="utf-8").strip()
        except OSError:
            return None
        try:
            # Plain integer, or a JSON object {"pid": N, ...}.
            if text.startswith("{"):
                return int(json.loads(text)["pid"])
            return int(text)
        except (ValueError, KeyError, TypeError):
            return None

    def clear(self) -> None:
        """Remove request, ack, pid and exit files left by an earlier run."""
        for name in CONTROL_FILES:
            with contextlib.suppress(FileNotFoundError):
                (self.dir / name).unlink()


def ack_answers(ack: CheckpointAck | None, request: CheckpointRequest) -> bool:
    """Pure: does ``ack`` answer ``request``?

    Either it names the request's id, or it was written after the request
    (the trainer may have saved on its own SIGTERM, which kubelet sends to
    every container at once, and acknowledged under its own id).
    """
    if ack is None:
        return False
    if ack.id == request.id:
        return True
    # 50 ms slack: file mtimes and time.time() are not taken at the same instant.
    return request.written_at is not None and ack.mtime >= request.written_at - 0.05
