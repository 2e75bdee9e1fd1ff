"""Both images built from the Dockerfile without a Docker engine, served by a registry on
127.0.0.1, pulled and run as a node would; the chart pointed at that registry; the release
artifacts.

The first session on a machine builds the images (minutes: testenv/images.py); later ones
find them in the cache by content.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testenv import chart
from testenv.cluster import repo_root
from testenv.images import (
    REF_ANNOTATION,
    TARGETS,
    TORCH_VERSION,
    BuiltImage,
    Store,
    build,
    content_key,
    ensure_base,
    layout_refs,
    project_version,
    prune_layout,
    snapshot_context,
    tool,
    write_simple_index,
)
from testenv.registry import Registry

# A cold build of both images takes several minutes; the fixtures build inside the first test.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

IMAGE_USER = "65532"


def image_config(source: str, *, tls_verify: bool = True) -> dict[str, Any]:
    """The OCI config of an image (``oci:...`` or ``docker://...``), as skopeo reads it."""
    argv = [tool("skopeo"), "inspect", "--config"]
    if source.startswith("docker://"):
        argv.append(f"--tls-verify={'true' if tls_verify else 'false'}")
    out = subprocess.run([*argv, source], capture_output=True, text=True, check=True, timeout=120).stdout
    config: dict[str, Any] = json.loads(out)["config"]
    return config


def test_both_targets_build_from_the_dockerfile_and_come_from_the_cache(
    built_images: dict[str, BuiltImage], image_context: Path
) -> None:
    assert sorted(built_images) == sorted(TARGETS)
    for target, img in built_images.items():
        config = image_config(img.source)
        # The label the Dockerfile's target sets: the image is that target's, not a second recipe's.
        assert config["Labels"]["dev.spotguard.image"] == f"spotguard/{target}"
        assert config["User"] == f"{IMAGE_USER}:{IMAGE_USER}"
        assert img.tag == project_version() and img.name == f"spotguard/{target}:{img.tag}"
        started = time.monotonic()
        again = build(target, context=image_context)
        assert again.cached and again.source == img.source, "unchanged inputs must come from the cache"
        assert time.monotonic() - started < 10
    assert built_images["spotguard"].source != built_images["spotguard-torch"].source


def _fake_layout(root: Path, images: dict[str, list[str]]) -> None:
    """An OCI layout whose images (name -> layer contents) share the blobs they have in common."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return f"sha256:{digest}"

    manifests = []
    for name, layers in images.items():
        manifest = {
            "config": {"digest": put(name.encode())},
            "layers": [{"digest": put(layer.encode())} for layer in layers],
        }
        manifests.append({"digest": put(json.dumps(manifest).encode()), "annotations": {REF_ANNOTATION: name}})
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))


def test_layout_keeps_the_most_recently_used_builds_and_the_blobs_they_share(tmp_path: Path) -> None:
    _fake_layout(
        tmp_path,
        {
            "spotguard-aaa": ["base", "old"],
            "spotguard-bbb": ["base", "mid"],
            "spotguard-ccc": ["base", "new"],
            "spotguard-torch-ddd": ["base", "torch"],
        },
    )
    uses = {"spotguard-aaa": 3.0, "spotguard-bbb": 1.0, "spotguard-ccc": 2.0, "spotguard-torch-ddd": 0.0}
    prune_layout(tmp_path, "spotguard", uses)
    assert sorted(layout_refs(tmp_path)) == ["spotguard-aaa", "spotguard-ccc", "spotguard-torch-ddd"]
    left = {p.read_bytes() for p in (tmp_path / "blobs" / "sha256").iterdir()}
    assert {b"base", b"old", b"new", b"torch"} <= left
    assert b"mid" not in left and b"spotguard-bbb" not in left


def test_content_key_follows_every_input(tmp_path: Path) -> None:
    for rel in ("Dockerfile", "pyproject.toml", "README.md", "spotguard/a.py", "examples/x.yaml"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    key = content_key("spotguard", tmp_path, "base1")
    assert content_key("spotguard", tmp_path, "base1") == key
    assert content_key("spotguard-torch", tmp_path, "base1") != key
    assert content_key("spotguard", tmp_path, "base2") != key
    # Bytecode is left out of the build context (.dockerignore), so it never changes the key.
    (tmp_path / "spotguard" / "__pycache__").mkdir()
    (tmp_path / "spotguard" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert content_key("spotguard", tmp_path, "base1") == key
    for rel in ("Dockerfile", "spotguard/a.py", "examples/x.yaml", "pyproject.toml"):
        before = (tmp_path / rel).read_text()
        (tmp_path / rel).write_text(before + "changed")
        assert content_key("spotguard", tmp_path, "base1") != key, rel
        (tmp_path / rel).write_text(before)
    # A session's snapshot of the context (bytecode left behind) is the same build.
    snap = snapshot_context(tmp_path / "snapshot" / "ctx", tmp_path)
    assert not (snap / "spotguard" / "__pycache__").exists()
    assert content_key("spotguard", snap, "base1") == key
    (tmp_path / "spotguard" / "b.py").write_text("")
    assert content_key("spotguard", tmp_path, "base1") != key


def test_simple_index_lists_each_project_for_pip(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "typing_extensions-4.16.0-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")
    index = tmp_path / "index"
    write_simple_index(index, wheels.glob("*.whl"))
    assert sorted(p.name for p in index.iterdir()) == ["torch", "typing-extensions"]
    assert 'href="torch-2.13.0%2Bcpu-cp311' in (index / "torch" / "index.html").read_text()
    assert (index / "typing-extensions" / "typing_extensions-4.16.0-py3-none-any.whl").is_file()


def test_stand_in_base_behaves_like_python_slim(built_images: dict[str, BuiltImage]) -> None:
    store = Store.default()
    base = ensure_base(store)
    script = (
        "import os, shutil, sys, sysconfig;"
        "print(sys.version_info[:2] == (3, 11), bool(shutil.which('pip')), bool(shutil.which('python')),"
        " os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')))"
    )
    proc = store.run(base, ["python", "-c", script])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "True", "False"]


def test_registry_serves_both_images(image_registry: Registry, built_images: dict[str, BuiltImage]) -> None:
    version = project_version()
    assert {f"spotguard/{t}" for t in TARGETS} <= set(image_registry.catalog())
    for target, img in built_images.items():
        assert image_registry.tags(f"spotguard/{target}") == [version]
        ref = image_registry.refs[target]
        assert ref == f"{image_registry.address}/spotguard/{target}:{version}"
        pulled = image_config(f"docker://{ref}", tls_verify=False)
        assert pulled == image_config(img.source), f"{ref} is not the image built for {target}"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Store]:
    """A node's empty image store: everything in it comes from the registry."""
    store = Store(tmp_path / "node")
    try:
        yield store
    finally:
        store.remove()


def test_operator_image_pulled_from_the_registry_runs_as_its_user(image_registry: Registry, node: Store) -> None:
    ref = image_registry.refs["spotguard"]
    proc = node.run(ref, ["spotguard", "--help"], pull=True)
    assert proc.returncode == 0, proc.stderr
    for command in ("operator", "sidecar", "restore"):
        assert command in proc.stdout
    ident = node.run(ref, ["id", "-u"])
    assert ident.stdout.strip() == IMAGE_USER, ident.stderr
    # No torch in the operator's image.
    assert node.run(ref, ["python", "-c", "import torch"]).returncode != 0


def test_trainer_image_pulled_from_the_registry_has_cpu_torch_and_the_examples(
    image_registry: Registry, node: Store
) -> None:
    ref = image_registry.refs["spotguard-torch"]
    script = (
        "import importlib.metadata as m, os, torch, spotguard;"
        "print(os.getuid(), torch.__version__, spotguard.__version__,"
        " sorted(d.metadata['Name'] for d in m.distributions() if d.metadata['Name'].lower().startswith('nvidia')),"
        " os.path.isfile('/opt/spotguard/examples/train.py'))"
    )
    proc = node.run(ref, ["python", "-c", script], pull=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [IMAGE_USER, f"{TORCH_VERSION}+cpu", project_version(), "[]", "True"]
    example = node.run(ref, ["python", "-m", "spotguard.demo.train", "--help"])
    assert example.returncode == 0, example.stderr


def _images(docs: list[dict[str, Any]]) -> list[str]:
    deployment = chart.one(docs, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return [container["image"], *(a.removeprefix("--image=") for a in container["command"] if a.startswith("--image="))]


def test_chart_image_registry_points_the_operator_and_its_pods_at_the_registry(image_registry: Registry) -> None:
    assert _images(chart.render()) == [f"spotguard/spotguard:{project_version()}"] * 2
    docs = chart.render(f"image.registry={image_registry.address}")
    assert _images(docs) == [image_registry.refs["spotguard"]] * 2
    # A sidecar image named in full stays as named.
    docs = chart.render(f"image.registry={image_registry.address}", "operator.sidecarImage=other/sidecar:1")
    assert _images(docs) == [image_registry.refs["spotguard"], "other/sidecar:1"]


@pytest.mark.parametrize("bad", ["registry.example.com/", "/ml", "a b"])
def test_chart_takes_a_registry_and_refuses_a_malformed_one(bad: str) -> None:
    for good in ("registry.example.com/ml", "127.0.0.1:5000"):
        docs = chart.render(f"image.registry={good}")
        assert _images(docs)[0] == f"{good}/spotguard/spotguard:{project_version()}"
    proc = chart.helm("template", "rel", str(chart.CHART), "--set", f"image.registry={bad}", check=False)
    assert proc.returncode != 0 and "registry" in proc.stderr


def test_release_makes_checked_python_distributions_and_the_chart(tmp_path: Path) -> None:
    from testenv.release import release

    out = tmp_path / "dist"
    made = release(out, images=False)
    version = project_version()
    names = sorted(p.name for p in made)
    assert names == sorted(
        [f"spotguard-{version}-py3-none-any.whl", f"spotguard-{version}.tar.gz", f"spotguard-{version}.tgz"]
    ), names
    with zipfile.ZipFile(out / f"spotguard-{version}-py3-none-any.whl") as whl:
        files = whl.namelist()
    assert "spotguard/cli.py" in files and not any(f.startswith(("tests/", "testenv/")) for f in files)
    # The packaged chart installs from the file a user downloads.
    rendered = chart.helm("template", "rel", str(out / f"spotguard-{version}.tgz")).stdout
    assert f"image: spotguard/spotguard:{version}" in rendered


def test_release_images_are_oci_archives_of_both_targets(built_images: dict[str, BuiltImage], tmp_path: Path) -> None:
    from testenv.images import archive

    paths = archive(built_images.values(), tmp_path)
    for path, (target, img) in zip(paths, built_images.items(), strict=True):
        assert path.name == f"{target}-{img.tag}.oci.tar"
        assert image_config(f"oci-archive:{path}") == image_config(img.source)


def test_images_cli_reports_both_from_the_cache(built_images: dict[str, BuiltImage], image_context: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "testenv.images", "build", "--context", str(image_context)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        cwd=repo_root(),
    )
    assert proc.returncode == 0, proc.stderr
    for img in built_images.values():
        assert f"{img.name}  {img.source}  (cached" in proc.stdout
