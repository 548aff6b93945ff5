"""Hardware catalog: per-GPU memory, dense bf16 FLOP/s, HBM bandwidth and interconnect bandwidth, each entry
with its public source; and `describe_gpu` for a GPU that is not in the catalog (or to correct some figures
of one that is).

Bandwidths are per GPU, per direction: intra-node is the GPU's NVLink / Infinity Fabric / PCIe bandwidth to
its node peers (half the bidirectional datasheet figure), inter-node the GPU's share of the node's network
(one NIC per GPU as in the reference designs). FLOP/s are dense (no 2:4 sparsity). Where a datasheet gives
only a sparse figure, the dense one is half of it. `cpu-logical` describes one logical GPU of a CPU
development machine (Ray logical GPUs), so the same planner runs the CPU demo job.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

GiB = 1024**3
GB = 10**9
TB = 10**12
CUSTOM = "custom"
# a described GPU has no catalog node size to check `gpus_per_node` against
UNBOUNDED_GPUS_PER_NODE = 1 << 16


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
    source: str = ""


def _gpu(name: str, memory_gb: float, bf16_dense_tflops: float, hbm_tb_per_s: float, intra_gb_per_s: float,
         inter_gb_per_s: float, source: str, max_gpus_per_node: int = 8) -> GPUSpec:
    return GPUSpec(name, int(memory_gb * GB), bf16_dense_tflops * 1e12, hbm_tb_per_s * TB, intra_gb_per_s * GB,
                   inter_gb_per_s * GB, max_gpus_per_node, source)


NIC_400G = "400 Gb/s NIC per GPU"
NIC_200G = "200 Gb/s NIC per GPU"
PCIE4 = "PCIe Gen4 x16 64 GB/s bidirectional, no NVLink"
PCIE5 = "PCIe Gen5 x16 128 GB/s bidirectional"

_ENTRIES: tuple[GPUSpec, ...] = (
    # NVIDIA Hopper
    _gpu("H100-SXM-80GB", 80, 989, 3.35, 450, 50, "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 80 GB HBM3, "
         "3.35 TB/s, BF16 dense 989 TFLOPS, NVLink 900 GB/s bidirectional); 400 Gb/s ConnectX-7 NIC per GPU "
         "(DGX H100 user guide)"),
    _gpu("H100-PCIe-80GB", 80, 756, 2.0, 64, 25, "NVIDIA H100 Tensor Core GPU datasheet (PCIe: 80 GB HBM2e, "
         f"2 TB/s, BF16 1,513 TFLOPS with sparsity = 756 dense; {PCIE5}; NVLink bridges join pairs only, so node "
         f"peers are reached over PCIe); {NIC_200G} (typical PCIe server)"),
    _gpu("H100-NVL-94GB", 94, 835, 3.9, 64, 50, "NVIDIA H100 Tensor Core GPU datasheet (H100 NVL: 94 GB HBM3, "
         f"3.9 TB/s, BF16 1,671 TFLOPS with sparsity = 835 dense; {PCIE5}; NVLink bridges join pairs only); "
         f"{NIC_400G}"),
    _gpu("H800-SXM-80GB", 80, 989, 3.35, 200, 50, "NVIDIA H800 SXM5 (H100 SXM silicon for export: 80 GB HBM3, "
         f"3.35 TB/s, BF16 dense 989 TFLOPS; NVLink limited to 400 GB/s bidirectional); {NIC_400G} (HGX H800 "
         "clusters)"),
    _gpu("H20-96GB", 96, 148, 4.0, 450, 50, "NVIDIA H20 product brief (96 GB HBM3, 4.0 TB/s, BF16 dense 148 "
         f"TFLOPS, NVLink 900 GB/s bidirectional); {NIC_400G} (HGX H20)"),
    _gpu("H200-SXM-141GB", 141, 989, 4.8, 450, 50, "NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e, "
         "4.8 TB/s, BF16 dense 989 TFLOPS, NVLink 900 GB/s); 400 Gb/s NIC per GPU (HGX H200 reference design)"),
    _gpu("H200-NVL-141GB", 141, 835, 4.8, 64, 50, "NVIDIA H200 Tensor Core GPU datasheet (H200 NVL: 141 GB "
         f"HBM3e, 4.8 TB/s, BF16 1,671 TFLOPS with sparsity = 835 dense; {PCIE5}; NVLink bridges join 2 or 4 "
         f"GPUs only); {NIC_400G}"),
    # NVIDIA Ampere
    _gpu("A100-SXM-80GB", 80, 312, 2.039, 300, 25, "NVIDIA A100 datasheet (SXM4 80GB: 2,039 GB/s HBM2e, BF16 "
         "dense 312 TFLOPS, NVLink 600 GB/s bidirectional); 200 Gb/s HDR NIC per GPU (DGX A100 user guide)"),
    _gpu("A100-SXM-40GB", 40, 312, 1.555, 300, 25, "NVIDIA A100 datasheet (SXM4 40GB: 1,555 GB/s HBM2, BF16 "
         f"dense 312 TFLOPS, NVLink 600 GB/s bidirectional); {NIC_200G} (DGX A100 user guide)"),
    _gpu("A100-PCIe-80GB", 80, 312, 1.935, 32, 25, "NVIDIA A100 datasheet (PCIe 80GB: 1,935 GB/s HBM2e, BF16 "
         f"dense 312 TFLOPS; {PCIE4} between node peers (bridges join pairs only)); {NIC_200G}"),
    _gpu("A800-SXM-80GB", 80, 312, 2.039, 200, 25, "NVIDIA A800 SXM4 80GB (A100 silicon for export: 2,039 GB/s "
         f"HBM2e, BF16 dense 312 TFLOPS; NVLink limited to 400 GB/s bidirectional); {NIC_200G} (HGX A800)"),
    _gpu("A800-PCIe-80GB", 80, 312, 1.935, 32, 25, "NVIDIA A800 PCIe 80GB datasheet (1,935 GB/s HBM2e, BF16 "
         f"dense 312 TFLOPS; {PCIE4} between node peers); {NIC_200G}"),
    _gpu("A10-24GB", 24, 125, 0.6, 32, 12.5, "NVIDIA A10 datasheet (24 GB GDDR6, 600 GB/s, BF16 250 TFLOPS "
         f"with sparsity = 125 dense; {PCIE4}); 100 Gb/s NIC per GPU (typical inference server)"),
    # NVIDIA Ada
    _gpu("L40S-48GB", 48, 362, 0.864, 32, 25, "NVIDIA L40S datasheet (48 GB GDDR6, 864 GB/s, BF16 362 TFLOPS "
         f"dense / 733 sparse, {PCIE4}); {NIC_200G}"),
    _gpu("L40-48GB", 48, 181, 0.864, 32, 25, "NVIDIA L40 datasheet (48 GB GDDR6, 864 GB/s, BF16 362 TFLOPS "
         f"with sparsity = 181 dense, {PCIE4}); {NIC_200G}"),
    _gpu("L20-48GB", 48, 119.5, 0.864, 32, 25, "NVIDIA L20 product brief (48 GB GDDR6, 864 GB/s, BF16 239 "
         f"TFLOPS with sparsity = 119.5 dense, {PCIE4}); {NIC_200G}"),
    # NVIDIA Blackwell
    _gpu("B200-SXM-180GB", 180, 2250, 7.7, 900, 50, "NVIDIA DGX B200 datasheet (1,440 GB over 8 GPUs, 72 PFLOPS "
         "FP8 training = 2.25 PFLOPS BF16 dense per GPU, NVLink 5 1.8 TB/s bidirectional, HBM3e ~7.7 TB/s); "
         "400 Gb/s ConnectX-7 per GPU"),
    _gpu("GB200-NVL72-186GB", 186, 2500, 8.0, 900, 50, "NVIDIA GB200 NVL72 datasheet (72 GPUs: 13.4 TB HBM3e = "
         "186 GB each, 576 TB/s = 8 TB/s each, BF16 360 PFLOPS with sparsity = 2.5 PFLOPS dense each, NVLink "
         f"130 TB/s = 1.8 TB/s bidirectional each); one NVLink domain of 72 GPUs is a node here; {NIC_400G}",
         max_gpus_per_node=72),
    # AMD Instinct
    _gpu("MI300X-192GB", 192, 1307.4, 5.3, 448, 50, "AMD Instinct MI300X datasheet (192 GB HBM3, 5.3 TB/s, "
         "BF16 dense 1,307.4 TFLOPS; 7 Infinity Fabric links, 896 GB/s aggregate bidirectional peer bandwidth); "
         f"{NIC_400G} (AMD Instinct MI300X platform)"),
    _gpu("MI325X-256GB", 256, 1307.4, 6.0, 448, 50, "AMD Instinct MI325X datasheet (256 GB HBM3E, 6 TB/s, BF16 "
         "dense 1,307.4 TFLOPS; Infinity Fabric 896 GB/s aggregate bidirectional peer bandwidth); "
         f"{NIC_400G}"),
    # CPU development machine
    GPUSpec("cpu-logical", 4 * GiB, 5e10, 2e10, 5e9, 5e9, max_gpus_per_node=64,
            source="Libra development profile: one Ray logical GPU of a 2-core CPU machine (measured order of "
                   "magnitude)"),
)

CATALOG: dict[str, GPUSpec] = {g.name: g for g in _ENTRIES}

ALIASES: dict[str, str] = {
    "H100": "H100-SXM-80GB", "H100-SXM": "H100-SXM-80GB", "H100-PCIe": "H100-PCIe-80GB", "H100-NVL": "H100-NVL-94GB",
    "H800": "H800-SXM-80GB", "H20": "H20-96GB", "H200": "H200-SXM-141GB", "H200-NVL": "H200-NVL-141GB",
    "A100": "A100-SXM-80GB", "A100-80GB": "A100-SXM-80GB", "A100-40GB": "A100-SXM-40GB",
    "A100-PCIe": "A100-PCIe-80GB", "A800": "A800-SXM-80GB", "A800-80GB": "A800-SXM-80GB",
    "A800-PCIe": "A800-PCIe-80GB", "A10": "A10-24GB", "L40S": "L40S-48GB", "L40": "L40-48GB", "L20": "L20-48GB",
    "B200": "B200-SXM-180GB", "GB200": "GB200-NVL72-186GB", "MI300X": "MI300X-192GB", "MI325X": "MI325X-256GB",
}

SOURCES: dict[str, str] = {name: gpu.source for name, gpu in CATALOG.items()}

# the figures `describe_gpu` takes, in the units of cluster.gpu_spec, and the GPUSpec field each sets
DESCRIBED_FIELDS: dict[str, tuple[str, float]] = {
    "memory_gb": ("memory_bytes", GB),
    "bf16_dense_tflops": ("bf16_flops", 1e12),
    "hbm_tb_per_s": ("hbm_bytes_per_s", TB),
    "intra_node_gb_per_s": ("intra_node_bytes_per_s", GB),
    "inter_node_gb_per_s": ("inter_node_bytes_per_s", GB),
}


class UnknownGPUError(KeyError):
    """A GPU type not in the catalog (and not described)."""

    def __init__(self, message: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.missing = missing  # DESCRIBED_FIELDS a description of this GPU still needs

    def __str__(self) -> str:
        return self.message


def catalog_key(name: str) -> str | None:
    """The catalog name of a name or alias (case-insensitive), or None."""
    for table in (CATALOG, ALIASES):
        for key in table:
            if key.lower() == name.lower():
                return key if table is CATALOG else ALIASES[key]
    return None


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by catalog name or short alias (H100, A800, H20, MI300X, ...), case-insensitive."""
    key = catalog_key(name)
    if key is None:
        raise UnknownGPUError(f"unknown gpu_type '{name}'; choose one of {', '.join(sorted(CATALOG))} (or the "
                              f"aliases {', '.join(sorted(ALIASES))}), or describe the GPU in cluster.gpu_spec "
                              f"({', '.join(DESCRIBED_FIELDS)})", missing=tuple(DESCRIBED_FIELDS))
    return CATALOG[key]


