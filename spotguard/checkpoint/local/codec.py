"""Training state <-> checkpoint files, without pickle.

A state is a tree of dicts, lists and tuples whose leaves are tensors (torch
or numpy), numbers, strings, bytes and None. Tensors go into safetensors files
grouped by the state's top-level key (``model`` -> ``model.safetensors``);
everything else goes into ``state.json`` with a small tagged encoding
(``{"__t": "tuple", ...}``) that records tuples, bytes, non-string dict keys,
non-finite floats and references to tensors. Loading parses JSON and
safetensors only, so it cannot run code.

:func:`snapshot_state` is the first phase of a two-phase save: it copies
every tensor to host memory (so training can go on mutating the originals) and
builds the JSON document; :func:`write_snapshot` persists it later, possibly in
another thread.
"""

from __future__ import annotations

import base64
import json
import math
import re
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard.checkpoint.local.written import (
    MIN_TRACKED_BYTES,
    WriteTracker,
    WriteView,
    host_ranges_equal,
    tracking_enabled,
)

STATE_FILE = "state.json"
STATE_FORMAT = 1
TAG = "__t"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class Plain(dict):  # type: ignore[type-arg]
    """A mapping its maker vouches is JSON as it stands (string keys, no ``TAG`` key, values of JSON's
    own types, nothing to encode): put into a snapshot's document as it is, without a walk through it.
    For the markers a sharded save leaves in place of its tensors, hundreds at every save."""


class StateError(ValueError):
    """A state cannot be saved, or a checkpoint's state cannot be loaded."""


