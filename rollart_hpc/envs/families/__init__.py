"""rollart_hpc.envs.families."""
