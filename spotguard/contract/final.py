"""A trainer that finished: its last checkpoint verified before the pod can lose it.

A native sidecar (Kubernetes 1.29+) is stopped by kubelet once the trainer's
container exits, within the pod's grace period, and the checkpoint volume
(an ``emptyDir``) goes with the pod. A last checkpoint that takes longer to
verify than that (a large one, or a part of a distributed checkpoint whose
global commit waits for the other nodes) would be lost while the pod shows
``Succeeded``. So a trainer that finished on its own waits on its way out,
bounded by ``SPOTGUARD_FINAL_VERIFY_SECONDS``, until the uploader's heartbeat
says its last checkpoint is verified (``verified`` in
``uploader-heartbeat.json``, :mod:`~spotguard.contract.control`). The wait
comes before kubelet stops the sidecar, so the pod's grace period does not
have to cover it.

A classic sidecar (a regular container) needs no such wait: it keeps the
pod alive itself until the last checkpoint is verified
(``SPOTGUARD_FINISH_SECONDS``).

A preempted trainer waits too, on every rank, but only while the uploader
shows it at work on that checkpoint: on its preemption's path (``emergency``
in the heartbeat), in a heartbeat at most ``HEARTBEAT_FRESH_SECONDS`` old that
says it ships; and no longer than the
preemption's deadline where the trainer knows it (else
:data:`PREEMPTED_WAIT_SECONDS`). Its checkpoint does not need the wait (the
uploader ships it within the grace period whether the trainer runs or not);
the upload does: a trainer's exit frees its memory page by page and tears
down its interpreter, work that took the upload's CPU on a small node
(0.04-0.1 s of a 2 GiB fine-tune's emergency upload). Having nothing left
to do, the trainer leaves that work until its checkpoint is safe. An
uploader that stops beating or fails to ship is not waited for, nor one still
in its routine loop: a native sidecar learns of the preemption only when
kubelet stops it, once the trainer has exited.

Pure; the trainer's loop around it is
:meth:`spotguard.trainer.channel.TrainerChannel.await_final_verified`.
Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spotguard.contract.control import UploaderHeartbeat, heartbeat_says_shipping

#: Clock slack between the trainer and the uploader (a heartbeat this much
#: older than the trainer's start still counts as this run's uploader).
CLOCK_SKEW_SECONDS = 1.0
#: How often the waiting trainer reads the heartbeat (a read of one small file).
FINAL_POLL_SECONDS = 0.1
#: The longest a preempted trainer waits where it knows no deadline: the longest
#: notice a cloud gives (2 min), after which nothing is left to wait for.
PREEMPTED_WAIT_SECONDS = 120.0


@dataclass(frozen=True)
class FinalWait:
    """What a trainer on its way out does next: ``wait`` (look again),
    ``verified`` (leave: its last checkpoint is safe) or ``leave`` (without
    it being verified: ``why`` says why)."""

    action: Literal["wait", "verified", "leave"]
    why: str = ""


def decide_final_wait(
    *,
    final_step: int | None,
    beat: UploaderHeartbeat | None,
    started: float,
    now: float,
    deadline: float,
    preempted: bool,
) -> FinalWait:
    """Pure: whether a finished trainer waits for its last checkpoint to be verified.

    - ``final_step``: the step of the newest checkpoint it committed (None: none);
    - ``beat``: the uploader's heartbeat as read now (None: none);
    - ``started``: when the trainer started (unix time): a heartbeat from
      before is an earlier run's, and no uploader attends this one;
    - ``deadline``: when the wait gives up (started waiting + the bound);
    - ``preempted``: a preemption (SIGTERM, a preempting request): the
      uploader ships within its grace period whatever the trainer does, so
      the trainer waits only while the heartbeat shows the uploader at work
      on it (fresh, shipping, on its preemption's path): one that stopped
      beating, fails, or is still in its routine loop is not waited for (a
      finished trainer's wait is bounded by ``deadline`` alone: its
      checkpoint may need it).
    """
    if final_step is None:
        return FinalWait("leave", "no checkpoint was committed")
    if beat is None or beat.time < started - CLOCK_SKEW_SECONDS:
        return FinalWait("leave", "no uploader attends this run")
    if beat.verified is not None and beat.verified >= final_step:
        return FinalWait("verified")
    if now >= deadline:
        newest = "none" if beat.verified is None else f"step {beat.verified}"
        return FinalWait("leave", f"step {final_step} not verified in time (newest verified: {newest})")
    if preempted and not (beat.emergency and heartbeat_says_shipping(beat, now)):
        if not beat.shipping:
            why = "says it fails to ship"
        elif not beat.emergency:
            why = "says it is not on its preemption's path"
        else:
            why = f"is {now - beat.time:.1f}s old"
        return FinalWait("leave", f"preempted, and the uploader's heartbeat {why}")
    return FinalWait("wait")


def trainer_final_verify_seconds(native_sidecar: bool, finish_seconds: float) -> float:
    """Pure: the bound a pod's trainer waits with (``SPOTGUARD_FINAL_VERIFY_SECONDS``).

    Beside a native sidecar, as long as a classic sidecar would go on shipping
    a finished trainer's last checkpoint without progress
    (``finish_seconds``); beside a classic one, 0: it waits itself, after
    the trainer's exit, and its pod stays up meanwhile.
    """
    return max(0.0, finish_seconds) if native_sidecar else 0.0