# safetensors dtype names <-> numpy dtype strings; torch dtypes are mapped lazily.
_NUMPY_TO_ST = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}
# torch has numpy's dtypes (by the same names) and those numpy lacks.
_TORCH_TO_ST = {**_NUMPY_TO_ST, "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_ST_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


@dataclass
class TensorBlob:
    """A host-memory copy of one tensor: safetensors dtype, shape and raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview  # contiguous, format "B", little-endian element order
    owner: Any = None  # keeps the host buffer alive
    #: The bytes are the ones the last committed snapshot held at the same place (see :data:`KEPT_SUFFIX`).
    unchanged: bool = False

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


#: The file of a part's tensors whose bytes did not change since the last committed checkpoint
#: (``model.kept.safetensors`` beside ``model.safetensors``): a writer may link it from that checkpoint.
KEPT_SUFFIX = ".kept.safetensors"
#: Keys of a host-buffer pool that are not buffers: where each buffer's bytes were (leaf, file, key)
#: in the last snapshot that used the pool, and the checkpoint that snapshot was committed as.
POOL_PLACES = "__places__"
POOL_COMMITTED = "__committed__"
#: The pool's view of the process's write tracker (None where there is none) and the storage each tracked buffer was
#: last filled from: pool key -> (storage, address, bytes). See :mod:`spotguard.checkpoint.local.written`.
POOL_TRACKER = "__tracker__"
POOL_TRACKED = "__tracked__"
POOL_CHANGING = "__changing__"
#: The pool's arenas: tensor file -> its host buffers laid out as that file in the staging memory
#: (:mod:`spotguard.checkpoint.local.arena`).
POOL_ARENAS = "__arenas__"


@dataclass
class Snapshot:
    """A state captured in host memory, ready to be written."""

    doc: dict[str, Any]
    tensors: dict[str, dict[str, TensorBlob]] = field(default_factory=dict)  # file -> key -> blob
    #: The committed checkpoint the unchanged tensors' bytes are in (their files may be linked from it),
    #: and what identifies that very copy (its manifest's inode and modification time).
    previous: str | None = None
    previous_stamp: tuple[int, int] | None = None
    #: Where each kept tensor was in ``previous``: file -> key -> (file, key) there.
    previous_places: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    #: Bytes of tensors told unchanged without reading them (no page written since they were copied).
    unread_bytes: int = 0
    #: The pool's arenas when the snapshot was taken: file -> :class:`spotguard.checkpoint.local.arena.Arena`.
    arenas: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for blobs in self.tensors.values() for b in blobs.values())


def _torch() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover - exercised only without torch
        return None
    return torch


class _Snapshotter:
    def __init__(self, pinned: dict[Any, Any] | None) -> None:
        import sys

        self.torch: Any = sys.modules.get("torch")  # only if the caller already uses torch
        self.np: Any = sys.modules.get("numpy")
        self.snapshot = Snapshot(doc={})
        self.pinned = pinned
        self.cuda_used = False
        self._index = 0
        # Unchanged tensors are told apart only against a snapshot that was committed.
        before = pinned.pop(POOL_PLACES, None) if pinned is not None else None
        committed = pinned.pop(POOL_COMMITTED, None) if pinned is not None else None
        self._before: dict[Any, tuple[str, str, str]] = before if committed is not None and before else {}
        if self._before and committed is not None:
            self.snapshot.previous, self.snapshot.previous_stamp = committed
        self.places: dict[Any, tuple[str, str, str]] = {}
        self.tracker: WriteView | None = None
        self.tracked: dict[Any, tuple[Any, int, int]] = {}
        self.changing: set[Any] = set()  # pool keys of tensors not tracked (mostly written last time)
        if pinned is not None:
            if POOL_TRACKER not in pinned:
                tracker = WriteTracker.shared() if tracking_enabled() else None
                pinned[POOL_TRACKER] = tracker.view() if tracker is not None else None
            self.tracker = pinned[POOL_TRACKER]
            self.tracked = pinned.setdefault(POOL_TRACKED, {})
            self.changing = pinned.setdefault(POOL_CHANGING, set())
            if self.tracker is not None:
                self.tracker.collect()  # before any tensor is read: a write from now on shows next time

    def part_file(self, path: tuple[Any, ...], kept: bool = False) -> str:
        top = str(path[0]) if path else "state"
        if not _SAFE_NAME.match(top) or top == "state":
            top = "tensors"
        return f"{top}{KEPT_SUFFIX}" if kept else f"{top}.safetensors"

    def add_blob(self, path: tuple[Any, ...], blob: TensorBlob, pool_key: Any = None) -> dict[str, str]:
        file = self.part_file(path, kept=blob.unchanged)
        blobs = self.snapshot.tensors.setdefault(file, {})
        key = ".".join(str(p) for p in path[1:]) or str(path[0]) if path else "tensor"
        base, n = key, 1
        while key in blobs or key == "__metadata__":
            n += 1
            key = f"{base}#{n}"
        blobs[key] = blob
        if pool_key is not None:
            self.places[pool_key] = (_path_str(path), file, key)
            if blob.unchanged:
                _, was_file, was_key = self._before[pool_key]
                self.snapshot.previous_places.setdefault(file, {})[key] = (was_file, was_key)
        return {"file": file, "key": key}

    def torch_blob(self, path: tuple[Any, ...], t: Any) -> tuple[TensorBlob, Any]:
        torch = self.torch
        dtype_name = str(t.dtype).removeprefix("torch.")
        st = _TORCH_TO_ST.get(dtype_name)
        where = _path_str(path)
        if st is None:
            raise StateError(f"{where}: tensors of dtype {t.dtype} cannot be checkpointed")
        if t.layout != torch.strided or t.is_quantized or t.is_meta:
            raise StateError(f"{where}: only dense tensors can be checkpointed (got {t.layout})")
        t = t.detach()
        on_gpu = t.device.type != "cpu"
        # Host buffers are reused between saves when the caller keeps a pool
        # (the Checkpointer does: at most one snapshot exists at a time), which
        # saves the page faults of fresh memory on every save; GPU tensors go
        # to page-locked buffers with non-blocking copies and one
        # synchronize() at the end of the snapshot.
        key = (self._index, t.dtype, tuple(t.shape), on_gpu)
        self._index += 1
        host = self.pinned.get(key) if self.pinned is not None else None
        unchanged, changing = self._unwritten(key, path, t, host) if host is not None else (False, False)
        if not unchanged:
            self._track(key, t, self.pinned is not None, changing)
            unchanged = host is not None and self._same_bytes(key, path, host, t)
            if unchanged:
                self.changing.discard(key)  # tracked again from the next snapshot on
        if host is None:
            pin = on_gpu and torch.cuda.is_available()
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            if self.pinned is not None:
                self.pinned[key] = host
        if not unchanged:
            host.copy_(t, non_blocking=on_gpu)
        self.cuda_used = self.cuda_used or on_gpu
        flat = host.reshape(-1).view(torch.uint8)
        blob = TensorBlob(st, tuple(int(s) for s in t.shape), memoryview(flat.numpy()), owner=host)
        blob.unchanged = unchanged
        return blob, (key if self.pinned is not None else None)

    def _trackable(self, t: Any) -> bool:
        return (
            self.tracker is not None
            and t.device.type == "cpu"
            and t.is_contiguous()
            and _nbytes(t) >= MIN_TRACKED_BYTES
            and not t.is_pinned()
            and not t.is_shared()
        )

    def _unwritten(self, key: Any, path: tuple[Any, ...], t: Any, host: Any) -> tuple[bool, bool]:
        """Whether ``t`` is, storage and place, what the host buffer at ``key`` was last filled from
        (or told unchanged against) in the last committed snapshot, and its pages written since (if
        any: a neighbour's write shares a page) hold what the host buffer holds: then ``t`` holds
        those bytes, and the rest of it is not read. See :mod:`spotguard.checkpoint.local.written`.
        Second: whether it is mostly written (it changes from checkpoint to checkpoint)."""
        tracked = self.tracked.get(key)
        before = self._before.get(key)
        if tracked is None or before is None or before[0] != _path_str(path) or not self._trackable(t):
            return False, False
        if not _tracked_is(tracked, t):
            return False, False
        _, ptr, nbytes = tracked
        assert self.tracker is not None
        written = self.tracker.written_ranges(ptr, nbytes)
        if written is None:
            return False, False
        if sum(b - a for a, b in written) > nbytes // 2:
            return False, True  # compared whole
        if not host_ranges_equal(self.torch, t, host, written):
            return False, False
        self.snapshot.unread_bytes += nbytes - sum(b - a for a, b in written)
        return True, False

    def _track(self, key: Any, t: Any, pooled: bool, changing: bool) -> None:
        """Before ``t`` is read into the host buffer at ``key``: track its pages from now on (a
        write after this shows in the next snapshot), or forget what the buffer was filled from.

        A tensor found mostly written (``changing``) is no longer tracked, until a comparison finds
        it unchanged: every write to a protected page costs a fault, once per page after each
        snapshot, which a tensor that changes at every step would pay for nothing."""
        tracked = self.tracked.pop(key, None)
        if self.tracker is None:
            return
        if changing:
            self.changing.add(key)
        if tracked is not None and not _tracked_is(tracked, t):
            self.tracker.forget(tracked[1], tracked[2])
            tracked = None
        if not pooled or not self._trackable(t) or key in self.changing:
            if tracked is not None:
                self.tracker.forget(tracked[1], tracked[2], unprotect=True)  # ``t`` holds its storage
            return
        if tracked is None:
            if not self.tracker.track(t.data_ptr(), _nbytes(t)):
                return
            tracked = (t.untyped_storage(), t.data_ptr(), _nbytes(t))  # held: its memory is never reused
        self.tracked[key] = tracked

    def _same_bytes(self, key: Any, path: tuple[Any, ...], host: Any, t: Any) -> bool:
        """Whether ``t`` holds, byte for byte, what the host buffer holds from the last committed
        snapshot, which had it at the same leaf. Compared as bytes (``-0.0`` is not ``0.0``, a NaN
        equals itself) at memory speed, on ``t``'s device; never by version counters, which
        writes through ``.data`` bypass."""
        before = self._before.get(key)
        if before is None or before[0] != _path_str(path) or not t.is_contiguous():
            return False
        torch = self.torch
        mine = t.reshape(-1).view(torch.uint8)
        theirs = host.reshape(-1).view(torch.uint8)
        if mine.device != theirs.device:
            return equal_in_slices(torch, mine, theirs)
        return bool(torch.equal(as_words(torch, mine), as_words(torch, theirs)))

    def numpy_blob(self, path: tuple[Any, ...], a: Any) -> TensorBlob:
        np = self.np
        st = _NUMPY_TO_ST.get(a.dtype.name)
        if st is None:
            raise StateError(f"{_path_str(path)}: numpy arrays of dtype {a.dtype} cannot be checkpointed")
        host = np.array(a, dtype=a.dtype.newbyteorder("<"), order="C", copy=True)
        return TensorBlob(st, tuple(int(s) for s in a.shape), memoryview(host.reshape(-1).view(np.uint8)), owner=host)

    def encode(self, value: Any, path: tuple[Any, ...]) -> Any:
        if value is None or type(value) is Plain or isinstance(value, bool | str):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            if math.isfinite(value):
                return float(value)
            return {TAG: "float", "v": repr(value)}
        torch, np = self.torch, self.np
        if torch is not None:
            if isinstance(value, torch.Tensor):
                blob, pool_key = self.torch_blob(path, value)
                return {TAG: "tensor", **self.add_blob(path, blob, pool_key)}
            if isinstance(value, torch.Size):
                return {TAG: "torch_size", "v": [int(s) for s in value]}
            if isinstance(value, torch.dtype):
                return {TAG: "torch_dtype", "v": str(value).removeprefix("torch.")}
            if isinstance(value, torch.device):
                return {TAG: "torch_device", "v": str(value)}
        if np is not None:
            if isinstance(value, np.ndarray):
                return {TAG: "ndarray", **self.add_blob(path, self.numpy_blob(path, value))}
            if isinstance(value, np.generic) and value.dtype.name in _NUMPY_TO_ST:
                raw = np.asarray(value, dtype=value.dtype.newbyteorder("<")).tobytes()
                return {TAG: "npscalar", "dtype": value.dtype.name, "v": base64.b64encode(raw).decode()}
        if isinstance(value, bytes | bytearray):
            return {TAG: "bytes", "v": base64.b64encode(bytes(value)).decode()}
        if isinstance(value, tuple):
            return {TAG: "tuple", "v": [self.encode(v, (*path, i)) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, (*path, i)) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            metadata = getattr(value, "_metadata", None)
            plain = all(isinstance(k, str) for k in value) and TAG not in value and not isinstance(value, OrderedDict)
            if plain:
                return {k: self.encode(v, (*path, k)) for k, v in value.items()}
            doc: dict[str, Any] = {
                TAG: "odict" if isinstance(value, OrderedDict) else "dict",
                "v": [[self.encode(k, (*path, "key")), self.encode(v, (*path, k))] for k, v in value.items()],
            }
            if isinstance(metadata, Mapping):
                doc["meta"] = self.encode(dict(metadata), (*path, "_metadata"))
            return doc
        raise StateError(
            f"{_path_str(path)}: values of type {type(value).__module__}.{type(value).__qualname__} "
            "cannot be checkpointed (use tensors, arrays, numbers, strings, bytes, lists, tuples, dicts)"
        )


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def _tracked_is(tracked: tuple[Any, int, int], t: Any) -> bool:
    """Whether ``t`` is the very memory a tracked record names: the same storage (which the record
    holds, so it was never freed nor reused), address and length."""
    storage, ptr, nbytes = tracked
    return bool(t.untyped_storage()._cdata == storage._cdata and t.data_ptr() == ptr and _nbytes(t) == nbytes)


def _path_str(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)


#: The host bytes compared with a device tensor at once (see :func:`equal_in_slices`).
COMPARE_SLICE = 64 << 20


def equal_in_slices(torch: Any, mine: Any, theirs: Any, slice_bytes: int = COMPARE_SLICE) -> bool:
    """Whether the flat uint8 tensors ``mine`` (on a device) and ``theirs`` (on the host)
    hold the same bytes, compared on ``mine``'s device ``slice_bytes`` at a time.

    The host bytes travel in slices into one device buffer of at most ``slice_bytes``:
    an emergency save on a GPU whose memory training fills needs no second copy of
    its largest tensor. Stops at the first slice that differs."""
    if mine.numel() != theirs.numel():
        return False
    n = mine.numel()
    buffer = torch.empty(min(n, max(1, slice_bytes)), dtype=torch.uint8, device=mine.device)
    for start in range(0, n, buffer.numel()):
        end = min(n, start + buffer.numel())
        part = buffer[: end - start]
        part.copy_(theirs[start:end], non_blocking=True)
        if not bool(torch.equal(as_words(torch, mine[start:end]), as_words(torch, part))):
            return False
    return True


def as_words(torch: Any, flat: Any) -> Any:
    """The flat uint8 tensor ``flat`` seen as 64-bit words where its length and address
    allow (the same bytes; ``torch.equal`` compares 8 bytes at a time, about four times
    faster than byte by byte), else as it is."""
    if flat.numel() % 8 == 0 and flat.data_ptr() % 8 == 0:
        return flat.view(torch.int64)
    return flat


def snapshot_state(state: Mapping[str, Any], *, pinned: dict[Any, Any] | None = None) -> Snapshot:
    """Capture ``state`` in host memory (phase one of a save).

    Tensors are copied and containers rebuilt, so the caller may modify or
    free the originals as soon as this returns. ``pinned`` is a pool of host
    buffers (page-locked for GPU tensors) reused by the next snapshot: pass
    the same dict only once the previous snapshot has been written.
    """
    if not isinstance(state, Mapping):
        raise StateError(f"the state to save must be a mapping, got {type(state).__name__}")
    drop_spent(pinned)  # buffers linked into a checkpoint are that checkpoint's: never written again
    snap = _Snapshotter(pinned)
    doc = snap.encode(dict(state), ())
    if snap.cuda_used:
        snap.torch.cuda.synchronize()
    snap.snapshot.doc = {"format": STATE_FORMAT, "state": doc}
    if pinned is not None:
        # What the buffers hold now; it counts only once the caller commits it (:func:`pool_committed`).
        pinned[POOL_PLACES] = snap.places
        snap.snapshot.arenas = dict(pinned.get(POOL_ARENAS, {}))
    return snap.snapshot


def drop_spent(pool: dict[Any, Any] | None) -> None:
    """Forget the arenas of ``pool`` that were linked into a checkpoint (``spent``), and their host
    buffers (the next snapshot takes new ones), so that nothing writes into them again
    (:mod:`spotguard.checkpoint.local.arena`)."""
    if pool is None:
        return
    arenas = pool.get(POOL_ARENAS, {})
    for file, arena in list(arenas.items()):
        if arena.spent:
            for key in arena.pool_keys:
                pool.pop(key, None)
            arena.close()
            del arenas[file]


def pool_committed(pinned: dict[Any, Any] | None, name: str, stamp: tuple[int, int]) -> None:
    """The last snapshot taken with ``pinned`` was committed as checkpoint ``name`` (``stamp``: its
    manifest's inode and modification time): the next snapshot may tell its unchanged tensors apart
    against it, and its writer link their files from that very copy."""
    if pinned is not None and POOL_PLACES in pinned:
        pinned[POOL_COMMITTED] = (name, stamp)


# -- safetensors writing --------------------------------------------------------


def safetensors_header(
    blobs: Mapping[str, TensorBlob], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[str]]:
    """The 8-byte length + JSON header of a safetensors file, and the order in
    which tensor data must follow (largest alignment first, then by name, like
    the reference writer, so every tensor stays aligned)."""
    order = sorted(blobs, key=lambda k: (-_ST_ITEMSIZE[blobs[k].dtype], k))
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for key in order:
        b = blobs[key]
        header[key] = {"dtype": b.dtype, "shape": list(b.shape), "data_offsets": [offset, offset + b.nbytes]}
        offset += b.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, order


def written_size(blobs: Mapping[str, TensorBlob]) -> int:
    """Pure: the size of the safetensors file :func:`iter_safetensors` makes of ``blobs``."""
    return len(safetensors_header(blobs)[0]) + sum(b.nbytes for b in blobs.values())


def iter_safetensors(blobs: Mapping[str, TensorBlob], chunk: int = 8 << 20) -> Iterator[bytes | memoryview]:
    """The bytes of a safetensors file holding ``blobs``, as header + views of
    the tensors' host memory (no intermediate copy of the whole file)."""
    header, order = safetensors_header(blobs)
    yield header
    for key in order:
        data = blobs[key].data
        for start in range(0, data.nbytes, chunk):
            yield data[start : start + chunk]


# -- loading ----------------------------------------------------------------------


class _Decoder:
    def __init__(self, load_file: Callable[[str, bool], Mapping[str, Any]]) -> None:
        self.load_file = load_file

    def decode(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self.decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        tag = value.get(TAG)
        if tag is None:
            return {k: self.decode(v) for k, v in value.items()}
        try:
            return self._tagged(tag, value)
        except StateError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"state.json: malformed {tag!r} entry ({exc})") from None

    def _tagged(self, tag: str, value: dict[str, Any]) -> Any:
        if tag == "tuple":
            return tuple(self.decode(v) for v in value["v"])
        if tag in ("dict", "odict"):
            items = [(self.decode(k), self.decode(v)) for k, v in value["v"]]
            out: dict[Any, Any] = OrderedDict(items) if tag == "odict" else dict(items)
            if "meta" in value and isinstance(out, OrderedDict):
                out._metadata = self.decode(value["meta"])  # type: ignore[attr-defined]
            return out
        if tag == "float":
            v = str(value["v"])
            if v not in ("nan", "inf", "-inf"):
                raise StateError(f"state.json: bad float {v!r}")
            return float(v)
        if tag == "bytes":
            return base64.b64decode(value["v"], validate=True)
        if tag in ("tensor", "ndarray"):
            tensors = self.load_file(str(value["file"]), tag == "tensor")
            key = str(value["key"])
            if key not in tensors:
                raise StateError(f"{value['file']}: tensor {key!r} referenced by state.json is missing")
            return tensors[key]
        if tag == "npscalar":
            import numpy as np

            dtype = str(value["dtype"])
            if dtype not in _NUMPY_TO_ST:
                raise StateError(f"state.json: unsupported numpy scalar dtype {dtype!r}")
            raw = base64.b64decode(value["v"], validate=True)
            return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)[0]
        torch = _torch()
        if tag == "torch_size" and torch is not None:
            return torch.Size(int(v) for v in value["v"])
        if tag == "torch_dtype" and torch is not None:
            name = str(value["v"])
            if name not in _TORCH_TO_ST and name not in ("complex64", "complex128"):
                raise StateError(f"state.json: unknown torch dtype {name!r}")
            return getattr(torch, name)
        if tag == "torch_device" and torch is not None:
            return torch.device(str(value["v"]))
        raise StateError(f"state.json: unknown tag {tag!r} (written by a newer spotguard?)")


def decode_state(doc: Any, load_file: Callable[[str, bool], Mapping[str, Any]]) -> dict[str, Any]:
    """Rebuild a state from the ``state.json`` document; ``load_file(name,
    as_torch)`` returns the tensors of a safetensors file."""
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT or not isinstance(doc.get("state"), dict):
        raise StateError("state.json: not a spotguard state document (format 1)")
    state = _Decoder(load_file).decode(doc["state"])
    assert isinstance(state, dict)
    return state


def load_safetensors(path: Path, as_torch: bool) -> dict[str, Any]:
    """Tensors of a safetensors file (torch tensors, or numpy arrays)."""
    try:
        if as_torch:
            from safetensors.torch import load_file as load_torch

            return dict(load_torch(str(path)))
        from safetensors.numpy import load_file as load_numpy

        return dict(load_numpy(str(path)))
    except ImportError as exc:
        raise StateError(f"{path.name}: loading needs {exc.name} (pip install 'spotguard[torch]')") from None
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types; each means a bad file
        raise StateError(f"{path.name}: not a valid safetensors file ({exc})") from None


# -- safetensors layout, for reading straight into tensors ---------------------------

#: The largest header a safetensors file may have (the reference reader's limit).
MAX_SAFETENSORS_HEADER = 100_000_000
#: safetensors dtype name -> torch dtype attribute name.
ST_TO_TORCH = {st: name for name, st in _TORCH_TO_ST.items()}


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's bytes lie in a safetensors file: ``[start, end)``, file offsets."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def itemsize(self) -> int:
        return _ST_ITEMSIZE[self.dtype]


def safetensors_header_end(first8: bytes, file_size: int) -> int:
    """Pure: the offset where a safetensors file's tensor data starts (8 + header
    length), from its first 8 bytes; raises :class:`StateError` when that cannot
    be the start of a safetensors file of ``file_size`` bytes."""
    if len(first8) < 8 or file_size < 8:
        raise StateError(f"{file_size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", first8[:8])
    if n > min(MAX_SAFETENSORS_HEADER, file_size - 8):
        raise StateError(f"header length {n} does not fit a file of {file_size} bytes")
    return 8 + int(n)


def parse_safetensors_header(header: bytes, file_size: int) -> list[TensorSpan]:
    """Pure: the tensors of a safetensors file from its JSON header (the bytes
    after the 8-byte length), ordered by offset. Checks what the reference
    reader checks (known dtypes, sizes that match shapes, tensors that tile the
    data exactly), so that the bytes can be read straight into tensors before
    anything else parses them; raises :class:`StateError` saying what is wrong."""
    base = 8 + len(header)
    try:
        doc = json.loads(header)
    except ValueError as exc:
        raise StateError(f"header is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise StateError("header is not a JSON object")
    spans: list[TensorSpan] = []
    for key, info in doc.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise StateError(f"tensor {key!r}: needs dtype, shape and two data_offsets") from None
        if dtype not in _ST_ITEMSIZE:
            raise StateError(f"tensor {key!r}: unknown dtype {dtype!r}")
        dims = tuple(shape) if isinstance(shape, list) else None
        if dims is None or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise StateError(f"tensor {key!r}: bad shape {shape!r}")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (b, e)) or not 0 <= b <= e:
            raise StateError(f"tensor {key!r}: bad data_offsets {[b, e]!r}")
        if e - b != math.prod(dims) * _ST_ITEMSIZE[dtype]:
            raise StateError(f"tensor {key!r}: {e - b} bytes do not hold shape {list(dims)} of {dtype}")
        spans.append(TensorSpan(str(key), dtype, dims, base + b, base + e))
    spans.sort(key=lambda t: (t.start, t.end))
    at = base
    for t in spans:
        if t.start != at:
            raise StateError(
                f"tensor {t.key!r}: data at offset {t.start - base}, expected {at - base} (overlapping or a gap)"
            )
        at = t.end
    if at != file_size:
        raise StateError(f"tensors end at byte {at}, the file has {file_size}")
    return spans


def tensor_files_of(doc: Any) -> set[str]:
    """Every file a ``state.json`` document references."""
    found: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            if v.get(TAG) in ("tensor", "ndarray") and isinstance(v.get("file"), str):
                found.add(v["file"])
            for x in v.values():
                walk(x)

    walk(doc)
    return found