def describe_gpu(gpu_type: str, figures: dict[str, float], name: str = "") -> GPUSpec:
    """The GPU the planner uses for `gpu_type` and the figures of cluster.gpu_spec (0 = not given).

    A catalog GPU takes the given figures in place of its own (e.g. a slower network). A type that is not in the
    catalog, or `custom`, is described by the figures alone and needs all of them; `name` (else `gpu_type`)
    names it.
    """
    unknown = set(figures) - set(DESCRIBED_FIELDS)
    if unknown:
        raise ValueError(f"unknown GPU figures {sorted(unknown)}; expected {list(DESCRIBED_FIELDS)}")
    given = {k: v for k, v in figures.items() if v}
    key = None if gpu_type.lower() == CUSTOM else catalog_key(gpu_type)
    if key is None:
        missing = tuple(f for f in DESCRIBED_FIELDS if f not in given)
        if missing:
            what = "gpu_type custom" if gpu_type.lower() == CUSTOM else f"gpu_type '{gpu_type}' is not in the catalog"
            raise UnknownGPUError(f"{what}, so cluster.gpu_spec must give {', '.join(missing)}"
                                  + ("" if gpu_type.lower() == CUSTOM else
                                     f" (or choose one of {', '.join(sorted(CATALOG))})"), missing=missing)
        base = GPUSpec(name or gpu_type, 0, 0.0, 0.0, 0.0, 0.0, UNBOUNDED_GPUS_PER_NODE, "cluster.gpu_spec")
    else:
        base = CATALOG[key]
        if not given:
            return base
        base = replace(base, name=name or base.name, source=f"{base.source}; corrected by cluster.gpu_spec")
    changes: dict[str, Any] = {DESCRIBED_FIELDS[k][0]: v * DESCRIBED_FIELDS[k][1] for k, v in given.items()}
    if "memory_bytes" in changes:
        changes["memory_bytes"] = int(changes["memory_bytes"])
    return replace(base, **changes)
