"""Both Dockerfile targets, built on a machine without a Docker engine or a registry.

The Dockerfile stays the one recipe: buildah (``buildah bud``) runs its own steps,
with two stand-ins passed as its build arguments:

- ``PYTHON_IMAGE``: a base made from Debian's packages (mmdebstrap: bookworm's
  python3, pip and venv) that behaves like ``python:3.11-slim`` (``python`` and
  ``pip`` on PATH, pip installs system-wide: Debian's EXTERNALLY-MANAGED marker
  is removed).
- ``TORCH_INDEX_URL``: a PEP 503 index of the CPU torch wheel (and its
  dependencies) as the host's pip resolves ``torch==TORCH_VERSION``, mounted into
  the build read-only: the build never reaches for a CUDA build of torch.

The host's CA bundle is mounted over the base's during the build (pip's TLS to
PyPI may be intercepted); it never becomes part of an image.

Everything is cached in ``$SPOTGUARD_CACHE/images`` (default
``~/.cache/spotguard/images``): the base by its recipe, buildah's layers in its
own storage there, and the built images in one OCI layout, each named by a hash of
what goes into it (the Dockerfile, pyproject.toml, README.md, spotguard/,
examples/, the base, the torch version). A build whose inputs are unchanged
costs well under a second.

    python -m testenv.images build                 # both targets; prints their names and OCI references
    python -m testenv.images push --registry registry.example.com/ml [--no-tls-verify]
    python -m testenv.images archive --out dist/images   # OCI archives for a release
    python -m testenv.registry --state-dir .dev/registry  # a local registry with both images, until Ctrl-C

For tests and other tools: :func:`build_all` gives one :class:`BuiltImage` per
target; ``testenv.registry`` runs a local registry on 127.0.0.1 and pushes them
(``testenv.pytest_images`` is the pytest fixture).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import html
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testenv.cluster import cache_dir, repo_root

TARGETS = ("spotguard", "spotguard-torch")
TORCH_VERSION = "2.13.0"
#: Where the torch index is mounted inside the build (the same path every build,
#: so that buildah's layer cache keys stay the same).
TORCH_INDEX_MOUNT = "/tmp/spotguard-torch-index"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-pip", "python3-venv", "python-is-python3", "ca-certificates", "passwd")
# python:3.11-slim's environment, as far as a build or a container reads it.
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
#: The inputs of an image, relative to the build context (besides the base and torch).
CONTEXT_INPUTS = ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "spotguard", "examples")
#: Builds kept per target: the most recently used few, so that switching branches back stays cheap.
KEEP_BUILDS = 2


class ImageBuildError(RuntimeError):
    """A step of an image build failed; the message says which and shows its output's end."""


def images_dir() -> Path:
    return cache_dir() / "images"


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise ImageBuildError(f"{name} is not installed: run `make setup` (or `bash testenv/provision.sh`)")
    return found


def _run(argv: list[str], what: str, timeout: float = 3600, **kwargs: object) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)  # type: ignore[call-overload]
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise ImageBuildError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    out: str = proc.stdout
    return out


def project_version(root: Path | None = None) -> str:
    data = tomllib.loads(((root or repo_root()) / "pyproject.toml").read_text())
    version: str = data["project"]["version"]
    return version


def repository(target: str) -> str:
    """The repository (without registry or tag) a target builds: its ``dev.spotguard.image`` label."""
    return f"spotguard/{target}"


# --- buildah and its storage ----------------------------------------------------------


