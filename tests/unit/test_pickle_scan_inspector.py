"""The pickle scan reads a pickle with Python's own unpickler, every import answered by an inert stand-in:
the imports it names are those a loader performs, no module is imported, and nothing of the pickle runs."""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import pickletools
import sys
from pathlib import Path
from typing import Any

import pytest

from spotguard.checkpoint.format.pickle_scan import UnsafePickleError, check_pickle_safe, pickle_globals


class _Call:
    """Pickles as ``func(*args)``."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> Any:
        return self.func, self.args


def test_a_payload_is_named_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    data = pickle.dumps({"w": [1, 2], "x": _Call(os.mkdir, str(marker))}, protocol=2)
    with pytest.raises(UnsafePickleError, match=r"would import (posix|os)\.mkdir"):
        check_pickle_safe(data)
    assert not marker.exists()


def test_no_module_is_imported_to_inspect_a_pickle() -> None:
    name = "spotguard_scan_never_imports_this"
    data = b"\x80\x02c" + name.encode() + b"\nthing\n)R."
    assert pickle_globals(data) == [(name, "thing")]
    with pytest.raises(UnsafePickleError, match=name):
        check_pickle_safe(data)
    assert name not in sys.modules


def test_imports_are_named_in_a_loaders_order_through_the_memo() -> None:
    # STACK_GLOBAL's strings fetched back from the memo: the unpickler, not a guess, says what they are.
    data = b"\x80\x04\x8c\x05torch\x94\x8c\x04Size\x94\x93h\x00h\x01\x93\x8c\x02os\x94\x8c\x06getcwd\x94\x93\x87."
    assert pickle_globals(data) == [("torch", "Size"), ("torch", "Size"), ("os", "getcwd")]


def test_state_items_and_calls_of_what_a_pickle_imports_are_taken() -> None:
    # What torch.save and numpy pickles do with what they import: call it, set its state, add items to it.
    import collections

    ordered = collections.OrderedDict(a=1, b=[2, 3])
    check_pickle_safe(pickle.dumps(ordered, protocol=2))
    check_pickle_safe(pickle.dumps({"s": {1, 2}, "f": frozenset({3}), "c": complex(1, 2)}, protocol=4))


def _mark(path: str) -> None:
    os.mkdir(path)


@pytest.fixture
def extension_code() -> Any:
    """``_mark`` registered as a copyreg extension code, and resolved once (the unpickler caches it)."""
    module, name, code = __name__, "_mark", 0x7F1D
    copyreg.add_extension(module, name, code)
    try:
        assert pickle.loads(pickle.dumps(_mark, protocol=2)) is _mark  # the code is now cached
        yield code
    finally:
        copyreg.remove_extension(module, name, code)


def test_an_extension_code_is_refused_before_the_pickle_is_read(extension_code: int, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    data = pickle.dumps(_Call(_mark, str(marker)), protocol=2)
    assert any(op.name == "EXT2" for op, _a, _p in pickletools.genops(data))  # no import a scan could see
    with pytest.raises(UnsafePickleError, match="extension code"):
        check_pickle_safe(data)
    with pytest.raises(UnsafePickleError, match="extension code"):
        check_pickle_safe(io.BytesIO(data))
    assert not marker.exists()


def test_a_large_pickle_of_many_items_is_scanned_whole() -> None:
    data = pickle.dumps([{"k": i, "v": _Call(complex, i, 1)} for i in range(20000)] + [_Call(os.getcwd)], protocol=4)
    with pytest.raises(UnsafePickleError, match=r"(posix|os)\.getcwd"):
        check_pickle_safe(data)
