"""Pytest plugin: the project's two images, built from the Dockerfile, in a registry on 127.0.0.1.

Registered by ``tests/conftest.py`` (``pytest_plugins``).

- ``built_images``: ``{"spotguard": BuiltImage, "spotguard-torch": BuiltImage}``, built from a
  copy of the repository's files taken at the session's first use (``image_context``) by
  ``testenv.images`` (cached by content: seconds when nothing changed, a cold build of both
  takes minutes).
- ``image_registry``: a ``testenv.registry.Registry`` of the session with both images pushed:
  ``image_registry.address`` (``127.0.0.1:PORT``, the chart's ``image.registry``) and
  ``image_registry.refs`` (target -> ``127.0.0.1:PORT/spotguard/<target>:<version>``). It is
  stopped with the session's other services.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testenv.images import BuiltImage, build_all, snapshot_context
from testenv.registry import Registry, start_registry
from testenv.require import require_root, require_tool

HINT = "run `make setup` (it installs buildah, mmdebstrap, skopeo and docker-registry)"


@pytest.fixture(scope="session")
def image_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The build context of the session's images: a copy of the repository's inputs taken once,
    so that the images and the tests see the same files while the working tree changes."""
    return snapshot_context(tmp_path_factory.mktemp("image-context"))


@pytest.fixture(scope="session")
def built_images(image_context: Path) -> dict[str, BuiltImage]:
    for name in ("buildah", "mmdebstrap", "skopeo", "unshare"):
        require_tool(name, HINT)
    require_root("building images with buildah (chroot isolation)")
    return build_all(context=image_context)


@pytest.fixture(scope="session")
def image_registry(built_images: dict[str, BuiltImage], testenv_supervisor: Any) -> Iterator[Registry]:
    require_tool("docker-registry", HINT)
    reg = start_registry(testenv_supervisor)
    reg.push_images(built_images.values())
    yield reg