@dataclass(frozen=True)
class Store:
    """buildah's image storage (its own, under the cache: the host's is left alone)."""

    root: Path
    driver: str = "overlay"

    @classmethod
    def default(cls) -> Store:
        return cls(images_dir() / "storage", os.environ.get("SPOTGUARD_IMAGES_DRIVER", "overlay"))

    def buildah(self, *args: str) -> list[str]:
        return [
            tool("buildah"),
            "--root",
            str(self.root / "root"),
            "--runroot",
            str(self.root / "run"),
            "--storage-driver",
            self.driver,
            *args,
        ]

    def remove(self) -> None:
        """Delete this storage: its mounts first (the overlay driver mounts its own directory
        onto itself, and a container's root while it runs), deepest first, then its files."""
        root = str(self.root.resolve())
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            point = line.split()[4].replace("\\040", " ")
            if point == root or point.startswith(root + "/"):
                subprocess.run(["umount", point], capture_output=True, check=False, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)

    def has_image(self, ref: str) -> bool:
        proc = subprocess.run(
            self.buildah("inspect", "--type", "image", ref), capture_output=True, text=True, check=False, timeout=60
        )
        return proc.returncode == 0

    def run(
        self, image: str, argv: list[str], *, timeout: float = 300, pull: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in a container of ``image`` (its user, working directory and environment)
        with no network: buildah's chroot isolation inside a network namespace of its own.
        ``pull``: ``image`` is a registry reference (``host:port/repo:tag``) pulled over plain HTTP."""
        source = f"docker://{image}" if pull else image
        opts = ["--tls-verify=false"] if pull else ["--pull-never"]
        ctr = _run(self.buildah("from", *opts, "--quiet", source), f"buildah from {image}", timeout=900).strip()
        try:
            return subprocess.run(
                [tool("unshare"), "--net", *self.buildah("run", "--isolation", "chroot", ctr, "--", *argv)],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        finally:
            subprocess.run(self.buildah("rm", ctr), capture_output=True, check=False, timeout=120)


# --- the stand-in for python:3.11-slim ------------------------------------------------


def base_key() -> str:
    recipe = json.dumps({"suite": SUITE, "packages": BASE_PACKAGES, "env": BASE_ENV, "variant": "minbase"})
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def _apt_sources() -> str:
    """The host's apt sources (its mirror, reachable from here), else Debian's own."""
    host = Path("/etc/apt/sources.list.d/debian.sources")
    return str(host) if host.is_file() else "http://deb.debian.org/debian"


def ensure_base(store: Store) -> str:
    """The base image's reference in ``store``; made (about 2 min) when missing."""
    key = base_key()
    ref = f"localhost/spotguard-testbase:{key}"
    if store.has_image(ref):
        return ref
    tarball = images_dir() / "base" / f"{key}.tar"
    if not tarball.is_file():
        tarball.parent.mkdir(parents=True, exist_ok=True)
        partial = tarball.with_suffix(".partial.tar")  # mmdebstrap picks its output format by the suffix
        _run(
            [
                tool("mmdebstrap"),
                "--variant=minbase",
                "--format=tar",
                "--include=" + ",".join(BASE_PACKAGES),
                # pip installs system-wide, as in python:3.11-slim (PEP 668's marker is Debian's).
                '--customize-hook=rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
                "--dpkgopt=path-exclude=/usr/share/doc/*",
                "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*",
                SUITE,
                str(partial),
                _apt_sources(),
            ],
            "mmdebstrap (the stand-in base image)",
            timeout=1800,
        )
        partial.rename(tarball)
    ctr = _run(store.buildah("from", "--quiet", "scratch"), "buildah from scratch").strip()
    try:
        _run(store.buildah("add", ctr, str(tarball), "/"), "buildah add (the base's root)")
        config = [arg for k, v in BASE_ENV.items() for arg in ("--env", f"{k}={v}")]
        _run(store.buildah("config", *config, "--cmd", '["python3"]', ctr), "buildah config (the base)")
        _run(store.buildah("commit", "--quiet", "--rm", ctr, ref), "buildah commit (the base)")
    except BaseException:
        subprocess.run(store.buildah("rm", ctr), capture_output=True, check=False, timeout=120)
        raise
    return ref


# --- the torch index ---------------------------------------------------------------------


def _project_name(filename: str) -> str:
    """A distribution file's project name, normalized as PEP 503 says."""
    name = filename.split("-", 1)[0]
    return "-".join(name.replace("_", "-").replace(".", "-").lower().split("-"))


def write_simple_index(directory: Path, files: Iterable[Path]) -> None:
    """A PEP 503 index in ``directory``: ``<project>/index.html`` linking its files (hard links
    beside it), read by pip from a ``file://`` URL."""
    projects: dict[str, list[Path]] = {}
    for f in files:
        projects.setdefault(_project_name(f.name), []).append(f)
    for project, found in projects.items():
        d = directory / project
        d.mkdir(parents=True, exist_ok=True)
        links = []
        for f in sorted(found):
            target = d / f.name
            if not target.exists():
                os.link(f, target)
            links.append(f'<a href="{html.escape(f.name.replace("+", "%2B"))}">{html.escape(f.name)}</a><br>')
        (d / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n")


def ensure_torch_index() -> Path:
    """A directory holding a PEP 503 index with ``torch==TORCH_VERSION`` as the host's pip
    resolves it (the CPU build) and its dependencies."""
    index = images_dir() / "torch-index" / TORCH_VERSION
    if (index / "complete").is_file():
        return index
    wheels = index.parent / f"{TORCH_VERSION}.wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--only-binary=:all:",
            "-d",
            str(wheels),
            f"torch=={TORCH_VERSION}",
        ],
        f"pip download torch=={TORCH_VERSION}",
        timeout=1800,
    )
    torch = [w for w in wheels.glob("torch-*.whl")]
    if not torch or any("+cpu" not in w.name for w in torch):
        raise ImageBuildError(f"pip resolved torch=={TORCH_VERSION} to {[w.name for w in torch]}, not the CPU build")
    write_simple_index(index, wheels.glob("*.whl"))
    (index / "complete").write_text(TORCH_VERSION)
    return index


