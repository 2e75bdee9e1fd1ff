"""Static inspection of pickles (legacy ``torch.save`` files) without running them.

spotguard itself never writes pickles. A checkpoint may still carry a
``.pt`` file; before it is handed to ``torch.load(weights_only=True)`` the
pickle's opcodes are inspected and any import outside a small allow-list of
tensor-rebuilding functions is reported, so a checkpoint "whose pickle would
run code" is named and refused. The same scan accepts the metadata of
``torch.distributed.checkpoint`` (``.metadata``), whose pickle holds only
DCP's plain data classes (:data:`DCP_METADATA_GLOBALS`).

Every pickle a loader would unpickle is scanned, not only the first: a zip
archive (``torch.save``'s format) has one per ``*.pkl`` member; a legacy
``torch.save`` file (``_use_new_zipfile_serialization=False``) is five
pickles back to back (magic number, protocol version, system info, the
object, the storage keys) followed by raw storage bytes, and the object's
pickle is the one that matters. Any other file must be exactly one pickle:
bytes after it are refused, since torch would read on past it if the first
pickle merely computed the legacy magic number. torch's older tar format is
refused outright (torch tries it before anything else).

How a pickle is inspected: Python's own unpickler (the C one, the one a
loader uses) reads it, with every import it asks for (``find_class``: the
only way a pickle reaches a callable) recorded and answered by an inert
stand-in (:class:`_Stub`) that accepts any call, state or item and runs
nothing; persistent ids are answered the same way. So the imports named are
exactly those a loader would perform, in its order, and no module is
imported. Only a pickle that imports ``builtins.getattr`` is also followed
opcode by opcode (:func:`_only_enum_lookups`), to accept it only as an enum
member's lookup.

A pickle found safe is remembered by its content's SHA-256 (the last
:data:`SAFE_MEMO_SIZE`, up to :data:`_READ_WHOLE` bytes each): the same
bytes inspected again give the same verdict without reading them as a
pickle. A sharded save's ``.metadata`` is the same bytes from one save to
the next, and its upload and verification each inspected it (8 ms each at
a thousand items). The key is a cryptographic digest, not the manifest's
checksum, which may be a CRC that other bytes can be made to match.
"""

from __future__ import annotations

import copyreg
import hashlib
import io
import pickle
import pickletools
import tarfile
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from spotguard import gcpause

PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".bin")

# What torch.save emits for tensors, parameters and state dicts.
_SAFE_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._utils", "_rebuild_qtensor"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
    ("builtins", "slice"),
    # numpy arrays and dtypes (the RNG state frameworks save: HF's
    # rng_state.pth, numpy.random.get_state()), as torch's weights_only
    # unpickler accepts them: an empty array of a shape and dtype whose bytes
    # are then set, and the latin-1 encoding of those bytes. No user code.
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("_codecs", "encode"),
}
_SAFE_TORCH_SUFFIXES = ("Storage",)

#: What ``torch.distributed.checkpoint`` pickles into its ``.metadata``: plain
#: data classes, enums and a path. Constructing them runs no user code.
DCP_METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
    }
)
_TORCH_DTYPES = {
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "half",
    "float",
    "double",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "uint16",
    "uint32",
    "uint64",
}

_STRING_OPS = {
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
    "STRING",
    "BINSTRING",
    "SHORT_BINSTRING",
}


#: What the first pickle of a legacy (non-zip) ``torch.save`` file holds (torch's ``MAGIC_NUMBER``).
LEGACY_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
#: The pickles of a legacy ``torch.save`` file, in order (raw storage bytes follow the last one).
LEGACY_PICKLES = ("magic number", "protocol version", "system info", "object", "storage keys")


class UnsafePickleError(ValueError):
    """A pickle would import or call something other than tensor rebuilding."""


