"""rollart_hpc.store."""
