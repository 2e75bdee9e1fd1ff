"""A Hugging Face model folder, and how a state dict becomes one.

The layout ``save_pretrained`` writes and the Hub's client uploads
(``config.json``, ``model.safetensors`` or its shards and
``model.safetensors.index.json``, tokenizer files), which files of a Trainer
checkpoint make the model, and how tensors are fitted to the model the config
describes (:func:`prepare_weights`): a wrapper prefix is removed
(:func:`choose_prefix` states the rule), a tied weight is left out (the model
ties it again on load), tensors sharing memory are written apart
(safetensors refuses shared storage), and every key must match the model's.

Nothing here reads storage: the tensors come from
:mod:`~spotguard.checkpoint.restore.stored_tensors`, and
:mod:`~spotguard.checkpoint.tools.export` puts the folder together. The functions
marked ``Pure:`` need neither torch nor files.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard.checkpoint.format.pickle_scan import PICKLE_SUFFIXES

if TYPE_CHECKING:
    import torch

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
#: The Hub's own default (``save_pretrained`` shards at 50 GB; 5 GB files upload and download more reliably).
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9

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
    "optimizer.*",
    "scheduler.*",
    "scaler.*",
    "rng_state*.pth",
    "trainer_state.json",
    "training_args.bin",
    "global_step*",
    "latest",
    "zero_to_fp32.py",
    "optimizer_*",
    "pytorch_model_fsdp_*",
)
#: Files of a model folder besides its config and weights (copied from ``--config DIR``).
MODEL_FOLDER_EXTRAS = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)
_WEIGHT_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


class ExportError(ValueError):
    """A checkpoint cannot be exported as asked; the message says why and what to do."""


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
        k
        for k in set(expected) - have
        if not (k in tied and tied[k] in have) and not (k in sources and sources[k] in have)
    )
    return missing, sorted(have - set(expected))


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
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a bad config
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
            raise ExportError(
                f"{what}: {target} differs from {tied[target]}, but the config ties them "
                "(tie_word_embeddings): the exported model would not be the trained one; "
                "pass the config the model was trained with (--config)"
            )
    out = {k: (t.clone() if k in clone else t) for k, t in renamed.items() if k not in drop}
    if model is not None:
        missing, unexpected = key_mismatch(out, model.expected, tied)
        if missing or unexpected:
            said = [f"{len(missing)} of its keys missing (e.g. {', '.join(missing[:3])})"] if missing else []
            if unexpected:
                said.append(f"{len(unexpected)} keys it does not have (e.g. {', '.join(unexpected[:3])})")
            removed = f" after removing the prefix {prefix!r}" if prefix else ""
            raise ExportError(
                f"{what} does not fit {model.architecture}{removed}: {'; '.join(said)}; pass the "
                "config of the model that was trained (--config), or the state part that holds "
                "its state_dict (--part)"
            )
    return PreparedWeights(
        out,
        prefix,
        {k: tied[k] for k in sorted(drop)},
        sorted(clone),
        model.architecture if model is not None else None,
    )


def write_weights(
    folder: Path, tensors: Mapping[str, torch.Tensor], max_shard_size: int, metadata: Mapping[str, str]
) -> list[str]:
    """Write ``model.safetensors`` (or shards and the index) into ``folder``
    with ``huggingface_hub``'s ``save_torch_state_dict``, the writer behind
    ``save_pretrained``: its shard plan, file names and index, so the folder
    is the one the Hub's own tools write. ``metadata`` goes into the file's
    header, or the index's ``metadata`` when sharded. Returns the weight
    files written, sorted. Raises :class:`ExportError` when
    ``huggingface_hub`` is not installed."""
    try:
        from huggingface_hub import save_torch_state_dict
    except ImportError:
        raise ExportError(
            "writing a model folder's weights needs huggingface_hub: pip install 'spotguard[hf]'"
        ) from None
    # Copies: save_torch_state_dict removes shared tensors from the dict it is given and notes them in the metadata.
    save_torch_state_dict(dict(tensors), folder, max_shard_size=max_shard_size, metadata=dict(metadata))
    return sorted(p.name for p in folder.iterdir() if is_weight_file(p.name))


__all__ = [
    "CONFIG_NAME",
    "DEFAULT_MAX_SHARD_SIZE",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "ExportError",
    "ModelKeys",
    "PreparedWeights",
    "choose_prefix",
    "describe_model",
    "folder_export_files",
    "index_weight_files",
    "is_weight_file",
    "key_mismatch",
    "parse_size",
    "prepare_weights",
    "resolve_tied",
    "shared_storage_groups",
    "write_weights",
]