# --- the images ------------------------------------------------------------------------------


def _hash_tree(h: hashlib._Hash, root: Path, rel: str) -> None:
    path = root / rel
    if path.is_file():
        h.update(f"{rel}\0{path.stat().st_mode & 0o111}\0".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    elif path.is_dir():
        for child in sorted(path.iterdir()):
            if child.name == "__pycache__" or child.suffix == ".pyc":
                continue  # left out of the build context by .dockerignore
            _hash_tree(h, root, f"{rel}/{child.name}")
    elif path.is_symlink():
        h.update(f"{rel}\0->{os.readlink(path)}".encode())


def content_key(target: str, context: Path, base: str) -> str:
    """A hash of everything that goes into ``target``'s image."""
    h = hashlib.sha256(f"{target}\0{base}\0torch=={TORCH_VERSION}\0".encode())
    for rel in CONTEXT_INPUTS:
        _hash_tree(h, context, rel)
    return h.hexdigest()[:16]


def snapshot_context(dest: Path, context: Path | None = None) -> Path:
    """A copy of the build context's inputs in ``dest``: a build of it sees one state of the files,
    however they change meanwhile."""
    context = context or repo_root()
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for rel in CONTEXT_INPUTS:
        src = context / rel
        if src.is_dir():
            shutil.copytree(src, dest / rel, symlinks=True, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, dest / rel)
    return dest


@dataclass(frozen=True)
class BuiltImage:
    """One built target: ``repository:tag`` (no registry), stored in the cache's OCI layout
    under the name ``<target>-<key>``."""

    target: str
    repository: str
    tag: str
    key: str
    layout: Path
    cached: bool = False
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.repository}:{self.tag}"

    @property
    def source(self) -> str:
        """The image as a containers-image reference (skopeo, buildah)."""
        return f"oci:{self.layout}:{self.target}-{self.key}"

    def ref(self, registry: str) -> str:
        """Its reference in ``registry`` (``host[:port][/prefix]``)."""
        return f"{registry.rstrip('/')}/{self.name}"


# One OCI layout holds every cached image: layers shared between builds are stored (and
# compressed) once, and a rebuild writes only its new layers.
REF_ANNOTATION = "org.opencontainers.image.ref.name"