#: How some Python releases pickle an enum member (Debian 12's 3.11.2 among them):
#: ``getattr(cls, name)``. Accepted only as exactly that call, on an enum class of
#: :data:`ENUM_CLASSES` and a literal name (:func:`_only_enum_lookups`); any other use of
#: ``getattr`` (``getattr(PosixPath, "unlink")``, then a call of what it returned) is refused.
ENUM_LOOKUP = ("builtins", "getattr")
#: The enum classes whose members a pickle may look up by name, and those members' names (named here, not
#: read from the class: the scan runs where torch is not installed, and any other attribute of an enum class,
#: such as ``_convert_``, is a callable a pickle must not reach).
ENUM_CLASSES: dict[tuple[str, str], frozenset[str]] = {
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): frozenset(
        {"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST", "TORCH_PRESERVE_FORMAT"}
    )
}

_MARK = object()
_UNKNOWN = ("?",)


def _only_enum_lookups(ops: list[tuple[Any, Any, int | None]]) -> bool:
    """Pure: whether every ``builtins.getattr`` the pickle imports is only called as
    ``getattr(<a class of ENUM_CLASSES>, "<one of its members' names>")``.

    Follows the unpickler's stack by each opcode's declared effect
    (``pickletools``' ``stack_before``/``stack_after``): strings, globals and
    tuples of them are known, everything else is unknown. ``getattr`` passed
    anywhere but as a REDUCE's callable with such arguments (into a container,
    to another call, as arguments, through the memo to any of these) fails.
    """
    stack: list[Any] = []
    memo: dict[int, Any] = {}

    def pop_items(effect: list[Any]) -> list[Any]:
        if pickletools.stackslice in effect:  # [..., mark, slice]: everything down to the mark, then the rest
            items: list[Any] = []
            while stack and stack[-1] is not _MARK:
                items.insert(0, stack.pop())
            if not stack:
                raise ValueError("no mark")
            stack.pop()
            below = effect.index(pickletools.markobject)
            items[:0] = [stack.pop() for _ in range(below)][::-1]
            return items
        return [stack.pop() for _ in range(len(effect))][::-1]

    try:
        for op, arg, _pos in ops:
            name = op.name
            if name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(str(arg))] = stack[-1]
                continue
            if name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
                continue
            if name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo.get(int(str(arg)), _UNKNOWN))
                continue
            popped = pop_items(op.stack_before)
            if name == "REDUCE" and popped[0] == ("global", *ENUM_LOOKUP):
                args = popped[1]
                ok = (
                    args[0] == "tuple"
                    and len(args[1]) == 2
                    and args[1][0][0] == "global"
                    and args[1][1][0] == "str"
                    and args[1][1][1] in ENUM_CLASSES.get(tuple(args[1][0][1:]), ())
                )
                if not ok:
                    return False
                stack.append(_UNKNOWN)
                continue
            if ("global", *ENUM_LOOKUP) in popped or (name == "INST" and str(arg) == " ".join(ENUM_LOOKUP)):
                return False  # getattr anywhere else: an argument, an item, called by another opcode
            if name in _STRING_OPS:
                stack.append(("str", str(arg)))
            elif name == "GLOBAL":
                module, _, attr = str(arg).partition(" ")
                stack.append(("global", module, attr))
            elif name == "STACK_GLOBAL":
                known = all(item[0] == "str" for item in popped)
                stack.append(("global", popped[0][1], popped[1][1]) if known else _UNKNOWN)
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3", "TUPLE", "EMPTY_TUPLE"):
                stack.append(("tuple", tuple(popped)))
            elif name == "MARK":
                stack.append(_MARK)
            elif name == "DUP":
                stack.extend([popped[0], popped[0]])
            else:
                stack.extend(_UNKNOWN for _ in op.stack_after)
    except (IndexError, ValueError, TypeError):
        return False  # a stack the unpickler would not have: refuse
    return True


def _is_safe(module: str, name: str) -> bool:
    if (module, name) in _SAFE_GLOBALS or (module, name) in DCP_METADATA_GLOBALS:
        return True
    return module == "torch" and (name.endswith(_SAFE_TORCH_SUFFIXES) or name in _TORCH_DTYPES)


