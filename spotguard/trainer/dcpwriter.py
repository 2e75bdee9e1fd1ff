"""A sharded save that writes what changed (:class:`DcpSaves`): the unchanged DCP items of a rank go to a
file of their own, linked from the previous save.

A fine-tune's frozen base is most of its sharded state and never changes.
``dcp.save`` with torch's :class:`FileSystemWriter` writes every item of a
rank into one ``__<rank>_0.distcp`` file at every save, and the writer and
the upload then read it back to checksum and hash it. Here:

- **Phase one** (:meth:`DcpSaves.stage`): each tensor is compared with its
  host copy from the previous stage (torch's stager keeps those buffers
  between saves): only the pages written since that copy, where write
  tracking tells them (:mod:`spotguard.checkpoint.local.written`: a frozen
  base is not read at all), else byte for byte at memory speed. An equal
  one is not copied again: its previous host copy is staged as it is. It is
  *unchanged*.
- **Phase two** (:class:`KeepingWriter`, the ``storage_writer`` of
  ``dcp.save``): a rank's items go to ``__<rank>_0.distcp`` (the *kept*
  file, named as torch names a rank's one file), except when the previous save's kept file holds every unchanged
  item: that file is then hard-linked into the new save (nothing written,
  its checksum the one recorded when it was written), the metadata points
  each unchanged item at its place in it, and only the changed items are
  written, into ``__<rank>_1.distcp``. Bytes of items that changed since
  stay in the linked file unreferenced (DCP reads an item where the
  metadata says); the file is written again once they outweigh the rest.
- **Metadata** (the coordinator's ``.metadata``): where torch's plan cache
  hands the same global metadata object again and every item is where the
  previous save put it (the same file, offset and length), the previous
  save's bytes are written again instead of pickling a thousand items anew.
  So that they are the same bytes, the writer names no temporary directory
  nor writer id in it (``storage_meta``: None; the part manifests name the
  save).
- **Broadcast**: DCP hands the coordinator's global metadata to every
  rank once the ``.metadata`` is written, pickling its thousand items once
  more. From that write until ``dcp.save`` returns the object pickles as the
  bytes just written (:class:`_SentAsWritten`), and a rank that receives the
  bytes it received last time takes the object it made of them then.
- **Upload**: the linked file is the same inode as the previous
  checkpoint's, so its chunks are taken from the previous verified manifest
  without reading a byte
  (:meth:`~spotguard.checkpoint.local.unchanged.Unchanged.linked`).

Why the link is exact: the previous kept file holds each of its items as the
host copy was when it was written; an unchanged item's host copy was not
written since (it equals the tensor at that stage and the stage before). A
link is made only when the previous kept file was written or linked by the
save of the *stage just before* this one, committed with that very inode;
a stage whose save was skipped or failed, another process, or any doubt
writes the file again. Restore and resharding read by DCP's metadata, which
names each item's file, offset and length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from spotguard.checkpoint.format.manifest import DCP_METADATA, FileEntry
from spotguard.checkpoint.local.codec import equal_in_slices
from spotguard.checkpoint.local.commit import LocalWriter
from spotguard.checkpoint.local.written import (
    MIN_TRACKED_BYTES,
    WriteTracker,
    WriteView,
    host_ranges_equal,
    tracking_enabled,
)
from spotguard.storage.file import fsync_file

log = logging.getLogger(__name__)

#: The file of a rank's kept items (``__<rank>_0.distcp``: with nothing to link, every item, as torch names its one
#: file) and of its changed ones when the kept file is linked.
KEPT_INDEX = 0
CHANGED_INDEX = 1

ItemKey = tuple[str, tuple[int, ...]]  # (fqn, the chunk's offsets)


@dataclass(frozen=True)
class _Placed:
    """Where one item is in a kept file, and what it is (so that another item of the same name is not taken)."""

    sizes: tuple[int, ...]
    dtype: Any
    size_in_bytes: int
    info: _StorageInfo


@dataclass
class _KeptFile:
    """A rank's kept file as the last save left it (written or linked)."""

    generation: int  # the stage whose save wrote or linked it
    name: str  # ``__<rank>_0.distcp``
    committed: Path  # where it is once that save is committed
    inode: int
    size: int
    items: dict[ItemKey, _Placed]
    algorithm: str | None = None  # the checksum, once the local writer computed it
    checksum: str | None = None
    linked: bool = False  # this save linked it (not written)


