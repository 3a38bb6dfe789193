"""rollart_hpc.train."""