def _read_ops(stream: BinaryIO) -> list[tuple[Any, Any, int | None]]:
    """The opcodes of the pickle at ``stream``'s position, which is left just after its STOP."""
    try:
        return list(pickletools.genops(stream))
    except Exception as exc:  # noqa: BLE001 - a malformed pickle may raise anything; each means refused
        raise UnsafePickleError(f"malformed pickle ({exc})") from None


class _Stub:
    """What every import and persistent id of a pickle under inspection stands for: it takes any
    arguments, state or items, and calling it gives another stub. Nothing of the pickle runs."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Stub:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Stub:
        return _Stub()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def add(self, item: Any) -> None:
        pass


class _Inspector(pickle.Unpickler):
    """Python's unpickler with every import recorded and answered by :class:`_Stub` (no module imported)."""

    def __init__(self, stream: BinaryIO) -> None:
        super().__init__(stream)
        self.imports: list[tuple[str, str]] = []

    def find_class(self, module: str, name: str) -> Any:
        self.imports.append((str(module), str(name)))
        return _Stub

    def persistent_load(self, pid: Any) -> Any:
        return _Stub()


@dataclass
class _Pickle:
    """One pickle of a file as inspected: what it imports, what it loads to (stubs for anything
    imported), and where it lies in its stream (for :func:`_only_enum_lookups`)."""

    imports: list[tuple[str, str]]
    value: Any
    stream: BinaryIO
    start: int
    end: int

    def ops(self) -> list[tuple[Any, Any, int | None]]:
        here = self.stream.tell()
        try:
            self.stream.seek(self.start)
            return _read_ops(io.BytesIO(self.stream.read(self.end - self.start)))
        finally:
            self.stream.seek(here)


def _inspect(stream: BinaryIO) -> _Pickle:
    """The pickle at ``stream``'s position, which is left just after its STOP."""
    start = stream.tell()
    # An extension code (EXT1/2/4) is looked up in copyreg's registry, and a code this process resolved
    # before is answered from the unpickler's cache without find_class: the cached callable itself. The
    # registry is empty unless a library registers codes; where it is not, a pickle using one is refused
    # before it is read.
    if getattr(copyreg, "_extension_registry", None):
        ops = _read_ops(stream)
        stream.seek(start)
        if any(op.name.startswith("EXT") for op, _arg, _pos in ops):
            raise UnsafePickleError("pickle uses an extension code (copyreg's registry: an import not seen)")
    inspector = _Inspector(stream)
    try:
        with gcpause.paused():  # a full collection of the process, amid a load of many small objects
            value = inspector.load()
    except Exception as exc:  # noqa: BLE001 - a malformed pickle may raise anything; each means refused
        raise UnsafePickleError(f"malformed pickle ({type(exc).__name__}: {exc})") from None
    return _Pickle(inspector.imports, value, stream, start, stream.tell())


def pickle_globals(data: bytes | BinaryIO) -> list[tuple[str, str]]:
    """Every ``module.name`` the (first) pickle imports, in a loader's order. Raises
    :class:`UnsafePickleError` on a malformed pickle."""
    return _inspect(io.BytesIO(data) if isinstance(data, bytes) else data).imports


def _is_tar(f: BinaryIO) -> bool:
    f.seek(0)
    try:
        with tarfile.open(fileobj=f, mode="r:"):
            return True
    except tarfile.TarError:
        return False
    finally:
        f.seek(0)


#: A file up to this size is read whole before it is inspected (an unpickler reads a stream opcode by opcode).
_READ_WHOLE = 64 << 20