@dataclass(frozen=True)
class _MetadataFile:
    """The last ``.metadata`` this coordinator wrote: its bytes, and what they were made of (the parts
    held, so that neither id is reused while this is remembered)."""

    described: Any  # Metadata.state_dict_metadata: torch's plan cache hands the same object while plans hold
    planner_data: Any
    version: Any
    storage: dict[Any, Any]  # MetadataIndex -> _StorageInfo
    data: bytes

    def made_of(self, metadata: Metadata, storage: dict[Any, Any]) -> bool:
        """Whether ``metadata`` with ``storage`` pickles to :attr:`data`."""
        return (
            metadata.state_dict_metadata is self.described
            and metadata.planner_data is self.planner_data
            and getattr(metadata, "version", None) == self.version
            and storage == self.storage
        )


#: A DTensor's spec, each of its fields, and the host copy it was found to match in shape, dtype, sharding
#: and mesh (all held, so that no id is reused while remembered).
_Shaped = tuple[Any, Any, Any, Any, Any]


def _shaped(spec: Any, host: Any) -> _Shaped:
    return (spec, spec.mesh, spec.placements, spec.tensor_meta, host)


def _still(shaped: _Shaped, spec: Any, host: Any) -> bool:
    """Whether ``spec``, each of its (immutable) fields, and ``host`` are the very objects remembered."""
    return all(a is b for a, b in zip(shaped, _shaped(spec, host), strict=True))


