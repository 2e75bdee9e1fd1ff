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

A preemption never waits here: the trainer leaves at once and the grace
period is the uploader's, as before. A classic sidecar (a regular container)
needs no such wait: it keeps the pod alive itself until the last checkpoint
is verified (``SPOTGUARD_FINISH_SECONDS``). Pure; the trainer's loop around
it is :meth:`spotguard.trainer.channel.TrainerChannel.await_final_verified`.
Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spotguard.contract.control import UploaderHeartbeat

#: Clock slack between the trainer and the uploader (a heartbeat this much
#: older than the trainer's start still counts as this run's uploader).
CLOCK_SKEW_SECONDS = 1.0
#: How often the waiting trainer reads the heartbeat (a read of one small file).
FINAL_POLL_SECONDS = 0.1


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
      uploader's grace period takes over, the trainer does not wait.
    """
    if final_step is None:
        return FinalWait("leave", "no checkpoint was committed")
    if preempted:
        return FinalWait("leave", "preempted: the uploader ships within the grace period")
    if beat is None or beat.time < started - CLOCK_SKEW_SECONDS:
        return FinalWait("leave", "no uploader attends this run")
    if beat.verified is not None and beat.verified >= final_step:
        return FinalWait("verified")
    if now >= deadline:
        newest = "none" if beat.verified is None else f"step {beat.verified}"
        return FinalWait("leave", f"step {final_step} not verified in time (newest verified: {newest})")
    return FinalWait("wait")


def trainer_final_verify_seconds(native_sidecar: bool, finish_seconds: float) -> float:
    """Pure: the bound a pod's trainer waits with (``SPOTGUARD_FINAL_VERIFY_SECONDS``).

    Beside a native sidecar, as long as a classic sidecar would go on shipping
    a finished trainer's last checkpoint without progress
    (``finish_seconds``); beside a classic one, 0: it waits itself, after
    the trainer's exit, and its pod stays up meanwhile.
    """
    return max(0.0, finish_seconds) if native_sidecar else 0.0
