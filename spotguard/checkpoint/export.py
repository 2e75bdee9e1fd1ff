"""A verified checkpoint as a Hugging Face model folder (``spotguard ckpt export --format hf``).

People share their best checkpoints on the Hugging Face Hub; the Hub's own
client uploads a folder (``hf upload USER/MODEL DEST``), so spotguard only
writes that folder, from a checkpoint that verifies (sizes, checksums, every
pickle scanned) and from files checked again as they stream in. Nothing is
unpickled: tensors are read from safetensors files (and DCP's data files by
:func:`spotguard.checkpoint.dcp.load_full_state`).

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
``save_pretrained`` writes them (:func:`prepare_weights`): a wrapper prefix is
removed (:func:`choose_prefix` states the rule), a tied weight is left out
(the model ties it again on load), tensors sharing memory are written apart
(safetensors refuses shared storage), and every key must match the model's.

The folder is built in a temporary directory next to ``DEST`` and renamed
into place at the end: ``DEST`` never holds half an export.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from spotguard.checkpoint.chunked import fetch_chunks
from spotguard.checkpoint.codec import STATE_FILE
from spotguard.checkpoint.fetch import fetch_verified
from spotguard.checkpoint.manifest import Manifest, ManifestError
from spotguard.checkpoint.pickle_scan import PICKLE_SUFFIXES, looks_like_pickle
from spotguard.checkpoint.remote import (
    CheckpointCorruptError,
    list_checkpoint_names,
    read_manifest,
    verify_checkpoint,
)
from spotguard.storage.base import NotFoundError, Storage

if TYPE_CHECKING:
    import torch

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
#: The Hub's own default (``save_pretrained`` shards at 50 GB; 5 GB files upload and download more reliably).
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
DCP_DIR = "dcp"
DCP_METADATA = f"{DCP_DIR}/.metadata"

#: Prefixes a training wrapper puts before every key: DistributedDataParallel,
#: DataParallel and DeepSpeed (``module.``), ``torch.compile`` (``_orig_mod.``).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
#: A prefix that may be a wrapper's (a Lightning module's ``self.model``, a
#: state saved as ``{"model": {"model": ...}}``) or the model's own (a
#: ``LlamaForCausalLM`` names its decoder ``model``): removed only when that
#: fits the model better (see :func:`choose_prefix`).
MODEL_PREFIX = "model."

#: A Trainer checkpoint's training state: resuming needs it, the model does not.
TRAINING_STATE = (
    "optimizer.*", "scheduler.*", "scaler.*", "rng_state*.pth", "trainer_state.json", "training_args.bin",
    "global_step*", "latest", "zero_to_fp32.py", "optimizer_*", "pytorch_model_fsdp_*",
)  # fmt: skip
#: Files of a model folder besides its config and weights (copied from ``--config DIR``).
MODEL_FOLDER_EXTRAS = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
    "processor_config.json",
)  # fmt: skip
_WEIGHT_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip

#: How a checkpoint holds the tensors of a state part (:func:`layout_of`).
LAYOUT_DCP = "dcp"
LAYOUT_STATE = "state"
LAYOUT_FOLDER = "folder"


class ExportError(ValueError):
    """A checkpoint cannot be exported as asked; the message says why and what to do."""


class ProgressBar(Protocol):
    """What a download reports its bytes to (``spotguard.checkpoint.cli.Progress``)."""

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


def _quiet(message: str) -> None:
    pass


# -- pure parts ------------------------------------------------------------------------


def parse_size(raw: str) -> int:
    """Pure: bytes of ``5GB``, ``500MB``, ``1GiB``, ``123`` (decimal units as
    the Hub counts them, binary ones with ``i``)."""
    m = _SIZE.match(raw)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {raw!r} (write e.g. 5GB, 500MB, 2GiB or a number of bytes)")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value < 1:
        raise ValueError(f"size must be at least 1 byte: {raw!r}")
    return value


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


def folder_export_files(paths: Iterable[str]) -> tuple[list[str], list[str]]:
    """Pure: of a Trainer checkpoint's files, those that make the model folder
    and those left out (training state and any other pickle), both sorted.
    spotguard's own part manifests (``parts/``) are neither."""
    keep: list[str] = []
    left: list[str] = []
    for path in sorted(paths):
        top = path.split("/", 1)[0]
        if top == "parts":
            continue
        state = any(fnmatch.fnmatch(path, g) or fnmatch.fnmatch(top, g) for g in TRAINING_STATE)
        (left if state or path.endswith(PICKLE_SUFFIXES) else keep).append(path)
    return keep, left


