"""The static pickle scan used by verification and DCP's metadata: a real ``.metadata``
passes, the same classes with one more import that would run code do not, and
``.distcp`` data files are not pickle-scanned."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from spotguard.checkpoint.format.manifest import FileEntry, new_manifest
from spotguard.checkpoint.format.pickle_scan import (
    DCP_METADATA_GLOBALS,
    UnsafePickleError,
    check_pickle_safe,
    looks_like_pickle,
    pickle_globals,
)
from spotguard.checkpoint.format.verify import needs_content, verify_files
from spotguard.storage.checksum import checksum_bytes
from testenv.require import require_module

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

torch = require_module("torch")
dcp = require_module("torch.distributed.checkpoint")


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dcp")
    state = {
        "model": {"w": torch.ones(3, 2), "b": torch.zeros(2, dtype=torch.bfloat16)},
        "optimizer": {"state": {"w": {"exp_avg": torch.full((3, 2), 0.5)}}},
    }
    dcp.save(state, checkpoint_id=str(d), no_dist=True)
    return d


def test_real_dcp_metadata_passes_the_scan(dcp_dir: Path) -> None:
    data = (dcp_dir / ".metadata").read_bytes()
    assert looks_like_pickle("dcp/.metadata", data[:4])
    check_pickle_safe(data)
    imported = set(pickle_globals(data))
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in imported
    assert imported - DCP_METADATA_GLOBALS <= {("torch", "float32"), ("torch", "bfloat16")}


class _RunsCode:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


def test_metadata_with_one_more_global_is_refused(dcp_dir: Path) -> None:
    with open(dcp_dir / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own file
    evil = pickle.dumps([metadata, _RunsCode()], protocol=4)
    globals_ = pickle_globals(evil)
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in globals_
    with pytest.raises(UnsafePickleError, match=r"would import posix\.system|would import os\.system"):
        check_pickle_safe(evil)
    # Hidden as an attribute of a metadata object, through the same memoized module names.
    metadata.storage_meta = _RunsCode()
    with pytest.raises(UnsafePickleError, match="system"):
        check_pickle_safe(pickle.dumps(metadata, protocol=4))


def test_a_stack_global_whose_name_is_not_followed_is_refused() -> None:
    # "torch" then "Size" pushed, but a DUP in between: the scanner cannot be
    # sure which strings the import takes and refuses it.
    sneaky = b"\x80\x04\x8c\x05posix\x94\x8c\x06system\x94\x8c\x04Size\x94\x30\x93."  # ... POP STACK_GLOBAL
    with pytest.raises(UnsafePickleError):
        check_pickle_safe(sneaky)
    memo_trick = b"\x80\x04\x8c\x05torch\x94\x8c\x05posix\x94h\x01\x8c\x06system\x93."
    with pytest.raises(UnsafePickleError, match=r"posix\.system"):
        check_pickle_safe(memo_trick)


def test_distcp_files_are_not_pickle_scanned(dcp_dir: Path) -> None:
    data_file = next(p for p in dcp_dir.iterdir() if p.suffix == ".distcp")
    head = data_file.read_bytes()[:4]
    assert not looks_like_pickle("dcp/__0_0.distcp", head)
    assert not needs_content("dcp/__0_0.distcp")
    assert needs_content("dcp/.metadata")  # read back and scanned even with a store checksum


def test_a_dcp_directory_verifies(dcp_dir: Path) -> None:
    entries = []
    for p in sorted(dcp_dir.iterdir()):
        data = p.read_bytes()
        entries.append(FileEntry(f"dcp/{p.name}", len(data), checksum_bytes(data, "crc32c")))
    manifest = new_manifest(1, entries, "crc32c")

    def read(path: str) -> Any:
        yield (dcp_dir / path.split("/", 1)[1]).read_bytes()

    sizes = {e.path: e.size for e in entries}
    problems, _ = verify_files(manifest, sizes, read)
    assert problems == []
    # A .metadata that would run code fails verification.
    with open(dcp_dir / ".metadata", "rb") as f:
        evil = pickle.dumps([pickle.load(f), _RunsCode()], protocol=4)
    entries = [FileEntry("dcp/.metadata", len(evil), checksum_bytes(evil, "crc32c"))]
    problems, _ = verify_files(
        new_manifest(1, entries, "crc32c"), {"dcp/.metadata": len(evil)}, lambda _p: iter([evil])
    )
    assert len(problems) == 1 and "system" in problems[0] and "refused" in problems[0]
