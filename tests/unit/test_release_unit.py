"""Which files a prune frees a step at a time, and the steps (pure)."""

from __future__ import annotations

import stat

from spotguard.checkpoint.local.release import MEMORY_FILE_SYSTEMS, shrinks, steps

REG = stat.S_IFREG | 0o644
EXT4 = 0xEF53


def test_steps_end_at_zero_and_never_grow() -> None:
    assert steps(10, 4) == [6, 2, 0]
    assert steps(8, 4) == [4, 0]
    assert steps(0, 4) == []


def test_only_a_large_regular_file_with_one_link_on_a_disk_shrinks() -> None:
    assert shrinks(REG, 1, 100, EXT4, step=10)
    assert not shrinks(REG, 2, 100, EXT4, step=10)  # another checkpoint holds it
    assert not shrinks(REG, 1, 10, EXT4, step=10)  # one step or less: unlinked at once
    assert not shrinks(stat.S_IFLNK | 0o777, 1, 100, EXT4, step=10)
    assert not shrinks(REG, 1, 100, None, step=10)  # file system unknown
    for memory in MEMORY_FILE_SYSTEMS:
        assert not shrinks(REG, 1, 100, memory, step=10)
