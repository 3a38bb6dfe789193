"""rollart_hpc.rollout."""
