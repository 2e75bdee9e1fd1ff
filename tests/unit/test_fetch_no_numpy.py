"""A restore lands chunks in the file's pages without numpy: the operator's image (the restore init
container, the sidecar) has no numpy, only the trainer's images do."""

from __future__ import annotations

import sys
from pathlib import Path

import google_crc32c
import pytest

from spotguard.checkpoint.restore.fetch import _Targets


def test_a_chunk_landed_in_a_mapped_file_is_checksummed_without_numpy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "numpy", None)  # `import numpy` raises ImportError, as in that image
    data = bytes(range(256)) * 64
    files = _Targets(tmp_path, mapped=True)
    files.open("model.bin", 3 * len(data))

    def read(views: list[memoryview]) -> None:
        views[0][:] = data

    try:
        crc = files.land("model.bin", len(data), len(data), read)
    finally:
        files.close()
    assert crc == google_crc32c.value(data)
    landed = (tmp_path / "model.bin").read_bytes()
    assert landed[len(data) : 2 * len(data)] == data and landed[: len(data)] == bytes(len(data))
