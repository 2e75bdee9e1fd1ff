"""Release artifacts, made from a fresh clone of a commit (default ``HEAD``): nothing that is
not committed gets in.

    python -m testenv.release --out dist [--rev v0.1.0] [--no-images]

Writes into ``--out``: the wheel and the sdist (``python -m build``, then
``twine check --strict``), the packaged Helm chart (``helm package``), and both
images as OCI archives under ``images/`` (``testenv.images``: built from the
clone's Dockerfile, cached by content). ``make release`` runs it; README.md
("Building and installing on a real cluster") says what to do with them.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from testenv.images import ImageBuildError, archive, build_all, report
from testenv.require import require_tool


class ReleaseError(RuntimeError):
    """A release step failed; the message names it."""


def _run(argv: list[str], what: str, cwd: Path | None = None) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=1800, cwd=cwd)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise ReleaseError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def clone(rev: str, dest: Path, repo: Path) -> Path:
    """A fresh clone of ``repo`` at ``rev`` in ``dest``."""
    _run(["git", "clone", "--quiet", "--no-checkout", str(repo), str(dest)], "git clone")
    _run(["git", "-C", str(dest), "checkout", "--quiet", "--detach", rev], f"git checkout {rev}")
    return dest


def python_dists(src: Path, out: Path) -> list[Path]:
    """The sdist and the wheel of ``src``, checked by ``twine check --strict``."""
    for old in [*out.glob("spotguard-*.whl"), *out.glob("spotguard-*.tar.gz")]:
        old.unlink()
    _run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(src)], "python -m build")
    dists = sorted([*out.glob("spotguard-*.whl"), *out.glob("spotguard-*.tar.gz")])
    if len(dists) != 2:
        raise ReleaseError(f"python -m build made {[d.name for d in dists]}, not one wheel and one sdist")
    _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dists)], "twine check")
    return dists


def chart(src: Path, out: Path, helm: str) -> Path:
    """The chart of ``src``, packaged (``spotguard-<version>.tgz``)."""
    for old in out.glob("spotguard-*.tgz"):
        old.unlink()
    _run([helm, "lint", str(src / "charts" / "spotguard")], "helm lint")
    _run([helm, "package", str(src / "charts" / "spotguard"), "--destination", str(out)], "helm package")
    (packaged,) = out.glob("spotguard-*.tgz")
    return packaged


def release(out: Path, *, rev: str = "HEAD", images: bool = True, repo: Path | None = None) -> list[Path]:
    """Every release artifact of ``rev`` in ``out``; returns their paths."""
    from testenv.cluster import bin_dir, repo_root

    helm = require_tool("helm", path=bin_dir() / "helm")
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="spotguard-release-") as tmp:
        src = clone(rev, Path(tmp) / "src", repo or repo_root())
        made = python_dists(src, out)
        made.append(chart(src, out, helm))
        if images:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(out / "images")
            built = build_all(context=src)
            report(built)
            made += archive(built.values(), out / "images")
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testenv.release", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="dist")
    parser.add_argument("--rev", default="HEAD", help="the commit to release (default HEAD)")
    parser.add_argument("--no-images", action="store_true", help="only the Python distributions and the chart")
    args = parser.parse_args(argv)
    try:
        for path in release(Path(args.out), rev=args.rev, images=not args.no_images):
            print(f"wrote {path}", flush=True)
    except (ReleaseError, ImageBuildError) as exc:
        print(f"release: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
