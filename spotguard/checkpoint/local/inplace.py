"""Loading a local checkpoint into the tensors a trainer already has, and what a fresh verification vouches for.

Loading used to read each safetensors file into new tensors that ``load_state_dict``
then copied into the model's parameters: every byte copied twice, the first time into
new memory, each page of which the kernel must find and zero. :func:`load_state_into`
reads each tensor's bytes from the file straight into the live tensor at the same place
of the state (the model's parameter, the optimizer's moment) where that is a CPU tensor
of the same dtype and shape, contiguous: one copy, into memory the trainer already has.
``load_state_dict`` then finds that very memory and copies nothing (torch skips a copy
onto the same data). Any other tensor (a shape that changed, a model on a GPU, an
optimizer before its first step) is read into a new tensor, one copy, as before.

Everything that can be refused is checked before the first byte lands: ``state.json``,
every file's header, every tensor ``state.json`` names. What can still fail after that
(an I/O error, a file cut short while it is read) raises :class:`PartlyLoaded`: the live
tensors hold part of the checkpoint, so the caller must neither walk back to an older
checkpoint nor start fresh with them.

A verification vouches for a local checkpoint while its files are the ones it read
(:func:`file_stamps`: each file's inode, size, modification and change times, the
manifest's too). ``spotguard run`` records the stamps of what it verified in the control
directory (:func:`spotguard.contract.control.write_verified_local`); a trainer that finds
every stamp unchanged (:func:`vouched`) does not checksum those bytes again. Any write
to a file, a rename over it, a new link or a truncation changes its change time, which no
process can set back (only the kernel's clock moves it), so a file that changed after the
verification is checksummed again, as before.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from spotguard.checkpoint.format.manifest import MANIFEST_NAME, Manifest
from spotguard.checkpoint.local.codec import (
    ST_TO_TORCH,
    STATE_FILE,
    TAG,
    StateError,
    TensorSpan,
    decode_state,
    parse_safetensors_header,
    safetensors_header_end,
)

#: Bytes of one read from a file into a tensor (the reads release the GIL).
READ_PIECE = 64 << 20
#: Threads reading pieces at once (copies from the page cache; memory bandwidth, not the disk).
READ_WORKERS = 2


class PartlyLoaded(RuntimeError):
    """Loading failed after some live tensors had received checkpoint bytes: they hold neither
    the state before nor the checkpoint's (restart the process; never train on with them)."""


# -- vouching ------------------------------------------------------------------------------


def file_stamps(path: Path, manifest: Manifest) -> dict[str, list[int]]:
    """What identifies the very files of local checkpoint ``path`` now: manifest and every
    file it lists -> ``[inode, size, mtime_ns, ctime_ns]``. Raises OSError for a missing file."""
    out: dict[str, list[int]] = {}
    for rel in (MANIFEST_NAME, *(e.path for e in manifest.files)):
        st = os.stat(Path(path) / rel, follow_symlinks=False)
        out[rel] = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    return out


def vouched(path: Path, manifest: Manifest, stamps: Mapping[str, Any] | None) -> bool:
    """Whether ``stamps`` (recorded by whoever verified ``path``) name exactly the manifest
    and files of ``path`` as they are now: then their bytes are the ones that verified."""
    if not stamps:
        return False
    try:
        now = file_stamps(path, manifest)
    except OSError:
        return False
    return set(now) == set(stamps) and all(list(stamps[k]) == v for k, v in now.items())


# -- where each tensor goes ------------------------------------------------------------------


def _key_of(encoded: Any) -> Any:
    """A dict key as state.json encodes it (numbers, strings, tuples of them); None when it is
    anything else (such a key is not matched)."""
    if isinstance(encoded, str | int | float | bool):
        return encoded
    if isinstance(encoded, dict) and encoded.get(TAG) == "tuple" and isinstance(encoded.get("v"), list):
        parts = [_key_of(v) for v in encoded["v"]]
        return None if any(p is None for p in parts) else tuple(parts)
    return None