def _scanned(data: bytes | BinaryIO) -> Iterator[tuple[str, _Pickle]]:
    """``(where, pickle)`` for every pickle a loader would unpickle from a file (see the module's doc)."""
    f = io.BytesIO(data) if isinstance(data, bytes) else data
    f.seek(0)
    head = f.read(4)
    f.seek(0)
    if head == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(f) as zf:
                members = [(n, zf.read(n)) for n in zf.namelist() if n.endswith(".pkl")]
        except zipfile.BadZipFile as exc:
            raise UnsafePickleError(f"malformed zip archive ({exc})") from None
        for name, member in members:
            yield f" in {name}", _inspect(io.BytesIO(member))
        return
    if _is_tar(f):
        raise UnsafePickleError("a tar archive (torch's oldest format, which loads more than one pickle)")
    if not isinstance(f, io.BytesIO) and f.seek(0, io.SEEK_END) <= _READ_WHOLE:
        f.seek(0)
        f = io.BytesIO(f.read())
    f.seek(0)
    first = _inspect(f)
    # torch reads a legacy file when its first pickle loads to the magic number (nothing imported makes an int).
    if not (type(first.value) is int and first.value == LEGACY_MAGIC_NUMBER):
        yield "", first
        if f.read(1):
            raise UnsafePickleError("data after the pickle (a loader could read on past it)")
        return
    for what in LEGACY_PICKLES[1:]:
        try:
            found = _inspect(f)
        except UnsafePickleError as exc:
            raise UnsafePickleError(f"legacy torch.save file, {what} pickle: {exc}") from None
        yield f" in the legacy torch.save file's {what}", found


#: How many safe pickles are remembered by content (see the module's doc).
SAFE_MEMO_SIZE = 64
_safe: OrderedDict[bytes, None] = OrderedDict()
_safe_lock = threading.Lock()


def check_pickle_safe(data: bytes | BinaryIO) -> None:
    """Raise :class:`UnsafePickleError` naming the first import that would run
    code; return quietly for pickles of tensors and plain containers (every
    pickle of the file: see the module's doc)."""
    digest = _digest(data)
    if digest is not None:
        with _safe_lock:
            if digest in _safe:
                _safe.move_to_end(digest)
                return
    _check(data)
    if digest is not None:
        with _safe_lock:
            _safe[digest] = None
            while len(_safe) > SAFE_MEMO_SIZE:
                _safe.popitem(last=False)


def _digest(data: bytes | BinaryIO) -> bytes | None:
    """The SHA-256 of ``data`` (a stream read whole, then put back at its start); None above
    :data:`_READ_WHOLE` bytes (not remembered)."""
    if isinstance(data, bytes):
        return hashlib.sha256(data).digest() if len(data) <= _READ_WHOLE else None
    size = data.seek(0, io.SEEK_END)
    data.seek(0)
    if size > _READ_WHOLE:
        return None
    hasher = hashlib.sha256()
    while block := data.read(1 << 20):
        hasher.update(block)
    data.seek(0)
    return hasher.digest()


def _check(data: bytes | BinaryIO) -> None:
    for where, found in _scanned(data):
        imports = found.imports
        if ENUM_LOOKUP in imports and _only_enum_lookups(found.ops()):
            imports = [g for g in imports if g != ENUM_LOOKUP]
        for module, attr in imports:
            if not _is_safe(module, attr):
                target = f"{module}.{attr}"
                raise UnsafePickleError(f"pickle{where} would import {target}, which can run code")


#: Files never inspected as pickles: spotguard's own formats (a safetensors
#: header length can start with the byte 0x80), and the data files of
#: ``torch.distributed.checkpoint`` (``.distcp``: tensors written back to back
#: by ``torch.save``, which spotguard reads only through a reader that loads
#: tensors with ``torch.load(weights_only=True)`` and refuses byte items; they
#: are not one zip archive a scanner could open).
NOT_PICKLE_SUFFIXES = (".safetensors", ".json", ".distcp")


def looks_like_pickle(path: str, head: bytes) -> bool:
    """Whether a checkpoint file must be treated as a pickle (by name or content).

    Files with a suffix in :data:`NOT_PICKLE_SUFFIXES` never are. DCP's
    ``.metadata`` is (by content): its pickle may import only
    :data:`DCP_METADATA_GLOBALS` and torch's tensor classes."""
    if path.endswith(PICKLE_SUFFIXES):
        return True
    if path.endswith(NOT_PICKLE_SUFFIXES):
        return False
    return head[:1] == b"\x80" or head[:4] == b"PK\x03\x04"