@dataclass
class DcpSaves:
    """What one rank's sharded saves remember from one to the next (see the module's docstring)."""

    generation: int = 0
    #: The previous stage's host copies by fqn (None: nothing to compare with).
    _staged: dict[str, Any] | None = None
    #: The fqns the last stage found unchanged.
    unchanged: frozenset[str] = frozenset()
    #: The last stage's result flattened as DCP flattens it, for its save's planner (:class:`Flattened`).
    flattened: Flattened | None = None
    kept: _KeptFile | None = None
    #: Bytes compared (read twice at memory speed) and left uncopied by the last stage.
    compared_bytes: int = 0
    unchanged_bytes: int = 0
    #: What the last save did with its kept file: bytes linked, bytes written anew.
    linked_bytes: int = 0
    written_bytes: int = 0
    #: Bytes told unchanged without reading them (write tracking: no page written since their copy).
    unread_bytes: int = 0
    #: The coordinator's last ``.metadata``, and whether the last save wrote those bytes again.
    _metadata: _MetadataFile | None = None
    metadata_reused: bool = False
    _fsynced: set[int] = field(default_factory=set)
    _opened: bool = False
    _tracker: WriteView | None = None
    _tracked: dict[str, tuple[Any, int, int]] = field(default_factory=dict)  # fqn -> (storage, address, bytes)
    _changing: set[str] = field(default_factory=set)  # fqns found mostly written: compared, not tracked
    #: Two meshes' equality, (id, id) -> (a, b, a == b): the pairs the last stage met, and those of this one.
    _meshes: dict[tuple[int, int], tuple[Any, Any, bool]] = field(default_factory=dict)
    _meshes_now: dict[tuple[int, int], tuple[Any, Any, bool]] = field(default_factory=dict)
    #: A DTensor's checks that held for its spec and its host copy: those of the last stage, and of this one.
    _shaped: dict[str, _Shaped] = field(default_factory=dict)
    _shaped_now: dict[str, _Shaped] = field(default_factory=dict)

    def stage(self, tensors: Mapping[str, Any], stage: Callable[[dict[str, Any]], Any], *, keep: bool) -> Any:
        """Phase one: ``tensors`` (nested dicts of tensors) staged by ``stage`` (torch's stager), but for
        the tensors equal to their host copy of the previous stage, which are staged as that copy.
        ``keep``: the stager keeps its host buffers for the next save (else nothing is compared)."""
        import torch

        self.generation += 1
        before, self._staged = self._staged, None
        view = self._view() if keep else None
        if view is not None:
            view.collect()  # before any tensor is read: a write from now on shows next time
        unchanged: dict[str, Any] = {}
        self.compared_bytes = self.unchanged_bytes = self.unread_bytes = 0
        leaves = list(_leaves(tensors))
        if before is not None:
            self._meshes_now, self._shaped_now = {}, {}
            for fqn, t in leaves:
                host = before.get(fqn)
                if host is not None and self._same(torch, fqn, t, host, view):
                    unchanged[fqn] = host
            # Only the pairs this stage met are kept: a changed item's host copy has a mesh of its own,
            # copied at each stage, which would otherwise pile up here.
            self._meshes, self._meshes_now = self._meshes_now, {}
            self._shaped, self._shaped_now = self._shaped_now, {}
        for fqn, t in leaves:  # before the stager reads them: a write after its copy shows next time
            self._track(view, fqn, _local(t))
        changed = _without(tensors, unchanged.keys())
        staged = stage(changed) if changed else {}
        merged = _with(tensors, staged, unchanged)
        self.unchanged = frozenset(unchanged)
        self.flattened = Flattened.of(torch, merged)
        if keep:
            self._staged = self.flattened.flat if self.flattened is not None else dict(_leaves(merged))
        return merged

    def _same(self, torch: Any, fqn: str, t: Any, host: Any, view: WriteView | None) -> bool:
        """Whether ``t`` is, shard and bytes, what its host copy ``host`` holds: the pages of ``t``
        written since that copy (write tracking: none, mostly) compared, else all of it."""
        spec = getattr(t, "_spec", None)  # a DTensor's: a parameter's detached aliases share its spec
        shaped = self._shaped.get(fqn) if spec is not None else None
        if shaped is not None and _still(shaped, spec, host):
            # The checks below held at the last stage for this spec and this host copy, and each of the
            # spec's fields is the very (immutable) object it was then: only the local shard is asked about.
            t, host = _local(t), _local(host)
            if not t.is_contiguous():
                return False
        else:
            shaped = None
            if type(t) is not type(host) or t.dtype != host.dtype or t.shape != host.shape:
                return False
            if hasattr(t, "to_local"):  # a DTensor: the same sharding, and the same local shard
                if t.placements != host.placements or not self._same_mesh(t.device_mesh, host.device_mesh):
                    return False
                local, host_local = _local(t), _local(host)
                if local.shape != host_local.shape:
                    return False
                shaped = _shaped(spec, host) if spec is not None else None
                t, host = local, host_local
            if not (t.is_contiguous() and host.is_contiguous()) or host.device.type != "cpu":
                return False
        n = int(t.numel() * t.element_size())
        tracked = self._tracked.get(fqn)
        written = view.written_ranges(tracked[1], tracked[2]) if view and tracked and _is(tracked, t) else None
        if written is not None and sum(b - a for a, b in written) <= n // 2:
            self.unread_bytes += n - sum(b - a for a, b in written)
            ranges = written
        else:
            if written is not None:
                self._changing.add(fqn)  # mostly written: not tracked until a comparison finds it unchanged
            ranges = [(0, n)]
        # No range: no page written since the copy, nothing to read (a frozen base, every save).
        self.compared_bytes += sum(b - a for a, b in ranges)
        if t.device.type == "cpu":
            if not host_ranges_equal(torch, t, host, ranges):
                return False
        elif ranges:
            mine, theirs = t.reshape(-1).view(torch.uint8), host.reshape(-1).view(torch.uint8)
            if not all(equal_in_slices(torch, mine[a:b], theirs[a:b]) for a, b in ranges):
                return False
        self.unchanged_bytes += n
        self._changing.discard(fqn)
        if shaped is not None:
            self._shaped_now[fqn] = shaped  # found unchanged: trusted as it is at the next stage
        return True

    def _same_mesh(self, mesh: Any, other: Any) -> bool:
        """Whether two device meshes are equal: by identity, else as ``==`` said for these two at
        this stage or the one before (the verdicts hold both meshes, so neither id is reused)."""
        if mesh is other:
            return True
        key = (id(mesh), id(other))
        known = self._meshes_now.get(key) or self._meshes.get(key)
        if known is None:
            known = (mesh, other, bool(mesh == other))
        self._meshes_now[key] = known
        return known[2]

    def _view(self) -> WriteView | None:
        """This rank's view of the process's write tracker, opened at the first call (None where there is none)."""
        if not self._opened:
            self._opened = True
            tracker = WriteTracker.shared() if tracking_enabled() else None
            self._tracker = tracker.view() if tracker is not None else None
        return self._tracker

    def _track(self, view: WriteView | None, fqn: str, t: Any) -> None:
        """Track the pages of ``t`` from now on (a CPU tensor of private memory, not changing at every
        save), or forget what was tracked at ``fqn`` when it is another storage now."""
        tracked = self._tracked.get(fqn)
        if tracked is not None and (view is None or not _is(tracked, t) or fqn in self._changing):
            if view is not None:
                view.forget(tracked[1], tracked[2], unprotect=_is(tracked, t))  # ``t`` holds its storage
            del self._tracked[fqn]
            tracked = None
        if view is None or tracked is not None or fqn in self._changing:
            return
        nbytes = int(t.numel() * t.element_size())
        if t.device.type != "cpu" or not t.is_contiguous() or nbytes < MIN_TRACKED_BYTES or t.is_pinned():
            return
        if not t.is_shared() and view.track(t.data_ptr(), nbytes):
            self._tracked[fqn] = (t.untyped_storage(), t.data_ptr(), nbytes)  # held: never freed nor reused

    def writer(self, dcp_dir: Path, committed: Path, *, durable: bool) -> FileSystemWriter:
        """The ``storage_writer`` of this stage's ``dcp.save`` into ``dcp_dir``; ``committed``: where
        that directory is once the save is committed."""
        if not callable(getattr(FileSystemWriter, "_write_data", None)):
            # An older torch release, whose writer has no queue of files to hand: every item
            # written into one file per rank, as torch does.
            self.kept = None
            return FileSystemWriter(dcp_dir, sync_files=durable)
        return KeepingWriter(dcp_dir, self, committed, sync_files=durable)

    def add_files(self, writer: LocalWriter, dcp_dir: Path, names: list[str]) -> None:
        """This rank's files of the save just made added to its local writer: the linked kept file with
        the checksum it was written with, the others checksummed by reading them back."""
        kept = self.kept
        for name in names:
            path = f"{dcp_dir.name}/{name}"
            if kept is not None and kept.linked and name == kept.name and kept.algorithm == writer.algorithm:
                assert kept.checksum is not None
                writer.entries.append(FileEntry(path=path, size=kept.size, checksum=kept.checksum))
                writer.bytes_linked += kept.size
                continue
            entry = writer.add_written(path)
            if kept is not None and name == kept.name:
                kept.algorithm, kept.checksum = writer.algorithm, entry.checksum

    def _linkable(self, items: list[WriteItem], keys: list[ItemKey], prefix: str) -> _KeptFile | None:
        """The previous kept file when it may be linked for these unchanged items (``keys``: theirs, in
        the same order; see the module's docstring)."""
        kept = self.kept
        if (
            kept is None
            or not items
            or kept.generation != self.generation - 1
            or kept.checksum is None
            or kept.name != f"{prefix}{KEPT_INDEX}.distcp"
        ):
            return None
        live = 0
        for item, key in zip(items, keys, strict=True):
            placed = kept.items.get(key)
            if placed is None or not _fits(placed, item):
                return None
            live += placed.info.length
        if kept.size - live > live:
            return None  # mostly bytes of items that changed since: written again, smaller
        try:
            st = os.stat(kept.committed)
        except OSError:
            return None
        if st.st_ino != kept.inode or st.st_size != kept.size:
            return None  # not the file that save left (it failed, or an existing checkpoint was kept)
        return kept


