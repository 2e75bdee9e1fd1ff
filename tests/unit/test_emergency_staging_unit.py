"""Pure parts of staging a preemption's checkpoint in memory (spotguard.checkpoint.local.staged)."""

from __future__ import annotations

import pytest

from spotguard.checkpoint.local.codec import Snapshot, TensorBlob
from spotguard.checkpoint.local.staged import (
    MEMORY_MARGIN,
    cgroup_room,
    fits_in_memory,
    may_link_kept,
    parse_meminfo_available,
)
from spotguard.run.supervisor import is_memory_mount

MiB = 1024 * 1024


def blob(unchanged: bool, n: int = 8) -> TensorBlob:
    return TensorBlob("U8", (n,), memoryview(bytes(n)), unchanged=unchanged)


@pytest.mark.parametrize(
    ("previous", "tensors", "links"),
    [
        (None, {"model.kept.safetensors": {"w": blob(True)}}, False),  # no previous checkpoint to link from
        ("ckpt-000000000001", {"model.kept.safetensors": {"w": blob(True)}}, True),  # a frozen base
        ("ckpt-000000000001", {"model.kept.safetensors": {"w": blob(True), "v": blob(False)}}, False),
        ("ckpt-000000000001", {"model.safetensors": {"w": blob(True)}}, False),  # not a kept file
        ("ckpt-000000000001", {"model.kept.safetensors": {}}, False),  # nothing in it
        (
            "ckpt-000000000001",
            {"model.safetensors": {"w": blob(False)}, "model.kept.safetensors": {"b": blob(True)}},
            True,
        ),
    ],
)
def test_a_save_that_may_link_a_kept_file_is_told(previous: str | None, tensors: dict, links: bool) -> None:
    assert may_link_kept(Snapshot({}, tensors, previous=previous)) is links


@pytest.mark.parametrize(
    ("needed", "free", "headroom", "fits"),
    [
        (100 * MiB, 100 * MiB + MEMORY_MARGIN, None, True),  # exactly the margin to spare
        (100 * MiB, 100 * MiB + MEMORY_MARGIN - 1, None, False),  # the file system too small
        (100 * MiB, 10_000 * MiB, 100 * MiB + MEMORY_MARGIN, True),
        (100 * MiB, 10_000 * MiB, 100 * MiB + MEMORY_MARGIN - 1, False),  # the memory too small (a cgroup limit)
        (0, MEMORY_MARGIN, 0, False),
    ],
)
def test_what_fits_in_memory(needed: int, free: int, headroom: int | None, fits: bool) -> None:
    assert fits_in_memory(needed, free, headroom) is fits


def test_meminfo_available_in_bytes() -> None:
    text = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\nBuffers: 1 kB\n"
    assert parse_meminfo_available(text) == 2048 * 1024
    assert parse_meminfo_available("MemTotal: 1 kB\n") is None  # kernels before 3.14
    assert parse_meminfo_available("MemAvailable: lots kB\n") is None


@pytest.mark.parametrize(
    ("limit", "current", "room"),
    [("max\n", "1000\n", None), ("5000\n", "1000\n", 4000), ("1000", "5000", 0), ("", "", None)],
)
def test_a_cgroup_limit_leaves_room(limit: str, current: str, room: int | None) -> None:
    assert cgroup_room(limit, current) == room


def test_a_cgroups_inactive_page_cache_counts_as_room() -> None:
    # A pod limited to 8 GiB whose routine checkpoints left 6 GiB of page cache charged to it:
    # 7 GiB "used", but the kernel reclaims the inactive cache before it refuses memory.
    gib = 1 << 30
    stat = f"anon {gib}\nfile {6 * gib}\nactive_file {gib}\ninactive_file {5 * gib}\nshmem 0\n"
    assert cgroup_room(str(8 * gib), str(7 * gib)) == gib
    assert cgroup_room(str(8 * gib), str(7 * gib), stat) == 6 * gib
    assert cgroup_room(str(8 * gib), str(7 * gib), "inactive_file lots\n") == gib  # unreadable: not counted
    assert cgroup_room(str(8 * gib), str(gib), f"inactive_file {2 * gib}\n") == 8 * gib  # never beyond the limit


MOUNTS = """sysfs /sys sysfs rw 0 0
/dev/vda / ext4 rw,discard 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
/dev/vdb /data ext4 rw 0 0
tmpfs /data ext4 rw 0 0
/dev/vdc /data ext4 rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "memory"),
    [("/dev/shm", True), ("/", False), ("/data", False), ("/nowhere", False)],  # the last mount at /data wins
)
def test_a_memory_mount_is_found(path: str, memory: bool) -> None:
    assert is_memory_mount(MOUNTS, path) is memory
