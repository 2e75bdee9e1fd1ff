"""The process node's image is the host's files: a volume mounted above them must not hide what containers run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from testenv.processnode.pod import IMAGE_PATHS, shadowed_image_paths

CHECKOUT = os.path.realpath(Path(__file__).resolve().parents[2])


def test_the_image_is_the_checkout_and_the_interpreters_environment() -> None:
    assert CHECKOUT in IMAGE_PATHS and os.path.realpath(sys.prefix) in IMAGE_PATHS


def test_a_volume_above_the_image_binds_it_back_read_only() -> None:
    parent = str(Path(CHECKOUT).parent)  # a checkout under /tmp, and spotguard's emptyDir at /tmp
    assert (CHECKOUT, CHECKOUT, True) in shadowed_image_paths([("/pods/x/tmp", parent, False)])


def test_volumes_beside_or_below_the_image_bind_nothing() -> None:
    assert shadowed_image_paths([("/pods/x/data", "/var/lib/spotguard", False)]) == []
    inside = [("/pods/x/cache", f"{CHECKOUT}/.cache", False)]
    assert (CHECKOUT, CHECKOUT, True) not in shadowed_image_paths(inside)
    assert (CHECKOUT, CHECKOUT, True) not in shadowed_image_paths([("/pods/x/same", CHECKOUT, False)])