class KeepingWriter(FileSystemWriter):
    """torch's file system writer, with a rank's unchanged items in a kept file linked from the previous save."""

    def __init__(self, path: Path, saves: DcpSaves, committed: Path, *, sync_files: bool) -> None:
        super().__init__(path, sync_files=sync_files)
        self._saves = saves
        self._committed = committed
        self._sending: Metadata | None = None  # the global metadata pickled as its written bytes (coordinator)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        saves = self._saves
        prefix: str = plan.storage_data.prefix
        kept_name = f"{prefix}{KEPT_INDEX}.distcp"
        tensors = [i for i in plan.items if i.type != WriteItemType.BYTE_IO and i.tensor_data is not None]
        unchanged = [i for i in tensors if i.index.fqn in saves.unchanged]
        keys = [_key(i) for i in unchanged]
        before = saves._linkable(unchanged, keys, prefix)
        saves.kept, saves.linked_bytes, saves.written_bytes = None, 0, 0
        linked: list[WriteResult] = []
        if before is not None and self._link(before, kept_name):
            done = set(keys)
            linked = [_result(i, before.items[k]) for i, k in zip(unchanged, keys, strict=True)]
            rest = [i for i in plan.items if _key(i) not in done]
            saves.kept = dataclasses.replace(
                before,
                generation=saves.generation,
                committed=self._committed / kept_name,
                items={k: before.items[k] for k in done},
                linked=True,
            )
            saves.linked_bytes = before.size
            name = f"{prefix}{CHANGED_INDEX}.distcp"
        else:
            rest, name = list(plan.items), kept_name
        files: queue.Queue[tuple[Any, str, list[WriteItem]]] = queue.Queue()
        if rest:
            files.put((self.fs.concat_path(self.path, name), name, rest))
        written = self._write_data(planner, files).wait() if rest else []
        if saves.kept is None and rest:
            st = os.stat(Path(self.path) / name)
            by_key = {_key(i): i for i in rest}
            items = {}
            for r in written:
                key = (r.index.fqn, tuple(r.index.offset or ()))
                item = by_key.get(key)
                if item is not None and item.tensor_data is not None:
                    chunk, dtype = item.tensor_data.chunk, item.tensor_data.properties.dtype
                    items[key] = _Placed(tuple(chunk.sizes), dtype, r.size_in_bytes, r.storage_data)
            saves.kept = _KeptFile(saves.generation, name, self._committed / name, st.st_ino, st.st_size, items)
            saves.written_bytes = st.st_size
        elif rest:
            saves.written_bytes = os.stat(Path(self.path) / name).st_size
        future: Future[list[WriteResult]] = Future()
        future.set_result(linked + written)
        return future

    def storage_meta(self) -> StorageMeta | None:
        """None: no temporary directory nor writer id in ``.metadata``, which is then the same bytes
        for the same items (the checkpoint's part manifests name the save)."""
        return None

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator's ``.metadata``: the previous save's bytes again where they describe the
        same items in the same places (see the module's docstring), else torch's own."""
        saves = self._saves
        storage = {r.index: r.storage_data for rank in results for r in rank}
        last = saves._metadata
        saves.metadata_reused = last is not None and last.made_of(metadata, storage)
        if last is not None and saves.metadata_reused:
            metadata.storage_data, metadata.storage_meta = storage, None  # as torch's finish leaves it
            self._write_metadata(last.data)
            self._send_as_written(metadata, last.data)
            return
        saves._metadata = None
        super().finish(metadata, results)
        data = (Path(self.path) / DCP_METADATA).read_bytes()
        saves._metadata = _MetadataFile(
            metadata.state_dict_metadata, metadata.planner_data, getattr(metadata, "version", None), storage, data
        )
        self._send_as_written(metadata, data)

    def sent(self) -> None:
        """Once ``dcp.save`` returned (or failed): the global metadata pickles as torch's again."""
        metadata, self._sending = self._sending, None
        if metadata is not None:
            metadata.__dict__.pop(_SENT, None)
            metadata.__class__ = Metadata

    def _send_as_written(self, metadata: Metadata, data: bytes) -> None:
        """From now until :meth:`sent`, ``metadata`` pickles as ``data`` (see :class:`_SentAsWritten`)."""
        if type(metadata) is not Metadata:
            return  # a subclass of a later torch release: pickled as torch does
        metadata.__dict__[_SENT] = (data, _made_of(metadata))
        metadata.__class__ = _SentAsWritten
        self._sending = metadata

    def _write_metadata(self, data: bytes) -> None:
        """``data`` as this save's ``.metadata``, as torch writes it (a temporary file renamed)."""
        target = Path(self.path) / DCP_METADATA
        tmp = target.with_name(f"{DCP_METADATA}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            if self.sync_files:
                os.fsync(f.fileno())
        os.replace(tmp, target)

    def _link(self, before: _KeptFile, name: str) -> bool:
        """Hard-link the previous kept file into this save (fsynced when the save is durable: the
        previous one may be an emergency save's, not fsynced). False when it cannot be (written instead)."""
        target = Path(self.path) / name
        try:
            os.link(before.committed, target)
            if self.sync_files and before.inode not in self._saves._fsynced:
                fsync_file(target)
                self._saves._fsynced.add(before.inode)
        except OSError as exc:
            log.info("writing %s instead of linking it from the previous save: %s", name, exc)
            with contextlib.suppress(OSError):  # never made
                target.unlink()
            return False
        log.debug("%s linked from %s (%d bytes, nothing written)", name, before.committed, before.size)
        return True


#: The attribute of a :class:`_SentAsWritten` that holds its bytes and what they were made of.
_SENT = "_spotguard_sent"


def _made_of(metadata: Metadata) -> tuple[Any, ...]:
    return (metadata.state_dict_metadata, metadata.planner_data, metadata.storage_data, metadata.storage_meta)


class _SentAsWritten(Metadata):
    """The coordinator's global metadata between the write of its ``.metadata`` and the end of
    ``dcp.save``, which broadcasts it to every rank: pickled as the bytes just written (where its
    fields are still the ones they were made of, else as torch's dataclass), instead of pickling
    every item again (19 ms at a thousand items, on the preemption's path)."""

    def __reduce__(self) -> Any:
        data, made_of = self.__dict__.get(_SENT) or (None, ())
        if data is not None and len(made_of) == 4 and all(a is b for a, b in zip(_made_of(self), made_of, strict=True)):
            BROADCASTS.sent_as_written += 1
            return (_received_metadata, (data,))
        fields = (self.state_dict_metadata, self.planner_data, self.storage_data, self.storage_meta, self.version)
        return (Metadata, fields)


@dataclass
class _Broadcasts:
    """What this process did with DCP's metadata broadcasts (read by the tests)."""

    sent_as_written: int = 0  # the coordinator: pickled as its written bytes
    loaded: int = 0  # a rank: bytes unlike the last ones received, loaded
    again: int = 0  # a rank: the bytes received last time, the object made of them then
    last: tuple[bytes, Metadata] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


BROADCASTS = _Broadcasts()


def _received_metadata(data: bytes) -> Metadata:
    """A rank's global metadata from the coordinator's broadcast (see :class:`_SentAsWritten`): the
    object loaded last time where the bytes are the same (``dcp.save`` only returns it; nothing
    changes it). The bytes come from the job's own coordinator over the process group, which torch
    unpickles in any case; no checkpoint is ever loaded so."""
    with BROADCASTS.lock:
        last = BROADCASTS.last
        if last is not None and last[0] == data:
            BROADCASTS.again += 1
            return last[1]
    metadata: Metadata = pickle.loads(data)  # noqa: S301 - the coordinator's broadcast, as torch's own
    with BROADCASTS.lock:
        BROADCASTS.last = (data, metadata)
        BROADCASTS.loaded += 1
    return metadata


@dataclass(frozen=True)
class Flattened:
    """A staged state dict (nested dicts of tensors, string keys) flattened as DCP's ``flatten_state_dict``
    flattens it: each tensor under its path's keys joined by dots, and the mapping of that name back to
    the path. The stage walks every leaf anyway; DCP's planner would walk them again, testing each value
    for a mapping, a list or a tensor (about 20 µs an item at every save, on the preemption's path:
    :class:`~spotguard.trainer.plancache.ReusingSavePlanner` takes this instead)."""

    tree: Mapping[str, Any]  # the staged state dict it was made of (held: its id is never another's)
    flat: dict[str, Any]
    mappings: dict[str, tuple[str, ...]]

    @staticmethod
    def of(torch: Any, tree: Mapping[str, Any]) -> Flattened | None:
        """Pure: ``tree`` flattened, in DCP's order (depth first, each mapping in its order), or None
        where DCP would flatten it otherwise (a leaf that is not a tensor, a key that is not a string,
        two paths that join to one name: torch then raises)."""
        flat: dict[str, Any] = {}
        mappings: dict[str, tuple[str, ...]] = {}

        def walk(path: tuple[str, ...], node: Mapping[str, Any]) -> bool:
            for key, value in node.items():
                if type(key) is not str:
                    return False
                at = (*path, key)
                if isinstance(value, Mapping):
                    if not walk(at, value):
                        return False
                    continue
                name = ".".join(at)
                if not isinstance(value, torch.Tensor) or name in flat:
                    return False
                flat[name] = value
                mappings[name] = at
            return True

        return Flattened(tree, flat, mappings) if walk((), tree) and flat else None

    def of_saved(self, state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[str, ...]]] | None:
        """This flattening for ``state_dict``, the top level of the tree it was made of as ``dcp.save``
        hands it to the planner (a shallow copy: the same values under the same keys), else None."""
        tree = self.tree
        if len(state_dict) != len(tree) or any(state_dict.get(k) is not v for k, v in tree.items()):
            return None
        return dict(self.flat), dict(self.mappings)


def _local(t: Any) -> Any:
    """A DTensor's local shard (its ``_local_tensor``, the storage ``to_local()`` views, without that
    call's autograd step: a few microseconds for each of hundreds of shards at every save), else ``t``."""
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return local
    return t.to_local() if hasattr(t, "to_local") else t


def _is(tracked: tuple[Any, int, int], t: Any) -> bool:
    """Whether ``t`` is the very memory a tracked record names (the same storage, held by the record)."""
    storage, ptr, nbytes = tracked
    return bool(
        t.untyped_storage()._cdata == storage._cdata and t.data_ptr() == ptr and t.numel() * t.element_size() == nbytes
    )


def _key(item: WriteItem) -> ItemKey:
    return item.index.fqn, tuple(int(o) for o in (item.index.offset or ()))


def _fits(placed: _Placed, item: WriteItem) -> bool:
    data = item.tensor_data
    return data is not None and placed.sizes == tuple(data.chunk.sizes) and placed.dtype == data.properties.dtype


def _result(item: WriteItem, placed: _Placed) -> WriteResult:
    return WriteResult(index=item.index, size_in_bytes=placed.size_in_bytes, storage_data=placed.info)


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Pure: the tensors of nested string-keyed dicts by their DCP names (keys joined with dots, as DCP
    flattens a state dict)."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _leaves(value, f"{name}.")
        else:
            yield name, value


def _without(tree: Mapping[str, Any], names: Any, prefix: str = "") -> dict[str, Any]:
    """Pure: ``tree`` less the leaves named in ``names`` (containers left empty dropped)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            sub = _without(value, names, f"{name}.")
            if sub:
                out[key] = sub
        elif name not in names:
            out[key] = value
    return out


def _with(tree: Mapping[str, Any], staged: Mapping[str, Any], unchanged: Mapping[str, Any], prefix: str = "") -> Any:
    """Pure: ``tree``'s shape with each leaf taken from ``unchanged`` (by DCP name) or else from ``staged``
    (the stager's copy of ``tree`` less those leaves, at the same keys)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out[key] = _with(value, staged.get(key) or {}, unchanged, f"{name}.")
        else:
            out[key] = unchanged[name] if name in unchanged else staged[key]
    return out


__all__ = ["DcpSaves", "Flattened", "KeepingWriter"]