def layout_refs(layout: Path) -> dict[str, dict[str, object]]:
    """The layout's images: name -> its manifest's descriptor."""
    index = layout / "index.json"
    if not index.is_file():
        return {}
    manifests: list[dict[str, Any]] = json.loads(index.read_text()).get("manifests", [])
    return {str(m.get("annotations", {}).get(REF_ANNOTATION)): m for m in manifests}


def _mark_used(layout: Path, name: str) -> dict[str, float]:
    uses_file = layout / "spotguard-uses.json"
    uses: dict[str, float] = json.loads(uses_file.read_text()) if uses_file.is_file() else {}
    uses[name] = time.time()
    uses_file.write_text(json.dumps(uses, indent=1))
    return uses


def prune_layout(layout: Path, target: str, uses: dict[str, float]) -> None:
    """Keep the ``KEEP_BUILDS`` most recently used images of ``target``; delete the blobs that no
    image of the layout references any more."""
    index_file = layout / "index.json"
    index = json.loads(index_file.read_text())
    mine = [n for n in layout_refs(layout) if n.startswith(f"{target}-") and n.count("-") == target.count("-") + 1]
    drop = set(sorted(mine, key=lambda n: uses.get(n, 0.0), reverse=True)[KEEP_BUILDS:])
    if not drop:
        return
    index["manifests"] = [m for m in index["manifests"] if m.get("annotations", {}).get(REF_ANNOTATION) not in drop]
    tmp = index_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(index))
    tmp.replace(index_file)
    blobs = layout / "blobs" / "sha256"
    keep: set[str] = set()
    for m in index["manifests"]:
        digest = m["digest"].split(":", 1)[1]
        keep.add(digest)
        manifest = json.loads((blobs / digest).read_text())
        keep.update(d["digest"].split(":", 1)[1] for d in [manifest["config"], *manifest["layers"]])
    for blob in blobs.iterdir():
        if blob.name not in keep:
            blob.unlink()


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    """One build at a time on this machine (parallel test workers share the cache)."""
    images_dir().mkdir(parents=True, exist_ok=True)
    with (images_dir() / "build.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def build(
    target: str, *, context: Path | None = None, store: Store | None = None, log: Path | None = None
) -> BuiltImage:
    """``target`` of the Dockerfile in ``context`` (the repository), from the cache when its inputs
    are unchanged. ``log`` receives the build's output (default: under the cache's ``logs``)."""
    if target not in TARGETS:
        raise ImageBuildError(f"unknown target {target!r}: the Dockerfile's images are {', '.join(TARGETS)}")
    with _build_lock():
        return _build(target, (context or repo_root()).resolve(), store or Store.default(), log)


def _build(target: str, context: Path, store: Store, log: Path | None) -> BuiltImage:
    started = time.monotonic()
    base = base_key()
    key = content_key(target, context, base)
    tag = project_version(context)
    layout = images_dir() / "layout"
    name = f"{target}-{key}"
    if name in layout_refs(layout):
        _mark_used(layout, name)
        return BuiltImage(target, repository(target), tag, key, layout, True, time.monotonic() - started)
    base_ref = ensure_base(store)
    local = f"localhost/{repository(target)}:{tag}"
    argv = store.buildah(
        "bud",
        "--isolation",
        "chroot",
        "--network",
        "host",
        "--layers",
        "--pull-never",
        "--build-arg",
        f"PYTHON_IMAGE={base_ref}",
        "--volume",
        f"{CA_BUNDLE}:{CA_BUNDLE}:ro",
        "--target",
        target,
        "--tag",
        local,
        "--file",
        str(context / "Dockerfile"),
    )
    if target == "spotguard-torch":
        index = ensure_torch_index()
        argv += [
            "--volume",
            f"{index}:{TORCH_INDEX_MOUNT}:ro",
            "--build-arg",
            f"TORCH_INDEX_URL=file://{TORCH_INDEX_MOUNT}",
        ]
    argv.append(str(context))
    log = log or images_dir() / "logs" / f"{target}-{key}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False, timeout=3600, cwd=context)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise ImageBuildError(f"buildah bud --target {target} failed (exit {proc.returncode}; log {log}):\n{tail}")
    layout.mkdir(parents=True, exist_ok=True)
    # Uncompressed: the layout then holds each layer under the digest buildah's storage knows it
    # by, so a rebuild writes only its new layers (the copies to a registry or an archive
    # compress them).
    push_argv = store.buildah(
        "push", "--quiet", "--disable-compression", "--format", "oci", local, f"oci:{layout}:{name}"
    )
    _run(push_argv, f"buildah push {local}")
    prune_layout(layout, target, _mark_used(layout, name))
    # The images of earlier builds, no longer tagged: their layers are freed, while the layers the
    # tagged images are built on stay as the cache of the next build.
    subprocess.run(store.buildah("rmi", "--prune"), capture_output=True, check=False, timeout=600)
    return BuiltImage(target, repository(target), tag, key, layout, False, time.monotonic() - started)


