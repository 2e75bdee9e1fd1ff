"""The images every real node has without a registry: ``pause`` and ``busybox``.

The sandbox image is a static ``pause`` built here (``gcc -static``), the test
image Debian's static busybox (a shell, ``nc``, ``sleep``: enough for pods
that talk TCP, trap signals and write termination messages). Both are written
as image archives (the ``docker save`` layout, one layer) and cached; each
node's containerd imports them (``ctr -n k8s.io images import``, a fraction of
a second). The project's own images come from a registry (``registry=``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

from testenv.realnode.config import BUSYBOX_IMAGE, PAUSE_IMAGE

#: kubelet's pause: PID 1 of the pod sandbox, reaps zombies, leaves on SIGINT/SIGTERM.
PAUSE_C = r"""
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void leave(int sig) { (void)sig; _exit(0); }
static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction term = {.sa_handler = leave}, child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
    sigaction(SIGINT, &term, NULL);
    sigaction(SIGTERM, &term, NULL);
    sigaction(SIGCHLD, &child, NULL);
    for (;;)
        pause();
    return 1;
}
"""

#: The busybox applets the test image links (busybox runs the one named by argv[0]).
BUSYBOX_APPLETS = ("sh", "nc", "sleep", "cat", "echo", "date", "ls", "kill", "hostname", "ip", "true", "env", "wc")
BUSYBOX = Path("/bin/busybox")


def _layer(files: dict[str, tuple[bytes, int]], links: dict[str, str]) -> bytes:
    """A layer tar: ``files`` (path -> (content, mode)) and symlinks (path -> target), directories made."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({str(Path(p).parent) for p in [*files, *links]} - {"."})
        for d in [*dirs, "tmp", "dev", "proc", "sys", "etc"]:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        for path, (data, mode) in sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
        for path, target in sorted(links.items()):
            info = tarfile.TarInfo(path)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buf.getvalue()


def image_archive(name: str, layer: bytes, entrypoint: list[str], cmd: list[str] | None = None) -> bytes:
    """Pure: an image archive (``docker save`` layout) of one layer, tagged ``name``."""
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint, "Cmd": cmd, "Env": ["PATH=/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [name], "Layers": ["layer.tar"]}]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, data in (
            (config_name, config_bytes),
            ("layer.tar", layer),
            ("manifest.json", json.dumps(manifest).encode()),
        ):
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


def _key(*parts: object) -> str:
    """A short name for what an archive is built from: a changed recipe builds a new archive."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]


def pause_archive(cache: Path) -> Path:
    """The pause image's archive, built once into ``cache``."""
    out = cache / f"pause-{_key(PAUSE_C, PAUSE_IMAGE)}.tar"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        src, binary = Path(tmp) / "pause.c", Path(tmp) / "pause"
        src.write_text(PAUSE_C)
        proc = subprocess.run(
            ["gcc", "-static", "-Os", "-o", str(binary), str(src)], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"building pause failed (needs gcc and libc6-dev): {proc.stderr.strip()}")
        layer = _layer({"pause": (binary.read_bytes(), 0o755)}, {})
    _write_atomically(out, image_archive(PAUSE_IMAGE, layer, ["/pause"]))
    return out


def busybox_archive(cache: Path) -> Path:
    """The test image's archive (static busybox with a few applets), built once into ``cache``."""
    if not BUSYBOX.exists():
        raise FileNotFoundError(f"{BUSYBOX} not found: install Debian's busybox-static (`make setup`)")
    out = (
        cache
        / f"busybox-{_key(BUSYBOX_APPLETS, BUSYBOX_IMAGE, BUSYBOX.stat().st_size, BUSYBOX.stat().st_mtime_ns)}.tar"
    )
    if out.exists():
        return out
    files = {"bin/busybox": (BUSYBOX.read_bytes(), 0o755)}
    links = {f"bin/{applet}": "busybox" for applet in BUSYBOX_APPLETS}
    _write_atomically(out, image_archive(BUSYBOX_IMAGE, _layer(files, links), [], ["sh"]))
    return out
