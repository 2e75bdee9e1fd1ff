"""The Checkpointer under ``torch.distributed`` (torchrun, DDP, FSDP2).

Every rank constructs the :class:`~spotguard.trainer.checkpointer.Checkpointer`
at the same point of the program and calls ``should_save`` / ``save`` /
``restore`` at the same steps; those calls are collective:

- ``should_save`` agrees on one answer with an ``all_reduce(MAX)`` of
  ``[preempt, save now, -deadline, time interval due, next period]`` on a
  gloo group of the main thread, so a SIGTERM or a request seen by any rank
  makes every rank save the same step (with the earliest deadline) and
  stop. The exchange is off the critical path: an exchanging call issues it
  without waiting (``async_op=True``) and the next exchanging call applies
  its answer; exchanges are spaced to about 0.1 s of steps, the same calls
  on every rank (:class:`~spotguard.trainer.policy.ExchangeSchedule`).
  Saves every N steps need no exchange (the step is the same everywhere)
  and happen at once. The flags ride the Checkpointer's own gloo group as a
  CPU tensor, so an nccl job pays no device copy and no stream sync for
  them. Every other collective on that group first waits for the
  outstanding exchange (:meth:`DistContext.settle`), so every rank issues
  them in one order, and ``close`` waits for it before the process group
  can be destroyed.
- ``save`` stages the tensors of ``state["model"]`` and
  ``state["optimizer"]`` (from ``get_state_dict``: FQN keys, DTensor shards)
  in host memory with DCP's stager, and everything else of the rank's state
  (non-tensor leaves, RNG, scheduler, extras) with spotguard's codec. A
  background thread then writes them on a second gloo group that only
  persist threads use: ``dcp.save`` into ``<tmp>/dcp`` (DDP replicas are
  written once, DTensor shards by their owners), the rank's own files into
  ``<tmp>/ranks/<rank:05d>/``; each rank checksums its files, the entries are
  gathered, and local rank 0 of each node commits that node's part manifest
  (atomic rename); a second gather tells every rank whether every node
  committed before requests are acknowledged.
- ``restore`` agrees on the newest checkpoint every node can load (or a
  newer verified one in storage), loads the tensors with ``dcp.load``
  through :class:`~spotguard.checkpoint.format.dcp.SafeFileSystemReader` into the
  live model's and optimizer's own state dicts (resharding when the world
  size changed) and puts them back with ``set_state_dict``.

The torchrun environment names the rank's place: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` (the node index; all
ranks on one node without it).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotguard.checkpoint.format.manifest import DCP_DIR, DCP_METADATA
from spotguard.checkpoint.local.codec import Plain
from spotguard.trainer.plancache import agreed_generation
from spotguard.trainer.state import RestoredState
from spotguard.trainer.statedicts import active, get_state_dicts, set_state_dicts

__all__ = ["active", "get_state_dicts", "set_state_dicts"]  # re-exported: their home is statedicts

log = logging.getLogger(__name__)

#: Top-level keys of a state whose tensors go through DCP.
DCP_KEYS = ("model", "optimizer")
#: Where each rank's own files go inside a distributed checkpoint.
RANKS_DIR = "ranks"
#: The DCP directory inside a distributed checkpoint, and DCP's metadata file.
_MARK = "__spotguard_dcp__"


def rank_prefix(rank: int) -> str:
    """``ranks/<rank:05d>/``: the directory of one rank's own files."""
    return f"{RANKS_DIR}/{rank:05d}/"


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int

    @property
    def parts(self) -> int:
        """Nodes (parts of a checkpoint): ``WORLD_SIZE / LOCAL_WORLD_SIZE``."""
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def node_leader(self) -> bool:
        """Local rank 0: commits the node's part and talks to the uploader."""
        return self.local_rank == 0


