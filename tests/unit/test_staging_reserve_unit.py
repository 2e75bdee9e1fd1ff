"""The staging reserve's decisions (spotguard.checkpoint.local.reserve), without I/O."""

from __future__ import annotations

import pytest

from spotguard.checkpoint.local import reserve
from spotguard.checkpoint.local.commit import TMP_PREFIX, WRITER_TMP_PREFIX
from spotguard.contract.env import STAGING_RESERVE, from_env
from spotguard.trainer.config import CheckpointerConfig

MiB = 1 << 20


def test_a_reserve_is_whole_mib_and_room_to_grow() -> None:
    assert reserve.reserve_size(0) == 2 * MiB
    assert reserve.reserve_size(MiB - 1) == 2 * MiB
    assert reserve.reserve_size(MiB) == 3 * MiB
    size = 2 * 1024 * MiB + 123
    assert size + MiB <= reserve.reserve_size(size) <= size + 2 * MiB
    assert reserve.reserve_size(size) % MiB == 0


def test_reserve_names_are_temporary_files_that_the_clean_ups_remove() -> None:
    # Everything that cleans a staging directory removes names of this prefix; nothing lists or ships them.
    assert reserve.RESERVE_PREFIX.startswith(TMP_PREFIX) and reserve.MAKING_PREFIX.startswith(TMP_PREFIX)
    assert not reserve.RESERVE_PREFIX.startswith(WRITER_TMP_PREFIX)
    assert reserve.parse_reserve_name(f"{reserve.RESERVE_PREFIX}3145728-ab12cd34") == 3 * MiB
    for other in (
        f"{reserve.MAKING_PREFIX}3145728-ab12cd34",  # being allocated: never taken
        f"{reserve.RESERVE_PREFIX}3145728",
        f"{reserve.RESERVE_PREFIX}-ab12",
        f"{reserve.RESERVE_PREFIX}3m-ab12",
        f"{WRITER_TMP_PREFIX}000000000001-ab12cd34",
        "ckpt-000000000001",
    ):
        assert reserve.parse_reserve_name(other) is None, other


def test_the_plan_keeps_reserves_that_match_and_replaces_the_rest() -> None:
    assert reserve.plan([3, 5], []) == ([3, 5], [])
    assert reserve.plan([3, 5], [5, 3]) == ([], [])
    assert reserve.plan([3, 3, 5], [3, 7]) == ([3, 5], [7])
    assert reserve.plan([], [3, 7]) == ([], [3, 7])


@pytest.mark.parametrize(
    ("new", "free", "headroom", "fits"),
    [
        (100, 1000, 1000, True),
        (100, 1000, None, True),  # memory unknown: the file system's room decides
        (100, 105, 1000, False),  # not in the staging file system
        (100, 1000, 205, False),  # would leave the process less memory than it takes
        (100, 1000, 210, True),
        (0, 10, 10, True),
    ],
)
def test_a_reserve_leaves_at_least_as_much_memory_as_it_takes(
    new: int, free: int, headroom: int | None, fits: bool
) -> None:
    assert reserve.fits(new, free, headroom, margin=10) is fits


def test_a_file_takes_the_smallest_reserve_that_holds_it_else_the_largest() -> None:
    assert reserve.choose([], 5) is None
    assert reserve.choose([8, 4, 6], 5) == 6
    assert reserve.choose([8, 4, 6], 6) == 6
    assert reserve.choose([8, 4, 6], 9) == 8


def test_the_reserve_is_off_unless_asked_for() -> None:
    assert from_env(STAGING_RESERVE, {}) is False
    assert CheckpointerConfig.from_env({}).staging_reserve is False
    assert CheckpointerConfig.from_env({STAGING_RESERVE.name: "true"}).staging_reserve is True
    with pytest.raises(ValueError, match=STAGING_RESERVE.name):
        CheckpointerConfig.from_env({STAGING_RESERVE.name: "maybe"})
