"""The tensors of checkpoints in storage: which to read, and reading them checked.

``spotguard ckpt export`` and ``spotguard ckpt average`` read tensors from
checkpoints that verify (:func:`named_verified`, :func:`best_verified` by a
recorded metric, :func:`last_verified`), from files checked again as they
stream in (size, checksum, pickle safety; :func:`fetch_files`). Nothing is
unpickled: tensors are read from safetensors files, and from DCP's data files
by :func:`spotguard.checkpoint.format.dcp.load_full_state`. A checkpoint holds a
state part in one of three layouts (:func:`layout_of`): a spotguard state's
``<part>.safetensors``, a distributed checkpoint's DCP files, or a Hugging
Face model folder's weights (:mod:`~spotguard.checkpoint.format.hf_folder` names
them). What becomes of the tensors is :mod:`~spotguard.checkpoint.tools.export`'s
business (or the average command's).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from spotguard.checkpoint.format.hf_folder import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    ExportError,
    index_weight_files,
)
from spotguard.checkpoint.format.manifest import DCP_DIR, DCP_METADATA, Manifest, ManifestError
from spotguard.checkpoint.local.codec import KEPT_SUFFIX, STATE_FILE
from spotguard.checkpoint.restore.fetch import fetch_chunks, fetch_verified
from spotguard.checkpoint.store.stored import CheckpointCorruptError, list_checkpoint_names, read_manifest, stored_files
from spotguard.checkpoint.store.verify_stored import verify_checkpoint
from spotguard.storage.base import NotFoundError, Storage

if TYPE_CHECKING:
    import torch

DCP_METADATA_PATH = f"{DCP_DIR}/{DCP_METADATA}"

#: How a checkpoint holds the tensors of a state part (:func:`layout_of`).
LAYOUT_DCP = "dcp"
LAYOUT_STATE = "state"
LAYOUT_FOLDER = "folder"


class ProgressBar(Protocol):
    """What a download reports its bytes to (``spotguard.progress.ByteProgress``)."""

    done: int

    def __call__(self, n: int) -> None: ...

    def close(self) -> None: ...


#: ``bars(total_bytes, label)``: a progress bar for one download.
BarFactory = Callable[[int, str], ProgressBar]


class _Silent:
    def __init__(self) -> None:
        self.done = 0

    def __call__(self, n: int) -> None:
        self.done += n

    def close(self) -> None:
        pass


def silent(total: int, label: str) -> ProgressBar:
    """A progress bar that shows nothing."""
    return _Silent()


def quiet_note(message: str) -> None:
    """A ``note`` callback that shows nothing (the default; the CLI prints its notes)."""


# -- which checkpoints -------------------------------------------------------------------


def best_first(candidates: Iterable[tuple[str, int, Mapping[str, float | None]]], metric: str, mode: str) -> list[str]:
    """Pure: names of the checkpoints ``(name, step, metrics)`` that record
    ``metric``, best first (lowest for ``min``, highest for ``max``); ties go
    to the newer one, as in retention's ``keep_best``. Checkpoints without the
    metric (or with a non-finite value) are left out."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    scored = []
    for name, step, metrics in candidates:
        value = metrics.get(metric)
        if value is not None and math.isfinite(value):
            scored.append((value if mode == "min" else -value, -step, name))
    return [name for _, _, name in sorted(scored)]


def verified(storage: Storage, names: Iterable[str], note: Callable[[str], None] = quiet_note) -> Iterator[Manifest]:
    """The manifests of the checkpoints in ``names`` that verify, in that
    order; each one passed over is reported to ``note`` with the reason."""
    for name in names:
        result = verify_checkpoint(storage, name)
        if result.ok and result.manifest is not None:
            yield result.manifest
        else:
            note(f"skipped {name}: {result.reason}")


def last_verified(
    storage: Storage, count: int, part: str, *, flag: str, note: Callable[[str], None] = quiet_note
) -> list[Manifest]:
    """The ``count`` newest verified checkpoints (newest first), each holding
    state part ``part``; ``flag`` names the option that asked, for the error
    when there are fewer."""
    chosen: list[Manifest] = []
    for manifest in verified(storage, reversed(list_checkpoint_names(storage)), note):
        layout_of(manifest, part)
        chosen.append(manifest)
        if len(chosen) == count:
            break
    if len(chosen) < count:
        raise ExportError(f"only {len(chosen)} verified checkpoint(s) at {storage.uri}; {flag} {count} needs more")
    return chosen


