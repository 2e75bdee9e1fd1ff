"""State encoding, safetensors writing, file verification and pickle inspection, in memory."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load

from spotguard.checkpoint.format.manifest import FileEntry, new_manifest
from spotguard.checkpoint.format.pickle_scan import (
    UnsafePickleError,
    check_pickle_safe,
    looks_like_pickle,
    pickle_globals,
)
from spotguard.checkpoint.format.verify import verify_files
from spotguard.checkpoint.local.codec import (
    STATE_FILE,
    StateError,
    decode_state,
    iter_safetensors,
    snapshot_state,
    tensor_files_of,
)
from spotguard.storage.checksum import check_algorithm, checksum_bytes, checksum_chunks


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """Snapshot, serialize to bytes as the writer would, and decode again."""
    snap = snapshot_state(state)
    files = {name: b"".join(bytes(c) for c in iter_safetensors(blobs)) for name, blobs in snap.tensors.items()}
    doc = json.loads(json.dumps(snap.doc, allow_nan=False))
    assert tensor_files_of(doc) == set(files)

    def load_file(name: str, as_torch: bool) -> dict[str, Any]:
        tensors = st_load(files[name])
        return tensors if as_torch else {k: v.numpy() for k, v in tensors.items()}

    return decode_state(doc, load_file)


def test_plain_values_roundtrip() -> None:
    state = {
        "none": None,
        "bools": [True, False],
        "ints": [0, -3, 2**80],
        "floats": [0.1, -2.5e-300, 1e308],
        "nonfinite": [float("inf"), float("-inf")],
        "str": "héllo",
        "bytes": b"\x00\xff",
        "tuple": (1, (2, "x"), []),
        "nested": {"a": {"b": [1, {"c": None}]}},
        "intkeys": {0: "a", 5: "b"},
        "tuplekeys": {(1, 2): 3},
        "tagclash": {"__t": "not a tag"},
    }
    out = roundtrip(state)
    nan_state = roundtrip({"nan": float("nan")})
    assert math.isnan(nan_state["nan"])
    assert out == state
    assert isinstance(out["tuple"], tuple) and isinstance(out["tuple"][1], tuple)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    ],
)
def test_tensors_roundtrip_bit_exact(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g) * 100
    t = base.to(dtype)
    state = {"model": {"w": t, "scalar": t[0, 0].clone(), "empty": torch.empty(0, 4, dtype=dtype)}}
    out = roundtrip(state)["model"]
    for key in state["model"]:
        assert out[key].dtype == dtype and out[key].shape == state["model"][key].shape
        raw_out = out[key].reshape(-1).view(torch.uint8)
        raw_in = state["model"][key].reshape(-1).view(torch.uint8)
        assert torch.equal(raw_out, raw_in)


def test_noncontiguous_and_view_tensors_are_copied_contiguously() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"model": {"t": base.t(), "slice": base[:, 1:3], "same": base}}
    out = roundtrip(state)["model"]
    assert torch.equal(out["t"], base.t())
    assert torch.equal(out["slice"], base[:, 1:3])
    assert torch.equal(out["same"], base)


def test_snapshot_is_independent_of_later_mutation() -> None:
    t = torch.zeros(4)
    nested = {"lr": 1.0}
    snap = snapshot_state({"model": {"t": t}, "opt": nested})
    t.add_(1)
    nested["lr"] = 2.0
    data = b"".join(bytes(c) for c in iter_safetensors(snap.tensors["model.safetensors"]))
    assert torch.equal(st_load(data)["t"], torch.zeros(4))
    assert snap.doc["state"]["opt"] == {"lr": 1.0}


def test_numpy_values_roundtrip() -> None:
    a = np.arange(10, dtype=np.uint32)
    big_endian = np.arange(4, dtype=">i4")
    state = {
        "arr": a,
        "be": big_endian,
        "scalars": [np.float32(1.5), np.int64(-7), np.uint8(255), np.bool_(True)],
        "legacy_rng": np.random.RandomState(3).get_state(),
    }
    out = roundtrip(state)
    assert out["arr"].dtype == np.uint32 and np.array_equal(out["arr"], a)
    assert np.array_equal(out["be"], big_endian)
    for got, want in zip(out["scalars"], state["scalars"], strict=True):
        assert type(got) is type(want) and got == want
    rs = np.random.RandomState()
    rs.set_state(out["legacy_rng"])
    assert np.array_equal(rs.random_sample(5), np.random.RandomState(3).random_sample(5))


def test_optimizer_and_module_state_dicts_roundtrip() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    out = roundtrip({"model": model.state_dict(), "optimizer": opt.state_dict()})
    assert isinstance(out["model"], OrderedDict)
    assert out["model"]._metadata == model.state_dict()._metadata  # type: ignore[attr-defined]
    model2 = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model2.load_state_dict(out["model"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    opt2.load_state_dict(out["optimizer"])
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for k, v in opt.state_dict()["state"].items():
        for name, t in v.items():
            assert torch.equal(opt2.state_dict()["state"][k][name], t)


def test_model_tensors_keep_their_state_dict_names() -> None:
    model = torch.nn.Linear(2, 3)
    snap = snapshot_state({"model": model.state_dict(), "optimizer": {"x": torch.ones(1)}})
    assert set(snap.tensors) == {"model.safetensors", "optimizer.safetensors"}
    assert set(snap.tensors["model.safetensors"]) == {"weight", "bias"}
    assert snap.nbytes == (6 + 3 + 1) * 4


@pytest.mark.parametrize(
    "value, problem",
    [
        (object(), "values of type builtins.object cannot be checkpointed"),
        (lambda: 1, "cannot be checkpointed"),
        ({1, 2}, "builtins.set"),
        (torch.zeros(2, dtype=torch.complex64), "dtype torch.complex64 cannot be checkpointed"),
        (torch.zeros(2).to_sparse(), "only dense tensors"),
        (np.array(["a"], dtype=object), "numpy arrays of dtype object"),
    ],
)
def test_unsupported_values_fail_at_snapshot_naming_the_path(value: Any, problem: str) -> None:
    with pytest.raises(StateError, match=problem) as err:
        snapshot_state({"extra": {"thing": value}})
    assert "state['extra']['thing']" in str(err.value)


def test_state_must_be_a_mapping() -> None:
    with pytest.raises(StateError, match="must be a mapping"):
        snapshot_state([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "doc, problem",
    [
        ({"format": 2, "state": {}}, "not a spotguard state document"),
        ({"state": {}}, "not a spotguard state document"),
        ({"format": 1, "state": {"x": {"__t": "pickle", "v": "..."}}}, "unknown tag 'pickle'"),
        ({"format": 1, "state": {"x": {"__t": "float", "v": "1e5"}}}, "bad float"),
        ({"format": 1, "state": {"x": {"__t": "bytes", "v": "!!"}}}, "malformed 'bytes'"),
        ({"format": 1, "state": {"x": {"__t": "tuple"}}}, "malformed 'tuple'"),
        ({"format": 1, "state": {"x": {"__t": "torch_dtype", "v": "os.system"}}}, "unknown torch dtype"),
        ({"format": 1, "state": {"x": {"__t": "npscalar", "dtype": "object", "v": ""}}}, "unsupported numpy"),
    ],
)
def test_malformed_state_documents_are_named(doc: dict[str, Any], problem: str) -> None:
    with pytest.raises(StateError, match=problem):
        decode_state(doc, lambda name, as_torch: {})


def test_missing_tensor_reference_is_named() -> None:
    doc = {"format": 1, "state": {"w": {"__t": "tensor", "file": "model.safetensors", "key": "w"}}}
    with pytest.raises(StateError, match="tensor 'w' referenced by state.json is missing"):
        decode_state(doc, lambda name, as_torch: {})


# -- checksums ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "algorithm, data, expected",
    [
        ("crc32c", b"", "00000000"),
        ("crc32c", b"123456789", "e3069283"),  # the CRC-32C check value
        ("sha256", b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
        ("CRC32C", b"123456789", "e3069283"),
        ("sha-256", b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    ],
)
def test_checksums(algorithm: str, data: bytes, expected: str) -> None:
    assert checksum_bytes(data, check_algorithm(algorithm)) == expected
    chunks = [data[i : i + 2] for i in range(0, len(data), 2)]
    assert checksum_chunks(chunks, check_algorithm(algorithm)) == (expected, len(data))


def test_unknown_checksum_algorithm() -> None:
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        check_algorithm("md5")


# -- verification against a manifest ---------------------------------------------------


def manifest_for(files: dict[str, bytes], algorithm: str = "crc32c") -> Any:
    entries = [FileEntry(p, len(d), checksum_bytes(d, algorithm)) for p, d in files.items()]
    return new_manifest(1, entries, algorithm)


def check(manifest: Any, stored: dict[str, bytes]) -> list[str]:
    def read(path: str) -> Iterator[bytes]:
        data = stored[path]
        for i in range(0, max(len(data), 1), 3):
            yield data[i : i + 3]

    problems, _ = verify_files(manifest, {p: len(d) for p, d in stored.items()}, read)
    return problems


GOOD = {"model.safetensors": b"tensor bytes here", STATE_FILE: b'{"format": 1}'}


@pytest.mark.parametrize("algorithm", ["crc32c", "sha256"])
def test_verify_files_accepts_good_files(algorithm: str) -> None:
    assert check(manifest_for(GOOD, algorithm), dict(GOOD)) == []


@pytest.mark.parametrize(
    "mutate, problem",
    [
        (lambda s: s.update({"model.safetensors": b"tensor bytes herE"}), "crc32c checksum mismatch"),
        (lambda s: s.update({"model.safetensors": b"tensor"}), "size 6 bytes, manifest says 17 (truncated)"),
        (lambda s: s.pop("model.safetensors"), "model.safetensors: missing"),
        (lambda s: s.update({"model.safetensors": b"tensor bytes here!"}), "longer than recorded"),
    ],
)
def test_verify_files_names_file_and_reason(mutate: Any, problem: str) -> None:
    stored = dict(GOOD)
    mutate(stored)
    problems = check(manifest_for(GOOD), stored)
    assert len(problems) == 1 and problem in problems[0] and problems[0].startswith("model.safetensors: "), problems


def test_verify_files_reports_every_bad_file() -> None:
    problems = check(manifest_for(GOOD), {})
    assert problems == ["model.safetensors: missing", "state.json: missing"]


# -- pickles -----------------------------------------------------------------------------


class RunsCode:
    def __reduce__(self) -> Any:
        return (os.system, ("true",))


def torch_saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_a_torch_save_of_tensors_is_safe() -> None:
    data = torch_saved({"w": torch.ones(2), "n": 3, "d": OrderedDict(a=torch.zeros(1, dtype=torch.int64))})
    check_pickle_safe(data)
    check_pickle_safe(pickle.dumps({"a": [1, 2.0, "x", (None,)]}))


@pytest.mark.parametrize(
    "payload, target",
    [
        (pickle.dumps(RunsCode(), protocol=2), "posix.system"),
        (pickle.dumps(RunsCode(), protocol=4), "posix.system"),
        (pickle.dumps(RunsCode(), protocol=0), "posix.system"),
        (torch_saved({"w": torch.ones(1), "evil": RunsCode()}), "posix.system"),
        (pickle.dumps(print), "builtins.print"),
    ],
)
def test_pickles_that_would_run_code_are_named(payload: bytes, target: str) -> None:
    with pytest.raises(UnsafePickleError, match=f"would import {target}, which can run code"):
        check_pickle_safe(payload)


def test_globals_of_a_pickle() -> None:
    assert ("posix", "system") in pickle_globals(pickle.dumps(RunsCode(), protocol=4))


def test_garbage_is_refused_as_malformed() -> None:
    with pytest.raises(UnsafePickleError, match="malformed"):
        check_pickle_safe(b"\x80\x04garbage")


@pytest.mark.parametrize(
    "path, head, expected",
    [
        ("model.pt", b"PK\x03\x04", True),
        ("weights.bin", b"\x00\x00", True),
        ("model.safetensors", b"\x80\x00\x00\x00", False),
        ("state.json", b"\x80", False),
        ("blob", b"\x80\x04", True),
        ("blob", b"PK\x03\x04", True),
        ("blob", b"data", False),
    ],
)
def test_which_files_are_treated_as_pickles(path: str, head: bytes, expected: bool) -> None:
    assert looks_like_pickle(path, head) is expected


def test_verify_names_a_pickle_that_would_run_code() -> None:
    files = {"model.pt": pickle.dumps(RunsCode(), protocol=4), STATE_FILE: b"{}"}
    problems = check(manifest_for(files), dict(files))
    assert problems == [
        "model.pt: pickle would import posix.system, which can run code (refused: loading it could run code)"
    ]


def test_a_device_tensor_is_compared_with_its_host_copy_a_slice_at_a_time() -> None:
    """``equal_in_slices`` (the compare a GPU tensor gets, here on the CPU): equal bytes
    are equal whatever the slicing; a byte that differs in any slice, a sign of zero,
    or a different length is not."""
    import torch

    from spotguard.checkpoint.local.codec import equal_in_slices

    base = torch.arange(50, dtype=torch.uint8)
    for slice_bytes in (1, 7, 50, 64):
        assert equal_in_slices(torch, base, base.clone(), slice_bytes)
        for where in (0, 20, 49):
            other = base.clone()
            other[where] ^= 1
            assert not equal_in_slices(torch, base, other, slice_bytes), (slice_bytes, where)
    assert not equal_in_slices(torch, base, base[:49].clone(), 7)
    zeros = torch.zeros(4).view(torch.uint8)
    assert not equal_in_slices(torch, zeros, (-torch.zeros(4)).view(torch.uint8), 3)


def test_bytes_are_compared_as_words_where_length_and_address_allow() -> None:
    import torch

    from spotguard.checkpoint.local.codec import as_words

    flat = torch.arange(64, dtype=torch.uint8)
    assert as_words(torch, flat).dtype == torch.int64 and as_words(torch, flat).numel() == 8
    assert as_words(torch, flat[:63]).dtype == torch.uint8  # length
    assert as_words(torch, flat[1:9]).dtype == torch.uint8  # address
    other = flat.clone()
    other[63] ^= 0x80  # one bit of the last word's top byte
    assert not torch.equal(as_words(torch, flat), as_words(torch, other))
