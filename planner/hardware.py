"""Hardware catalog: per-GPU memory, dense bf16 FLOP/s, HBM bandwidth and interconnect bandwidth.

Numbers are vendor datasheet figures (sources in `SOURCES`); bandwidths are per GPU, per direction.
`cpu-logical` describes one logical GPU of a CPU development machine (Ray logical GPUs), so the same
planner runs the CPU demo job.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3
GB = 10**9


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator model as the planner sees it."""

    name: str
    memory_bytes: int
    bf16_flops: float
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    max_gpus_per_node: int = 8


CATALOG: dict[str, GPUSpec] = {
    "H100-SXM-80GB": GPUSpec("H100-SXM-80GB", 80 * GB, 989e12, 3.35e12, 450e9, 50e9),
    "H200-SXM-141GB": GPUSpec("H200-SXM-141GB", 141 * GB, 989e12, 4.8e12, 450e9, 50e9),
    "A100-SXM-80GB": GPUSpec("A100-SXM-80GB", 80 * GB, 312e12, 2.039e12, 300e9, 25e9),
    "B200-SXM-180GB": GPUSpec("B200-SXM-180GB", 180 * GB, 2.25e15, 7.7e12, 900e9, 50e9),
    "L40S-48GB": GPUSpec("L40S-48GB", 48 * GB, 362e12, 864e9, 32e9, 25e9),
    "cpu-logical": GPUSpec("cpu-logical", 4 * GiB, 5e10, 2e10, 5e9, 5e9, max_gpus_per_node=64),
}

ALIASES: dict[str, str] = {"H100": "H100-SXM-80GB", "H200": "H200-SXM-141GB", "A100": "A100-SXM-80GB",
                           "B200": "B200-SXM-180GB", "L40S": "L40S-48GB"}

SOURCES: dict[str, str] = {
    "H100-SXM-80GB": "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 80 GB HBM3, 3.35 TB/s, BF16 dense 989 TFLOPS, "
    "NVLink 900 GB/s bidirectional); 400 Gb/s ConnectX-7 NIC per GPU (DGX H100 user guide)",
    "H200-SXM-141GB": "NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, BF16 dense 989 TFLOPS, "
    "NVLink 900 GB/s); 400 Gb/s NIC per GPU (HGX H200 reference design)",
    "A100-SXM-80GB": "NVIDIA A100 datasheet (SXM4 80GB: 2,039 GB/s HBM2e, BF16 dense 312 TFLOPS, NVLink 600 GB/s "
    "bidirectional); 200 Gb/s HDR NIC per GPU (DGX A100 user guide)",
    "B200-SXM-180GB": "NVIDIA DGX B200 datasheet (1,440 GB over 8 GPUs, 72 PFLOPS FP8 training = 2.25 PFLOPS BF16 dense "
    "per GPU, NVLink 5 1.8 TB/s bidirectional, HBM3e ~7.7 TB/s); 400 Gb/s ConnectX-7 per GPU",
    "L40S-48GB": "NVIDIA L40S datasheet (48 GB GDDR6, 864 GB/s, BF16 362 TFLOPS dense / 733 sparse, PCIe Gen4 x16 "
    "64 GB/s bidirectional, no NVLink)",
    "cpu-logical": "Libra development profile: one Ray logical GPU of a 2-core CPU machine (measured order of magnitude)",
}


class UnknownGPUError(KeyError):
    """A GPU type not in the catalog."""


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by catalog name or short alias (H100, H200, A100, B200, L40S)."""
    key = ALIASES.get(name, name)
    if key not in CATALOG:
        raise UnknownGPUError(f"unknown gpu_type '{name}'; choose one of {', '.join(sorted(CATALOG))}")
    return CATALOG[key]