def named_verified(storage: Storage, name: str) -> Manifest:
    """The manifest of checkpoint ``name``, which must verify."""
    result = verify_checkpoint(storage, name)
    if not result.ok or result.manifest is None:
        raise ExportError(
            f"{name} does not verify, refusing to export it: {result.reason} "
            f"(`spotguard ckpt ls {storage.uri}` shows which checkpoints do)"
        )
    return result.manifest


def best_verified(storage: Storage, metric: str, mode: str, note: Callable[[str], None] = quiet_note) -> Manifest:
    """The verified checkpoint with the best recorded ``metric`` (see :func:`best_first`)."""
    candidates: list[tuple[str, int, Mapping[str, float | None]]] = []
    recorded: set[str] = set()
    for name in list_checkpoint_names(storage):
        try:
            manifest = read_manifest(storage, name)
        except (NotFoundError, ManifestError) as exc:
            note(f"skipped {name}: no readable manifest ({exc})")
            continue
        recorded.update(manifest.metrics)
        candidates.append((name, manifest.step, manifest.metrics))
    order = best_first(candidates, metric, mode)
    if not order:
        raise ExportError(
            f"no checkpoint at {storage.uri} records the metric {metric!r} "
            f"(recorded: {', '.join(sorted(recorded)) or 'none'})"
        )
    for manifest in verified(storage, order, note):
        return manifest
    raise ExportError(f"no checkpoint at {storage.uri} that records {metric!r} verifies")


# -- how a checkpoint holds a state part, and reading it -----------------------------------


def layout_of(manifest: Manifest, part: str) -> str:
    """How ``manifest``'s checkpoint holds state part ``part``:
    :data:`LAYOUT_DCP` (a distributed checkpoint's DCP files),
    :data:`LAYOUT_STATE` (``<part>.safetensors`` of a spotguard state) or
    :data:`LAYOUT_FOLDER` (a Hugging Face model folder's weights); raises
    :class:`ExportError` naming what is missing."""
    paths = {f.path for f in manifest.files}
    part_file = f"{part}.safetensors"
    has_part = bool(state_part_files(paths, part))
    if manifest.sharding is not None and DCP_METADATA_PATH in paths:
        return LAYOUT_DCP
    if STATE_FILE in paths and has_part:
        return LAYOUT_STATE
    if STATE_FILE not in paths and (SAFE_WEIGHTS_NAME in paths or SAFE_WEIGHTS_INDEX_NAME in paths):
        if part != "model":
            raise ExportError(
                f"{manifest.name} is a Hugging Face model folder: its weights are its only state "
                "part (leave --part at model)"
            )
        return LAYOUT_FOLDER
    if manifest.sharding is not None:
        raise ExportError(f"{manifest.name} is a distributed checkpoint without {DCP_METADATA_PATH}")
    if has_part:
        return LAYOUT_STATE
    raise ExportError(
        f"{manifest.name} has no {part_file} (choose the state part with --part) and is not a "
        f"Hugging Face model folder (no {SAFE_WEIGHTS_NAME})"
    )


def state_part_files(paths: Iterable[str], part: str) -> list[str]:
    """Pure: the files of a spotguard state that hold part ``part``'s tensors: ``<part>.safetensors``
    and ``<part>.kept.safetensors`` (those unchanged since the save before), whichever exist."""
    present = set(paths)
    return [f for f in (f"{part}.safetensors", f"{part}{KEPT_SUFFIX}") if f in present]


def describe_part(layout: str, part: str) -> str:
    """Pure: how messages name the tensors of ``part`` in a checkpoint of ``layout``."""
    if layout == LAYOUT_DCP:
        return f"state part {part!r}"
    if layout == LAYOUT_FOLDER:
        return "the model weights"
    return f"{part}.safetensors"


def fetch_files(
    storage: Storage, manifest: Manifest, paths: Iterable[str], dest: Path, bars: BarFactory = silent
) -> None:
    """Download some files of a checkpoint into ``dest`` (relative paths kept),
    each checked against ``manifest`` as it streams in (size, checksum, pickle
    safety), also from a checkpoint stored incrementally. Raises
    :class:`CheckpointCorruptError` naming a file that does not match;
    ``dest`` may then hold partial files (a scratch directory)."""
    wanted = set(paths)
    entries = tuple(f for f in manifest.files if f.path in wanted)
    unknown = sorted(wanted - {e.path for e in entries})
    if unknown:
        raise ExportError(f"{manifest.name} has no {unknown[0]}")
    subset = dataclasses.replace(manifest, files=entries)
    bar = bars(sum(e.size for e in entries), f"fetching {manifest.name}")
    try:
        if manifest.chunked:
            problems = fetch_chunks(storage, subset, dest, progress=bar)
        else:
            listing = stored_files(storage, manifest.name)
            sizes = {path: o.size for path, o in listing.items()}
            problems = fetch_verified(storage, manifest.name, subset, sizes, dest, progress=bar, seen=listing)
    finally:
        if bar.done:
            bar.close()
    if problems:
        raise CheckpointCorruptError(manifest.name, problems)


