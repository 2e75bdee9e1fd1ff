"""Which checkpoints to keep: a pure planner, table-tested without storage.

Rules (a checkpoint is kept if any rule keeps it):

- the newest verified checkpoint is always kept;
- every checkpoint newer than the newest verified one is kept (it may be an
  upload in progress, or the next one to verify);
- ``keep_last N``: the N newest checkpoints;
- ``keep_best M``: the M best by ``metric`` (``mode`` ``min`` or ``max``;
  ties go to the newer one; checkpoints without the metric never count);
- ``keep_every K``: every checkpoint whose step is a multiple of K.

A policy with no rule set keeps everything; without a verified checkpoint
nothing is deleted.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from spotguard.checkpoint.format.manifest import parse_checkpoint_name
from spotguard.contract.env import BEST_METRIC, BEST_MODE, KEEP_BEST, KEEP_EVERY, KEEP_LAST, from_env, to_env


@dataclass(frozen=True)
class RetentionPolicy:
    """How many checkpoints to keep; ``None`` disables a rule."""

    keep_last: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_best", "keep_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.keep_every == 0:
            raise ValueError("keep_every must be at least 1")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")
        if self.keep_best and not self.metric:
            raise ValueError("keep_best needs a metric name")

    @property
    def keeps_everything(self) -> bool:
        """True when no rule limits retention."""
        return self.keep_last is None and self.keep_best is None and self.keep_every is None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RetentionPolicy:
        """From ``SPOTGUARD_KEEP_LAST``, ``SPOTGUARD_KEEP_BEST``,
        ``SPOTGUARD_BEST_METRIC``, ``SPOTGUARD_BEST_MODE``, ``SPOTGUARD_KEEP_EVERY``."""
        return cls(
            keep_last=from_env(KEEP_LAST, environ),
            keep_best=from_env(KEEP_BEST, environ),
            metric=from_env(BEST_METRIC, environ) or None,
            mode=from_env(BEST_MODE, environ).strip().lower(),
            keep_every=from_env(KEEP_EVERY, environ),
        )

    def to_env(self) -> dict[str, str]:
        """Pure: the ``SPOTGUARD_*`` variables that :meth:`from_env` reads back as this policy.

        Rules that are off are left out; so are the metric and its mode
        without ``keep_best`` (they rank nothing then). The operator hands a
        job's ``spec.checkpoint.retention`` to its sidecar so.
        """
        out: dict[str, str] = {}
        if self.keep_last is not None:
            out[KEEP_LAST.name] = to_env(KEEP_LAST, self.keep_last)
        if self.keep_best is not None:
            out[KEEP_BEST.name] = to_env(KEEP_BEST, self.keep_best)
            if self.metric:
                out[BEST_METRIC.name] = to_env(BEST_METRIC, self.metric)
            out[BEST_MODE.name] = to_env(BEST_MODE, self.mode)
        if self.keep_every is not None:
            out[KEEP_EVERY.name] = to_env(KEEP_EVERY, self.keep_every)
        return out


@dataclass(frozen=True)
class RetentionCandidate:
    """A checkpoint as the planner sees it."""

    name: str
    step: int
    metrics: Mapping[str, float | None] = field(default_factory=dict)


@dataclass(frozen=True)
class RetentionPlan:
    """The planner's decision: why each kept checkpoint is kept, and what goes."""

    keep: Mapping[str, tuple[str, ...]]
    delete: tuple[str, ...]


def plan_retention(
    candidates: Sequence[RetentionCandidate],
    policy: RetentionPolicy,
    newest_verified: str | None,
) -> RetentionPlan:
    """Decide which checkpoints to keep and which to delete (see module doc)."""
    by_step = sorted(candidates, key=lambda c: c.step)
    reasons: dict[str, list[str]] = {c.name: [] for c in by_step}
    verified = next((c for c in by_step if c.name == newest_verified), None)
    if verified is None or policy.keeps_everything:
        why = "no verified checkpoint" if verified is None else "no retention rule"
        for c in by_step:
            reasons[c.name].append(why)
        return RetentionPlan({n: tuple(r) for n, r in reasons.items()}, ())
    reasons[verified.name].append("newest verified")
    for c in by_step:
        if c.step > verified.step:
            reasons[c.name].append("newer than the newest verified")
    if policy.keep_last:
        for c in by_step[-policy.keep_last :]:
            reasons[c.name].append(f"last {policy.keep_last}")
    if policy.keep_best and policy.metric:
        metric = policy.metric
        scored = []
        for c in by_step:
            value = c.metrics.get(metric)
            if value is not None and math.isfinite(value):
                scored.append((value if policy.mode == "min" else -value, -c.step, c.name))
        for _, _, name in sorted(scored)[: policy.keep_best]:
            reasons[name].append(f"best {policy.keep_best} by {metric} ({policy.mode})")
    if policy.keep_every:
        for c in by_step:
            if c.step % policy.keep_every == 0:
                reasons[c.name].append(f"every {policy.keep_every}th step")
    keep = {n: tuple(r) for n, r in reasons.items() if r}
    delete = tuple(c.name for c in by_step if not reasons[c.name])
    return RetentionPlan(keep, delete)


def plan_local_prune(committed: Sequence[str], verified: Collection[str], keep: int) -> list[str]:
    """Pure: local checkpoints the uploader may delete once they are safe in storage.

    Only checkpoints older than the newest one verified in storage (by
    design they are verified themselves, or superseded: an older checkpoint
    is never uploaded after a newer one is verified, it could only make
    storage look older), and never the newest ``keep`` (at least 1)
    committed ones (the trainer may be restoring from them).
    """
    keep = max(1, keep)
    steps = {n: parse_checkpoint_name(n) for n in committed}
    ordered = sorted((n for n in committed if steps[n] is not None), key=lambda n: steps[n] or 0)
    newest_verified = max((s for n in verified if (s := parse_checkpoint_name(n)) is not None), default=None)
    if newest_verified is None:
        return []
    protected = set(ordered[-keep:])
    return [n for n in ordered if (steps[n] or 0) < newest_verified and n not in protected]
