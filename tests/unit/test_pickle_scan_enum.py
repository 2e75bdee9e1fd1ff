"""DCP metadata whose enum members are pickled as ``getattr(cls, name)`` (Debian 12's Python 3.11.2 does so).

Such metadata is what a trainer image built on Debian's Python writes for every sharded checkpoint; the
sidecar's scan refused it ("would import builtins.getattr"), so no step of a gang was ever verified. It is
accepted as exactly that call on DCP's own enum and one of its members' names, and nothing else."""

from __future__ import annotations

import io
import pickle
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from spotguard.checkpoint.format.dcp import UnsafeMetadataError, parse_metadata
from spotguard.checkpoint.format.pickle_scan import UnsafePickleError, check_pickle_safe


class _EnumByGetattr(pickle.Pickler):
    """Pickles DCP's enum members as some Python releases do: ``getattr(cls, name)``."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _MEM_FORMAT_ENCODING):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _dumps(obj: Any, pickler: type[pickle.Pickler] = _EnumByGetattr) -> bytes:
    buf = io.BytesIO()
    pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


@pytest.fixture(scope="module")
def metadata(tmp_path_factory: pytest.TempPathFactory) -> Any:
    where = tmp_path_factory.mktemp("dcp")
    with pytest.warns(UserWarning):  # no process group: DCP says it saves in one process
        dcp.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, checkpoint_id=str(where))
    return parse_metadata((where / ".metadata").read_bytes())


def test_enum_members_pickled_by_getattr_pass_the_scan_and_load(metadata: Any) -> None:
    data = _dumps(metadata)
    assert b"getattr" in data  # the form the fix is about
    check_pickle_safe(data)
    loaded = parse_metadata(data)
    formats = {k: v.properties.memory_format for k, v in loaded.state_dict_metadata.items()}
    assert formats == {k: v.properties.memory_format for k, v in metadata.state_dict_metadata.items()}
    assert all(isinstance(f, torch.memory_format) for f in formats.values())


class _Call:
    """Pickles as ``func(*args)``."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> Any:
        return self.func, self.args


@pytest.mark.parametrize(
    "payload",
    [
        # An enum class's own callables.
        _Call(getattr, _MEM_FORMAT_ENCODING, "_convert_"),
        _Call(getattr, _MEM_FORMAT_ENCODING, "__class__"),
        # A member name of another class, or a name that is not a literal string.
        _Call(getattr, torch.Size, "TORCH_CONTIGUOUS_FORMAT"),
        _Call(getattr, _MEM_FORMAT_ENCODING, _Call(str, "TORCH_CHANNELS_LAST")),
        # getattr itself handed on rather than called.
        [getattr],
        _Call(torch.Size, (getattr,)),
    ],
    ids=["enum-convert", "enum-class", "other-class", "computed-name", "in-list", "as-arg"],
)
def test_any_other_getattr_is_refused(payload: Any) -> None:
    _refused(_dumps(payload, pickle.Pickler))


def test_a_method_looked_up_by_getattr_and_called_is_refused() -> None:
    # getattr(PosixPath, "unlink")(PosixPath("/nonexistent")): an allowed class, an attribute that is no enum member.
    _refused(
        b"\x80\x02cbuiltins\ngetattr\ncpathlib\nPosixPath\nX\x06\x00\x00\x00unlink\x86R"
        b"cpathlib\nPosixPath\nX\x0c\x00\x00\x00/nonexistent\x85R\x85R."
    )


def _refused(data: bytes) -> None:
    with pytest.raises(UnsafePickleError, match="builtins.getattr"):
        check_pickle_safe(data)
    with pytest.raises(UnsafeMetadataError):
        parse_metadata(data)