def live_places(doc_state: Any, live: Any) -> dict[tuple[str, str], Any]:
    """Pure: ``(file, key) -> leaf of live`` for each tensor ``state.json``'s tree
    (``doc_state``) references, where ``live`` (a tree of the same shape: the trainer's
    ``{"model": model.state_dict(), ...}``) has a leaf at the same path."""
    out: dict[tuple[str, str], Any] = {}

    def walk(enc: Any, value: Any) -> None:
        if isinstance(enc, list):
            if isinstance(value, list | tuple):
                for e, v in zip(enc, value, strict=False):
                    walk(e, v)
            return
        if not isinstance(enc, dict):
            return
        tag = enc.get(TAG)
        if tag is None:
            if isinstance(value, Mapping):
                for k, e in enc.items():
                    if k in value:
                        walk(e, value[k])
        elif tag in ("dict", "odict"):
            if isinstance(value, Mapping) and isinstance(enc.get("v"), list):
                for item in enc["v"]:
                    if isinstance(item, list) and len(item) == 2:
                        k = _key_of(item[0])
                        if k is not None and k in value:
                            walk(item[1], value[k])
        elif tag == "tuple":
            walk(enc.get("v"), value)
        elif tag == "tensor" and isinstance(enc.get("file"), str) and isinstance(enc.get("key"), str):
            out[(enc["file"], enc["key"])] = value

    walk(doc_state, live)
    return out


def fits_in_place(torch: Any, target: Any, dtype: Any, shape: tuple[int, ...]) -> bool:
    """Whether the bytes of a tensor of ``dtype`` and ``shape`` can be read straight into ``target``."""
    return (
        isinstance(target, torch.Tensor)
        and target.device.type == "cpu"
        and target.dtype == dtype
        and tuple(target.shape) == shape
        and target.layout == torch.strided
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
    )


class _File:
    """One safetensors file whose header is read and checked: where each of its tensors goes."""

    def __init__(self, torch: Any, path: Path, targets: Mapping[str, Any]) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(self.fd).st_size
            end = safetensors_header_end(os.pread(self.fd, 8, 0), size)
            header = os.pread(self.fd, end - 8, 8)
            if len(header) != end - 8:
                raise StateError(f"{end - 8}-byte header cut short")
            spans = parse_safetensors_header(header, size)
            self.tensors: dict[str, Any] = {}
            self.places: list[tuple[TensorSpan, Any]] = []
            self.in_place = 0
            for span in spans:
                name = ST_TO_TORCH.get(span.dtype)
                dtype = getattr(torch, name) if name else None
                if dtype is None:
                    raise StateError(f"tensor {span.key!r}: dtype {span.dtype} is not available in this torch")
                target = targets.get(span.key)
                if target is not None and fits_in_place(torch, target, dtype, span.shape):
                    self.tensors[span.key] = target  # the live tensor itself: load_state_dict finds it
                    self.places.append((span, target.detach()))
                    self.in_place += span.end - span.start
                else:
                    t = torch.empty(span.shape, dtype=dtype)
                    self.tensors[span.key] = t
                    self.places.append((span, t))
        except StateError as exc:
            os.close(self.fd)
            raise StateError(f"{path.name}: not a valid safetensors file ({exc})") from None
        except BaseException:  # the descriptor closed on any exit, an interrupt too; raised again
            os.close(self.fd)
            raise

    def pieces(self, torch: Any) -> list[tuple[_File, Any, int, int]]:
        """What to read: ``(file, flat byte view of the tensor's memory, its offset in the
        file, bytes)``, at most :data:`READ_PIECE` bytes each."""
        out: list[tuple[_File, Any, int, int]] = []
        for span, t in self.places:
            n = span.end - span.start
            if not n:
                continue
            flat = t.reshape(-1).view(torch.uint8).numpy()
            for at in range(0, n, READ_PIECE):
                out.append((self, flat[at : min(n, at + READ_PIECE)], span.start + at, min(READ_PIECE, n - at)))
        return out

    def read_into(self, view: Any, offset: int, n: int) -> None:
        """Read ``n`` bytes at ``offset`` into ``view`` (:class:`PartlyLoaded` on failure)."""
        at = 0
        try:
            while at < n:
                got = os.preadv(self.fd, [view[at:]], offset + at)
                if got <= 0:
                    raise OSError(errno.EIO, f"ends at byte {offset + at} while read")
                at += got
        except OSError as exc:
            raise PartlyLoaded(f"{self.path.name}: unreadable while loaded in place ({exc})") from exc

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = -1