def is_weight_file(path: str) -> bool:
    """Pure: ``model.safetensors``, one of its shards, or its index."""
    return bool(_WEIGHT_FILE.match(path))


def layout_of(manifest: Manifest, part: str) -> str:
    """How ``manifest``'s checkpoint holds state part ``part``:
    :data:`LAYOUT_DCP` (a distributed checkpoint's DCP files),
    :data:`LAYOUT_STATE` (``<part>.safetensors`` of a spotguard state) or
    :data:`LAYOUT_FOLDER` (a Hugging Face model folder's weights); raises
    :class:`ExportError` naming what is missing."""
    paths = {f.path for f in manifest.files}
    part_file = f"{part}.safetensors"
    if manifest.sharding is not None and DCP_METADATA in paths:
        return LAYOUT_DCP
    if STATE_FILE in paths and part_file in paths:
        return LAYOUT_STATE
    if STATE_FILE not in paths and (SAFE_WEIGHTS_NAME in paths or SAFE_WEIGHTS_INDEX_NAME in paths):
        if part != "model":
            raise ExportError(f"{manifest.name} is a Hugging Face model folder: its weights are its only state "
                              "part (leave --part at model)")  # fmt: skip
        return LAYOUT_FOLDER
    if manifest.sharding is not None:
        raise ExportError(f"{manifest.name} is a distributed checkpoint without {DCP_METADATA}")
    if part_file in paths:
        return LAYOUT_STATE
    raise ExportError(f"{manifest.name} has no {part_file} (choose the state part with --part) and is not a "
                      f"Hugging Face model folder (no {SAFE_WEIGHTS_NAME})")  # fmt: skip


def describe_part(layout: str, part: str) -> str:
    """Pure: how messages name the tensors of ``part`` in a checkpoint of ``layout``."""
    if layout == LAYOUT_DCP:
        return f"state part {part!r}"
    if layout == LAYOUT_FOLDER:
        return "the model weights"
    return f"{part}.safetensors"


def choose_prefix(keys: Collection[str], expected: Collection[str] | None) -> str:
    """Pure: the prefix to remove from every key of a state dict.

    The candidates are the leading run of ``module.``, ``_orig_mod.`` and
    ``model.`` segments that *every* key carries (``module._orig_mod.`` of a
    compiled model under DDP), cut after each segment. With the model's own
    key names (``expected``) the cut after which the most keys match them
    wins, fewer segments on a tie (a ``LlamaForCausalLM``'s own
    ``model.layers...`` keys keep their ``model.``). Without them the
    wrapper segments (``module.``, ``_orig_mod.``) are removed up to the
    first ``model.``, which stays.
    """
    segments: list[str] = []
    rest = list(keys)
    while rest:
        prefix = next((p for p in (*WRAPPER_PREFIXES, MODEL_PREFIX) if all(k.startswith(p) for k in rest)), None)
        if prefix is None:
            break
        segments.append(prefix)
        rest = [k[len(prefix) :] for k in rest]
    if expected is None:
        n = 0
        while n < len(segments) and segments[n] in WRAPPER_PREFIXES:
            n += 1
        return "".join(segments[:n])
    wanted = set(expected)
    best, best_score = "", -1
    for n in range(len(segments) + 1):
        prefix = "".join(segments[:n])
        score = len({k[len(prefix) :] for k in keys} & wanted)
        if score > best_score:
            best, best_score = prefix, score
    return best


def resolve_tied(
    keys: Collection[str], shared: Iterable[Sequence[str]], tied: Mapping[str, str]
) -> tuple[set[str], set[str]]:
    """Pure: which keys to leave out and which to write as copies, the way
    ``save_pretrained`` handles tied weights.

    ``tied`` maps each tied weight to the one it is tied to
    (``{"lm_head.weight": "transformer.wte.weight"}``, the model's
    ``all_tied_weights_keys``; empty when the config unties them). A tied
    weight whose source is present is left out: the model ties it again on
    load. ``shared`` lists groups of keys whose tensors share memory; of each
    group's remaining keys, all but the first (sorted) are written as copies,
    as safetensors refuses shared storage. Returns ``(drop, clone)``.
    """
    present = set(keys)
    drop = {target for target, source in tied.items() if target in present and source in present}
    clone: set[str] = set()
    for group in shared:
        rest = sorted(k for k in group if k in present and k not in drop)
        clone.update(rest[1:])
    return drop, clone