def part_tensors(
    storage: Storage, manifest: Manifest, scratch: Path, part: str, bars: BarFactory = silent
) -> dict[str, torch.Tensor]:
    """The tensors of state part ``part`` of a verified checkpoint, whole (a
    distributed checkpoint's nested keys joined with ``.``), downloaded into
    ``scratch`` (removed afterwards) and checked on the way."""
    from spotguard.checkpoint.local.codec import load_safetensors

    layout = layout_of(manifest, part)
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        if layout == LAYOUT_DCP:
            return _dcp_part_tensors(storage, manifest, scratch, part, bars)
        if layout == LAYOUT_STATE:
            files = state_part_files((f.path for f in manifest.files), part)
        elif SAFE_WEIGHTS_INDEX_NAME in {f.path for f in manifest.files}:
            fetch_files(storage, manifest, [SAFE_WEIGHTS_INDEX_NAME], scratch, bars)
            try:
                doc = json.loads((scratch / SAFE_WEIGHTS_INDEX_NAME).read_bytes())
            except ValueError as exc:
                raise ExportError(f"{manifest.name}/{SAFE_WEIGHTS_INDEX_NAME}: not JSON ({exc})") from None
            files = index_weight_files(doc)
        else:
            files = [SAFE_WEIGHTS_NAME]
        fetch_files(storage, manifest, files, scratch, bars)
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(load_safetensors(scratch / file, as_torch=True))
            (scratch / file).unlink()
        return tensors
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _dcp_part_tensors(
    storage: Storage, manifest: Manifest, scratch: Path, part: str, bars: BarFactory
) -> dict[str, torch.Tensor]:
    import torch

    from spotguard.checkpoint.format.dcp import load_full_state

    fetch_files(storage, manifest, [f.path for f in manifest.files if f.path.startswith(f"{DCP_DIR}/")], scratch, bars)
    state = load_full_state(scratch / DCP_DIR)
    if part not in state:
        raise ExportError(
            f"{manifest.name} has no state part {part!r} (it has {', '.join(sorted(state))}; choose it with --part)"
        )
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value.detach().contiguous()
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)

    walk("", state[part])
    if not flat:
        raise ExportError(f"{manifest.name}: state part {part!r} holds no tensors")
    return flat


def average_tensors(
    storage: Storage, manifests: Sequence[Manifest], part: str, scratch: Path, bars: BarFactory = silent
) -> dict[str, torch.Tensor]:
    """The element-wise mean of state part ``part`` over ``manifests`` (newest
    first), computed in float64 and stored in each tensor's own dtype; integer
    tensors (step counters, masks) are taken from the newest checkpoint.
    Every checkpoint must hold the same tensor names."""
    import torch

    sums: dict[str, torch.Tensor | None] = {}
    newest: dict[str, torch.Tensor] = {}
    for manifest in manifests:
        tensors = part_tensors(storage, manifest, scratch / manifest.name, part, bars)
        if sums and set(tensors) != set(sums):
            what = describe_part(layout_of(manifest, part), part)
            raise ExportError(f"{manifest.name}: {what} holds different tensors than {manifests[0].name}")
        for key, t in tensors.items():
            if t.is_floating_point() or t.is_complex():
                acc = t.to(torch.float64 if t.is_floating_point() else torch.complex128)
                previous = sums.get(key)
                sums[key] = acc if previous is None else previous + acc
            else:
                sums.setdefault(key, None)
            newest.setdefault(key, t)  # manifests are newest first
    out: dict[str, torch.Tensor] = {}
    for key, ref in newest.items():
        total = sums[key]
        out[key] = (total / len(manifests)).to(ref.dtype) if total is not None else ref.clone()
    return out


__all__ = [
    "LAYOUT_DCP",
    "LAYOUT_FOLDER",
    "LAYOUT_STATE",
    "BarFactory",
    "ProgressBar",
    "average_tensors",
    "best_first",
    "best_verified",
    "describe_part",
    "fetch_files",
    "last_verified",
    "layout_of",
    "named_verified",
    "part_tensors",
    "quiet_note",
    "silent",
    "verified",
]
