"""rollart_hpc.bench."""