def load_state_into(path: Path, manifest: Manifest, live: Any) -> tuple[dict[str, Any], int]:
    """The state of local checkpoint ``path`` (its ``state.json`` and the safetensors files
    it references, only files its ``manifest`` lists), each tensor read straight into the
    leaf at the same place of ``live`` where it fits (see the module's docstring), else into
    a new tensor. Returns the state (whose fitting leaves are ``live``'s own tensors) and the
    bytes read in place. Raises :class:`StateError` before any live tensor is written,
    :class:`PartlyLoaded` after."""
    import torch

    path = Path(path)
    listed = {f.path for f in manifest.files}
    if STATE_FILE not in listed:
        raise StateError(f"{path.name}: no {STATE_FILE}")
    try:
        doc = json.loads((path / STATE_FILE).read_bytes())
    except (OSError, ValueError) as exc:
        raise StateError(f"{STATE_FILE}: unreadable ({exc})") from None
    places = live_places(doc.get("state") if isinstance(doc, dict) else None, live)
    wanted: list[str] = []

    def note(name: str, as_torch: bool) -> Mapping[str, Any]:
        if name not in listed or not name.endswith(".safetensors"):
            raise StateError(f"state.json references {name!r}, which is not a safetensors file of this checkpoint")
        if name not in wanted:
            wanted.append(name)
        return _Any()

    decode_state(doc, note)  # refuses a bad document before anything is read
    files: dict[str, _File] = {}
    try:
        for name in wanted:
            targets = {key: t for (file, key), t in places.items() if file == name}
            files[name] = _File(torch, path / name, targets)
        loaded = {name: f.tensors for name, f in files.items()}

        def load_file(name: str, as_torch: bool) -> Mapping[str, Any]:
            tensors = loaded[name]
            return tensors if as_torch else {k: t.numpy() for k, t in tensors.items()}

        state = decode_state(doc, load_file)  # every referenced key exists: checked before any byte lands
    except BaseException:  # every descriptor closed on any exit, an interrupt too; raised again
        for f in files.values():
            f.close()
        raise
    _read_all(torch, list(files.values()))
    return state, sum(f.in_place for f in files.values())


def _read_all(torch: Any, files: list[_File]) -> None:
    """Read every file's tensors into place, in pieces spread over :data:`READ_WORKERS` threads
    (a large optimizer file is not left to one of them); the files are closed afterwards."""
    try:
        pieces = [p for f in files for p in f.pieces(torch)]
        if len(pieces) <= 1:
            for f, view, offset, n in pieces:
                f.read_into(view, offset, n)
            return
        with ThreadPoolExecutor(max_workers=min(READ_WORKERS, len(pieces)), thread_name_prefix="load-in-place") as pool:
            for _ in pool.map(lambda p: p[0].read_into(p[1], p[2], p[3]), pieces):
                pass
    finally:
        for f in files:
            f.close()


class _Any(Mapping[str, Any]):
    """A file's tensors before the file is read: every key is there (checked once the headers are read)."""

    def __getitem__(self, key: str) -> Any:
        return None

    def __contains__(self, key: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


__all__ = ["PartlyLoaded", "file_stamps", "fits_in_place", "live_places", "load_state_into", "vouched"]