def build_all(targets: Iterable[str] = TARGETS, *, context: Path | None = None) -> dict[str, BuiltImage]:
    return {t: build(t, context=context) for t in targets}


def copy_image(source: str, dest: str, *, tls_verify: bool = True) -> None:
    """``skopeo copy`` from ``source`` to ``dest`` (containers-image references); layers are
    gzip-compressed on the way (a registry compresses by itself, an archive is told to)."""
    argv = [tool("skopeo"), "copy", "--quiet"]
    if dest.startswith("docker://"):
        argv.append(f"--dest-tls-verify={'true' if tls_verify else 'false'}")
    else:
        argv += ["--dest-compress", "--dest-compress-format", "gzip"]
    _run([*argv, source, dest], f"skopeo copy to {dest}", timeout=1800)


def push(images: Iterable[BuiltImage], registry: str, *, tls_verify: bool = True) -> list[str]:
    """Push each image to ``registry`` (``host[:port][/prefix]``) as ``<registry>/<repository>:<tag>``."""
    refs = []
    for img in images:
        copy_image(img.source, f"docker://{img.ref(registry)}", tls_verify=tls_verify)
        refs.append(img.ref(registry))
    return refs


def archive(images: Iterable[BuiltImage], out: Path) -> list[Path]:
    """One OCI archive per image in ``out`` (``<target>-<tag>.oci.tar``): `docker load`,
    `ctr images import` and `skopeo copy oci-archive:...` read it."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for img in images:
        path = out / f"{img.target}-{img.tag}.oci.tar"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        # The full name a node's runtime looks up for the chart's `spotguard/spotguard:<tag>`.
        copy_image(img.source, f"oci-archive:{path}:docker.io/{img.name}")
        paths.append(path)
    return paths


# --- command line ---------------------------------------------------------------------------


def report(images: dict[str, BuiltImage]) -> None:
    for img in images.values():
        how = "cached" if img.cached else "built"
        print(f"{img.name}  {img.source}  ({how} in {img.seconds:.1f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testenv.images", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, text in (
        ("build", "build (or find in the cache) the images"),
        ("push", "build, then push to REGISTRY as REGISTRY/spotguard/<image>:<version>"),
        ("archive", "build, then write OCI archives into OUT"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--target", action="append", choices=TARGETS, help="only this target (repeatable)")
        p.add_argument("--context", type=Path, help="the build context (default: this repository)")
        if name == "push":
            p.add_argument("--registry", required=True, help="host[:port][/prefix], e.g. registry.example.com/ml")
            p.add_argument("--no-tls-verify", action="store_true", help="plain HTTP or a self-signed registry")
        if name == "archive":
            p.add_argument("--out", default="dist/images")
    args = parser.parse_args(argv)
    try:
        images = build_all(args.target or TARGETS, context=args.context)
        report(images)
        if args.cmd == "push":
            for ref in push(images.values(), args.registry, tls_verify=not args.no_tls_verify):
                print(f"pushed {ref}", flush=True)
        elif args.cmd == "archive":
            for path in archive(images.values(), Path(args.out)):
                print(f"wrote {path}", flush=True)
    except ImageBuildError as exc:
        print(f"images: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
