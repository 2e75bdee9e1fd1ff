"""How soon a failed upload is tried again: one backoff, shared by the uploader and the trainer.

The sidecar's shipper retries a routine checkpoint with :func:`retry_delay`;
its emergency path, and a trainer that uploads its own preemption checkpoint
(``spotguard.trainer.shipping``), retry with the shorter emergency bounds
below. Kept in the contract floor so the trainer need not import the sidecar
to wait the same way. Standard library only.
"""

from __future__ import annotations

# Retries of a failed emergency upload: soon, then a little less often; the
# deadline bounds them all.
EMERGENCY_RETRY_INITIAL = 0.25
EMERGENCY_RETRY_MAX = 2.0


def retry_delay(failures: int, initial: float = 1.0, maximum: float = 30.0) -> float:
    """Pure: seconds before retrying a checkpoint that failed ``failures`` times."""
    return float(min(maximum, initial * 2 ** max(0, failures - 1)))
