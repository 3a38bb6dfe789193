"""Memory of one GPU of a role: `roles.<role>.gpu_memory_gb`, else the known GPU named by `gpu_type`.

Figures are the datasheets' memory in GB, taken as 10^9 bytes. The devices expose a little more than that
(an H100 80GB reports 81,559 MiB = 85.5e9 bytes), so a plan checked against these limits is conservative.
"""

from __future__ import annotations

from rollart_hpc.config.roles import RoleConfig

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
