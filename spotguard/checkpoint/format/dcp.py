"""Reading ``torch.distributed.checkpoint`` (DCP) directories without running code.

DCP stores its metadata (``dcp/.metadata``) as a pickle. spotguard reads it
with :class:`SafeFileSystemReader`: an unpickler that can build only DCP's own
data classes (``pickle_scan.DCP_METADATA_GLOBALS``) and torch dtypes, and that
refuses metadata describing anything but tensors. A ``BytesStorageMetadata``
entry would make DCP's default load planner call
``torch.load(weights_only=False)`` on the bytes, so such a checkpoint is
refused before any data is read; tensor items are read by DCP itself with
``torch.load(weights_only=True)``. spotguard never writes byte items: every
non-tensor leaf of a sharded state goes through its own codec.

:func:`load_full_state` loads a whole DCP directory into one process (no
process group), the safe counterpart of torch's ``dcp_to_torch_save``.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader

from spotguard.checkpoint.format.manifest import DCP_METADATA
from spotguard.checkpoint.format.pickle_scan import DCP_METADATA_GLOBALS, ENUM_CLASSES, ENUM_LOOKUP

METADATA_FILE = DCP_METADATA
_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")


class UnsafeMetadataError(ValueError):
    """DCP metadata that spotguard refuses to load (it could run code, or
    describes something other than tensors)."""


# Built (a plain data class), then refused by parse_metadata with a clear reason.
_REFUSED_LATER = frozenset({("torch.distributed.checkpoint.metadata", "BytesStorageMetadata")})


def _enum_member(cls: Any, name: Any) -> Any:
    """What ``builtins.getattr`` is in DCP metadata: a member of one of DCP's enums, by name, and nothing else
    (some Python releases pickle an enum member as ``getattr(cls, name)``; see ``pickle_scan.ENUM_LOOKUP``)."""
    members = ENUM_CLASSES.get((cls.__module__, cls.__qualname__), ()) if isinstance(cls, type) else ()
    if not isinstance(name, str) or name not in members or name not in getattr(cls, "__members__", {}):
        raise UnsafeMetadataError(f"DCP metadata would call getattr({cls!r}, {name!r}), which is no enum member")
    return cls[name]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS or (module, name) in _REFUSED_LATER:
            return super().find_class(module, name)
        if (module, name) == ENUM_LOOKUP:
            return _enum_member
        if module == "torch" and name.isidentifier() and not name.startswith("_"):
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise UnsafeMetadataError(f"DCP metadata would import {module}.{name}, which can run code")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadataError("DCP metadata uses persistent ids (not DCP metadata)")


def parse_metadata(data: bytes) -> Any:
    """Unpickle DCP metadata with only DCP's data classes allowed, and check
    that it describes tensors stored in this directory. Raises
    :class:`UnsafeMetadataError`."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeMetadataError:
        raise
    except Exception as exc:  # noqa: BLE001 - unpickling untrusted bytes may raise anything; each means unreadable
        raise UnsafeMetadataError(f"DCP metadata is not readable ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadataError(f"DCP metadata holds a {type(metadata).__name__}, not Metadata")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeMetadataError("DCP metadata: state_dict_metadata is not a dict")
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            raise UnsafeMetadataError(f"DCP metadata: key {key!r} is not a string")
        if not isinstance(item, TensorStorageMetadata):
            raise UnsafeMetadataError(
                f"DCP metadata: {key!r} is stored as {type(item).__name__}, not a tensor "
                "(loading it would unpickle arbitrary objects)"
            )
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise UnsafeMetadataError("DCP metadata: storage_data is not a dict")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise UnsafeMetadataError("DCP metadata: storage_data entry of an unexpected type")
        if index.fqn not in metadata.state_dict_metadata:
            raise UnsafeMetadataError(f"DCP metadata: stored item {index.fqn!r} is not described")
        path = info.relative_path
        if not isinstance(path, str) or not _DATA_FILE.match(path):
            raise UnsafeMetadataError(f"DCP metadata: data file {path!r} is not a DCP data file of this directory")
        if info.transform_descriptors:
            raise UnsafeMetadataError(
                f"DCP metadata: {index.fqn!r} uses stream transforms {info.transform_descriptors}"
            )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file system reader, with metadata read by :func:`parse_metadata`
    (no arbitrary unpickling)."""

    def read_metadata(self, *args: Any) -> Any:  # no **kwargs: DCP then never falls back to rank-local files
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(None)
        with self.fs.create_stream(path, "rb") as f:
            metadata = parse_metadata(f.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_full_state(dcp_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Every tensor of a DCP directory as one nested state dict, in this
    process (no process group; the whole state must fit in memory)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # Like torch's dcp_to_torch_save: the planner builds the state from the metadata.
    reader = SafeFileSystemReader(Path(dcp_dir))
    reader.read_metadata()  # refused here, with its own error, before DCP wraps it
    state: dict[str, Any] = {}
    planner = _EmptyStateDictLoadPlanner()  # type: ignore[no-untyped-call]
    _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    return state
