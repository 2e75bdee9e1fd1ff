"""A verified checkpoint as a Hugging Face model folder (``spotguard ckpt export --format hf``).

People share their best checkpoints on the Hugging Face Hub; the Hub's own
client uploads a folder (``hf upload USER/MODEL DEST``), so spotguard only
writes that folder, from a checkpoint that verifies (sizes, checksums, every
pickle scanned) and from files checked again as they stream in. Nothing is
unpickled: tensors are read from safetensors files (and DCP's data files by
:func:`spotguard.checkpoint.format.dcp.load_full_state`).

Two kinds of checkpoints become a model folder:

- a Hugging Face Trainer checkpoint (the Trainer's ``checkpoint-N`` folder,
  committed whole by the integration): the files the Trainer saved for the
  model (``config.json``, ``generation_config.json``, ``model.safetensors``
  or its shards and index, tokenizer files) are copied as they are; its
  training state (optimizer, scheduler, scaler, RNG, ``trainer_state.json``)
  and any other pickle are left out;
- a spotguard state (``Checkpointer.save``) whose state part (``model`` by
  default) holds a transformers model's ``state_dict()``: the tensors are
  written as ``model.safetensors`` (sharded above ``max_shard_size``, with
  the standard ``model.safetensors.index.json``) next to the config the user
  names (a ``config.json``, or a model directory, whose tokenizer files come
  along).

Tensors are fitted to the model the config describes the way
``save_pretrained`` writes them
(:func:`~spotguard.checkpoint.format.hf_folder.prepare_weights`): a wrapper prefix is
removed (:func:`~spotguard.checkpoint.format.hf_folder.choose_prefix` states the
rule), a tied weight is left out (the model ties it again on load), tensors
sharing memory are written apart (safetensors refuses shared storage), and
every key must match the model's.

This module puts the folder together: the checkpoint chosen and its tensors
read come from :mod:`~spotguard.checkpoint.restore.stored_tensors`, the folder's
layout and the fitting of tensors from :mod:`~spotguard.checkpoint.format.hf_folder`.

The folder is built in a temporary directory next to ``DEST`` and renamed
into place at the end: ``DEST`` never holds half an export.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from spotguard.checkpoint.format.hf_folder import (
    CONFIG_NAME,
    DEFAULT_MAX_SHARD_SIZE,
    MODEL_FOLDER_EXTRAS,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    ExportError,
    PreparedWeights,
    describe_model,
    folder_export_files,
    index_weight_files,
    is_weight_file,
    prepare_weights,
    write_weights,
)
from spotguard.checkpoint.format.manifest import Manifest
from spotguard.checkpoint.format.pickle_scan import looks_like_pickle
from spotguard.checkpoint.restore.stored_tensors import (
    LAYOUT_FOLDER,
    BarFactory,
    average_tensors,
    best_verified,
    describe_part,
    fetch_files,
    last_verified,
    layout_of,
    named_verified,
    part_tensors,
    quiet_note,
    silent,
)
from spotguard.storage.base import Storage


@dataclass
class ExportResult:
    """What :func:`export_hf` wrote."""

    dest: Path
    sources: list[Manifest]  # newest first; more than one for an average
    layout: str
    files: list[str]
    left_out: list[str] = field(default_factory=list)
    weights: PreparedWeights | None = None


def config_sources(path: Path) -> dict[str, Path]:
    """The files ``--config`` brings: its ``config.json`` (the file itself,
    or the one in a model directory) and, from a directory, the generation
    config and tokenizer files (never weights)."""
    if path.is_file():
        try:
            json.loads(path.read_bytes())
        except ValueError as exc:
            raise ExportError(f"--config {path}: not a JSON config ({exc})") from None
        return {CONFIG_NAME: path}
    if not path.is_dir():
        raise ExportError(f"--config {path}: no such file or directory")
    if not (path / CONFIG_NAME).is_file():
        raise ExportError(
            f"--config {path}: no {CONFIG_NAME} in it (pass a model directory saved with "
            "save_pretrained, or the config.json file)"
        )
    out = {CONFIG_NAME: path / CONFIG_NAME}
    for name in MODEL_FOLDER_EXTRAS:
        if (path / name).is_file():
            out[name] = path / name
    return out


def check_dest(dest: Path, force: bool) -> None:
    """Refuse a ``DEST`` that holds something, unless ``force``."""
    if not os.path.lexists(dest) or force:
        return
    if dest.is_dir() and not any(dest.iterdir()):
        return
    raise ExportError(f"{dest} is not empty: choose another destination, or pass --force to replace it")


def export_hf(
    storage: Storage,
    name: str | None,
    dest: Path,
    *,
    config: Path | None = None,
    best: str | None = None,
    mode: str = "min",
    average: int | None = None,
    part: str = "model",
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    force: bool = False,
    bars: BarFactory = silent,
    note: Callable[[str], None] = quiet_note,
) -> ExportResult:
    """Write a verified checkpoint (``name``; else the best by ``best``, the
    average of the ``average`` newest, or the newest) as a Hugging Face model
    folder at ``dest`` (see the module doc). Raises :class:`ExportError`,
    :class:`CheckpointCorruptError` or a storage error; ``dest`` is then
    unchanged."""
    if name is not None and (best is not None or average is not None):
        raise ExportError(
            "--best and --average choose among all checkpoints: give the storage root URI, not one checkpoint"
        )
    if best is not None and average is not None:
        raise ExportError("--best and --average exclude each other")
    dest = Path(os.path.abspath(dest))  # "." and ".." resolved: the name is the folder's
    if not dest.name:
        raise ExportError(f"{dest} cannot be a model folder: choose a directory below it")
    check_dest(dest, force)
    extra = config_sources(config) if config is not None else {}
    if name is not None:
        sources = [named_verified(storage, name)]
    elif best is not None:
        sources = [best_verified(storage, best, mode, note)]
    else:
        sources = last_verified(storage, average or 1, part, flag="--average", note=note)
    layout = layout_of(sources[0], part)
    if layout != LAYOUT_FOLDER and not extra:
        raise ExportError(
            f"{sources[0].name} holds a spotguard state, without the model's config: pass --config "
            "PATH (the model's config.json, or a directory saved with save_pretrained)"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}.spotguard-export-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        result = _build(storage, sources, layout, staging, extra, part, max_shard_size, average is not None, bars)
        check_dest(dest, force)
        _publish(staging, dest)
    except BaseException:  # no half-built export left, an interrupt too; raised again
        shutil.rmtree(staging, ignore_errors=True)
        raise
    result.dest = dest
    return result


def _build(
    storage: Storage,
    sources: list[Manifest],
    layout: str,
    staging: Path,
    extra: Mapping[str, Path],
    part: str,
    max_shard_size: int,
    averaged: bool,
    bars: BarFactory,
) -> ExportResult:
    newest = sources[0]
    result = ExportResult(staging, sources, layout, [])
    if layout == LAYOUT_FOLDER:
        keep, result.left_out = folder_export_files(f.path for f in newest.files)
        if averaged:
            keep = [p for p in keep if not is_weight_file(p)]  # new weights are written below
        fetch_files(storage, newest, keep, staging, bars)
        result.left_out += _remove_pickles(staging, keep)
    for rel, src in extra.items():
        if not (staging / rel).exists():
            shutil.copyfile(src, staging / rel)
    if not (staging / CONFIG_NAME).is_file():
        raise ExportError(
            f"{newest.name} holds no {CONFIG_NAME}: pass --config PATH (the model's config.json, or "
            "a directory saved with save_pretrained)"
        )
    if layout != LAYOUT_FOLDER or averaged:
        with tempfile.TemporaryDirectory(prefix=".spotguard-export-", dir=staging.parent) as tmp:
            if averaged:
                tensors = average_tensors(storage, sources, part, Path(tmp), bars)
                what = f"the average of {', '.join(m.name for m in sources)}"
                meta = {"spotguard_average_of": ",".join(m.name for m in sources)}
            else:
                tensors = part_tensors(storage, newest, Path(tmp) / newest.name, part, bars)
                what = f"{newest.name}'s {describe_part(layout, part)}"
                meta = {"spotguard_checkpoint": newest.name}
        result.weights = prepare_weights(tensors, describe_model(staging / CONFIG_NAME), what)
        write_weights(staging, result.weights.tensors, max_shard_size, meta)
    else:
        _check_folder_weights(staging, newest.name)
    result.files = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
    return result


def _remove_pickles(folder: Path, paths: Iterable[str]) -> list[str]:
    """Remove the files that are pickles by content (a name without a known
    suffix); returns them."""
    removed = []
    for rel in paths:
        with open(folder / rel, "rb") as f:
            head = f.read(4)
        if looks_like_pickle(rel, head):
            (folder / rel).unlink()
            removed.append(rel)
    return removed


def _check_folder_weights(folder: Path, name: str) -> None:
    if (folder / SAFE_WEIGHTS_INDEX_NAME).is_file():
        try:
            doc = json.loads((folder / SAFE_WEIGHTS_INDEX_NAME).read_bytes())
        except ValueError as exc:
            raise ExportError(f"{name}/{SAFE_WEIGHTS_INDEX_NAME}: not JSON ({exc})") from None
        missing = [f for f in index_weight_files(doc) if not (folder / f).is_file()]
        if missing:
            raise ExportError(f"{name}: {SAFE_WEIGHTS_INDEX_NAME} names {missing[0]}, which the checkpoint lacks")
    elif not (folder / SAFE_WEIGHTS_NAME).is_file():
        raise ExportError(f"{name} holds no {SAFE_WEIGHTS_NAME}")


def _publish(staging: Path, dest: Path) -> None:
    """Put the finished folder at ``dest``: one rename; a replaced ``DEST`` is
    moved aside first and removed after."""
    if not os.path.lexists(dest):
        os.rename(staging, dest)
        return
    if dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()):
        dest.rmdir()
        os.rename(staging, dest)
        return
    old = dest.parent / f".{dest.name}.spotguard-replaced-{uuid.uuid4().hex[:8]}"
    os.rename(dest, old)
    os.rename(staging, dest)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()


__all__ = ["ExportResult", "check_dest", "config_sources", "export_hf"]
