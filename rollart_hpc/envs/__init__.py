"""rollart_hpc.envs."""
