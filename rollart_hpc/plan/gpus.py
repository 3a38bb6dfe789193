"""Memory of one GPU of a role: `roles.<role>.gpu_memory_gb`, else the known GPU named by `gpu_type`.

Figures are the datasheets' memory in GB, taken as 10^9 bytes. The devices expose a little more than that
(an H100 80GB reports 81,559 MiB = 85.5e9 bytes), so a plan checked against these limits is conservative.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollart_hpc.config.roles import RoleConfig
from rollart_hpc.contracts.errors import UsageError

GB = 10**9

# gpu_type (lower case) -> memory per GPU, GB.
KNOWN_GPUS_GB: dict[str, float] = {
    "h100": 80.0,  # NVIDIA H100 Tensor Core GPU datasheet (SXM5: 80 GB HBM3)
    "h800": 80.0,  # NVIDIA H800 SXM5 (80 GB HBM3; product brief, via secondary listings)
    "h200": 141.0,  # NVIDIA H200 Tensor Core GPU datasheet (141 GB HBM3e)
    "h20": 96.0,  # NVIDIA H20 (96 GB HBM3; no public NVIDIA datasheet, third-party listings)
    "a100": 80.0,  # NVIDIA A100 Tensor Core GPU datasheet (80 GB HBM2e SXM4)
    "a100-80gb": 80.0,  # as "a100"
    "a100-40gb": 40.0,  # NVIDIA A100 Tensor Core GPU datasheet (40 GB HBM2 SXM4)
    "l40s": 48.0,  # NVIDIA L40S GPU datasheet (48 GB GDDR6)
}


def gpu_memory_bytes(cfg: RoleConfig) -> int | None:
    """Bytes of one GPU of a rank with `cfg`; None when the rank has no GPU or its memory is unknown."""
    if not cfg.gpus_per_rank:
        return None
    if cfg.gpu_memory_gb:
        return int(cfg.gpu_memory_gb * GB)
    known = KNOWN_GPUS_GB.get(cfg.gpu_type.lower())
    return None if known is None else int(known * GB)


# Datasheet figures per GPU for cost models (dense bf16 tensor FLOP/s without sparsity, HBM bandwidth,
# GPU-to-GPU NVLink bandwidth, scale-out network per GPU) and a relative price (H20 = 1) where one is public.
@dataclass(frozen=True)
class GpuSpec:
    name: str
    bf16_flops: float  # FLOP/s, dense
    hbm_bytes_per_s: float
    memory_gb: float
    nvlink_bytes_per_s: float  # per GPU, both directions
    network_bytes_per_s: float  # scale-out NIC per GPU
    cost: float = 0.0  # relative price per GPU-hour (H20 = 1); 0 = no public figure


TERA = 1e12
GPU_SPECS: dict[str, GpuSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 900 GB/s;
    # one 400 Gb/s NDR NIC per GPU (DGX H100 user guide).
    "h100": GpuSpec("h100", 989 * TERA, 3.35 * TERA, 80.0, 900e9, 50e9),
    # H800 SXM5: H100 compute and HBM with NVLink cut to 400 GB/s (NVIDIA H800 product brief, secondary
    # listings); 400 Gb/s InfiniBand per GPU within a cluster (RollArt §7.1). Price: RollArt §7.5, H20:H800 = 1:2.85.
    "h800": GpuSpec("h800", 989 * TERA, 3.35 * TERA, 80.0, 400e9, 50e9, cost=2.85),
    # H20: 148 TFLOP/s bf16 dense, 4.0 TB/s HBM3, 96 GB, NVLink 900 GB/s (NVIDIA H20 spec sheet as reproduced by
    # third-party listings; no public NVIDIA datasheet). Price: the unit of RollArt's cost model.
    "h20": GpuSpec("h20", 148 * TERA, 4.0 * TERA, 96.0, 900e9, 50e9, cost=1.0),
    # NVIDIA H200 Tensor Core GPU datasheet: H100 compute, 4.8 TB/s HBM3e, 141 GB.
    "h200": GpuSpec("h200", 989 * TERA, 4.8 * TERA, 141.0, 900e9, 50e9),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOP/s bf16 dense, 2.039 TB/s, NVLink 600 GB/s;
    # one 200 Gb/s HDR NIC per GPU (DGX A100 user guide).
    "a100": GpuSpec("a100", 312 * TERA, 2.039 * TERA, 80.0, 600e9, 25e9),
}


def gpu_spec(name: str) -> GpuSpec:
    """The known GPU `name` (case-insensitive); a usage error naming the known ones otherwise."""
    spec = GPU_SPECS.get(name.lower())
    if spec is None:
        raise UsageError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPU_SPECS))}")
    return spec
