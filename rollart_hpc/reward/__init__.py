"""rollart_hpc.reward."""
