"""Typed, torch-free configuration: schema, TOML loading with dotted overrides, resolution."""

from rollart_hpc.config.resolve import load_config, read_resolved, world_size, write_resolved
from rollart_hpc.config.schema import ROLE_NAMES, Config

__all__ = ["ROLE_NAMES", "Config", "load_config", "read_resolved", "world_size", "write_resolved"]
