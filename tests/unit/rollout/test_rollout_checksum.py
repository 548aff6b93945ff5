"""The weight checksum: what it is invariant to, what changes it, the server-side computation agreeing with
the file-side one, and the parameter value check of the worker extension."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file as load_torch

from libra.rollout.weights_checksum import (
    ChecksumError,
    TensorDigest,
    checksum_hf_weights,
    combine_digests,
    dtype_code,
)
from libra.rollout.worker_extension import _DigestingStream, check_parameter_values

Tensors = dict[str, np.ndarray]


def base_tensors() -> Tensors:
    rng = np.random.default_rng(0)
    return {
        "model.embed_tokens.weight": rng.standard_normal((10, 4)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((4, 4)).astype(np.float32),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((2, 4)).astype(np.float32),
        "model.layers.0.self_attn.v_proj.weight": rng.standard_normal((2, 4)).astype(np.float32),
        "model.norm.weight": np.ones(4, dtype=np.float32),
        "step": np.array(3, dtype=np.int64),
    }


def write(
    directory: str, shards: list[Tensors], metadata: dict[str, str] | None = None, index: bool = False
) -> str:
    os.makedirs(directory, exist_ok=True)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        save_numpy(shard, os.path.join(directory, name), metadata=metadata)
        weight_map.update({k: name for k in shard})
    if index:
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    return directory


def reversed_order(t: Tensors) -> list[Tensors]:
    return [dict(reversed(list(t.items())))]


def two_shards(t: Tensors) -> list[Tensors]:
    items = list(t.items())
    return [dict(items[:3]), dict(items[3:])]


SAME_CHECKSUM: dict[str, Callable[[Tensors], list[Tensors]]] = {
    "tensor order in the file": reversed_order,
    "sharding into two files": two_shards,
}


@pytest.mark.parametrize("case", SAME_CHECKSUM, ids=list(SAME_CHECKSUM))
def test_checksum_ignores_layout(tmp_path: os.PathLike[str], case: str) -> None:
    tensors = base_tensors()
    reference = checksum_hf_weights(write(os.path.join(tmp_path, "ref"), [tensors]))
    other = write(os.path.join(tmp_path, "other"), SAME_CHECKSUM[case](tensors), metadata={"format": "pt"})
    assert checksum_hf_weights(other) == reference


def _changed_value(t: Tensors) -> Tensors:
    out = dict(t)
    out["model.norm.weight"] = out["model.norm.weight"].copy()
    out["model.norm.weight"][2] = np.nextafter(np.float32(1), np.float32(2))
    return out


def _renamed(t: Tensors) -> Tensors:
    out = dict(t)
    out["model.final_norm.weight"] = out.pop("model.norm.weight")
    return out


def _reshaped(t: Tensors) -> Tensors:
    out = dict(t)
    out["model.layers.0.self_attn.q_proj.weight"] = out["model.layers.0.self_attn.q_proj.weight"].reshape(
        2, 8
    )
    return out


def _retyped(t: Tensors) -> Tensors:
    out = dict(t)
    out["step"] = out["step"].astype(np.int32)
    return out


def _extra(t: Tensors) -> Tensors:
    return {**t, "lm_head.weight": np.zeros((10, 4), dtype=np.float32)}


CHANGED: dict[str, Callable[[Tensors], Tensors]] = {
    "one value by one ulp": _changed_value,
    "a tensor name": _renamed,
    "a shape with the same bytes": _reshaped,
    "a dtype": _retyped,
    "an extra tensor": _extra,
}


@pytest.mark.parametrize("case", CHANGED, ids=list(CHANGED))
def test_checksum_sees_every_change(tmp_path: os.PathLike[str], case: str) -> None:
    tensors = base_tensors()
    reference = checksum_hf_weights(write(os.path.join(tmp_path, "ref"), [tensors]))
    assert checksum_hf_weights(write(os.path.join(tmp_path, "x"), [CHANGED[case](tensors)])) != reference


def test_index_selects_files_like_the_loader(tmp_path: os.PathLike[str]) -> None:
    tensors = base_tensors()
    directory = write(os.path.join(tmp_path, "m"), two_shards(tensors), index=True)
    reference = checksum_hf_weights(directory)
    save_numpy({"stale": np.zeros(3, dtype=np.float32)}, os.path.join(directory, "old.safetensors"))
    assert checksum_hf_weights(directory) == reference, "files outside the index are not loaded"
    os.remove(os.path.join(directory, "model-00001.safetensors"))
    with pytest.raises(ChecksumError, match="do not exist"):
        checksum_hf_weights(directory)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "does not exist"),
        ("empty", "no \\*.safetensors"),
        ("duplicate", "appears twice"),
        ("truncated", "not a safetensors file"),
        ("bad-header", "unreadable safetensors header"),
    ],
)
def test_unusable_checkpoints_are_clear_errors(tmp_path: os.PathLike[str], setup: str, message: str) -> None:
    directory = os.path.join(tmp_path, "m")
    if setup != "missing":
        os.makedirs(directory)
    if setup == "duplicate":
        write(directory, two_shards(base_tensors()))
        save_numpy(
            {"model.norm.weight": np.ones(4, dtype=np.float32)}, os.path.join(directory, "z.safetensors")
        )
    elif setup == "truncated":
        with open(os.path.join(directory, "model.safetensors"), "wb") as fh:
            fh.write(b"\x01\x02")
    elif setup == "bad-header":
        with open(os.path.join(directory, "model.safetensors"), "wb") as fh:
            fh.write((5).to_bytes(8, "little") + b"{oops")
    with pytest.raises(ChecksumError, match=message):
        checksum_hf_weights(directory)


def test_server_side_stream_digest_equals_file_checksum(tmp_path: os.PathLike[str]) -> None:
    """What the worker extension computes from loaded tensors is what the publisher computes from files."""
    directory = write(os.path.join(tmp_path, "m"), two_shards(base_tensors()))
    tensors = {}
    for name in sorted(os.listdir(directory)):
        tensors.update(load_torch(os.path.join(directory, name)))
    stream = _DigestingStream(tensors.items(), torch.float32)
    assert [name for name, _ in stream] == list(tensors)
    assert combine_digests(stream.digests) == checksum_hf_weights(directory)
    assert stream.bytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_bfloat16_digest_uses_raw_bytes() -> None:
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    digest = TensorDigest.of_tensor("w", t)
    assert (digest.dtype, digest.shape) == ("BF16", (2, 3))
    assert digest.sha256 == TensorDigest.of_tensor("w", t.clone()).sha256
    assert dtype_code(torch.float32) == "F32"
    with pytest.raises(ChecksumError, match="no safetensors code"):
        dtype_code(torch.complex64)


class PackedModel(torch.nn.Module):
    """Parameters laid out as vLLM keeps them: fused qkv, a vocabulary padded embedding, a norm."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, t: Tensors, pad_rows: int = 6) -> None:
        super().__init__()
        qkv = np.concatenate([t[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
        emb = np.concatenate([t["model.embed_tokens.weight"], np.zeros((pad_rows, 4), dtype=np.float32)])
        self.register_parameter("qkv", torch.nn.Parameter(torch.from_numpy(qkv)))
        self.register_parameter("emb", torch.nn.Parameter(torch.from_numpy(emb)))
        self.register_parameter("norm", torch.nn.Parameter(torch.from_numpy(t["model.norm.weight"].copy())))
        self.register_parameter("sharded", torch.nn.Parameter(torch.zeros(2, 4)))

    def named_parameters(self, *args: object, **kwargs: object):  # type: ignore[no-untyped-def, override]
        names = {
            "qkv": "model.layers.0.self_attn.qkv_proj.weight",
            "emb": "model.embed_tokens.weight",
            "norm": "model.norm.weight",
            "sharded": "model.layers.0.self_attn.o_proj.weight",
        }
        for name, param in super().named_parameters():
            yield names[name], param


def stream_digests(t: Tensors) -> dict[str, TensorDigest]:
    extra = {"model.layers.0.self_attn.o_proj.weight": np.ones((4, 4), dtype=np.float32)}
    stream = _DigestingStream([(k, torch.from_numpy(v)) for k, v in {**t, **extra}.items()], torch.float32)
    list(stream)
    return stream.value_digests


def test_parameter_values_are_compared_through_packing_and_padding() -> None:
    tensors = base_tensors()
    model = PackedModel(tensors)
    compared, mismatched = check_parameter_values(model, stream_digests(tensors), torch.float32)
    # qkv (packed), the padded embedding and the norm are compared; the TP-sharded-like o_proj is skipped.
    assert (compared, mismatched) == (3, [])
    with torch.no_grad():
        model.get_parameter("qkv")[5, 1] += 1.0  # inside k_proj
    assert check_parameter_values(model, stream_digests(tensors), torch.float32) == (
        3,
        ["model.layers.0.self_attn.qkv_proj.weight"],
    )


@pytest.mark.parametrize(
    ("workers", "window"), [(1, 1 << 30), (4, 1), (4, 1 << 30)], ids=["serial", "tiny-window", "wide"]
)
def test_threaded_digests_keep_order_and_values(workers: int, window: int) -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = [(f"t{i:02d}", torch.randn(64, 8 + i, generator=generator)) for i in range(20)]
    stream = _DigestingStream(iter(tensors), torch.bfloat16, workers=workers, window_bytes=window)
    assert [name for name, _ in stream] == [name for name, _ in tensors]
    assert stream.digests == [TensorDigest.of_tensor(n, t) for n, t in tensors]
    assert stream.value_digests["t03"] == TensorDigest.of_tensor("t03", tensors[3][1].to(torch.bfloat16))