def key_mismatch(
    keys: Collection[str], expected: Collection[str], tied: Mapping[str, str]
) -> tuple[list[str], list[str]]:
    """Pure: the model's keys missing from ``keys`` and the keys it does not
    have (both sorted). A tied pair counts as present when either is there."""
    have = set(keys)
    sources = {source: target for target, source in tied.items()}
    missing = sorted(
        k for k in set(expected) - have
        if not (k in tied and tied[k] in have) and not (k in sources and sources[k] in have)
    )  # fmt: skip
    return missing, sorted(have - set(expected))


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Pure: tensors ``(name, bytes)`` split into shards in order, a new shard
    starting when the next tensor would take the current one above
    ``max_shard_size`` (a tensor bigger than that gets a shard of its own),
    as ``huggingface_hub.split_torch_state_dict_into_shards`` does."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, nbytes in sizes:
        if current and size + nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def shard_file_names(count: int) -> list[str]:
    """Pure: ``model.safetensors`` for one shard, else ``model-00001-of-0000N.safetensors`` ..."""
    if count == 1:
        return [SAFE_WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def shard_index(shards: Sequence[Sequence[str]], sizes: Mapping[str, int]) -> dict[str, Any]:
    """Pure: the standard ``model.safetensors.index.json`` document for ``shards``."""
    files = shard_file_names(len(shards))
    weight_map = {name: file for file, names in zip(files, shards, strict=True) for name in names}
    return {"metadata": {"total_size": sum(sizes[n] for n in weight_map)},
            "weight_map": dict(sorted(weight_map.items()))}  # fmt: skip


def index_weight_files(doc: Any) -> list[str]:
    """Pure: the shard files a ``model.safetensors.index.json`` document names, sorted."""
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ExportError(f"{SAFE_WEIGHTS_INDEX_NAME}: no weight_map")
    files = {str(v) for v in weight_map.values()}
    bad = sorted(f for f in files if not is_weight_file(f) or "/" in f)
    if bad:
        raise ExportError(f"{SAFE_WEIGHTS_INDEX_NAME}: names {bad[0]!r}, not a model shard file")
    return sorted(files)


# -- the model the config describes ------------------------------------------------------


@dataclass(frozen=True)
class ModelKeys:
    """The key names of the model a config describes (built on PyTorch's meta
    device: no memory, nothing downloaded, no code from the config run)."""

    architecture: str
    expected: frozenset[str]
    tied: Mapping[str, str]
    ignore_on_save: frozenset[str] = frozenset()


def describe_model(config_file: Path) -> ModelKeys | None:
    """The keys of the model ``config_file`` describes, or None when its
    architecture is not one transformers has (then keys are not checked)."""
    try:
        import torch
        import transformers
        from transformers import AutoConfig
    except ImportError:
        raise ExportError("exporting tensors needs torch and transformers: pip install 'spotguard[hf]'") from None
    try:
        config = AutoConfig.from_pretrained(str(config_file), trust_remote_code=False)
    except Exception as exc:  # transformers raises many kinds for a bad config
        raise ExportError(f"{config_file}: not a transformers model config ({exc})") from None
    architectures = getattr(config, "architectures", None) or []
    cls = getattr(transformers, str(architectures[0]), None) if architectures else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        return None
    with torch.device("meta"):
        model = cls(config)
    return ModelKeys(
        architecture=cls.__name__,
        expected=frozenset(model.state_dict()),
        tied=dict(getattr(model, "all_tied_weights_keys", None) or {}),
        ignore_on_save=frozenset(getattr(model, "_keys_to_ignore_on_save", None) or ()),
    )


# -- tensors -----------------------------------------------------------------------------


def shared_storage_groups(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Groups (sorted, of two or more keys) of tensors that share memory."""
    by_storage: dict[tuple[str, int], list[str]] = {}
    for key, t in tensors.items():
        if t.numel() == 0:
            continue
        by_storage.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append(key)
    return [sorted(keys) for keys in by_storage.values() if len(keys) > 1]


@dataclass
class PreparedWeights:
    """Tensors ready for ``model.safetensors`` and what was done to them."""

    tensors: dict[str, torch.Tensor]
    prefix: str = ""
    dropped: dict[str, str] = field(default_factory=dict)  # tied key left out -> the key it is tied to
    cloned: list[str] = field(default_factory=list)
    #: The model class the keys were checked against; None when the config
    #: names no architecture transformers has (keys then not checked).
    architecture: str | None = None


def prepare_weights(tensors: Mapping[str, torch.Tensor], model: ModelKeys | None, what: str) -> PreparedWeights:
    """Fit a state dict to the model: prefix removed (:func:`choose_prefix`),
    the model's ``_keys_to_ignore_on_save`` and tied weights left out, shared
    memory written apart (:func:`resolve_tied`), keys checked against the
    model's. Raises :class:`ExportError` when the keys do not fit, or a tied
    weight differs from its source (the model would not be the trained one)."""
    import torch

    if not tensors:
        raise ExportError(f"{what} holds no tensors")
    prefix = choose_prefix(list(tensors), model.expected if model else None)
    renamed = {k[len(prefix) :]: t for k, t in tensors.items()}
    tied: Mapping[str, str] = {}
    if model is not None:
        for key in model.ignore_on_save:
            renamed.pop(key, None)
        tied = model.tied
    drop, clone = resolve_tied(renamed, shared_storage_groups(renamed), tied)
    for target in sorted(drop):
        if not torch.equal(renamed[target], renamed[tied[target]]):
            raise ExportError(f"{what}: {target} differs from {tied[target]}, but the config ties them "
                              "(tie_word_embeddings): the exported model would not be the trained one; "
                              "pass the config the model was trained with (--config)")  # fmt: skip
    out = {k: (t.clone() if k in clone else t) for k, t in renamed.items() if k not in drop}
    if model is not None:
        missing, unexpected = key_mismatch(out, model.expected, tied)
        if missing or unexpected:
            said = [f"{len(missing)} of its keys missing (e.g. {', '.join(missing[:3])})"] if missing else []
            if unexpected:
                said.append(f"{len(unexpected)} keys it does not have (e.g. {', '.join(unexpected[:3])})")
            removed = f" after removing the prefix {prefix!r}" if prefix else ""
            raise ExportError(f"{what} does not fit {model.architecture}{removed}: {'; '.join(said)}; pass the "
                              "config of the model that was trained (--config), or the state part that holds "
                              "its state_dict (--part)")  # fmt: skip
    return PreparedWeights(out, prefix, {k: tied[k] for k in sorted(drop)}, sorted(clone),
                           model.architecture if model is not None else None)  # fmt: skip


def write_weights(
    folder: Path, tensors: Mapping[str, torch.Tensor], max_shard_size: int, metadata: Mapping[str, str]
) -> list[str]:
    """Write ``model.safetensors`` (or shards and the index) into ``folder``; returns the file names."""
    from safetensors.torch import save_file

    sizes = [(k, t.numel() * t.element_size()) for k, t in tensors.items()]
    shards = plan_shards(sizes, max_shard_size)
    files = shard_file_names(len(shards))
    meta = {"format": "pt", **metadata}
    for file, names in zip(files, shards, strict=True):
        save_file({k: tensors[k].contiguous() for k in names}, str(folder / file), metadata=meta)
    if len(shards) == 1:
        return files
    index = shard_index(shards, dict(sizes))
    (folder / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*files, SAFE_WEIGHTS_INDEX_NAME]


# -- storage -------------------------------------------------------------------------------


def fetch_files(storage: Storage, manifest: Manifest, paths: Iterable[str], dest: Path,
                bars: BarFactory = silent) -> None:  # fmt: skip
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
            prefix = f"{manifest.name}/"
            sizes = {o.key[len(prefix) :]: o.size for o in storage.list_objects(prefix)}
            problems = fetch_verified(storage, manifest.name, subset, sizes, dest, progress=bar)
    finally:
        if bar.done:
            bar.close()
    if problems:
        raise CheckpointCorruptError(manifest.name, problems)


def part_tensors(storage: Storage, manifest: Manifest, scratch: Path, part: str,
                 bars: BarFactory = silent) -> dict[str, torch.Tensor]:  # fmt: skip
    """The tensors of state part ``part`` of a verified checkpoint, whole (a
    distributed checkpoint's nested keys joined with ``.``), downloaded into
    ``scratch`` (removed afterwards) and checked on the way."""
    from spotguard.checkpoint.codec import load_safetensors

    layout = layout_of(manifest, part)
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        if layout == LAYOUT_DCP:
            return _dcp_part_tensors(storage, manifest, scratch, part, bars)
        if layout == LAYOUT_STATE:
            files = [f"{part}.safetensors"]
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


def _dcp_part_tensors(storage: Storage, manifest: Manifest, scratch: Path, part: str,
                      bars: BarFactory) -> dict[str, torch.Tensor]:  # fmt: skip
    import torch

    from spotguard.checkpoint.dcp import load_full_state

    fetch_files(storage, manifest, [f.path for f in manifest.files if f.path.startswith(f"{DCP_DIR}/")], scratch,
                bars)  # fmt: skip
    state = load_full_state(scratch / DCP_DIR)
    if part not in state:
        raise ExportError(f"{manifest.name} has no state part {part!r} (it has {', '.join(sorted(state))}; "
                          "choose it with --part)")  # fmt: skip
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


def average_tensors(storage: Storage, manifests: Sequence[Manifest], part: str, scratch: Path,
                    bars: BarFactory = silent) -> dict[str, torch.Tensor]:  # fmt: skip
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


def verified(storage: Storage, names: Iterable[str], note: Callable[[str], None] = _quiet) -> Iterator[Manifest]:
    """The manifests of the checkpoints in ``names`` that verify, in that
    order; each one passed over is reported to ``note`` with the reason."""
    for name in names:
        result = verify_checkpoint(storage, name)
        if result.ok and result.manifest is not None:
            yield result.manifest
        else:
            note(f"skipped {name}: {result.reason}")


def last_verified(storage: Storage, count: int, part: str, *, flag: str,
                  note: Callable[[str], None] = _quiet) -> list[Manifest]:  # fmt: skip
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
        raise ExportError(f"{name} does not verify, refusing to export it: {result.reason} "
                          f"(`spotguard ckpt ls {storage.uri}` shows which checkpoints do)")  # fmt: skip
    return result.manifest


def best_verified(storage: Storage, metric: str, mode: str, note: Callable[[str], None] = _quiet) -> Manifest:
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
        raise ExportError(f"no checkpoint at {storage.uri} records the metric {metric!r} "
                          f"(recorded: {', '.join(sorted(recorded)) or 'none'})")  # fmt: skip
    for manifest in verified(storage, order, note):
        return manifest
    raise ExportError(f"no checkpoint at {storage.uri} that records {metric!r} verifies")


# -- the export ------------------------------------------------------------------------------


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
        raise ExportError(f"--config {path}: no {CONFIG_NAME} in it (pass a model directory saved with "
                          "save_pretrained, or the config.json file)")  # fmt: skip
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
    note: Callable[[str], None] = _quiet,
) -> ExportResult:
    """Write a verified checkpoint (``name``; else the best by ``best``, the
    average of the ``average`` newest, or the newest) as a Hugging Face model
    folder at ``dest`` (see the module doc). Raises :class:`ExportError`,
    :class:`CheckpointCorruptError` or a storage error; ``dest`` is then
    unchanged."""
    if name is not None and (best is not None or average is not None):
        raise ExportError("--best and --average choose among all checkpoints: give the storage root URI, "
                          "not one checkpoint")  # fmt: skip
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
        raise ExportError(f"{sources[0].name} holds a spotguard state, without the model's config: pass --config "
                          "PATH (the model's config.json, or a directory saved with save_pretrained)")  # fmt: skip
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}.spotguard-export-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        result = _build(storage, sources, layout, staging, extra, part, max_shard_size, average is not None, bars)
        check_dest(dest, force)
        _publish(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    result.dest = dest
    return result


def _build(storage: Storage, sources: list[Manifest], layout: str, staging: Path, extra: Mapping[str, Path],
           part: str, max_shard_size: int, averaged: bool, bars: BarFactory) -> ExportResult:  # fmt: skip
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
        raise ExportError(f"{newest.name} holds no {CONFIG_NAME}: pass --config PATH (the model's config.json, or "
                          "a directory saved with save_pretrained)")  # fmt: skip
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


__all__ = [
    "DEFAULT_MAX_SHARD_SIZE", "ExportError", "ExportResult", "ModelKeys", "PreparedWeights", "average_tensors",
    "best_first", "choose_prefix", "export_hf", "fetch_files", "folder_export_files", "last_verified",
    "layout_of", "parse_size", "part_tensors", "plan_shards", "prepare_weights", "resolve_tied", "shard_index",
]  # fmt: skip