def _int_env(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{key} must be an integer, got {raw!r}") from None


def rank_info_from_env(env: Mapping[str, str], rank: int, world_size: int) -> RankInfo:
    """Pure: the torchrun facts for ``rank`` of ``world_size`` (the process
    group's view wins over the environment). Without torchrun's variables:
    one node holding every rank."""
    local_world = _int_env(env, "LOCAL_WORLD_SIZE", 0)
    if local_world <= 0 or world_size % local_world:
        local_world = world_size
        local_rank, node = rank, 0
    else:
        local_rank = _int_env(env, "LOCAL_RANK", rank % local_world)
        node = _int_env(env, "GROUP_RANK", rank // local_world)
    return RankInfo(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world, node=node)


def wants_distributed(distributed: bool | None) -> bool:
    """Whether a Checkpointer is collective: ``distributed`` when given, else
    when torch.distributed is initialized with more than one rank."""
    if distributed is not None:
        return distributed
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return False
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


# -- the state tree: tensors for DCP, everything else for the codec -------------


def _is_tensor(value: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def split_tensors(tree: Any, path: tuple[str, ...] = ()) -> tuple[Any, Any]:
    """Split a state dict into (tensors, skeleton).

    ``tensors``: nested dicts with string keys holding only the tensor
    leaves (list positions become ``"0"``, ``"1"``, ...), None when there are
    none; ``skeleton``: the same tree with each tensor replaced by a marker
    naming its path in ``tensors``.
    """
    if _is_tensor(tree):
        return tree, Plain({_MARK: list(path)})
    if isinstance(tree, Mapping):
        tensors: dict[str, Any] = {}
        items = []
        for key, value in tree.items():
            skey = str(key)
            if skey in tensors:
                raise ValueError(f"state keys {key!r} collide as strings at {'.'.join(path) or 'top level'}")
            sub, skel = split_tensors(value, (*path, skey))
            if sub is not None:
                tensors[skey] = sub
            items.append((key, skel))
        skeleton: Any = type(tree)(items) if isinstance(tree, dict) else dict(items)
        return (tensors or None), skeleton
    if isinstance(tree, list | tuple):
        tensors = {}
        skels = []
        for i, value in enumerate(tree):
            sub, skel = split_tensors(value, (*path, str(i)))
            if sub is not None:
                tensors[str(i)] = sub
            skels.append(skel)
        return (tensors or None), (tuple(skels) if isinstance(tree, tuple) else skels)
    return None, tree


def fill_tensors(skeleton: Any, tensors: Mapping[str, Any] | None, base: tuple[str, ...] = ()) -> Any:
    """Put tensors back into a skeleton made by :func:`split_tensors`;
    ``tensors`` is rooted at ``base`` (the skeleton's markers hold full paths)."""
    if isinstance(skeleton, Mapping):
        if set(skeleton) == {_MARK}:
            node: Any = tensors
            for key in list(skeleton[_MARK])[len(base) :]:
                if not isinstance(node, Mapping) or key not in node:
                    raise KeyError(".".join(skeleton[_MARK]))
                node = node[key]
            return node
        items = [(k, fill_tensors(v, tensors, base)) for k, v in skeleton.items()]
        return type(skeleton)(items) if isinstance(skeleton, dict) else dict(items)
    if isinstance(skeleton, list):
        return [fill_tensors(v, tensors, base) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(fill_tensors(v, tensors, base) for v in skeleton)
    return skeleton


# -- the process groups ------------------------------------------------------------


@dataclass(frozen=True)
class Agreement:
    """What every rank decided in ``should_save`` (:meth:`DistContext.post`,
    then :meth:`DistContext.collect`)."""

    preempt: bool  # some rank has a preempting request
    save_now: bool  # some rank has a request
    deadline: float | None  # the earliest deadline of any rank's requests
    interval_due: bool  # some rank's interval is due
    every: int = 1  # calls until the next exchange: the most any rank proposed

    @staticmethod
    def flags(preempt: bool, save_now: bool, deadline: float | None, interval_due: bool, every: int = 1) -> list[float]:
        """One rank's flags as the numbers the ``all_reduce(MAX)`` combines
        (the deadline negated: the earliest wins)."""
        return [
            float(preempt),
            float(save_now),
            -deadline if deadline is not None else -math.inf,
            float(interval_due),
            float(max(1, every)),
        ]

    @classmethod
    def of(cls, values: list[float]) -> Agreement:
        """The agreement the reduced numbers say."""
        p, s, d, t, e = values
        return cls(
            preempt=p > 0, save_now=s > 0, deadline=None if d == -math.inf else -d, interval_due=t > 0, every=int(e)
        )


@dataclass(frozen=True)
class SaveStart:
    """What every rank learns before a save's phase one ends (:meth:`DistContext.start_save`)."""

    any_busy: bool  # a rank still writes the previous checkpoint at the deadline
    any_failed: bool  # a rank could not snapshot its state
    token: int  # rank 0's random token: the node's temporary directory and the save's id
    plans: int = 0  # the DCP plan-cache generation this save uses (spotguard.trainer.plancache)


class DistContext:
    """The process groups and rank facts of a distributed Checkpointer.

    ``main``: collectives of the training thread (flags, save agreement,
    restore); ``persist``: collectives of the background writer only
    (``dcp.save``, commit). Never two threads on one group.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "distributed checkpoints need torch.distributed to be initialized "
                "(dist.init_process_group) before the Checkpointer is built"
            )
        self.dist = dist
        env = os.environ if env is None else env
        self.info = rank_info_from_env(env, dist.get_rank(), dist.get_world_size())
        self.main: Any = dist.new_group(backend="gloo")
        self.persist: Any = dist.new_group(backend="gloo")
        # The flag exchange in flight on ``main`` (its tensor and work handle), and its answer once waited for.
        self._posted: tuple[Any, Any] | None = None
        self._answer: Agreement | None = None
        # Which node every rank is on (the environment could lie; the group cannot).
        nodes: list[Any] = [None] * self.info.world_size
        dist.all_gather_object(nodes, (self.info.node, self.info.local_rank), group=self.main)
        self.node_of = [int(n) for n, _ in nodes]
        self.node_ranks = tuple(r for r, n in enumerate(self.node_of) if n == self.info.node)
        self.parts = len(set(self.node_of))
        if sorted(set(self.node_of)) != list(range(self.parts)):
            raise RuntimeError(f"node indices (GROUP_RANK) of the ranks are not 0..n-1: {sorted(set(self.node_of))}")
        leaders = [r for r, (_, lr) in enumerate(nodes) if int(lr) == 0]
        if len(leaders) != self.parts or any(
            sum(1 for r in leaders if self.node_of[r] == n) != 1 for n in range(self.parts)
        ):
            raise RuntimeError("every node needs exactly one local rank 0 (LOCAL_RANK)")

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def leader(self) -> bool:
        return self.info.node_leader

    # -- the flag exchange off the critical path -------------------------------------
    def post(self, preempt: bool, save_now: bool, deadline: float | None, interval_due: bool, every: int = 1) -> None:
        """Start the ``all_reduce(MAX)`` of this rank's flags (and its
        proposed exchange period, ``every`` calls) without waiting for it
        (``async_op=True``): it runs on gloo's threads while the next steps
        compute; :meth:`collect` gives its answer. Collective: every rank
        posts at the same call."""
        import torch

        if self._posted is not None or self._answer is not None:
            raise RuntimeError("a flag exchange is posted before the previous one's answer was collected")
        flags = torch.tensor(Agreement.flags(preempt, save_now, deadline, interval_due, every), dtype=torch.float64)
        work = self.dist.all_reduce(flags, op=self.dist.ReduceOp.MAX, group=self.main, async_op=True)
        self._posted = (flags, work)

    def settle(self) -> None:
        """Wait for the posted exchange and keep its answer for :meth:`collect`.
        Called before every other collective on the main group (the ranks
        then issue them in one order) and at close (nothing pending when the
        process group is destroyed)."""
        posted, self._posted = self._posted, None
        if posted is not None:
            flags, work = posted
            work.wait()
            self._answer = Agreement.of(flags.tolist())

    def collect(self) -> Agreement | None:
        """The answer of the exchange :meth:`post` started (waiting for it if
        needed), or None when none was posted since the last collect."""
        self.settle()
        answer, self._answer = self._answer, None
        return answer

    def forget_exchange(self) -> None:
        """Drop the posted exchange unwaited (its process group was destroyed)."""
        self._posted = self._answer = None

    def settle_at_close(self) -> None:
        """At the Checkpointer's end: wait for the flag exchange the last
        ``should_save`` posted, so that no collective is pending when the process
        group is destroyed (its answer would apply to a step that never comes)."""
        if not self.dist.is_initialized():
            self.forget_exchange()  # the group is gone: no wait can finish
            return
        try:
            self.collect()
        except Exception as exc:  # noqa: BLE001 - a gone rank fails it in any way; nothing left to agree with
            log.warning("the last flag exchange between the ranks did not finish: %s", exc)

    def check_one_directory(self, directory: Path) -> None:
        """Raise unless the ranks of each node use one checkpoint directory (they
        build each checkpoint together). Collective; every rank decides alike."""
        seen = self.gather((self.info.node, str(directory.resolve())), persist=False)
        for node in sorted({n for n, _ in seen}):
            paths = {path for n, path in seen if n == node}
            if len(paths) > 1:
                raise ValueError(f"the ranks of node {node} must use one checkpoint directory, got {sorted(paths)}")

    def start_save(self, busy: bool, failed: bool, plans: int = 0) -> SaveStart:
        """Before a save: whether any rank still writes the previous one or
        could not snapshot, a token (from rank 0) naming the temporary
        directory every rank of a node shares and naming the save in the
        part manifests (``Sharding.save_id``), and the DCP plan-cache
        generation the save uses, from the one each rank holds (``plans``:
        :func:`~spotguard.trainer.plancache.agreed_generation`)."""
        import torch

        self.settle()
        # Below 2**53: exact through the float64 all_reduce.
        token = secrets.randbelow(1 << 52) + 1 if self.rank == 0 else 0
        values = [float(busy), float(failed), float(token), float(plans), -float(plans)]
        flags = torch.tensor(values, dtype=torch.float64)
        self.dist.all_reduce(flags, op=self.dist.ReduceOp.MAX, group=self.main)
        b, f, t, highest, lowest = flags.tolist()
        generation = agreed_generation(int(-lowest), int(highest))
        return SaveStart(any_busy=b > 0, any_failed=f > 0, token=int(t), plans=generation)

    def gather(self, obj: Any, *, persist: bool) -> list[Any]:
        """Every rank's ``obj`` (on the persist group from the writer thread)."""
        out: list[Any] = [None] * self.world_size
        if not persist:
            self.settle()  # the writer thread never touches the main group's exchange
        self.dist.all_gather_object(out, obj, group=self.persist if persist else self.main)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (main group)."""
        self.settle()
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.main)
        return box[0]

    def barrier(self) -> None:
        self.settle()
        self.dist.barrier(group=self.main)


# -- loading ------------------------------------------------------------------------


def load_sharded(path: Any, ctx: DistContext, model: Any, optimizer: Any, *, strict: bool = True) -> Any:
    """Load this rank's part of a local checkpoint into ``model`` and
    ``optimizer`` (collective: ``dcp.load`` on the main group) and return
    the :class:`~spotguard.trainer.state.RestoredState` (scheduler, extras and
    RNG not applied yet).

    The tensors are read into the live objects' own state dicts (so DCP
    reshards them to the current world size and sharding); the rest of the
    model/optimizer state comes from this rank's saved files, or rank 0's
    when this rank did not exist when it was saved.
    """
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from spotguard.checkpoint.format.dcp import SafeFileSystemReader
    from spotguard.checkpoint.local.codec import StateError
    from spotguard.checkpoint.local.commit import load_checkpoint_state, load_rank_state, read_local_manifest

    path = Path(path)
    manifest = read_local_manifest(path)
    sharding = manifest.sharding
    live = get_state_dicts(model, optimizer)
    if sharding is None:
        # A single-process checkpoint: full state dicts, loaded by every rank.
        full = load_checkpoint_state(path, manifest)
        restored = RestoredState(
            full, step=manifest.step, name=manifest.name, path=str(path), epoch=manifest.epoch, metrics=manifest.metrics
        )
        restored.exact, restored.resharded_from = ctx.world_size == 1, 1
        restored.rank_state_own = ctx.rank == 0
        if live:
            set_state_dicts(model, optimizer, {k: full[k] for k in live}, strict=strict)
        restored.sharded = True
        _warn_inexact(restored, ctx)
        return restored
    listed = {f.path for f in manifest.files}
    own = rank_prefix(ctx.rank) + "state.json" in listed
    prefix = rank_prefix(ctx.rank) if own else rank_prefix(0)
    rank_state = load_rank_state(path, manifest, prefix)
    tensors, _ = split_tensors(live)
    if tensors:
        ctx.settle()
        dcp_load(tensors, storage_reader=SafeFileSystemReader(path / DCP_DIR), process_group=ctx.main)
    state: dict[str, Any] = {}
    for key, value in rank_state.items():
        if key in DCP_KEYS:
            if key not in live:
                continue  # not asked for: its tensors were not read
            try:
                state[key] = fill_tensors(value, (tensors or {}).get(key), (key,))
            except KeyError as exc:
                raise StateError(
                    f"{path.name}: the saved {key} state has tensor {exc.args[0]!r}, which the live {key} does not"
                ) from None
        else:
            state[key] = value
    if live:
        set_state_dicts(model, optimizer, state, strict=strict)
    restored = RestoredState(
        state, step=manifest.step, name=manifest.name, path=str(path), epoch=manifest.epoch, metrics=manifest.metrics
    )
    restored.sharded = True
    restored.rank_state_own = own
    if sharding.world_size != ctx.world_size:
        restored.exact, restored.resharded_from = False, sharding.world_size
    _warn_inexact(restored, ctx)
    return restored


def load_sharded_whole(path: Any, manifest: Any) -> Any:
    """A distributed checkpoint loaded by one process without a process
    group: every tensor whole (through the safe DCP reader), and rank 0's
    own state (RNG, scheduler, extras, non-tensor leaves)."""
    from spotguard.checkpoint.format.dcp import load_full_state
    from spotguard.checkpoint.local.codec import StateError
    from spotguard.checkpoint.local.commit import load_rank_state

    path = Path(path)
    rank_state = load_rank_state(path, manifest, rank_prefix(0))
    listed = {f.path for f in manifest.files}
    tensors = load_full_state(path / DCP_DIR) if f"{DCP_DIR}/{DCP_METADATA}" in listed else {}
    state: dict[str, Any] = {}
    for key, value in rank_state.items():
        try:
            state[key] = fill_tensors(value, tensors.get(key), (key,)) if key in DCP_KEYS else value
        except KeyError as exc:
            raise StateError(f"{path.name}: tensor {exc.args[0]!r} is missing from its DCP files") from None
    restored = RestoredState(
        state, step=manifest.step, name=manifest.name, path=str(path), epoch=manifest.epoch, metrics=manifest.metrics
    )
    restored.sharded = True
    world = manifest.sharding.world_size
    if world != 1:
        restored.exact, restored.resharded_from = False, world
        log.warning(
            "checkpoint %s was written by %d ranks, restored by one process: model and optimizer are "
            "whole, RNG states and data position are rank 0's",
            restored.name,
            world,
        )
    return restored


def _warn_inexact(restored: Any, ctx: DistContext) -> None:
    if restored.exact:
        return
    log.warning(
        "checkpoint %s was written by %d rank(s), restored on %d: model and optimizer are resharded, but "
        "per-rank RNG states and data positions cannot be exact%s",
        restored.name,
        restored.resharded_from,
        ctx.world_size,
        ""
        if restored.rank_state_own
        else f" (rank {ctx.rank} has no saved state: it keeps its fresh RNG and uses rank 0's scheduler and extras)",
    )
