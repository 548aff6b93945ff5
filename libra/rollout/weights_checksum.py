"""The single definition of a weight checksum, shared by the publisher (trainer export), the rollout pool and
the vLLM worker extension that computes it inside the server.

A checksum covers every tensor of an HF-format safetensors checkpoint: for each tensor a record
`name dtype shape sha256(raw little-endian bytes)`; the records sorted by name are hashed again with
sha256. The file order, the sharding into files and the safetensors metadata do not matter; a changed value,
name, dtype or shape does. The publisher computes it from the files (`checksum_hf_weights`), the server
from the tensors its loader streamed into the model (`TensorDigest.of_tensor` + `combine_digests`), so equal
values mean the server loaded exactly the published tensors.

Which files count mirrors vLLM's safetensors loader: every `*.safetensors` in the directory, restricted to
the files named in `model.safetensors.index.json` when that index exists.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

CHECKSUM_PREFIX = "sha256t1:"
SAFETENSORS_INDEX = "model.safetensors.index.json"

# torch dtype name (str(dtype) without "torch.") -> safetensors dtype code
_TORCH_TO_SAFETENSORS = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


class ChecksumError(ValueError):
    """A checkpoint that cannot be checksummed (no weight files, broken header, duplicate tensor)."""


@dataclass(frozen=True)
class TensorDigest:
    """One tensor's contribution to a checksum."""

    name: str
    dtype: str  # safetensors dtype code, e.g. "F32"
    shape: tuple[int, ...]
    sha256: str

    def record(self) -> str:
        return f"{self.name} {self.dtype} {','.join(str(d) for d in self.shape)} {self.sha256}\n"

    @classmethod
    def of_tensor(cls, name: str, tensor: Any) -> TensorDigest:
        """Digest of a torch tensor's raw bytes (moved to the CPU, made contiguous)."""
        import torch

        dtype = dtype_code(tensor.dtype)
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy() if flat.numel() else b""
        return cls(name, dtype, tuple(int(d) for d in tensor.shape), hashlib.sha256(data).hexdigest())


def dtype_code(torch_dtype: Any) -> str:
    """The safetensors code of a torch dtype (`torch.float32` -> `"F32"`)."""
    name = str(torch_dtype).removeprefix("torch.")
    try:
        return _TORCH_TO_SAFETENSORS[name]
    except KeyError:
        raise ChecksumError(
            f"dtype {torch_dtype} has no safetensors code; known: {sorted(_TORCH_TO_SAFETENSORS)}"
        ) from None


def combine_digests(digests: Iterable[TensorDigest]) -> str:
    """The checksum of a set of tensors: sha256 over their records in name order."""
    by_name: dict[str, TensorDigest] = {}
    for digest in digests:
        if digest.name in by_name:
            raise ChecksumError(f"tensor '{digest.name}' appears twice in the checkpoint")
        by_name[digest.name] = digest
    if not by_name:
        raise ChecksumError("no tensors to checksum")
    outer = hashlib.sha256()
    for name in sorted(by_name):
        outer.update(by_name[name].record().encode("utf-8"))
    return CHECKSUM_PREFIX + outer.hexdigest()


def weight_files(hf_dir: str) -> list[str]:
    """The safetensors files of `hf_dir` that a loader reads (index-filtered when an index exists)."""
    if not os.path.isdir(hf_dir):
        raise ChecksumError(f"weights directory '{hf_dir}' does not exist")
    files = sorted(os.path.join(hf_dir, name) for name in os.listdir(hf_dir) if name.endswith(".safetensors"))
    index_path = os.path.join(hf_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map", {})
        indexed = {os.path.join(hf_dir, f) for f in weight_map.values()}
        missing = sorted(indexed - set(files))
        if missing:
            raise ChecksumError(f"{index_path} names weight files that do not exist: {missing}")
        files = [f for f in files if f in indexed]
    if not files:
        raise ChecksumError(f"'{hf_dir}' holds no *.safetensors weight files")
    return files


def file_tensor_digests(path: str) -> list[TensorDigest]:
    """Digests of every tensor in one safetensors file, read straight from the file (no torch needed)."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ChecksumError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", head)
        try:
            header = json.loads(fh.read(header_len))
        except ValueError as exc:
            raise ChecksumError(f"{path}: unreadable safetensors header ({exc})") from exc
        data_start = 8 + header_len
        size = os.fstat(fh.fileno()).st_size
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        if not tensors:
            return []
        digests = []
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mem:
            view = memoryview(mem)
            try:
                for name, info in tensors.items():
                    begin, end = info["data_offsets"]
                    if not 0 <= begin <= end <= size - data_start:
                        raise ChecksumError(
                            f"{path}: tensor '{name}' has offsets {begin}..{end} outside the file"
                        )
                    sha = hashlib.sha256(view[data_start + begin : data_start + end]).hexdigest()
                    digests.append(
                        TensorDigest(name, str(info["dtype"]), tuple(int(d) for d in info["shape"]), sha)
                    )
            finally:
                view.release()
        return digests


def hf_tensor_digests(hf_dir: str) -> list[TensorDigest]:
    digests: list[TensorDigest] = []
    for path in weight_files(hf_dir):
        digests.extend(file_tensor_digests(path))
    return digests


def checksum_hf_weights(hf_dir: str) -> str:
    """Checksum of the weights in an HF-format directory, as defined in this module's docstring."""
    return combine_digests(hf_tensor_digests(hf_dir))
